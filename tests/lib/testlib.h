/*
 * Helpers for test programs. Each test is its own program: exit 0 pass,
 * 1 fail, 77 skip (the runner's contract). CHECK fails the test with the
 * file, line and a message; children are reaped with tl_wait_children.
 */
#ifndef SHMRPC_TESTLIB_H
#define SHMRPC_TESTLIB_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

#define TL_SKIP 77

#define CHECK(cond, ...)                                                          \
	do {                                                                      \
		if (!(cond)) {                                                    \
			fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                             \
			fputc('\n', stderr);                                      \
			exit(1);                                                  \
		}                                                                 \
	} while (0)

/* CHECK that a call returned 0; prints the code and shmrpc_errmsg(). */
#define CHECK_OK(expr)                                                            \
	do {                                                                      \
		int rc_ = (expr);                                                 \
		CHECK(rc_ == 0, "%s returned %d (%s): %s", #expr, rc_,            \
		      shmrpc_strerror(rc_), shmrpc_errmsg());                     \
	} while (0)

/* Prints "skip: REASON" (the runner shows it, and its -a allow-list
 * judges it) and returns TL_SKIP: `return tl_skip("...")`. */
int tl_skip(const char *reason);
/* Scale for long loops: 1 normally, smaller under sanitizers (SHMRPC_TEST_SCALE). */
double tl_scale(void);
/* The CPUs this process may run on (at least 1). */
unsigned tl_cores(void);
/* Waits for every child; false if any exited non-zero or by a signal
 * (each reported on stderr with its pid). */
bool tl_wait_children(void);
/* Number of entries of /dev/shm whose name mentions shmrpc. */
int tl_shm_leftovers(void);
/* The wait modes to exercise: uring (when it works here), futex, spin. */
int tl_wait_modes(const char **names, int max);

/* pid's state letter in /proc/PID/stat ('R', 'S', 'T', 'Z'...); 0 when
 * the process is gone. */
char tl_proc_state(pid_t pid);
/* A process stopped for a while: tl_pause_begin sends it SIGSTOP, waits
 * until it is stopped, and has a thread send SIGCONT ns later;
 * tl_pause_end joins that thread. */
struct tl_pause {
	pthread_t thread;
	pid_t pid;
	uint64_t ns;
};
void tl_pause_begin(struct tl_pause *p, pid_t pid, uint64_t ns);
void tl_pause_end(struct tl_pause *p);

/* The unsigned number after "key": in the JSON text that starts at from
 * (a failed CHECK if there is none). */
unsigned long long tl_json_num(const char *from, const char *key);

#endif
