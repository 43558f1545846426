/*
 * shmrun, the launcher: what its files share. main.c runs the steps in
 * order: options.c reads the command line, spawn.c creates the workers,
 * watch.c waits on them (pidfds, signals, the timeout) and tears the job
 * down, output.c carries --tag-output lines, report.c says what happened,
 * trace_json.c writes --trace's file, orphans.c and guard.c stop what the
 * workers started (guard.c: also when shmrun itself is killed; tree.c
 * finds them), integrity.c checks the segment's header and slots.
 *
 * The launcher is one thread; only it writes `struct job`.
 */
#ifndef SHMRPC_LAUNCHER_SHMRUN_H
#define SHMRPC_LAUNCHER_SHMRUN_H

#include <stdbool.h>
#include <stddef.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>

#include "launcher/job_shm.h"
#include "launcher/seg_watch.h"

/* Exit codes of the launcher itself. */
#define SHMRUN_EXIT_FAILED 1  /* a worker failed, or the job could not start */
#define SHMRUN_EXIT_USAGE 2   /* bad command line */
#define SHMRUN_EXIT_TIMEOUT 124
#define SHMRUN_EXIT_NOEXEC 127 /* a worker could not exec its program */

#define SHMRUN_DUMP_RECORDS 32 /* --dump-on-failure: records shown per death */

struct shmrun_opts {
	uint32_t nproc;
	const char *name_format; /* {rank} and {local_rank} are substituted */
	bool tag_output;
	bool cpu_bind;
	bool keep_going; /* --on-failure=continue */
	bool quiet;
	bool dump_on_failure; /* a dead worker's last trace records after its death line */
	uint64_t timeout_ns; /* 0: none */
	uint64_t grace_ns;
	const char *timeout_text; /* --timeout as given, for the message */
	const char *wait_mode;    /* --wait, passed on as SHMRPC_WAIT; NULL: none */
	uint32_t ring_size;       /* 0: the segment's default */
	uint64_t pool_size;       /* bytes of tensor data at most; 0: pool_default_bytes() */
	uint32_t max_rrefs;       /* 0: the table's default */
	uint32_t holder_records;  /* --holder-records; 0: the pool's default */
	uint32_t pool_records;    /* --pool-records; 0: the pool's default */
	uint32_t trace_records;   /* flight-recorder records per worker; 0: the segment's default */
	const char *trace_path;   /* --trace: the job's recorders as trace JSON; NULL: none */
	uint32_t seg_flags;       /* SHM_F_* */
	char **argv;              /* the program and its arguments */
};

/* One --tag-output stream of one worker: the read end of its pipe and the
 * bytes of a line not finished yet. */
struct out_stream {
	int fd;      /* -1 once closed */
	int dst;     /* 1 or 2: where its lines go */
	uint32_t rank;
	bool mid_line; /* a line too long for buf was started without its end */
	size_t len;
	char buf[4096];
};

struct proc {
	pid_t pid;   /* 0: never started */
	int pidfd;   /* -1 once reaped */
	uint32_t exit_info; /* 0: exited 0; SHM_EXIT_* otherwise */
	bool failed;  /* ended badly before the launcher stopped the job */
	bool stopped; /* ended badly after the launcher began to stop the job */
	struct seg_watch_rank watch; /* what its slot must say (integrity.c) */
	struct out_stream out[2]; /* stdout, stderr (--tag-output) */
};

enum stop_reason {
	STOP_NONE = 0,
	STOP_FAILURE, /* a worker failed and --on-failure=abort */
	STOP_SIGNAL,  /* the launcher was sent SIGINT, SIGTERM or SIGHUP */
	STOP_TIMEOUT, /* --timeout expired */
	STOP_ERROR,   /* the launcher could not start or watch every worker */
	STOP_CORRUPT, /* the segment header was overwritten (integrity.c) */
};

struct job {
	const struct shmrun_opts *o;
	struct job_shm shm;
	struct proc *procs; /* [o->nproc] */
	uint32_t running;   /* started and not reaped yet */
	uint32_t failed;
	pid_t launcher_pid;
	sigset_t worker_sigmask;          /* the signal mask the launcher was started with */
	struct sigaction worker_sigpipe;  /* and its SIGPIPE disposition */
	int cpus[CPU_SETSIZE];            /* --cpu-bind: the cores allowed, in order */
	int ncpus;
	uint64_t start_ns;
	int sigfd;
	enum stop_reason stop;
	int stop_signal;    /* STOP_SIGNAL: which */
	uint64_t kill_at_ns; /* stopping: when SIGKILL follows; 0: none pending */
	struct pollfd *pfd;  /* watch.c's, one per fd it watches */
	struct watched *watched;
	pid_t guard_pid;     /* guard.c's process; 0: none */
	struct seg_watch watch;     /* the header as shmrun wrote it (integrity.c) */
	uint64_t check_at;          /* when integrity_check runs next */
	int guard_fd;        /* the write end of its pipe */
};

/* options.c: fills o from argv. Returns -1 to go on, or the exit code
 * (0 after --help or --version, SHMRUN_EXIT_USAGE after a bad argument). */
int shmrun_parse_options(int argc, char **argv, struct shmrun_opts *o);

/* spawn.c: writes every slot's name and generation, then forks and execs
 * the workers. 0, or -1 (said on stderr) if one could not be started. */
int spawn_workers(struct job *j);
/* The name of a worker, from the format: NUL-terminated, truncated to len. */
void spawn_format_name(const char *fmt, uint32_t rank, uint32_t local_rank, char *buf, size_t len);

/* watch.c: before the workers start: blocks the signals the launcher
 * forwards and opens j->sigfd for them, ignores SIGPIPE (keeping what the
 * workers must get back), allocates what the watch needs. 0 or -1 (said
 * on stderr). */
int watch_init(struct job *j);
void watch_free(struct job *j);
/* Starts the teardown: shutting_down, doorbells, sig to every worker. */
void watch_stop(struct job *j, enum stop_reason why, int sig);
/* Waits until every started worker is reaped; returns the exit code. */
int watch_job(struct job *j);

/* output.c: makes the pipe of one stream; *child_end is the write end for
 * the worker (close-on-exec: the worker dup2s it). 0 or -1. */
int output_open(struct out_stream *s, int dst, uint32_t rank, int *child_end);
/* Reads what the stream has and writes its complete lines, prefixed; at
 * end of file, flushes a partial last line and closes. */
void output_pump(struct out_stream *s);
/* The worker is gone: takes what is left in the pipe, flushes, closes. */
void output_finish(struct out_stream *s);

/* orphans.c: the processes the workers start. Makes shmrun their child
 * subreaper (0, or -1 said on stderr); reaps those that have ended (on
 * SIGCHLD); once every worker is reaped, stops the rest (SIGTERM, the
 * grace, SIGKILL: every descendant, however deep), reaps them and says so
 * on stderr. */
int orphans_adopt(void);
void orphans_reap(const struct job *j);
/* sig to every descendant of shmrun but the live workers (their pidfds'
 * business) and the guard: with the workers' own, when the job stops. */
void orphans_signal(const struct job *j, int sig);
void orphans_end(const struct job *j);

/* tree.c: the descendants of root (not root), parents before children,
 * into out (most at most); how many. */
int tree_list(pid_t root, pid_t *out, int most);

/* guard.c: forks the guard, which stops the processes the workers left
 * when shmrun ends before them (a kill -9); 0, or -1 said on stderr (the
 * job runs without). guard_stop, once the orphans are stopped: it looks
 * once more and ends. */
int guard_start(struct job *j);
void guard_stop(struct job *j);

/* integrity.c: integrity_init keeps shmrun's copy of the header, once
 * it is written; integrity_check, from the watch loop every
 * SHMRUN_CHECK_NS, compares the header with it (a change stops the job,
 * STOP_CORRUPT) and each slot with what shmrun recorded (a slot found
 * corrupt is said once and fails the job at its end); both note
 * SHM_CORRUPT_* in j->shm.corrupt for report_corrupt. */
#define SHMRUN_CHECK_NS SEG_WATCH_EVERY_NS
void integrity_init(struct job *j);
void integrity_check(struct job *j);

/* report.c */
void report_death(const struct job *j, uint32_t rank);
/* The last records of rank's flight recorder, on stderr (--dump-on-failure). */
void report_trace(const struct job *j, uint32_t rank);
void report_summary(const struct job *j);
/* After the job: says so on stderr if the RRef table is not empty. */
void report_leaks(const struct job *j);
/* After the job: names the workers that received corrupt frames, and each
 * shared structure found corrupt (tensor pool, RRef table) with who found
 * it; how many such findings. */
int report_corrupt(const struct job *j);
/* "worker 3 (worker3)" */
void report_worker(const struct job *j, uint32_t rank, char *buf, size_t len);

/* trace_json.c: once every worker is reaped, their flight recorders as
 * Chrome trace-event JSON into path. 0, or -1 (said on stderr). */
int trace_json_write(const struct job *j, const char *path);

#endif
