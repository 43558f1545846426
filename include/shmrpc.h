/*
 * shmrpc — single-node multi-process RPC over shared memory.
 *
 * Public C API. Every function returns 0 (or a non-negative count) on
 * success and a negative errno on failure, as liburing does;
 * shmrpc_strerror() names the code and shmrpc_errmsg() gives the full
 * sentence (what, where, what to do) recorded by the last failing call
 * on this thread. Each function's comment lists the codes it returns
 * ("Errors:"), with the lists shared by several named once ("the call
 * errors", "the pool errors", "the CUDA errors", "the future's errors");
 * one that cannot fail says what it gives instead.
 */
#ifndef SHMRPC_H
#define SHMRPC_H

#include <dlpack/dlpack.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHMRPC_API __attribute__((visibility("default")))

#define SHMRPC_VERSION_MAJOR 0
#define SHMRPC_VERSION_MINOR 1
#define SHMRPC_VERSION_PATCH 0
#define SHMRPC_VERSION_STRING "0.1.0"

/* Error codes beyond plain errno meanings (each is a negative errno when returned). */
#define SHMRPC_EBADSEG EPROTO             /* the file is not a shmrpc segment */
#define SHMRPC_EVERSION EPROTONOSUPPORT   /* segment format this library cannot read */
#define SHMRPC_ETRUNC EOVERFLOW           /* segment shorter than its header says */
#define SHMRPC_ECORRUPT EBADMSG           /* a frame failed its checksum or bounds check */
#define SHMRPC_EPEERDEAD ECONNRESET       /* the peer worker died */

#define SHMRPC_EREMOTE EREMOTEIO          /* the remote function failed (see the future's error) */

/* The name of an error code (negative or not; 0: "success"): shmrpc's own
 * above, else strerror's. Cannot fail. */
SHMRPC_API const char *shmrpc_strerror(int err);
/* The sentence of this thread's last failure; "" before any. Cannot fail. */
SHMRPC_API const char *shmrpc_errmsg(void);
/* SHMRPC_VERSION_STRING of the library linked. Cannot fail. */
SHMRPC_API const char *shmrpc_version(void);

/*
 * Values: arguments and results. A value is a small tagged struct; strings,
 * bytes and lists point to memory owned by whoever made the value: the
 * caller for arguments, the call (shmrpc_call_alloc) for results, the future
 * for values received. On the wire they are MessagePack (docs/PROTOCOL.md).
 */
enum shmrpc_type {
	SHMRPC_NIL = 0,
	SHMRPC_BOOL = 1,
	SHMRPC_INT = 2,
	SHMRPC_FLOAT = 3,
	SHMRPC_STR = 4,   /* UTF-8, len bytes, NUL-terminated when received */
	SHMRPC_BYTES = 5,
	SHMRPC_LIST = 6,  /* len items */
	SHMRPC_MAP = 7,   /* len pairs: items[2i] is a key, items[2i+1] its value */
	SHMRPC_TENSOR = 8, /* a tensor in the shared pool or on a CUDA device: handed over, never copied */
	SHMRPC_RREF = 9,   /* a reference to a value on some worker (shmrpc_remote) */
};

typedef struct shmrpc_tensor shmrpc_tensor;
typedef struct shmrpc_rref shmrpc_rref;

typedef struct shmrpc_value {
	uint32_t type; /* enum shmrpc_type */
	uint32_t len;
	union {
		int b;
		int64_t i;
		double f;
		const char *s;
		const void *p;
		const struct shmrpc_value *items;
		shmrpc_tensor *t;
		shmrpc_rref *r;
	} u;
} shmrpc_value;

static inline shmrpc_value shmrpc_nil(void) { shmrpc_value v = { SHMRPC_NIL, 0, { 0 } }; return v; }
static inline shmrpc_value shmrpc_bool(int b) { shmrpc_value v = { SHMRPC_BOOL, 0, { .b = !!b } }; return v; }
static inline shmrpc_value shmrpc_int(int64_t i) { shmrpc_value v = { SHMRPC_INT, 0, { .i = i } }; return v; }
static inline shmrpc_value shmrpc_float(double f) { shmrpc_value v = { SHMRPC_FLOAT, 0, { .f = f } }; return v; }
static inline shmrpc_value shmrpc_strn(const char *s, uint32_t n) { shmrpc_value v = { SHMRPC_STR, n, { .s = s } }; return v; }
static inline shmrpc_value shmrpc_str(const char *s) { return shmrpc_strn(s, (uint32_t)__builtin_strlen(s)); }
static inline shmrpc_value shmrpc_bytes(const void *p, uint32_t n) { shmrpc_value v = { SHMRPC_BYTES, n, { .p = p } }; return v; }
static inline shmrpc_value shmrpc_list(const shmrpc_value *items, uint32_t n) { shmrpc_value v = { SHMRPC_LIST, n, { .items = items } }; return v; }
static inline shmrpc_value shmrpc_tensor_value(shmrpc_tensor *t) { shmrpc_value v = { SHMRPC_TENSOR, 0, { .t = t } }; return v; }
static inline shmrpc_value shmrpc_rref_value(shmrpc_rref *r) { shmrpc_value v = { SHMRPC_RREF, 0, { .r = r } }; return v; }
static inline shmrpc_value shmrpc_map(const shmrpc_value *kv, uint32_t npairs) { shmrpc_value v = { SHMRPC_MAP, npairs, { .items = kv } }; return v; }

/* "int", "str", ...; "unknown" for a type outside enum shmrpc_type. */
SHMRPC_API const char *shmrpc_type_name(uint32_t type);

/* ---- Tensors ------------------------------------------------------------
 *
 * A tensor lives in the job's shared pool (shmrun --pool-size). Passing one
 * as an argument or result hands the receiver a view of the same bytes:
 * nothing is copied, whatever the size. Each handle owns one reference to
 * its block; the block is freed when the last handle of any process goes.
 * A tensor received in a call's arguments or in a future's value belongs
 * to the call or the future: shmrpc_tensor_retain() keeps it longer.
 * Contiguous tensors of up to SHMRPC_TENSOR_MAX_DIMS dimensions.
 *
 * Small tensors from outside the pool are the exception: a CPU tensor of
 * at most SHMRPC_INLINE_MAX bytes (environment; 1024 by default, 0: none)
 * that shmrpc_tensor_from_dlpack copies is kept in this process's memory
 * and its bytes travel inside the message; the receiver gets a copy of its
 * own (no pool block, no shmrpc_tensor_pool_offset). A tensor in the pool
 * (shmrpc_tensor_alloc, or a whole pool block taken from DLPack) is always
 * handed over by reference, whatever its size.
 *
 * CUDA device tensors (kDLCUDA, taken with shmrpc_tensor_from_dlpack) are
 * handed over through CUDA IPC, not copied either: the receiver maps the
 * producer's allocation (once per allocation while it holds tensors of it)
 * and reads and writes the same device bytes; unless a device map
 * (shmrpc_options.device_maps) lands the tensor on another device, where
 * the receiver gets a copy of its own, made on the GPU. Ordering: a send records an
 * event on the tensor's stream (shmrpc_tensor_set_cuda_stream; the legacy
 * default stream unless set) after the work queued there, and the
 * receiver's legacy default stream (stream 0 of the device's primary
 * context) waits for it before the tensor is handed out: work the receiver
 * queues there, or on a blocking stream, runs after the sender's writes;
 * a non-blocking stream of the receiver must wait on the default stream
 * first. The host never waits. Lifetime: the producer keeps the memory
 * (its DLPack deleter does not run) until every receiver has let go of its
 * handles, the dead included; a producer that shuts down while receivers
 * hold some says so on stderr and keeps that memory until it exits. Once a
 * tensor's producer has exited or died, the receivers' handles fail
 * (shmrpc_tensor_data and shmrpc_tensor_dl give NULL, sending or exporting
 * it -SHMRPC_EPEERDEAD, shmrpc_errmsg() says which worker) rather than
 * give memory that is gone; a pointer taken before must not be used after.
 * A received tensor may be passed on (or returned) as it is. The job
 * needs its tensor pool for them too (each sent tensor costs a 64-byte
 * block there while held). Not yet: strided tensors, other device types.
 */
#define SHMRPC_TENSOR_MAX_DIMS 8

/*
 * The pool errors, of any function that takes a pool block or a reference
 * to one: -ENOMEM (the pool is exhausted or out of block records, the
 * machine has no memory to commit the block, or this process none for the
 * handle), -ENOSPC (this worker's holder table in the pool is full: it
 * holds too many blocks at once), -SHMRPC_ECORRUPT (the pool's records are
 * corrupt).
 *
 * The CUDA errors, of any function that calls the driver: -ENOSYS or
 * -ENODEV (CUDA is not available here: no driver, too old, no device),
 * -ENOMEM, -EINVAL, -EOPNOTSUPP (the driver refused: out of device memory,
 * a bad value, not permitted) or -EIO (any other driver error);
 * shmrpc_errmsg() names the driver's error.
 */

/* A tensor in the pool, uninitialized. Errors: -ENOTCONN (no agent runs),
 * -ENOTSUP (the job has no pool: not started by shmrun), -EINVAL (out or
 * shape missing, ndim outside 0..SHMRPC_TENSOR_MAX_DIMS, a zero-bit
 * dtype, a negative dimension, a size beyond 64 bits), the pool errors. */
SHMRPC_API int shmrpc_tensor_alloc(DLDataType dtype, int32_t ndim, const int64_t *shape,
				   shmrpc_tensor **out);
/* A new handle (one more reference) to the same bytes. Errors: -ENOMEM;
 * for a pool tensor also -ENOTCONN, -ENOTSUP, -EINVAL (its block is free:
 * a handle used after the job it came from ended), -EOVERFLOW (the block
 * has 2^32-1 references), the pool errors. */
SHMRPC_API int shmrpc_tensor_retain(shmrpc_tensor *t, shmrpc_tensor **out);
/* Drops t's reference; NULL is ignored. Cannot fail (a pool that refuses
 * the release is named on stderr). */
SHMRPC_API void shmrpc_tensor_free(shmrpc_tensor *t);
/* The bytes: in this process's mapping of the pool, or a CUDA device
 * pointer (this process's mapping of the producer's allocation). NULL for
 * a CUDA tensor whose producer is gone (shmrpc_errmsg() says so). */
SHMRPC_API void *shmrpc_tensor_data(const shmrpc_tensor *t);
/* The size in bytes. Cannot fail. */
SHMRPC_API uint64_t shmrpc_tensor_nbytes(const shmrpc_tensor *t);
/* The tensor as DLPack sees it (device kDLCPU or kDLCUDA); valid while the
 * handle lives. NULL as shmrpc_tensor_data. */
SHMRPC_API const DLTensor *shmrpc_tensor_dl(const shmrpc_tensor *t);
/* Where the bytes are in the pool (the same number in every process).
 * UINT64_MAX for a CUDA tensor or a small one that travels inline, which
 * are not in the pool (shmrpc_errmsg()). */
SHMRPC_API uint64_t shmrpc_tensor_pool_offset(const shmrpc_tensor *t);
/* The CUstream (as an integer; 0: the legacy default stream) on which the
 * last writes of CUDA tensor t were queued: each later send of t, by any
 * handle of it in this process, orders the receiver after the work queued
 * there. Errors: -EINVAL (t is NULL or a CPU tensor). */
SHMRPC_API int shmrpc_tensor_set_cuda_stream(shmrpc_tensor *t, uintptr_t stream);
/* Makes stream (a CUstream of the tensor's device, as an integer: 0 the
 * legacy default stream) wait, on the GPU, for the writes that CUDA tensor
 * t was sent after (or, for a tensor of this process, for the work queued
 * on the stream set with shmrpc_tensor_set_cuda_stream): for a consumer
 * that reads t on another stream than the receiver's legacy default,
 * which waited already when t came in. The host never waits here; when
 * the last handle of a received t goes, the host waits for the work queued
 * on that stream and on the legacy default one (as torch's receiver does),
 * so that the producer never frees or reuses memory a kernel still reads:
 * the stream must still exist then. Errors: -EINVAL (t is NULL or a CPU
 * tensor), -SHMRPC_EPEERDEAD (t's producer is gone), the CUDA errors. */
SHMRPC_API int shmrpc_tensor_cuda_wait(shmrpc_tensor *t, uintptr_t stream);
/* DLPack out: *out owns t's reference (t is consumed); its deleter drops
 * it. Errors (t stays the caller's): -EINVAL (t or out missing),
 * -SHMRPC_EPEERDEAD (a CUDA tensor whose producer is gone), -ENOMEM. */
SHMRPC_API int shmrpc_tensor_to_dlpack(shmrpc_tensor *t, DLManagedTensor **out);
/* DLPack in. A tensor that is a whole block of this job's pool is taken
 * without a copy; other contiguous host memory is copied once (counted in
 * the worker's dlpack_copies): into the pool, or up to SHMRPC_INLINE_MAX
 * bytes into this process's memory (sent inline); for both, m is consumed on
 * success (its deleter is called). Contiguous CUDA device memory
 * (kDLCUDA; allocated with cuMemAlloc / cudaMalloc, as torch's caching
 * allocator does, not with cuMemCreate or a memory pool) is taken as it
 * is, without a copy nor a call to the device: the handle owns m, whose
 * deleter runs when the last reference of this process goes (its handles,
 * and while receivers hold it, the sends). Needs no running agent; fails
 * where CUDA is not available. Other devices are not supported yet. On
 * failure m is still the caller's. Errors: -EINVAL (m or out missing, its
 * dtype or shape as shmrpc_tensor_alloc's, or host bytes with a NULL data
 * pointer), -ENOTSUP (a device other than CPU and CUDA, or a strided
 * tensor: not supported yet); for host memory -ENOTCONN and the pool's
 * -ENOTSUP as shmrpc_tensor_alloc, the pool errors, -EOVERFLOW as
 * shmrpc_tensor_retain; for CUDA memory the CUDA errors. */
SHMRPC_API int shmrpc_tensor_from_dlpack(DLManagedTensor *m, shmrpc_tensor **out);

/* ---- The job ---------------------------------------------------------- */

/*
 * One entry of this worker's CUDA device maps (torch's set_device_map):
 * this worker's cuda:from tensors in its requests to worker `worker` land
 * on that worker's cuda:to, and that worker's cuda:to tensors in its
 * replies land here on cuda:from. A tensor on a device that the map for
 * its destination does not name fails its call ("Request device mapping
 * is not available for destination ...", torch's words), and so does a
 * reply tensor on a device that the caller's map for the callee does not
 * name as a target. Without a map for a destination, a CUDA tensor lands
 * on the same ordinal (where torch refuses CUDA tensors). A tensor that
 * lands on another device is copied there once, device to device, on the
 * receiver's legacy default stream (after the sender's writes, the host
 * never waits); on the same device it is shared, not copied. Devices 0 to
 * 15. Every worker checks every worker's maps at shmrpc_init (torch's
 * checks and texts: unknown worker names, duplicated targets, device
 * indices beyond a worker's device count), so a bad map fails
 * shmrpc_init on every worker with the same sentence.
 */
struct shmrpc_device_map_entry {
	const char *worker; /* the destination's name */
	int32_t from;       /* device ordinal here */
	int32_t to;         /* device ordinal there */
};

/*
 * What shmrpc_init takes. Make one with SHMRPC_OPTIONS, which sets size
 * (the struct as this header has it) and leaves every field it is not
 * given zero, its default:
 *
 *     struct shmrpc_options o = SHMRPC_OPTIONS(.num_threads = 2, .name = "ps");
 *
 * size and reserved keep the ABI: later versions use reserved for new
 * fields (zero being their default) or grow the struct, and tell a
 * program built against an older header by its size.
 */
struct shmrpc_options {
	uint32_t size;       /* sizeof(struct shmrpc_options): set by SHMRPC_OPTIONS */
	int num_threads;     /* executor threads; 0: 4 */
	const char *name;    /* this worker's name; NULL: from shmrun (SHMRPC_NAME) */
	int64_t timeout_ms;  /* default call timeout; 0: 60000; <0: none */
	int64_t startup_timeout_ms; /* waiting for every worker to join; 0: 60000 */
	/* This worker's device maps (above), num_device_maps entries; read
	 * during shmrpc_init only. */
	const struct shmrpc_device_map_entry *device_maps;
	uint32_t num_device_maps;
	uint32_t reserved32; /* zero */
	uint64_t reserved[8]; /* zero */
};
#define SHMRPC_OPTIONS(...) { .size = sizeof(struct shmrpc_options), __VA_ARGS__ }

struct shmrpc_worker_info {
	int rank;
	char name[48];
};

/* Attaches to the job this process was started in by shmrun, starts the
 * agent and waits until every worker of the job has joined. opts: made
 * with SHMRPC_OPTIONS, or NULL for the defaults. Errors: -EINVAL (opts'
 * size not this library's, or reserved fields set; num_threads outside
 * 0..1024; a name of 0 or more than 47 bytes; a bad device map; not
 * started by shmrun: SHMRPC_RANK, SHMRPC_WORLD_SIZE or the job's fd
 * missing, or not matching the segment; SHMRPC_INLINE_MAX or
 * SHMRPC_RREF_FETCH malformed), -EALREADY (the agent runs already),
 * -ENOTSUP (this process was forked from a worker whose agent ran),
 * -EEXIST (this rank has joined already, or two workers share a name),
 * -SHMRPC_EBADSEG, -SHMRPC_EVERSION, -SHMRPC_ETRUNC (the job's segment,
 * pool or RRef table is not one this library reads), -SHMRPC_EPEERDEAD (a
 * worker ended before the job started), -ETIMEDOUT (a worker did not join
 * within startup_timeout_ms), -ENOMEM, -EAGAIN (no thread could be
 * started), or an errno of mapping the job's memory. */
SHMRPC_API int shmrpc_init(const struct shmrpc_options *opts);
/* graceful: wait (up to timeout_ms; <=0: none) until no worker of the job has
 * calls in flight, then all leave together. Otherwise leave now. The
 * agent is stopped in every case but -ENOTCONN; calls still pending fail
 * with -ESHUTDOWN. Errors: -ENOTCONN (no agent runs), -ETIMEDOUT (graceful,
 * and workers were still busy after timeout_ms: the message names them). */
SHMRPC_API int shmrpc_shutdown(int graceful, int64_t timeout_ms);
/* This worker's rank, and the job's number of workers. Errors: -ENOTCONN
 * (no agent runs). */
SHMRPC_API int shmrpc_rank(void);
SHMRPC_API int shmrpc_world_size(void);
/* By name (NULL: this worker) or by rank. Errors: -ENOTCONN (no agent
 * runs), -ENOENT (no worker of that name), -EINVAL (no worker of that
 * rank). */
SHMRPC_API int shmrpc_get_worker_info(const char *name, struct shmrpc_worker_info *out);
SHMRPC_API int shmrpc_get_worker_info_by_rank(int rank, struct shmrpc_worker_info *out);

/* ---- Serving ---------------------------------------------------------- */

typedef struct shmrpc_call shmrpc_call;

/*
 * A registered function. Runs on an executor thread. Returns 0 with
 * *result set, or the value of shmrpc_call_error(). Memory for the result
 * comes from shmrpc_call_alloc (freed after the reply is sent) or is static.
 * A tensor in the result is handed to the call, which frees it once the
 * caller holds it (an argument's tensor may be returned as it is).
 */
typedef int (*shmrpc_fn)(shmrpc_call *call, const shmrpc_value *args, uint32_t nargs,
			 shmrpc_value *result, void *user);

/*
 * Registers fn under name. sig, when not NULL, is the argument types, one
 * letter each: n nil, b bool, i int, f float (an int is accepted), s str,
 * y bytes, l list, m map, t tensor, r RRef, v any; calls with another count or type fail with
 * a clear error before fn runs. May be called before or after shmrpc_init.
 * Errors: -EINVAL (no fn, a name of 0 or more than 256 bytes, a letter of sig
 * not above), -EEXIST (name is registered already), -ENOMEM.
 */
SHMRPC_API int shmrpc_register(const char *name, const char *sig, shmrpc_fn fn, void *user);
/* n bytes that live as long as the call; NULL when out of memory. */
SHMRPC_API void *shmrpc_call_alloc(shmrpc_call *call, size_t n);
/* The rank of the caller. Cannot fail. */
SHMRPC_API int shmrpc_call_caller(const shmrpc_call *call);
/* Records an error for the caller (type e.g. "ValueError", message) and a
 * backtrace of this side; returns -SHMRPC_EREMOTE for fn to return (it
 * cannot fail: a backtrace that cannot be taken is left out). */
SHMRPC_API int shmrpc_call_error(shmrpc_call *call, const char *type, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* ---- Calling ---------------------------------------------------------- */

typedef struct shmrpc_future shmrpc_future;

#define SHMRPC_TIMEOUT_DEFAULT (-1) /* the timeout given to shmrpc_init */
#define SHMRPC_TIMEOUT_NONE 0
/* How deep calls may nest: a call made by a function serving a call at
 * depth d is at depth d + 1 (a call made outside any is at depth 1); one
 * deeper fails at once with -SHMRPC_ENESTING (docs/ARCHITECTURE.md). */
#define SHMRPC_MAX_NESTING 100000
#define SHMRPC_ENESTING ELOOP

/*
 * The call errors, of a call refused before it goes (shmrpc_rpc_async,
 * shmrpc_rpc_sync, shmrpc_remote and the RRef proxies): -ENOTCONN (no
 * agent runs), -EINVAL (fn, out or args missing; an empty fn; dst not a
 * rank of the job; a negative timeout other than SHMRPC_TIMEOUT_DEFAULT;
 * a value that cannot be sent: an unknown type, a NULL string or list;
 * a CUDA tensor on a device that dst's device map does not cover),
 * -SHMRPC_ENESTING (nested deeper than SHMRPC_MAX_NESTING),
 * -SHMRPC_EPEERDEAD (dst has ended, or died as the call went),
 * -EMSGSIZE (the arguments do not fit in a frame: pass large data as
 * tensors, or raise shmrun --ring-size), -ENOMEM; with RRefs in the
 * arguments -ENOTSUP (the job has no RRef table) and -ENOSPC (the RRef
 * table is full); with tensors, those of sending one (-SHMRPC_EPEERDEAD
 * for a CUDA tensor whose producer is gone, the pool errors, the CUDA
 * errors).
 *
 * The future's errors, of a call that went and failed (shmrpc_future_wait,
 * shmrpc_future_error, shmrpc_rpc_sync, shmrpc_rref_to_here):
 * -SHMRPC_EREMOTE (the function failed, or dst could not run it: unknown
 * function, arguments not matching its signature; shmrpc_future_error_type
 * and shmrpc_future_remote_backtrace tell more), -ETIMEDOUT (the call ran
 * out of its timeout), -SHMRPC_EPEERDEAD (dst died first), -ESHUTDOWN
 * (this agent was shut down first), -EBADMSG (a malformed reply),
 * -ENOMEM (the reply could not be kept), or the errors of taking a tensor
 * of the result (the pool errors, the CUDA errors).
 */

/* Calls fn on worker dst. timeout_ms: SHMRPC_TIMEOUT_DEFAULT, SHMRPC_TIMEOUT_NONE or ms.
 * rpc_async: *out is a future to wait on and free. rpc_sync: waits; on
 * success *out holds the result (free it with shmrpc_future_free), on
 * failure *out is NULL and shmrpc_errmsg() says what happened. Errors:
 * the call errors; for rpc_sync also the future's errors. */
SHMRPC_API int shmrpc_rpc_async(int dst, const char *fn, const shmrpc_value *args, uint32_t nargs,
				int64_t timeout_ms, shmrpc_future **out);
SHMRPC_API int shmrpc_rpc_sync(int dst, const char *fn, const shmrpc_value *args, uint32_t nargs,
			       int64_t timeout_ms, shmrpc_future **out);

/* Waits up to timeout_ms (<0: for ever). 0 when it succeeded, or the call's
 * error (the text in shmrpc_errmsg()), or -ETIMEDOUT when it is still
 * pending after timeout_ms. A call that ran out of its own time fails with
 * -ETIMEDOUT too: shmrpc_future_done() tells the two apart (0: still
 * pending, wait again; 1: the call timed out, for good). Errors: the
 * future's errors. */
SHMRPC_API int shmrpc_future_wait(shmrpc_future *f, int64_t timeout_ms);
/* 1 once f has completed (succeeded or failed), else 0. Cannot fail. */
SHMRPC_API int shmrpc_future_done(shmrpc_future *f);
/* The result, valid until shmrpc_future_free; NULL unless it succeeded. */
SHMRPC_API const shmrpc_value *shmrpc_future_value(shmrpc_future *f);
/* 0, or the error code (the future's errors); *msg (if not NULL) the
 * full text. -EINPROGRESS while f is pending. */
SHMRPC_API int shmrpc_future_error(shmrpc_future *f, const char **msg);
/* For remote errors: the error's type ("ValueError") and the remote
 * backtrace; NULL while pending, and for other errors or none. */
SHMRPC_API const char *shmrpc_future_error_type(shmrpc_future *f);
SHMRPC_API const char *shmrpc_future_remote_backtrace(shmrpc_future *f);
/* cb runs once the future completes (at once if it has), on an executor
 * thread: it may call rpc_sync. Errors: -EINVAL (no cb), -ENOMEM. */
SHMRPC_API int shmrpc_future_then(shmrpc_future *f, void (*cb)(shmrpc_future *f, void *arg), void *arg);
/* Drops the caller's reference (a pending call keeps its own); NULL is
 * ignored. Cannot fail. */
SHMRPC_API void shmrpc_future_free(shmrpc_future *f);

/* ---- RRefs -------------------------------------------------------------
 *
 * A remote reference: a value that lives on its owner worker. The job's RRef
 * table (shmrun --max-rrefs) records every RRef and who holds it; the owner
 * frees the value once no worker holds a reference (docs/RREF.md).
 * An RRef received in a call's arguments or a future's value belongs to the
 * call or the future: shmrpc_rref_retain() keeps it longer. Passing one as
 * an argument or result makes a new reference for the receiver.
 */

/* Runs fn(args) on dst and returns at once an RRef to its result, owned by
 * dst (an OwnerRRef when dst is this worker). Free it with shmrpc_rref_free.
 * Errors: the call errors, and -ENOTSUP (the job has no RRef table),
 * -ENOSPC (the RRef table is full: shmrun --max-rrefs). What the call
 * itself fails with, to_here says. */
SHMRPC_API int shmrpc_remote(int dst, const char *fn, const shmrpc_value *args, uint32_t nargs,
			     int64_t timeout_ms, shmrpc_rref **out);
/* Waits up to timeout_ms (SHMRPC_TIMEOUT_DEFAULT, _NONE or ms) for the value.
 * On success *out is a completed future holding it (shmrpc_future_value);
 * on failure (the remote error, a timeout, the owner's death) *out is NULL
 * and shmrpc_errmsg() says what happened. Errors: -EINVAL (r or out
 * missing, a negative timeout other than SHMRPC_TIMEOUT_DEFAULT),
 * -ENOTCONN (no agent runs), -ENOTSUP (the job has no RRef table),
 * -ETIMEDOUT (not ready within timeout_ms), -SHMRPC_EPEERDEAD (the owner
 * died), -ENOMEM, and what the remote call failed with (the future's
 * errors). */
SHMRPC_API int shmrpc_rref_to_here(shmrpc_rref *r, int64_t timeout_ms, shmrpc_future **out);
/* The value, on the owner only; valid while r lives. Errors: -ENOTCONN,
 * -ENOTSUP as to_here, -EINVAL (r or out missing), -EPERM (this worker is
 * not r's owner), and as to_here what the remote call that makes the
 * value failed with. */
SHMRPC_API int shmrpc_rref_local_value(shmrpc_rref *r, const shmrpc_value **out);
/* The owner's rank and name. Cannot fail. */
SHMRPC_API int shmrpc_rref_owner(const shmrpc_rref *r);
SHMRPC_API const char *shmrpc_rref_owner_name(const shmrpc_rref *r);
/* 1 when this worker owns r, else 0 (also when no agent runs). */
SHMRPC_API int shmrpc_rref_is_owner(const shmrpc_rref *r);
/* 1 once the owner knows of this reference, else 0 (also when no agent
 * runs). */
SHMRPC_API int shmrpc_rref_confirmed_by_owner(const shmrpc_rref *r);
/* "OwnerRRef(rref_id=...)" or "UserRRef(rref_id=..., fork_id=...)"; the
 * length it needs, like snprintf. Cannot fail. */
SHMRPC_API int shmrpc_rref_str(const shmrpc_rref *r, char *buf, size_t len);
/* Another handle to the same reference. Errors: -ENOTCONN, -ENOTSUP as
 * to_here, -SHMRPC_EPEERDEAD (the owner died before it confirmed r),
 * -ENOENT (r's entry is gone from the table), -ENOMEM. */
SHMRPC_API int shmrpc_rref_retain(shmrpc_rref *r, shmrpc_rref **out);
/* Drops the handle's reference; NULL is ignored. Cannot fail. */
SHMRPC_API void shmrpc_rref_free(shmrpc_rref *r);
/* The proxies: fn(value of r, args...) on r's owner. Errors: as
 * shmrpc_rpc_sync, shmrpc_rpc_async and shmrpc_remote, and -ENOTSUP as
 * to_here. */
SHMRPC_API int shmrpc_rref_rpc_sync(shmrpc_rref *r, const char *fn, const shmrpc_value *args,
				    uint32_t nargs, int64_t timeout_ms, shmrpc_future **out);
SHMRPC_API int shmrpc_rref_rpc_async(shmrpc_rref *r, const char *fn, const shmrpc_value *args,
				     uint32_t nargs, int64_t timeout_ms, shmrpc_future **out);
SHMRPC_API int shmrpc_rref_remote(shmrpc_rref *r, const char *fn, const shmrpc_value *args,
				  uint32_t nargs, int64_t timeout_ms, shmrpc_rref **out);

/* ---- Profiling ----------------------------------------------------------
 *
 * While on, this process's calls go out as RUN_WITH_PROFILING_REQ: each is
 * recorded under torch's key "rpc_sync#fn(caller -> callee)" (rpc_async,
 * rpc_remote), with what the callee ran recorded beneath it
 * ("KEY#remote_op: fn"). Times are CLOCK_MONOTONIC ns, the same clock in
 * every worker.
 */
typedef struct shmrpc_profile shmrpc_profile;
struct shmrpc_profile_event {
	const char *name;
	int rank;   /* the worker where it happened */
	int parent; /* index of the call it belongs to, -1 for a call */
	uint64_t start_ns, end_ns;
};
/* Starts recording (what a previous start recorded is dropped). Cannot
 * fail: returns 0. */
SHMRPC_API int shmrpc_profile_start(void);
/* Stops, and gives what was recorded (free with shmrpc_profile_free).
 * Errors: -EINVAL (no out), -ENOMEM. */
SHMRPC_API int shmrpc_profile_stop(shmrpc_profile **out);
/* The number of events, and event i (NULL past the last; p NULL: none). */
SHMRPC_API uint32_t shmrpc_profile_count(const shmrpc_profile *p);
SHMRPC_API const struct shmrpc_profile_event *shmrpc_profile_event(const shmrpc_profile *p,
								     uint32_t i);
/* A Chrome trace-event JSON file (Perfetto, chrome://tracing): a process
 * per worker, a flow from each call to what its callee ran. Errors:
 * -EINVAL (no path), or the errno of creating or writing the file. */
SHMRPC_API int shmrpc_profile_export_chrome(const shmrpc_profile *p, const char *path);
/* NULL is ignored. Cannot fail. */
SHMRPC_API void shmrpc_profile_free(shmrpc_profile *p);

#ifdef __cplusplus
}
#endif

#endif
