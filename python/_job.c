/*
 * _shmrpc.Job: a job whose launcher is this process. shmrpc.data's loader
 * makes one to start its workers by fork (so that they inherit the dataset,
 * as torch's DataLoader workers do): this process is rank 0, the children
 * it forks are the other ranks, and a watcher thread does for them what
 * shmrun's watch does: reaps each one, releases what it held and marks its
 * slot (launcher/job_shm.c), so that the agents fail their calls to it.
 *
 * The children hold the job's memfds from the fork; this process attaches
 * its own agent to duplicates (the agent closes what it attaches).
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "shmrpc.h"
#include "launcher/job_shm.h"
#include "python/module.h"
#include "shm/exit_info.h"
#include "worker/python_api.h"

struct child {
	pid_t pid;  /* 0: not started */
	int pidfd;  /* -1 once reaped */
	bool ended;
	uint32_t exit_info;
};

typedef struct {
	PyObject_HEAD
	struct job_shm shm;
	bool open;
	uint32_t world;
	struct child *kids; /* [world]; kids[0] is this process, never watched */
	int stopfd;         /* eventfd: the watcher ends */
	bool watching;
	pthread_t watcher;
	pthread_mutex_t lock; /* kids[].ended/exit_info, running */
	pthread_cond_t changed;
	uint32_t running;     /* started and not reaped */
	bool closing;         /* a closer thread runs close_job: only it touches the job */
	pthread_t closer;
	long long close_grace_ms;
	_Atomic bool closer_done; /* release by the closer at its end; acquire in closed() */
} JobObject;

static void *watch_main(void *arg)
{
	JobObject *j = arg;
	struct pollfd *pfd = calloc(j->world, sizeof(*pfd));
	uint32_t *rank = calloc(j->world, sizeof(*rank));

	if (!pfd || !rank) {
		fprintf(stderr, "shmrpc.data: out of memory watching the workers\n");
		goto out;
	}
	for (;;) {
		nfds_t n = 0;

		pfd[n++] = (struct pollfd){ .fd = j->stopfd, .events = POLLIN };
		for (uint32_t r = 1; r < j->world; r++)
			if (j->kids[r].pidfd >= 0) {
				rank[n] = r;
				pfd[n++] = (struct pollfd){ .fd = j->kids[r].pidfd, .events = POLLIN };
			}
		if (n == 1 || poll(pfd, n, -1) < 0 || pfd[0].revents)
			break;
		for (nfds_t i = 1; i < n; i++) {
			struct child *c = &j->kids[rank[i]];
			uint32_t info;

			if (!pfd[i].revents)
				continue;
			info = job_reap(c->pidfd, c->pid);
			close(c->pidfd);
			c->pidfd = -1;
			/* Known here before the agents hear of it (job_worker_ended's
			 * doorbells), so that a failed call can name the cause. */
			pthread_mutex_lock(&j->lock);
			c->ended = true;
			c->exit_info = info;
			pthread_mutex_unlock(&j->lock);
			job_worker_ended(&j->shm, rank[i], info);
			pthread_mutex_lock(&j->lock);
			j->running--;
			pthread_cond_broadcast(&j->changed);
			pthread_mutex_unlock(&j->lock);
		}
	}
out:
	free(pfd);
	free(rank);
	return NULL;
}

/* Job(names, pool_bytes, max_rrefs=0, pool_records=0, holder_records=0,
 * pool_retain=0): names[r] is rank r's; rank 0 is this process. The counts
 * size the RRef table and the pool's records, pool_retain the free pool
 * bytes kept committed (0: the defaults, which are shmrun's). */
static PyObject *job_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
	PyObject *names;
	unsigned long long pool_bytes, pool_retain = 0;
	unsigned int max_rrefs = 0, pool_records = 0, holder_records = 0;
	JobObject *j;
	Py_ssize_t n;
	int rc;

	(void)kw;
	if (!PyArg_ParseTuple(args, "OK|IIIK", &names, &pool_bytes, &max_rrefs, &pool_records,
			      &holder_records, &pool_retain))
		return NULL;
	n = PyList_Size(names);
	if (n < 2 || n > (Py_ssize_t)SHM_MAX_WORLD) {
		if (!PyErr_Occurred())
			PyErr_Format(PyExc_ValueError, "a job has 2 to %d workers", (int)SHM_MAX_WORLD);
		return NULL;
	}
	j = (JobObject *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
	if (!j)
		return NULL;
	j->stopfd = -1;
	j->world = (uint32_t)n;
	j->kids = calloc((size_t)n, sizeof(*j->kids));
	if (!j->kids) {
		Py_DECREF(j);
		return PyErr_NoMemory();
	}
	for (Py_ssize_t r = 0; r < n; r++)
		j->kids[r].pidfd = -1;
	pthread_mutex_init(&j->lock, NULL);
	pthread_cond_init(&j->changed, NULL);
	Py_BEGIN_ALLOW_THREADS
	rc = job_shm_create(&j->shm, &(struct job_shm_params){ .world = (uint32_t)n,
							  .job_name = "shmrpc.data",
							  .pool_size = pool_bytes,
							  .max_rrefs = max_rrefs,
							  .pool_records = pool_records,
							  .holder_records = holder_records,
							  .pool_retain = pool_retain });
	Py_END_ALLOW_THREADS
	if (rc) {
		PyErr_SetString(PyExc_RuntimeError, shmrpc_errmsg());
		Py_DECREF(j);
		return NULL;
	}
	j->open = true;
	for (uint32_t r = 0; r < j->world; r++) {
		struct shm_worker *w = shm_worker(&j->shm.seg, r);
		PyObject *b = PyUnicode_AsUTF8String(PyList_GetItem(names, r));
		const char *name = b ? PyBytes_AsString(b) : NULL;

		if (!name || strlen(name) >= SHM_NAME_MAX) {
			if (!PyErr_Occurred())
				PyErr_Format(PyExc_ValueError, "worker names have under %d bytes",
					     SHM_NAME_MAX);
			Py_XDECREF(b);
			Py_DECREF(j);
			return NULL;
		}
		memcpy(w->name, name, strlen(name));
		Py_DECREF(b);
		/* Release: a worker that reads its generation (acquire) sees the name. */
		atomic_store_explicit(&w->generation, 1, memory_order_release);
	}
	/* Release: pairs with the peers' acquire of our pid before they watch us. */
	atomic_store_explicit(&shm_worker(&j->shm.seg, 0)->pid, (uint32_t)getpid(),
			      memory_order_release);
	j->kids[0].pid = getpid();
	return (PyObject *)j;
}

static JobObject *open_job(PyObject *self)
{
	JobObject *j = (JobObject *)self;

	/* closing first: while the closer runs, open is the closer's. */
	if (j->closing || !j->open) {
		PyErr_SetString(PyExc_ValueError, "the job is closed");
		return NULL;
	}
	return j;
}

/* fds() -> (segment, pool, rrefs): the memfds, for a child to attach. */
static PyObject *job_fds(PyObject *self, PyObject *unused)
{
	JobObject *j = open_job(self);

	(void)unused;
	return j ? Py_BuildValue("(iii)", j->shm.seg.fd, j->shm.pool.fd, j->shm.rrefs.fd) : NULL;
}

/* started(rank, pid): the child forked for rank. */
static PyObject *job_started(PyObject *self, PyObject *args)
{
	JobObject *j = open_job(self);
	unsigned int rank;
	int pid, fd;

	if (!j || !PyArg_ParseTuple(args, "Ii", &rank, &pid))
		return NULL;
	if (rank == 0 || rank >= j->world || j->kids[rank].pid || j->watching) {
		PyErr_Format(PyExc_ValueError, "started(%u): not a rank waiting for its worker", rank);
		return NULL;
	}
	fd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (fd < 0)
		return PyErr_SetFromErrno(PyExc_OSError);
	j->kids[rank].pid = pid;
	j->kids[rank].pidfd = fd;
	j->running++;
	/* Release: the slot's name and generation are visible with the pid. */
	atomic_store_explicit(&shm_worker(&j->shm.seg, rank)->pid, (uint32_t)pid,
			      memory_order_release);
	Py_RETURN_NONE;
}

/* watch(): the watcher starts; every child is started by now. */
static PyObject *job_watch(PyObject *self, PyObject *unused)
{
	JobObject *j = open_job(self);
	int rc;

	(void)unused;
	if (!j)
		return NULL;
	if (j->watching)
		Py_RETURN_NONE;
	j->stopfd = eventfd(0, EFD_CLOEXEC);
	if (j->stopfd < 0)
		return PyErr_SetFromErrno(PyExc_OSError);
	rc = pthread_create(&j->watcher, NULL, watch_main, j);
	if (rc) {
		errno = rc;
		return PyErr_SetFromErrno(PyExc_OSError);
	}
	j->watching = true;
	Py_RETURN_NONE;
}

/* ended() -> [(rank, pid, exit_info, text)] for the children that ended. */
static PyObject *job_ended(PyObject *self, PyObject *unused)
{
	JobObject *j = (JobObject *)self;
	PyObject *out = PyList_New(0);

	(void)unused;
	if (!out)
		return NULL;
	pthread_mutex_lock(&j->lock);
	for (uint32_t r = 1; r < j->world; r++) {
		char text[96];
		PyObject *item;

		if (!j->kids[r].ended)
			continue;
		shm_exit_info_format(j->kids[r].exit_info, text, sizeof(text));
		item = Py_BuildValue("(IiIs)", r, (int)j->kids[r].pid, j->kids[r].exit_info, text);
		if (!item || PyList_Append(out, item)) {
			Py_XDECREF(item);
			Py_CLEAR(out);
			break;
		}
		Py_DECREF(item);
	}
	pthread_mutex_unlock(&j->lock);
	return out;
}

static void signal_children(JobObject *j, int sig)
{
	/* Through the pidfd: a reaped pid that was reused is never hit. */
	pthread_mutex_lock(&j->lock);
	for (uint32_t r = 1; r < j->world; r++)
		if (j->kids[r].pidfd >= 0 && !j->kids[r].ended)
			syscall(SYS_pidfd_send_signal, j->kids[r].pidfd, sig, NULL, 0);
	pthread_mutex_unlock(&j->lock);
}

/* Waits until every child has ended, at most grace_ms (then SIGKILL),
 * stops the watcher and frees the job's memory. */
static void close_job(JobObject *j, long long grace_ms)
{
	struct timespec until;

	if (!j->open)
		return;
	if (j->watching) {
		clock_gettime(CLOCK_REALTIME, &until);
		until.tv_sec += grace_ms / 1000;
		until.tv_nsec += (grace_ms % 1000) * 1000000;
		if (until.tv_nsec >= 1000000000) {
			until.tv_sec++;
			until.tv_nsec -= 1000000000;
		}
		pthread_mutex_lock(&j->lock);
		while (j->running && pthread_cond_timedwait(&j->changed, &j->lock, &until) == 0)
			;
		pthread_mutex_unlock(&j->lock);
		signal_children(j, SIGKILL);
		pthread_mutex_lock(&j->lock);
		while (j->running)
			pthread_cond_wait(&j->changed, &j->lock);
		pthread_mutex_unlock(&j->lock);
		(void)eventfd_write(j->stopfd, 1);
		pthread_join(j->watcher, NULL);
		close(j->stopfd);
		j->watching = false;
	}
	/* Children never watched (a failed start) are collected here. */
	for (uint32_t r = 1; r < j->world; r++)
		if (j->kids[r].pidfd >= 0) {
			syscall(SYS_pidfd_send_signal, j->kids[r].pidfd, SIGKILL, NULL, 0);
			job_reap(j->kids[r].pidfd, j->kids[r].pid);
			close(j->kids[r].pidfd);
			j->kids[r].pidfd = -1;
		}
	/* What this process left in the pool and the table (its agent is gone). */
	job_worker_ended(&j->shm, 0, 0);
	job_shm_close(&j->shm);
	j->open = false;
}

static void *closer_main(void *arg)
{
	JobObject *j = arg;

	close_job(j, j->close_grace_ms);
	atomic_store_explicit(&j->closer_done, true, memory_order_release);
	return NULL;
}

/* The closer started by close(wait=False) has ended (joined here). */
static void join_closer(JobObject *j)
{
	if (!j->closing)
		return;
	pthread_join(j->closer, NULL);
	j->closing = false;
}

/* close(grace_ms=0, wait=True). wait False: a thread of its own closes
 * the job (waits for the children, then frees the job's memory), and
 * close returns at once; the object must be kept until closed() says
 * so (its deallocation waits for that thread). */
static PyObject *job_close(PyObject *self, PyObject *args)
{
	JobObject *j = (JobObject *)self;
	long long grace_ms = 0;
	int wait = 1;

	if (!PyArg_ParseTuple(args, "|Lp", &grace_ms, &wait))
		return NULL;
	if (!wait && !j->closing && j->open) {
		j->close_grace_ms = grace_ms;
		if (pthread_create(&j->closer, NULL, closer_main, j) == 0) {
			j->closing = true;
			Py_RETURN_NONE;
		}
		/* No thread to spare: closed here, as with wait. */
	}
	Py_BEGIN_ALLOW_THREADS
	join_closer(j);
	close_job(j, grace_ms);
	Py_END_ALLOW_THREADS
	Py_RETURN_NONE;
}

/* closed() -> bool: no close is left to finish (close(wait=False)'s
 * thread has ended, or the job was closed in place). */
static PyObject *job_closed(PyObject *self, PyObject *unused)
{
	JobObject *j = (JobObject *)self;

	(void)unused;
	if (j->closing)
		return PyBool_FromLong(atomic_load_explicit(&j->closer_done, memory_order_acquire));
	return PyBool_FromLong(!j->open);
}

/* pool_stats() -> (size, used): bytes of tensor data in the job's pool. */
static PyObject *job_pool_stats(PyObject *self, PyObject *unused)
{
	JobObject *j = open_job(self);
	struct pool_stats st;

	(void)unused;
	if (!j)
		return NULL;
	pool_stats(&j->shm.pool, &st);
	return Py_BuildValue("(KK)", (unsigned long long)st.size, (unsigned long long)st.used);
}

/* kill(): SIGKILL to every child still running (the trainer is going away). */
static PyObject *job_kill(PyObject *self, PyObject *unused)
{
	(void)unused;
	signal_children((JobObject *)self, SIGKILL);
	Py_RETURN_NONE;
}

/* A copy of the job in a process forked from its launcher (a program's
 * own fork after an epoch, while the job's close still runs): the threads,
 * the children, the rank-0 references and the descriptors' state are the
 * launcher's. Joining a thread the copy names would wait for ever, and a
 * close could close descriptors the process has reused: the copy is left
 * as it is (its mappings and memfds go when the process ends or execs). */
static bool forked_copy(const JobObject *j)
{
	return j->kids && j->kids[0].pid && j->kids[0].pid != getpid();
}

static void job_dealloc(PyObject *self)
{
	JobObject *j = (JobObject *)self;
	PyTypeObject *tp = Py_TYPE(self);

	if (!forked_copy(j)) {
		Py_BEGIN_ALLOW_THREADS
		join_closer(j);
		Py_END_ALLOW_THREADS
		close_job(j, 0);
		if (j->kids) {
			pthread_mutex_destroy(&j->lock);
			pthread_cond_destroy(&j->changed);
		}
	}
	free(j->kids);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp);
}

static PyMethodDef job_methods[] = {
	{ "fds", job_fds, METH_NOARGS, "fds() -> (segment, pool, rrefs) memfds" },
	{ "started", job_started, METH_VARARGS, "started(rank, pid): the child forked for rank" },
	{ "watch", job_watch, METH_NOARGS, "start watching the children" },
	{ "ended", job_ended, METH_NOARGS, "ended() -> [(rank, pid, exit_info, text)]" },
	{ "pool_stats", job_pool_stats, METH_NOARGS, "pool_stats() -> (size, used) bytes" },
	{ "kill", job_kill, METH_NOARGS, "SIGKILL every child still running" },
	{ "close", job_close, METH_VARARGS,
	  "close(grace_ms=0, wait=True): wait, then kill, then free (wait False: in a thread)" },
	{ "closed", job_closed, METH_NOARGS, "closed() -> bool: no close left to finish" },
	{ NULL, NULL, 0, NULL },
};

static PyType_Slot job_slots[] = {
	{ Py_tp_new, job_new },
	{ Py_tp_dealloc, job_dealloc },
	{ Py_tp_methods, job_methods },
	{ Py_tp_doc, "Job(names, pool_bytes): a job this process launches (rank 0) by fork" },
	{ 0, NULL },
};

static PyType_Spec job_spec = { "shmrpc._shmrpc.Job", sizeof(JobObject), 0, Py_TPFLAGS_DEFAULT,
				job_slots };

/* die_with_parent(ppid): in a forked worker, first thing: SIGKILL when
 * the launcher (its parent) dies, and exit now if it already has. */
static PyObject *mod_die_with_parent(PyObject *m, PyObject *arg)
{
	long ppid = PyLong_AsLong(arg);

	(void)m;
	if (ppid == -1 && PyErr_Occurred())
		return NULL;
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != (pid_t)ppid)
		_exit(1);
	Py_RETURN_NONE;
}

/* pool_mapping() -> (address, bytes) of this process's mapping of its
 * job's pool, or None: what to register with CUDA so that batches in the
 * pool are pinned host memory. */
static PyObject *mod_pool_mapping(PyObject *m, PyObject *unused)
{
	void *base;
	uint64_t size;

	(void)m, (void)unused;
	if (!python_pool_mapping(&base, &size))
		Py_RETURN_NONE;
	return Py_BuildValue("(KK)", (unsigned long long)(uintptr_t)base, (unsigned long long)size);
}

static PyMethodDef job_functions[] = {
	{ "pool_mapping", mod_pool_mapping, METH_NOARGS,
	  "pool_mapping() -> (address, bytes) of the pool's mapping, or None" },
	{ "die_with_parent", mod_die_with_parent, METH_O,
	  "die_with_parent(ppid): SIGKILL when the parent dies" },
	{ NULL, NULL, 0, NULL },
};

int module_add_job(PyObject *m)
{
	PyObject *t = PyType_FromSpec(&job_spec);

	/* The join's functions (_join.c) come with the job's, so that the
	 * module's init needs no line for them. */
	if (!t || PyModule_AddFunctions(m, job_functions) || module_add_join(m))
		return -1;
	return PyModule_AddObject(m, "Job", t);
}
