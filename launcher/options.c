/* shmrun's command line: torchrun's spellings are accepted beside ours. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "ipc/wait.h"
#include "launcher/shmrun.h"

#define DEFAULT_GRACE_S 3.0
#define MAX_SECONDS 1e9 /* keeps seconds * 1e9 inside a uint64_t */

enum {
	OPT_NAME_FORMAT = 256,
	OPT_TAG_OUTPUT,
	OPT_TIMEOUT,
	OPT_CPU_BIND,
	OPT_ON_FAILURE,
	OPT_GRACE,
	OPT_WAIT,
	OPT_RING_SIZE,
	OPT_POOL_SIZE,
	OPT_MAX_RREFS,
	OPT_HOLDER_RECORDS,
	OPT_POOL_RECORDS,
	OPT_TRACE_RECORDS,
	OPT_TRACE,
	OPT_DUMP_ON_FAILURE,
	OPT_NO_CSUM,
	OPT_QUIET,
	OPT_AS_TORCH,
	OPT_VERSION,
};

static const struct option long_opts[] = {
	{ "nproc-per-node", required_argument, NULL, 'n' },
	{ "nproc_per_node", required_argument, NULL, 'n' },
	{ "name-format", required_argument, NULL, OPT_NAME_FORMAT },
	{ "tag-output", no_argument, NULL, OPT_TAG_OUTPUT },
	{ "timeout", required_argument, NULL, OPT_TIMEOUT },
	{ "cpu-bind", no_argument, NULL, OPT_CPU_BIND },
	{ "on-failure", required_argument, NULL, OPT_ON_FAILURE },
	{ "grace", required_argument, NULL, OPT_GRACE },
	{ "wait", required_argument, NULL, OPT_WAIT },
	{ "ring-size", required_argument, NULL, OPT_RING_SIZE },
	{ "pool-size", required_argument, NULL, OPT_POOL_SIZE },
	{ "max-rrefs", required_argument, NULL, OPT_MAX_RREFS },
	{ "holder-records", required_argument, NULL, OPT_HOLDER_RECORDS },
	{ "pool-records", required_argument, NULL, OPT_POOL_RECORDS },
	{ "trace-records", required_argument, NULL, OPT_TRACE_RECORDS },
	{ "trace", required_argument, NULL, OPT_TRACE },
	{ "dump-on-failure", no_argument, NULL, OPT_DUMP_ON_FAILURE },
	{ "no-payload-checksum", no_argument, NULL, OPT_NO_CSUM },
	{ "quiet", no_argument, NULL, OPT_QUIET },
	{ "as-torch", no_argument, NULL, OPT_AS_TORCH },
	{ "version", no_argument, NULL, OPT_VERSION },
	{ "help", no_argument, NULL, 'h' },
	{ NULL, 0, NULL, 0 },
};

/* The default pool size here, as --pool-size would take it ("12G"). */
static const char *pool_default_text(void)
{
	static char buf[32];
	uint64_t v = pool_default_bytes();

	if (!(v & ((1ull << 30) - 1)))
		snprintf(buf, sizeof(buf), "%lluG", (unsigned long long)(v >> 30));
	else if (v >= (1ull << 30))
		snprintf(buf, sizeof(buf), "%.1fG", (double)v / (1ull << 30));
	else
		snprintf(buf, sizeof(buf), "%lluM", (unsigned long long)(v >> 20));
	return buf;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: shmrun -n N [options] -- PROG [ARGS...]\n"
		"Runs N copies of PROG as one shmrpc job on this machine.\n"
		"\n"
		"  -n, --nproc-per-node N  number of workers, 1..%u (also --nproc_per_node)\n"
		"  --name-format FMT       worker names; {rank} and {local_rank} are replaced\n"
		"                          (default 'worker{rank}')\n"
		"  --tag-output            prefix each line the workers print with [rank]\n"
		"  --timeout SEC           stop the whole job after SEC seconds (exit 124)\n"
		"  --cpu-bind              pin worker i to the i-th core this process may use\n"
		"  --on-failure=MODE       abort (default): stop the others when a worker fails;\n"
		"                          continue: let them finish\n"
		"  --grace SEC             seconds between SIGTERM and SIGKILL (default 3)\n"
		"  --wait=MODE             how workers sleep: uring, futex or spin\n"
		"  --ring-size BYTES       bytes per ring, a power of two in %u..%u\n"
		"  --pool-size BYTES       the most the shared tensor pool may hold, e.g. 512M\n"
		"                          or 4G (default: half of this machine's memory, or\n"
		"                          of its cgroup's limit: %s here); memory is taken\n"
		"                          as tensors are made and given back as they go\n"
		"  --max-rrefs N           RRefs alive at once in the job, 1..%u (default %u)\n"
		"  --holder-records N      pool references each worker may hold at once (its\n"
		"                          received and made tensors), a power of two in\n"
		"                          16..16777216 (default %u; half beyond 512 workers)\n"
		"  --pool-records N        tensor pool blocks alive at once, 1..%u\n"
		"                          (default: one per 16 KiB of pool, %u..%u;\n"
		"                          a slab of 64 B tensors takes 1024)\n"
		"  --trace-records N       flight-recorder records per worker, a power of two\n"
		"                          in %u..%u (default %u; fewer beyond 256 workers);\n"
		"                          from 1024 split into up to 8 lanes, one per thread\n"
		"  --trace FILE            when the job has ended (also after a failure), write\n"
		"                          the workers' recorders to FILE as Chrome trace JSON\n"
		"                          for ui.perfetto.dev: calls, handlers, queue waits and\n"
		"                          flows between them, from each ring's last records\n"
		"  --dump-on-failure       when a worker dies, print its last %u recorded\n"
		"                          messages (shmrpc-inspect --trace shows them live)\n"
		"  --no-payload-checksum   frames carry no payload checksum\n"
		"  --quiet                 no summary line at the end\n"
		"  --as-torch              PROG is a Python interpreter: run its program with\n"
		"                          torch.distributed.rpc, .autograd and\n"
		"                          DistributedOptimizer resolving to shmrpc\n"
		"                          (python3 -m shmrpc.as_torch PROG.py ...)\n"
		"  --version               print the version and exit\n"
		"  -h, --help              print this help and exit\n"
		"\n"
		"Exit status: 0 when every worker exited 0, 1 when one failed, 2 for bad\n"
		"arguments, 124 on --timeout, 128+N when stopped by signal N.\n",
		SHM_MAX_WORLD, SHM_RING_MIN, SHM_RING_MAX, pool_default_text(), RREF_MAX_RREFS,
		RREF_DEFAULT_MAX_RREFS, POOL_HOLDER_CAP_DEFAULT, POOL_MAX_BLOCKS, POOL_BLOCKS_DEFAULT_MIN,
		POOL_BLOCKS_DEFAULT_MAX, SHM_TRACE_MIN, SHM_TRACE_MAX, shm_default_trace_records(1),
		SHMRUN_DUMP_RECORDS);
}

static int bad(const char *fmt, ...) SHMRPC_PRINTF(1, 2);
static int bad(const char *fmt, ...)
{
	va_list ap;

	fputs("shmrun: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	usage(stderr);
	return SHMRUN_EXIT_USAGE;
}

/* A whole decimal number in [lo, hi]. */
static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
	unsigned long long v;
	char *end;

	if (*s < '0' || *s > '9')
		return false;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || v < lo || v > hi)
		return false;
	*out = v;
	return true;
}

/* A byte count with an optional K, M, G or T suffix (powers of 1024). */
static bool parse_bytes(const char *s, uint64_t *out)
{
	static const char units[] = "KMGT";
	unsigned long long v;
	const char *u;
	char *end;

	if (*s < '0' || *s > '9')
		return false;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno)
		return false;
	if (*end) {
		if (end[1] || !(u = strchr(units, *end)))
			return false;
		for (int shift = 10 * (int)(u - units + 1); shift > 0; shift -= 10) {
			if (v > (~0ull >> 10))
				return false;
			v <<= 10;
		}
	}
	*out = v;
	return v > 0;
}

/* Seconds, fractions allowed, in [0, MAX_SECONDS]; zero only if allow_zero. */
static bool parse_seconds(const char *s, bool allow_zero, uint64_t *ns)
{
	char *end;
	double v;

	errno = 0;
	v = strtod(s, &end);
	if (errno || end == s || *end || !isfinite(v) || v < 0 || v > MAX_SECONDS ||
	    (v == 0 && !allow_zero))
		return false;
	*ns = (uint64_t)(v * 1e9);
	return true;
}

static bool has_rank_field(const char *fmt)
{
	return strstr(fmt, "{rank}") || strstr(fmt, "{local_rank}");
}

/* --as-torch: PYTHON [ITS OPTIONS] PROG ARGS... becomes PYTHON [ITS OPTIONS]
 * -m shmrpc.as_torch PROG ARGS... (PROG may be `-m MODULE`). The program
 * is not changed, so the words run as they would on torch; only a Python
 * command can be run so. Returns -1 to go on, or 2. */
static int as_torch_argv(struct shmrun_opts *o)
{
	static char mod_opt[] = "-m", mod[] = "shmrpc.as_torch";
	const char *base = strrchr(o->argv[0], '/');
	size_t n = 0, at = 1;
	char **argv;

	base = base ? base + 1 : o->argv[0];
	if (strncmp(base, "python", 6))
		return bad("--as-torch runs a Python program: the command must start with a Python "
			   "interpreter (python3 prog.py), not '%s'; a script that starts Python "
			   "itself can run python3 -m shmrpc.as_torch prog.py", o->argv[0]);
	/* Python's own options come first; -W and -X take the next word. */
	while (o->argv[at] && o->argv[at][0] == '-' && strcmp(o->argv[at], "-m") &&
	       strcmp(o->argv[at], "-c") && strcmp(o->argv[at], "-"))
		at += (!strcmp(o->argv[at], "-W") || !strcmp(o->argv[at], "-X")) && o->argv[at + 1]
			      ? 2 : 1;
	if (!o->argv[at] || !strcmp(o->argv[at], "-c") || !strcmp(o->argv[at], "-"))
		return bad("--as-torch needs the program Python runs, a file or -m MODULE (not "
			   "%s)", o->argv[at] ? (o->argv[at][1] ? "-c" : "stdin") : "nothing");
	while (o->argv[n])
		n++;
	argv = calloc(n + 3, sizeof(*argv));
	if (!argv)
		return bad("--as-torch: out of memory");
	memcpy(argv, o->argv, at * sizeof(*argv));
	argv[at] = mod_opt;
	argv[at + 1] = mod;
	memcpy(argv + at + 2, o->argv + at, (n - at + 1) * sizeof(*argv));
	o->argv = argv; /* lives as long as the launcher */
	return -1;
}

int shmrun_parse_options(int argc, char **argv, struct shmrun_opts *o)
{
	bool as_torch = false;
	uint64_t v;
	int c;

	*o = (struct shmrun_opts){ .name_format = "worker{rank}",
				   .grace_ns = (uint64_t)(DEFAULT_GRACE_S * 1e9) };
	opterr = 0; /* our own messages, each followed by the usage */
	/* '+': stop at the program, whose own options are not ours. */
	while ((c = getopt_long(argc, argv, "+:n:h", long_opts, NULL)) != -1) {
		switch (c) {
		case 'n':
			if (!parse_u64(optarg, 1, SHM_MAX_WORLD, &v))
				return bad("the number of workers must be 1..%u, not '%s'", SHM_MAX_WORLD,
					   optarg);
			o->nproc = (uint32_t)v;
			break;
		case OPT_NAME_FORMAT:
			if (!*optarg)
				return bad("--name-format must not be empty");
			o->name_format = optarg;
			break;
		case OPT_TAG_OUTPUT:
			o->tag_output = true;
			break;
		case OPT_TIMEOUT:
			if (!parse_seconds(optarg, false, &o->timeout_ns))
				return bad("--timeout takes a number of seconds above 0, not '%s'", optarg);
			o->timeout_text = optarg;
			break;
		case OPT_CPU_BIND:
			o->cpu_bind = true;
			break;
		case OPT_ON_FAILURE:
			if (strcmp(optarg, "abort") && strcmp(optarg, "continue"))
				return bad("--on-failure is abort or continue, not '%s'", optarg);
			o->keep_going = !strcmp(optarg, "continue");
			break;
		case OPT_GRACE:
			if (!parse_seconds(optarg, true, &o->grace_ns))
				return bad("--grace takes a number of seconds, not '%s'", optarg);
			break;
		case OPT_WAIT:
			if (ipc_wait_mode_parse(optarg) <= IPC_WAIT_AUTO)
				return bad("--wait is uring, futex or spin, not '%s'", optarg);
			o->wait_mode = optarg;
			break;
		case OPT_RING_SIZE:
			if (!parse_u64(optarg, SHM_RING_MIN, SHM_RING_MAX, &v) || (v & (v - 1)))
				return bad("--ring-size must be a power of two in %u..%u, not '%s'",
					   SHM_RING_MIN, SHM_RING_MAX, optarg);
			o->ring_size = (uint32_t)v;
			break;
		case OPT_POOL_SIZE:
			if (!parse_bytes(optarg, &o->pool_size))
				return bad("--pool-size must be a byte count like 1073741824, 512M or "
					   "2G, not '%s'", optarg);
			break;
		case OPT_MAX_RREFS:
			if (!parse_u64(optarg, 1, RREF_MAX_RREFS, &v))
				return bad("--max-rrefs must be 1..%u, not '%s'", RREF_MAX_RREFS, optarg);
			o->max_rrefs = (uint32_t)v;
			break;
		case OPT_HOLDER_RECORDS:
			if (!parse_u64(optarg, 16, 1u << 24, &v) || (v & (v - 1)))
				return bad("--holder-records must be a power of two in 16..16777216, "
					   "not '%s'", optarg);
			o->holder_records = (uint32_t)v;
			break;
		case OPT_POOL_RECORDS:
			if (!parse_u64(optarg, 1, POOL_MAX_BLOCKS, &v))
				return bad("--pool-records must be 1..%u, not '%s'", POOL_MAX_BLOCKS,
					   optarg);
			o->pool_records = (uint32_t)v;
			break;
		case OPT_TRACE_RECORDS:
			if (!parse_u64(optarg, SHM_TRACE_MIN, SHM_TRACE_MAX, &v) || (v & (v - 1)))
				return bad("--trace-records must be a power of two in %u..%u, not '%s'",
					   SHM_TRACE_MIN, SHM_TRACE_MAX, optarg);
			o->trace_records = (uint32_t)v;
			break;
		case OPT_TRACE:
			if (!*optarg)
				return bad("--trace needs a file name");
			o->trace_path = optarg;
			break;
		case OPT_DUMP_ON_FAILURE:
			o->dump_on_failure = true;
			break;
		case OPT_NO_CSUM:
			o->seg_flags |= SHM_F_NO_PAYLOAD_CSUM;
			break;
		case OPT_QUIET:
			o->quiet = true;
			break;
		case OPT_AS_TORCH:
			as_torch = true;
			break;
		case OPT_VERSION:
			printf("shmrun (shmrpc) %s\n", shmrpc_version());
			return 0;
		case 'h':
			usage(stdout);
			return 0;
		case ':':
			return bad("option '%s' needs an argument", argv[optind - 1]);
		default:
			return bad("unknown option '%s'", argv[optind - 1]);
		}
	}
	if (!o->nproc)
		return bad("missing -n N (the number of workers)");
	if (optind >= argc)
		return bad("missing the program to run (after --)");
	if (o->nproc > 1 && !has_rank_field(o->name_format))
		return bad("--name-format '%s' gives every worker the same name: put {rank} in it",
			   o->name_format);
	o->argv = argv + optind;
	if (as_torch)
		return as_torch_argv(o);
	return -1;
}
