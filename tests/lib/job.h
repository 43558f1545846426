/*
 * Tests that are shmrpc jobs: the test program runs itself under the real
 * launcher (`shmrun ... -- /proc/self/exe`) and judges the job from the
 * launcher's exit status and output. In the workers tl_is_worker() is true.
 */
#ifndef SHMRPC_TESTS_JOB_H
#define SHMRPC_TESTS_JOB_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>

bool tl_is_worker(void);
/* $SHMRPC_BUILD/rel (default build/rel), written to path. */
const char *tl_build_path(char path[static PATH_MAX], const char *rel);
/* Path of shmrun in the build being tested ($SHMRPC_BUILD/bin/shmrun). */
const char *tl_shmrun_path(void);
/* $SHMRPC_BUILD/bin/shmrpc-inspect (default build/). */
const char *tl_inspect_path(void);
/* Runs shmrun with the NULL-terminated options, then `-- /proc/self/exe`;
 * stdout+stderr of the whole job go to out (NUL-terminated, truncated to
 * len). Returns the launcher's exit code, 128+signal if it was killed, -1
 * if it could not run. */
int tl_shmrun(char *out, size_t len, const char *opt, ...) __attribute__((sentinel));
/*
 * The whole main() of most job tests: in a worker, returns worker();
 * otherwise runs the job with the options (NULL-terminated), and passes
 * when the launcher exits 0 and nothing is left in /dev/shm. Skips (77)
 * when shmrun is not built.
 */
int tl_job_test(int (*worker)(void), const char *opt, ...) __attribute__((sentinel));
/* The same for a job meant to fail: the launcher must exit want_rc and its
 * output hold every string of texts (NULL-terminated). */
int tl_job_expect(int (*worker)(void), int want_rc, const char *const *texts, const char *opt, ...)
	__attribute__((sentinel));

#endif
