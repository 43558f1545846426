/*
 * The worker's side of a join without shmrun (launcher/keeper.h):
 * init_rpc in a process that something else started meets its job's
 * keeper at an abstract unix socket named after the rendezvous, starting
 * the keeper itself when there is none yet, and receives the job's memfds.
 *
 * The first worker to find no keeper binds the socket (two first workers
 * race at bind: the loser, EADDRINUSE, connects to the winner's keeper)
 * and forks; the child starts a new session (a Ctrl-C at that worker's
 * terminal does not reach the keeper), forks again (the keeper is not the
 * worker's child: the worker may exit first, and must not collect it),
 * keeps only stderr and the socket (it must not hold the worker's pipes,
 * which a parent may be waiting on) and execs this same Python with this
 * same extension loaded by its path, whose _keep runs the keeper: a fresh
 * process, which holds none of the worker's memory (a fork that stayed
 * would share the worker's pages copy-on-write for the whole job, and keep
 * whatever the worker had mapped, a GPU's included, after the worker
 * ended). The exec needs no shmrun on PATH (a pip-installed package has
 * none). Should it fail, the forked child runs the keeper itself. The
 * keeper also gets a pidfd of the worker that started it: should that
 * worker end before anyone joined (killed, or its init_rpc timed out
 * before it knocked), the keeper ends at once instead of waiting 60 s
 * for a job nobody is coming to.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "launcher/keeper.h"
#include "python/module.h"

#define RETRY_US 2000

/* How the keeper is exec'd: `PYTHON -I -S -c KEEP_CODE EXTENSION WORLD POOL
 * STARTER` (STARTER: 4, the starter's pidfd, or -1: none), the socket at fd 3. */
static const char KEEP_CODE[] =
	"import sys\n"
	"from importlib.machinery import ExtensionFileLoader\n"
	"from importlib.util import module_from_spec, spec_from_loader\n"
	"loader = ExtensionFileLoader('shmrpc._shmrpc', sys.argv[1])\n"
	"m = module_from_spec(spec_from_loader('shmrpc._shmrpc', loader))\n"
	"loader.exec_module(m)\n"
	"sys.exit(m._keep(3, int(sys.argv[4]), int(sys.argv[2]), int(sys.argv[3])))\n";

struct keeper_exec {
	const char *python;    /* NULL: no exec, the forked child keeps */
	char extension[4096];  /* this extension's file */
	char world[16], pool[24], starter[12];
};

/* In the keeper (the grandchild); never returns. */
static void keeper_child(int lfd, int starter, uint32_t world, uint64_t pool_size,
			 struct keeper_exec *x)
{
	sigset_t none;
	int null;

	if (setsid() < 0 || fork() != 0)
		_exit(0); /* the intermediate child: the keeper is orphaned */
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	for (int s = 1; s < NSIG; s++)
		if (s != SIGKILL && s != SIGSTOP)
			signal(s, SIG_DFL);
	signal(SIGPIPE, SIG_IGN);
	/* stderr stays: the keeper reports deaths there, as shmrun does. */
	null = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (null >= 0) {
		dup2(null, 0);
		dup2(null, 1);
		close(null);
	}
	/* listen here, not before the fork: a worker's SO_PEERCRED names the
	 * process that called listen, and that is the keeper. */
	if (listen(lfd, SHM_MAX_WORLD) < 0)
		_exit(1);
	/* The socket at 3 and the starter's pidfd at 4, where the exec'd
	 * keeper finds them: first both above 4 (either may sit at 3 or 4
	 * now), then down; dup2 clears FD_CLOEXEC on the copies. */
	lfd = fcntl(lfd, F_DUPFD, 5);
	if (starter >= 0)
		starter = fcntl(starter, F_DUPFD, 5);
	if (lfd < 0 || dup2(lfd, 3) < 0)
		_exit(1);
	lfd = 3;
	if (starter >= 0)
		starter = dup2(starter, 4);
	syscall(SYS_close_range, starter < 0 ? 4u : 5u, ~0u, 0u);
	snprintf(x->starter, sizeof(x->starter), "%d", starter);
	if (x->python) {
		char *argv[] = { (char *)x->python, "-I", "-S", "-c", (char *)KEEP_CODE,
				 (char *)x->extension, (char *)x->world, (char *)x->pool,
				 (char *)x->starter, NULL };

		execv(x->python, argv);
	}
	prctl(PR_SET_NAME, "shmrpc-keeper");
	_exit(keeper_run(lfd, starter, world, pool_size));
}

/* Binds the rendezvous's socket and forks its keeper; 0 also when
 * another process bound it first (its keeper answers). */
static int start_keeper(const struct sockaddr_un *a, socklen_t alen, uint32_t world,
			uint64_t pool_size, const char *python)
{
	int lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0), status, self;
	struct keeper_exec x = { .python = python && *python ? python : NULL };
	Dl_info dl;
	pid_t pid;

	if (lfd < 0)
		return shmrpc__fail(-errno, "init_rpc: cannot make a unix socket: %s",
				    strerror(errno));
	if (bind(lfd, (const struct sockaddr *)a, alen) < 0) {
		int err = errno;

		close(lfd);
		if (err == EADDRINUSE)
			return 0;
		return shmrpc__fail(-err, "init_rpc: cannot bind the rendezvous socket @%s: %s",
				    a->sun_path + 1, strerror(err));
	}
	/* Prepared here: the child only execs. */
	if (x.python && (!dladdr((void *)keeper_run, &dl) || !dl.dli_fname ||
			 snprintf(x.extension, sizeof(x.extension), "%s", dl.dli_fname) >=
				 (int)sizeof(x.extension)))
		x.python = NULL;
	snprintf(x.world, sizeof(x.world), "%u", world);
	snprintf(x.pool, sizeof(x.pool), "%llu", (unsigned long long)pool_size);
	/* -1 (a kernel without pidfd_open): the keeper waits KEEPER_IDLE_NS. */
	self = (int)syscall(SYS_pidfd_open, getpid(), 0);
	if ((pid = fork()) < 0) {
		int err = errno;

		close(lfd);
		if (self >= 0)
			close(self);
		return shmrpc__fail(-err, "init_rpc: cannot start the job's keeper: %s",
				    strerror(err));
	}
	if (pid == 0)
		keeper_child(lfd, self, world, pool_size, &x);
	close(lfd);
	if (self >= 0)
		close(self);
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	return 0;
}

/* The request, then the reply with its fds. 0; -EAGAIN when the
 * connection ended before a reply (a keeper on its way out: try again);
 * else the keeper's refusal or what failed, said. */
static int knock(int c, const struct join_req *req, uint64_t deadline, int fds[3])
{
	struct join_reply rep;
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(3 * sizeof(int))];
	} ctl;
	struct iovec iov = { &rep, sizeof(rep) };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
			      .msg_controllen = sizeof(ctl.buf) };
	struct pollfd p = { .fd = c, .events = POLLIN };
	struct cmsghdr *cm;
	int got = 0, rc;
	ssize_t n;

	if (send(c, req, sizeof(*req), MSG_NOSIGNAL) != (ssize_t)sizeof(*req))
		return errno == EPIPE || errno == ECONNRESET ? -EAGAIN
		       : shmrpc__fail(-errno, "init_rpc: cannot reach the job's keeper: %s",
				      strerror(errno));
	for (;;) {
		uint64_t now = shmrpc_now_ns();

		if (now >= deadline)
			return shmrpc__fail(-ETIMEDOUT, "init_rpc: the job's keeper did not answer");
		rc = poll(&p, 1, (int)((deadline - now) / 1000000u) + 1);
		if (rc > 0)
			break;
		if (rc < 0 && errno != EINTR)
			return shmrpc__fail(-errno, "init_rpc: poll: %s", strerror(errno));
	}
	n = recvmsg(c, &msg, MSG_CMSG_CLOEXEC);
	if (n == 0 || (n < 0 && errno == ECONNRESET))
		return -EAGAIN;
	for (cm = CMSG_FIRSTHDR(&msg); n > 0 && cm; cm = CMSG_NXTHDR(&msg, cm))
		if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
			int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));

			for (int i = 0; i < k; i++) {
				int fd;

				memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
				if (got < 3)
					fds[got++] = fd;
				else
					close(fd);
			}
		}
	if (n == (ssize_t)sizeof(rep) && rep.magic == JOIN_MAGIC && rep.err < 0) {
		rep.msg[JOIN_MSG_MAX - 1] = '\0';
		rc = shmrpc__fail(rep.err, "%s", rep.msg);
	} else if (n != (ssize_t)sizeof(rep) || rep.magic != JOIN_MAGIC || got != 3) {
		rc = shmrpc__fail(-EPROTO, "init_rpc: the job's keeper answered with %zd bytes and "
				  "%d fds: not a shmrpc keeper of this version?", n, got);
	} else {
		return 0;
	}
	while (got)
		close(fds[--got]);
	return rc;
}

/* Connects to the rendezvous's keeper (starting one when there is none)
 * and joins; 0 with *conn and fds[3], or -errno said. */
static int join(const char *key, const struct join_req *req, uint64_t pool_size,
		uint64_t timeout_ms, const char *python, int *conn, int fds[3])
{
	struct sockaddr_un a;
	socklen_t alen = (socklen_t)join_sockaddr(key, &a);
	uint64_t deadline = shmrpc_now_ns() + timeout_ms * 1000000u;
	int rc;

	for (;;) {
		int c = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

		if (c < 0)
			return shmrpc__fail(-errno, "init_rpc: cannot make a unix socket: %s",
					    strerror(errno));
		if (connect(c, (struct sockaddr *)&a, alen) == 0) {
			rc = knock(c, req, deadline, fds);
			if (rc == 0) {
				*conn = c;
				return 0;
			}
			if (rc != -EAGAIN) {
				close(c);
				return rc;
			}
		} else if (errno == ECONNREFUSED || errno == ENOENT) {
			/* No keeper (or one that closed its door): be the first. */
			rc = start_keeper(&a, alen, req->world, pool_size, python);
			if (rc) {
				close(c);
				return rc;
			}
		} else if (errno != EAGAIN && errno != EINTR) {
			rc = -errno;
			close(c);
			return shmrpc__fail(rc, "init_rpc: cannot connect to the rendezvous socket "
					    "@%s: %s", a.sun_path + 1, strerror(-rc));
		}
		close(c);
		if (shmrpc_now_ns() >= deadline)
			return shmrpc__fail(-ETIMEDOUT, "init_rpc: no keeper of this rendezvous "
					    "answered within %llu ms", (unsigned long long)timeout_ms);
		usleep(RETRY_US);
	}
}

/* join(key, rank, world, name, pool_bytes, timeout_ms, python)
 *   -> (conn, segment_fd, pool_fd, rref_fd, keeper_pid); python: the
 * interpreter that runs a keeper this process starts ("": none, fork only) */
static PyObject *mod_join(PyObject *m, PyObject *args)
{
	const char *key, *name, *python;
	unsigned int rank, world;
	unsigned long long pool_bytes, timeout_ms;
	struct join_req req = { .magic = JOIN_MAGIC, .version = JOIN_VERSION };
	struct ucred cred = { 0 };
	socklen_t clen = sizeof(cred);
	int conn = -1, fds[3], rc;

	(void)m;
	if (!PyArg_ParseTuple(args, "sIIsKKs", &key, &rank, &world, &name, &pool_bytes,
			      &timeout_ms, &python))
		return NULL;
	if (!*name || strlen(name) >= SHM_NAME_MAX) {
		PyErr_Format(PyExc_ValueError, "init_rpc: a worker name has 1 to %d bytes",
			     SHM_NAME_MAX - 1);
		return NULL;
	}
	if (world < 1 || world > SHM_MAX_WORLD || rank >= world) {
		PyErr_Format(PyExc_ValueError, "init_rpc: rank %u, world_size %u: a job has 1 to %d "
			     "workers, ranked from 0", rank, world, (int)SHM_MAX_WORLD);
		return NULL;
	}
	req.rank = rank;
	req.world = world;
	memcpy(req.name, name, strlen(name));
	Py_BEGIN_ALLOW_THREADS
	rc = join(key, &req, pool_bytes, timeout_ms, python, &conn, fds);
	if (rc == 0)
		getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &clen);
	Py_END_ALLOW_THREADS
	if (rc) {
		PyErr_SetString(rc == -ETIMEDOUT ? PyExc_TimeoutError : PyExc_RuntimeError,
				shmrpc_errmsg());
		return NULL;
	}
	return Py_BuildValue("(iiiii)", conn, fds[0], fds[1], fds[2], (int)cred.pid);
}

/* leave(conn): the keeper hears this worker leave (even while a process
 * forked from it still holds a copy of the connection). */
static PyObject *mod_leave(PyObject *m, PyObject *arg)
{
	long fd = PyLong_AsLong(arg);

	(void)m;
	if (fd == -1 && PyErr_Occurred())
		return NULL;
	shutdown((int)fd, SHUT_RDWR);
	close((int)fd);
	Py_RETURN_NONE;
}

/* _keep(fd, starter, world, pool_bytes): in the exec'd keeper, runs it on
 * the listening socket fd (starter: the starter's pidfd, or -1); returns
 * its exit code. */
static PyObject *mod_keep(PyObject *m, PyObject *args)
{
	int fd, starter, rc;
	unsigned int world;
	unsigned long long pool_bytes;

	(void)m;
	if (!PyArg_ParseTuple(args, "iiIK", &fd, &starter, &world, &pool_bytes))
		return NULL;
	prctl(PR_SET_NAME, "shmrpc-keeper");
	Py_BEGIN_ALLOW_THREADS
	rc = keeper_run(fd, starter, world, pool_bytes);
	Py_END_ALLOW_THREADS
	return PyLong_FromLong(rc);
}

static PyMethodDef join_functions[] = {
	{ "join", mod_join, METH_VARARGS,
	  "join(key, rank, world, name, pool_bytes, timeout_ms, python) -> (conn, seg, pool, "
	  "rrefs, keeper_pid)" },
	{ "_keep", mod_keep, METH_VARARGS,
	  "_keep(fd, starter, world, pool_bytes): runs a job's keeper" },
	{ "leave", mod_leave, METH_O, "leave(conn): this worker leaves its keeper's job" },
	{ NULL, NULL, 0, NULL },
};

int module_add_join(PyObject *m)
{
	return PyModule_AddFunctions(m, join_functions);
}
