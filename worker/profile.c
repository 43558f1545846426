/* RPC profiling; see profile.h. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/json.h"
#include "worker/profile.h"
#include "worker/value.h"

struct shmrpc_profile {
	uint32_t n, cap;
	struct shmrpc_profile_event *ev;
};

static struct {
	pthread_mutex_t lock;
	_Atomic bool on; /* relaxed: a switch; the events are under the lock */
	struct shmrpc_profile rec;
} prof = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* Profiled calls in flight. Relaxed: stop polls it; the events it waits
 * for are recorded under the lock before the count drops. */
static _Atomic uint32_t in_flight;

static _Thread_local const char *next_kind;
static _Thread_local const char *next_fn;
static _Thread_local unsigned next_torch; /* PROFILE_ bits, 0: none */

void profile_call_begin(void)
{
	atomic_fetch_add_explicit(&in_flight, 1, memory_order_relaxed);
}

void profile_call_end(void)
{
	atomic_fetch_sub_explicit(&in_flight, 1, memory_order_relaxed);
}

void profile_forget_next(void)
{
	next_kind = next_fn = NULL;
	next_torch = 0;
}

bool profile_on(void)
{
	return atomic_load_explicit(&prof.on, memory_order_relaxed);
}

void profile_name_next(const char *kind, const char *fn)
{
	if (kind && !next_kind) /* the outermost caller names the kind */
		next_kind = kind;
	if (fn)
		next_fn = fn;
}

void profile_torch_next(unsigned what)
{
	next_torch = what;
}

void profile_take_names(const char **kind, const char **fn, unsigned *torch)
{
	*kind = next_kind;
	*fn = next_fn;
	*torch = next_torch;
	profile_forget_next();
}

void profile_key(const char *kind, const char *fn, const char *caller, const char *callee,
		 char *buf, size_t len)
{
	snprintf(buf, len, "%s#%s(%s -> %s)", kind ? kind : "rpc_async", fn ? fn : "?", caller,
		 callee);
}

static void events_free(struct shmrpc_profile *p)
{
	for (uint32_t i = 0; i < p->n; i++)
		free((char *)p->ev[i].name);
	free(p->ev);
	*p = (struct shmrpc_profile){ 0 };
}

int32_t profile_record(const char *name, uint32_t rank, uint64_t start_ns, uint64_t end_ns,
		       int32_t parent)
{
	struct shmrpc_profile *p = &prof.rec;
	int32_t at = -1;
	char *copy = strdup(name);

	pthread_mutex_lock(&prof.lock);
	if (copy && p->n == p->cap) {
		uint32_t cap = p->cap ? 2 * p->cap : 64;
		struct shmrpc_profile_event *n = realloc(p->ev, cap * sizeof(*n));

		if (n) {
			p->ev = n;
			p->cap = cap;
		}
	}
	if (copy && p->n < p->cap && p->n < INT32_MAX) {
		at = (int32_t)p->n++;
		p->ev[at] = (struct shmrpc_profile_event){ copy, (int)rank, parent, start_ns, end_ns };
		copy = NULL;
	}
	pthread_mutex_unlock(&prof.lock);
	free(copy); /* out of memory: the event is lost, the call is not */
	return at;
}

int profile_wrap_request(uint16_t type, const void *buf, size_t len, unsigned what,
			 msgpack_sbuffer *out)
{
	msgpack_packer pk;

	msgpack_packer_init(&pk, out, msgpack_sbuffer_write);
	if (len > UINT32_MAX || msgpack_pack_array(&pk, 3) || msgpack_pack_uint16(&pk, type) ||
	    msgpack_pack_bin_with_body(&pk, buf, len) || msgpack_pack_unsigned_int(&pk, what))
		return shmrpc__fail(-ENOMEM, "out of memory wrapping a profiled request");
	return 0;
}

int profile_unwrap(const void *buf, size_t len, struct arena *a, uint16_t *type, const void **inner,
		   size_t *inner_len, shmrpc_value *extra)
{
	const shmrpc_value *it;
	shmrpc_value v;
	size_t used;

	if (value_unpack(buf, len, a, &v, &used, NULL) || used != len || v.type != SHMRPC_LIST ||
	    v.len != 3 || (it = v.u.items)[0].type != SHMRPC_INT || it[0].u.i <= 0 ||
	    it[0].u.i > UINT16_MAX || it[1].type != SHMRPC_BYTES ||
	    (it[2].type != SHMRPC_LIST && it[2].type != SHMRPC_INT))
		return shmrpc__fail(-EBADMSG, "a malformed profiling wrapper came in");
	*type = (uint16_t)it[0].u.i;
	*inner = it[1].u.p;
	*inner_len = it[1].len;
	*extra = it[2];
	return 0;
}

void profile_events_add(struct profile_events *pe, const char *name, uint64_t start_ns,
			uint64_t end_ns, uint64_t thread, uint32_t rank, const char *shapes,
			int64_t cpu_mem)
{
	char *shapes_copy = NULL;

	if (pe->n == pe->cap) {
		uint32_t cap = pe->cap ? 2 * pe->cap : 4;
		struct profile_event_rec *n = realloc(pe->ev, cap * sizeof(*n));

		if (!n)
			return; /* the event is lost, the call is not */
		pe->ev = n;
		pe->cap = cap;
	}
	if (shapes && !(shapes_copy = strdup(shapes)))
		return;
	pe->ev[pe->n].shapes = shapes_copy;
	pe->ev[pe->n].cpu_mem = cpu_mem;
	snprintf(pe->ev[pe->n].name, sizeof(pe->ev[pe->n].name), "%s", name);
	pe->ev[pe->n].start_ns = start_ns;
	pe->ev[pe->n].end_ns = end_ns;
	pe->ev[pe->n].thread = thread;
	pe->ev[pe->n++].rank = rank;
}

void profile_events_free(struct profile_events *pe)
{
	for (uint32_t i = 0; i < pe->n; i++)
		free(pe->ev[i].shapes);
	free(pe->ev);
	*pe = (struct profile_events){ 0 };
}

int profile_wrap_reply(uint16_t type, const void *buf, size_t len, const struct profile_events *pe,
		       uint32_t rank, msgpack_sbuffer *out)
{
	msgpack_packer pk;
	int rc;

	msgpack_packer_init(&pk, out, msgpack_sbuffer_write);
	rc = len > UINT32_MAX || msgpack_pack_array(&pk, 3) || msgpack_pack_uint16(&pk, type) ||
	     msgpack_pack_bin_with_body(&pk, buf, len) || msgpack_pack_array(&pk, pe->n);
	for (uint32_t i = 0; rc == 0 && i < pe->n; i++) {
		const struct profile_event_rec *e = &pe->ev[i];
		bool more = e->shapes || e->cpu_mem;

		rc = msgpack_pack_array(&pk, more ? 7 : 5) ||
		     msgpack_pack_str_with_body(&pk, e->name, strlen(e->name)) ||
		     msgpack_pack_uint64(&pk, e->start_ns) || msgpack_pack_uint64(&pk, e->end_ns) ||
		     msgpack_pack_uint32(&pk, e->rank == PROFILE_HERE ? rank : e->rank) ||
		     msgpack_pack_uint64(&pk, e->thread);
		if (rc == 0 && more)
			rc = msgpack_pack_str_with_body(&pk, e->shapes ? e->shapes : "",
							e->shapes ? strlen(e->shapes) : 0) ||
			     msgpack_pack_int64(&pk, e->cpu_mem);
	}
	return rc ? shmrpc__fail(-ENOMEM, "out of memory wrapping a profiled reply") : 0;
}

/* The i-th of a reply's events, if well formed (from the callee: checked
 * like everything received); its fields. */
static const shmrpc_value *event_at(const shmrpc_value *events, uint32_t i)
{
	const shmrpc_value *e = &events->u.items[i], *f = e->u.items;

	if (e->type != SHMRPC_LIST || (e->len != 5 && e->len != 7) || f[0].type != SHMRPC_STR ||
	    f[1].type != SHMRPC_INT || f[2].type != SHMRPC_INT || f[1].u.i < 0 ||
	    f[2].u.i < f[1].u.i || f[3].type != SHMRPC_INT || f[3].u.i < 0 ||
	    f[3].u.i > UINT32_MAX || f[4].type != SHMRPC_INT ||
	    (e->len == 7 && (f[5].type != SHMRPC_STR || f[6].type != SHMRPC_INT)))
		return NULL;
	return f;
}

void profile_call_done(const char *key, uint32_t rank, uint64_t start_ns, const shmrpc_value *events)
{
	int32_t parent = profile_record(key, rank, start_ns, shmrpc_now_ns(), -1);

	for (uint32_t i = 0; events->type == SHMRPC_LIST && i < events->len; i++) {
		const shmrpc_value *f = event_at(events, i);
		char name[640]; /* a key of up to 320, a callee's name of up to 256 */

		if (!f)
			continue;
		snprintf(name, sizeof(name), "%s#remote_op: %s", key, f[0].u.s);
		profile_record(name, (uint32_t)f[3].u.i, (uint64_t)f[1].u.i, (uint64_t)f[2].u.i, parent);
	}
}

struct profile_events *profile_events_of(const shmrpc_value *events)
{
	struct profile_events *pe = calloc(1, sizeof(*pe));

	for (uint32_t i = 0; pe && events->type == SHMRPC_LIST && i < events->len; i++) {
		const shmrpc_value *f = event_at(events, i);

		if (f)
			profile_events_add(pe, f[0].u.s, (uint64_t)f[1].u.i, (uint64_t)f[2].u.i,
					   (uint64_t)f[4].u.i, (uint32_t)f[3].u.i,
					   events->u.items[i].len == 7 && f[5].len ? f[5].u.s : NULL,
					   events->u.items[i].len == 7 ? f[6].u.i : 0);
	}
	return pe;
}

/* ---- public API ---- */

int shmrpc_profile_start(void)
{
	pthread_mutex_lock(&prof.lock);
	events_free(&prof.rec);
	atomic_store_explicit(&prof.on, true, memory_order_relaxed);
	pthread_mutex_unlock(&prof.lock);
	return 0;
}

int shmrpc_profile_stop(shmrpc_profile **out)
{
	shmrpc_profile *p;

	if (!out)
		return shmrpc__fail(-EINVAL, "shmrpc_profile_stop: out must be given");
	/* Calls still in flight belong to this profile: wait for them (each
	 * ends by its reply, its timeout or its callee's death), 1 ms a look. */
	while (atomic_load_explicit(&in_flight, memory_order_relaxed))
		usleep(1000);
	if (!(p = calloc(1, sizeof(*p))))
		return shmrpc__fail(-ENOMEM, "out of memory stopping the profiler");
	pthread_mutex_lock(&prof.lock);
	atomic_store_explicit(&prof.on, false, memory_order_relaxed);
	*p = prof.rec; /* calls still in flight record into a fresh list */
	prof.rec = (struct shmrpc_profile){ 0 };
	pthread_mutex_unlock(&prof.lock);
	*out = p;
	return 0;
}

uint32_t shmrpc_profile_count(const shmrpc_profile *p)
{
	return p ? p->n : 0;
}

const struct shmrpc_profile_event *shmrpc_profile_event(const shmrpc_profile *p, uint32_t i)
{
	return p && i < p->n ? &p->ev[i] : NULL;
}

void shmrpc_profile_free(shmrpc_profile *p)
{
	if (p) {
		events_free(p);
		free(p);
	}
}

int shmrpc_profile_export_chrome(const shmrpc_profile *p, const char *path)
{
	const char *sep = "";
	FILE *f;

	if (!path)
		return shmrpc__fail(-EINVAL, "shmrpc_profile_export_chrome: no path given");
	if (!(f = fopen(path, "w")))
		return shmrpc__fail(-errno, "cannot write the trace to %s: %s", path,
				    strerror(errno));
	/* Chrome trace events: one process per worker; a flow arrow from
	 * each call to what its callee ran. */
	fprintf(f, "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[");
	for (uint32_t i = 0; p && i < p->n; i++) {
		const struct shmrpc_profile_event *e = &p->ev[i];

		fprintf(f, "%s\n{\"name\":", sep);
		json_put_str(f, e->name);
		fprintf(f, ",\"cat\":\"rpc\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,"
			"\"dur\":%.3f}", e->rank, e->parent < 0 ? 0 : 1, (double)e->start_ns / 1e3,
			(double)(e->end_ns - e->start_ns) / 1e3);
		sep = ",";
		if (e->parent >= 0 && (uint32_t)e->parent < p->n) {
			const struct shmrpc_profile_event *c = &p->ev[e->parent];

			fprintf(f, ",\n{\"name\":\"rpc\",\"cat\":\"rpc\",\"ph\":\"s\",\"id\":%u,"
				"\"pid\":%d,\"tid\":0,\"ts\":%.3f}", i, c->rank,
				(double)c->start_ns / 1e3);
			fprintf(f, ",\n{\"name\":\"rpc\",\"cat\":\"rpc\",\"ph\":\"f\",\"bp\":\"e\","
				"\"id\":%u,\"pid\":%d,\"tid\":1,\"ts\":%.3f}", i, e->rank,
				(double)e->start_ns / 1e3);
		}
	}
	fprintf(f, "\n]}\n");
	if (fclose(f))
		return shmrpc__fail(-errno, "cannot write the trace to %s: %s", path, strerror(errno));
	return 0;
}
