/*
 * The keeper of a job whose workers were started by something else
 * (torch.multiprocessing.spawn, mp.Process, torchrun's convention): what
 * shmrun does for its own children, done for processes that join it over
 * a unix socket (docs/ARCHITECTURE.md, "Joining without shmrun").
 *
 * The socket is abstract ("\0shmrpc-<uid>-<hash of the rendezvous>"), so
 * nothing is left in the filesystem. A worker sends a join_req; the keeper
 * checks it (SO_PEERCRED, rank, world size, unique rank and name), writes
 * the worker's slot, watches its pid with a pidfd and answers with a
 * join_reply carrying the job's three memfds (SCM_RIGHTS). The connection
 * stays open while the worker is in the job: the worker's close (after
 * shutdown) is its leave, its pidfd its death. The keeper exits once every
 * worker that joined has left or died; the first leave closes the door, so
 * that a later init_rpc at the same rendezvous makes a new job.
 */
#ifndef SHMRPC_LAUNCHER_KEEPER_H
#define SHMRPC_LAUNCHER_KEEPER_H

#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/layout.h"

#define JOIN_MAGIC 0x4e4a5253u /* "SRJN" */
#define JOIN_VERSION 1u
#define JOIN_MSG_MAX 512

struct join_req {
	uint32_t magic;
	uint32_t version;
	uint32_t rank;
	uint32_t world;
	char name[SHM_NAME_MAX]; /* NUL-terminated */
};

/* err 0: three fds come with it (segment, pool, RRef table); else -errno
 * and msg says why, in a sentence for init_rpc to raise. */
struct join_reply {
	uint32_t magic;
	int32_t err;
	char msg[JOIN_MSG_MAX];
};

/* The abstract socket's name for a rendezvous key ("tcp:29500",
 * "file:/tmp/x"): sun_path[0] is NUL, the rest "shmrpc-<uid>-<hash>".
 * Returns the address length to pass to bind/connect. */
SHMRPC_HIDDEN size_t join_sockaddr(const char *key, void *sockaddr_un);

/* Runs the keeper on lfd, a bound, listening SOCK_SEQPACKET socket, for
 * a job of world workers with pool_size bytes of tensor pool; returns the
 * process's exit code once every worker has gone. starter: a pidfd of the
 * worker that started the keeper (-1: none); should it end before anyone
 * joined, the keeper ends too (nobody is in its job, and a worker knocking
 * later starts a new one). */
SHMRPC_HIDDEN int keeper_run(int lfd, int starter, uint32_t world, uint64_t pool_size);

#endif
