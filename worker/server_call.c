/* Running a call: a registered C function or the Python handler, and the
 * public API such a function has (shmrpc_call_*). */
#include <errno.h>
#include <execinfo.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "worker/client.h"
#include "worker/devmap.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/profile.h"
#include "worker/python.h"
#include "worker/registry.h"
#include "worker/rref.h"
#include "worker/server_impl.h"
#include "worker/tensor.h"
#include "worker/value.h"
/* The call's error, set by its function or by the checks before it. */
static void call_fail(shmrpc_call *call, const char *type, const char *msg)
{
	snprintf(call->errtype, sizeof(call->errtype), "%s", type);
	snprintf(call->errmsg, sizeof(call->errmsg), "%s", msg);
	call->failed = true;
}

/* Decodes a call [fn, args] or [fn, flags, args] from buf and runs it:
 * 0 with *result, or call->failed with the error. *fn names it. */
static void run_call(shmrpc_call *call, uint16_t type, const uint8_t *buf, size_t len,
		     const char **fn, shmrpc_value *result)
{
	const struct registry_entry *e;
	const shmrpc_value *items, *args;
	shmrpc_value req, *proxied = NULL;
	uint32_t nargs, flags = 0;
	size_t used;
	char msg[400];
	int rc;

	*fn = "?";
	call->tensors.land = devmap_landing(worker_agent, call->caller, false);
	/* What the decoder refused (a corrupt tensor descriptor...) is said. */
	rc = value_unpack(buf, len, &call->arena, &req, &used, &call->tensors);
	if (rc || used != len || req.type != SHMRPC_LIST || (req.len != 2 && req.len != 3) ||
	    (items = req.u.items)[0].type != SHMRPC_STR ||
	    items[req.len - 1].type != SHMRPC_LIST ||
	    (req.len == 3 && items[1].type != SHMRPC_INT)) {
		snprintf(msg, sizeof(msg), "a malformed %s request came in%s%s",
			 worker_msg_name(type), rc ? ": " : "", rc ? shmrpc_errmsg() : "");
		call_fail(call, "RuntimeError", msg);
		return;
	}
	*fn = items[0].u.s;
	flags = req.len == 3 ? (uint32_t)items[1].u.i : 0;
	args = items[req.len - 1].u.items;
	nargs = items[req.len - 1].len;
	if (!(e = registry_find(*fn))) {
		snprintf(msg, sizeof(msg), "no function named \"%.256s\" is registered", *fn);
		call_fail(call, "RuntimeError", msg);
		return;
	}
	if (flags & CALL_F_PROXY) {
		/* fn(value of the RRef, args...): the RRef must be ours. */
		const shmrpc_value *v;

		if (!nargs || args[0].type != SHMRPC_RREF || !shmrpc_rref_is_owner(args[0].u.r) ||
		    !(proxied = shmrpc_call_alloc(call, nargs * sizeof(*proxied)))) {
			call_fail(call, "RuntimeError", "a call through an RRef came to a worker that "
				  "does not own the RRef");
			return;
		}
		if (rref_local_value(args[0].u.r, &v)) {
			call_fail(call, "RuntimeError", shmrpc_errmsg());
			return;
		}
		memcpy(proxied, args, nargs * sizeof(*proxied));
		proxied[0] = *v;
		args = proxied;
	}
	if (value_check_sig(*fn, e->sig, args, nargs)) {
		call_fail(call, "TypeError", shmrpc_errmsg());
		return;
	}
	rc = e->fn(call, args, nargs, result, e->user);
	if (rc && !call->failed) {
		snprintf(msg, sizeof(msg), "%.256s() failed: %s", *fn, shmrpc_strerror(rc));
		call_fail(call, "RuntimeError", msg);
	}
}

/* Whether this worker runs the Python package; if not, the call fails
 * saying so (a C-only worker answers its requests "not supported yet"). */
static bool python_here(shmrpc_call *call, uint16_t type)
{
	char msg[256];

	if (python_handler())
		return true;
	snprintf(msg, sizeof(msg), "request type %s is not supported yet: this worker runs no "
		 "Python (start it from the shmrpc Python package)", worker_msg_name(type));
	call_fail(call, "RuntimeError", msg);
	return false;
}

/* The Python package's request of type in buf, decoded into *in in the
 * call's arena (its RRefs and tensors are the call's), or pointing into
 * buf (a common call's: python_request_plain); false with the call
 * failed. */
bool server_python_decode(shmrpc_call *call, uint16_t type, const uint8_t *buf, size_t len,
			  struct python_request *in)
{
	shmrpc_value req;
	size_t used;
	char msg[400];
	int rc;

	/* The common call's request, read where it lies: buf outlives the
	 * call, as the arena would. */
	if (python_request_plain(type, buf, len, in))
		return true;
	call->tensors.land = devmap_landing(worker_agent, call->caller, false);
	rc = value_unpack(buf, len, &call->arena, &req, &used, &call->tensors);
	if (rc == 0 && used == len && python_request_of(type, &req, &call->arena, in) == 0)
		return true;
	snprintf(msg, sizeof(msg), "a malformed %s request came in%s%s", worker_msg_name(type),
		 rc ? ": " : "", rc ? shmrpc_errmsg() : "");
	call_fail(call, "RuntimeError", msg);
	return false;
}

/* A request of the Python package (a pickled call, or one of distributed
 * autograd's) run by the binding's handler, which fills out's message (in
 * the call's arena) and autograd message id; *result is out (of the type
 * the caller set) as a payload, in the call's arena too. The RRef and
 * tensor handles the handler made for it are freed once sent, as a C
 * function's (free_result_handles). */
static void run_python(shmrpc_call *call, const struct python_request *in,
		       struct python_request *out, shmrpc_value *result)
{
	if (python_handler()(call->caller, in, out,
			     call->profile_what & PROFILE_TORCH ? call->profile : NULL, &call->arena)) {
		call_fail(call, "RuntimeError", shmrpc_errmsg());
		return;
	}
	out->context_id = in->context_id; /* a FORWARD_AUTOGRAD_RESP's */
	if (python_request_value(out, &call->arena, result) == 0)
		return;
	for (uint32_t i = 0; i < out->msg.nrrefs; i++)
		shmrpc_rref_free(out->msg.rrefs[i]);
	for (uint32_t i = 0; i < out->msg.ntensors; i++)
		shmrpc_tensor_free(out->msg.tensors[i]);
	call_fail(call, "RuntimeError", shmrpc_errmsg());
}

/* Runs the call in buf: a SCRIPT_ call, or a Python package's request by
 * the binding (in: that request if decoded already; out: the handler's
 * reply, of the type the caller set, which *result holds). */
void server_run_any(shmrpc_call *call, uint16_t type, const uint8_t *buf, size_t len,
		    const struct python_request *in, struct python_request *out, const char **fn,
		    shmrpc_value *result)
{
	bool timed = call->profile && (call->profile_what & PROFILE_CALLS);
	uint64_t start = timed ? shmrpc_now_ns() : 0;
	struct python_request decoded;

	if (python_is_request(type)) {
		*fn = "python";
		/* Asked first: a C-only worker decodes none of them. A remote
		 * call's RRef (out's) goes to the handler, which may keep the
		 * value under it. */
		if (python_here(call, type) && (in || server_python_decode(call, type, buf, len, &decoded))) {
			if (!in) {
				decoded.rref_id = out->rref_id;
				decoded.rref_slot = out->rref_slot;
			}
			run_python(call, in ? in : &decoded, out, result);
		}
	} else {
		run_call(call, type, buf, len, fn, result);
	}
	if (timed)
		profile_events_add(call->profile, *fn, start, shmrpc_now_ns(), 0, PROFILE_HERE, NULL,
				   0);
}

/* A call answered with its result (in: a Python request decoded already). */
void server_run_script_call(struct request_job *rq, shmrpc_call *call,
			    const struct python_request *in)
{
	struct python_request out = { .type = python_reply_type(rq->type),
				      .wrapped = MSG_PYTHON_RET };
	shmrpc_value result = shmrpc_nil();
	const char *fn;

	server_run_any(call, rq->type, rq->payload, rq->len, in, &out, &fn, &result);
	if (call->failed)
		server_reply_exception(rq, call->errtype, call->errmsg, call->backtrace);
	else
		server_reply_value(rq, call, fn, &result,
			    rq->type == MSG_SCRIPT_CALL ? MSG_SCRIPT_RET : out.type);
}

/* ---- public API for functions ---- */

void *shmrpc_call_alloc(shmrpc_call *call, size_t n)
{
	return arena_alloc(&call->arena, n);
}

int shmrpc_call_caller(const shmrpc_call *call)
{
	return (int)call->caller;
}

/* This side's stack, one frame a line, for the caller to see. */
static char *capture_backtrace(void)
{
	void *frames[48];
	int n = backtrace(frames, 48);
	char **sym = backtrace_symbols(frames, n);
	size_t len = 0;
	char *out;

	if (!sym)
		return NULL;
	for (int i = 0; i < n; i++)
		len += strlen(sym[i]) + 1;
	if ((out = malloc(len + 1))) {
		out[0] = '\0';
		for (int i = 1; i < n; i++) /* frame 0 is this function */
			strcat(strcat(out, sym[i]), "\n");
	}
	free(sym);
	return out;
}

int shmrpc_call_error(shmrpc_call *call, const char *type, const char *fmt, ...)
{
	va_list ap;

	snprintf(call->errtype, sizeof(call->errtype), "%s", type && *type ? type : "RuntimeError");
	va_start(ap, fmt);
	vsnprintf(call->errmsg, sizeof(call->errmsg), fmt, ap);
	va_end(ap);
	free(call->backtrace);
	call->backtrace = capture_backtrace();
	call->failed = true;
	return -SHMRPC_EREMOTE;
}
