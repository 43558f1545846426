/*
 * Request types the agent does not implement yet are answered, not
 * dropped: rank 0 speaks the wire protocol by hand (a raw port, no agent)
 * and sends rank 1's agent a PYTHON_CALL and each of distributed
 * autograd's requests (a C-only worker serves none), a type that is no
 * message type at all, a SCRIPT_CALL whose payload is not MessagePack, RRef requests
 * naming RRefs that do not exist, and a malformed RREF_FORK_REQUEST. Each gets an EXCEPTION with the
 * request's id and a clear text, and rank 1 keeps serving: a well-formed
 * SCRIPT_CALL afterwards still gets its SCRIPT_RET.
 */
#include <msgpack.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/segment.h"
#include "ipc/port.h"
#include "worker/msg.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

struct reply {
	uint16_t type;
	uint64_t msg_id;
	char text[512];
};

static void on_frame(void *arg, const struct ipc_frame *f)
{
	struct reply *r = arg;
	msgpack_unpacked u;
	size_t off = 0;

	r->type = f->hdr.type;
	r->msg_id = f->hdr.msg_id;
	r->text[0] = '\0';
	msgpack_unpacked_init(&u);
	if (f->hdr.type == MSG_EXCEPTION &&
	    msgpack_unpack_next(&u, (const char *)f->payload, f->hdr.payload_len, &off) ==
		    MSGPACK_UNPACK_SUCCESS &&
	    u.data.type == MSGPACK_OBJECT_ARRAY && u.data.via.array.size == 3) {
		msgpack_object_str s = u.data.via.array.ptr[1].via.str;

		snprintf(r->text, sizeof(r->text), "%.*s", (int)s.size, s.ptr);
	}
	msgpack_unpacked_destroy(&u);
}

/* Sends one raw request at nesting depth `depth` to rank 1 and waits for
 * the frame that answers it. */
static struct reply ask_at(struct ipc_port *p, uint16_t type, uint64_t id, uint32_t depth,
			   const void *payload, size_t len)
{
	struct iovec iov = { (void *)payload, len };
	struct ipc_msg m = { .type = type, .msg_id = id, .depth = depth, .iov = &iov, .iovcnt = 1 };
	struct reply r = { 0 };

	CHECK_OK(ipc_port_send(p, 1, &m, 5000000000ull));
	for (int i = 0; i < 1000 && r.type == 0; i++)
		if (!ipc_port_poll(p, on_frame, &r, 1))
			ipc_port_wait(p, 10000000);
	CHECK(r.type != 0, "no answer to request type %u", type);
	CHECK(r.msg_id == id, "answer carries id %llu, want %llu", (unsigned long long)r.msg_id,
	      (unsigned long long)id);
	return r;
}

/* ... at depth 1, as a request not made inside another. */
static struct reply ask(struct ipc_port *p, uint16_t type, uint64_t id, const void *payload, size_t len)
{
	return ask_at(p, type, id, 1, payload, len);
}

/* Well-formed requests of the Python package's autograd (docs/PROTOCOL.md). */
static const struct {
	uint16_t type;
	const char *payload;
	size_t len;
} autograd_reqs[] = {
	/* [context 1, message 2, PYTHON_CALL, [b"", [], []]] */
	{ MSG_FORWARD_AUTOGRAD_REQ, "\x94\x01\x02\x03\x93\xc4\x00\x90\x90", 9 },
	/* [context 1, message 2, [b"", [], []]] */
	{ MSG_BACKWARD_AUTOGRAD_REQ, "\x93\x01\x02\x93\xc4\x00\x90\x90", 8 },
	{ MSG_CLEANUP_AUTOGRAD_CONTEXT_REQ, "\x91\x01", 2 }, /* [context 1] */
	/* [nil where the RRef goes: never looked at, context 1, false] */
	{ MSG_RREF_BACKWARD_REQ, "\x93\xc0\x01\xc2", 4 },
};

static int raw_worker(void)
{
	static const char call[] = "\x92\xa3one\x90"; /* ["one", []] */
	struct shm_seg seg;
	struct ipc_port port;
	struct reply r;
	char want[160];

	CHECK_OK(shm_seg_attach_env(&seg));
	CHECK_OK(ipc_port_open(&port, &seg, 0, IPC_WAIT_AUTO));
	/* Join the startup barrier as an agent would (release: pairs with its
	 * acquire). Rank 1 may be LEAVING already: it keeps serving until we go. */
	atomic_store_explicit(&shm_worker(&seg, 0)->agent_state, SHM_AGENT_READY, memory_order_release);
	while (atomic_load_explicit(&shm_worker(&seg, 1)->agent_state, memory_order_acquire) <
	       SHM_AGENT_READY)
		usleep(1000);

	r = ask(&port, MSG_PYTHON_CALL, 7, "\x90", 1);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "Error on worker 1 (worker1): request type "
							  "PYTHON_CALL is not supported yet"),
	      "PYTHON_CALL: type %u, \"%s\"", r.type, r.text);
	for (size_t i = 0; i < sizeof(autograd_reqs) / sizeof(autograd_reqs[0]); i++) {
		r = ask(&port, autograd_reqs[i].type, 20 + i, autograd_reqs[i].payload,
			autograd_reqs[i].len);
		snprintf(want, sizeof(want), "Error on worker 1 (worker1): request type %s is not "
			 "supported yet: this worker runs no Python", worker_msg_name(autograd_reqs[i].type));
		CHECK(r.type == MSG_EXCEPTION && strstr(r.text, want), "%s: type %u, \"%s\"",
		      worker_msg_name(autograd_reqs[i].type), r.type, r.text);
	}
	/* A depth no sender of ours writes (frame header): refused. */
	r = ask_at(&port, MSG_SCRIPT_CALL, 40, 0, call, sizeof(call) - 1);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "a request at nesting depth 0 came in from "
							  "worker 0 (1 to 100000 are valid)"),
	      "depth 0: type %u \"%s\"", r.type, r.text);
	r = ask_at(&port, MSG_SCRIPT_CALL, 41, SHMRPC_MAX_NESTING + 1, call, sizeof(call) - 1);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "a request at nesting depth 100001 came in"),
	      "depth 100001: type %u \"%s\"", r.type, r.text);
	r = ask(&port, 999, 8, "", 0);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "unknown message type 999"), "type 999: \"%s\"",
	      r.text);
	r = ask(&port, MSG_SCRIPT_CALL, 9, "\xc1\xc1", 2);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "malformed SCRIPT_CALL"), "garbage: \"%s\"",
	      r.text);
	/* [id, slot] of an RRef the table does not hold, then a call. */
	r = ask(&port, MSG_SCRIPT_REMOTE_CALL, 11, "\x92\x05\x03\x92\xa3one\x90", 9);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "that is not ours in the RRef table"),
	      "remote call for no RRef: type %u \"%s\"", r.type, r.text);
	/* [context 1, message 2, PYTHON_REMOTE_CALL, [id 5, slot 3], [b"", [], []]] */
	r = ask(&port, MSG_FORWARD_AUTOGRAD_REQ, 30, "\x95\x01\x02\x06\x92\x05\x03\x93\xc4\x00\x90\x90", 12);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "that is not ours in the RRef table"),
	      "wrapped remote call for no RRef: type %u \"%s\"", r.type, r.text);
	r = ask(&port, MSG_FORWARD_AUTOGRAD_REQ, 31, "\x94\x01\x02\x06\xc0", 5);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "malformed FORWARD_AUTOGRAD_REQ"),
	      "wrapped remote call without RRef: type %u \"%s\"", r.type, r.text);
	r = ask(&port, MSG_FORWARD_AUTOGRAD_REQ, 32, "\x94\x01\x02\x07\xc0", 5);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "malformed FORWARD_AUTOGRAD_REQ"),
	      "a request wrapping a reply: type %u \"%s\"", r.type, r.text);
	r = ask(&port, MSG_SCRIPT_RREF_FETCH_CALL, 12, "\x92\x05\xce\xff\xff\xff\x00", 7);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "does not own"), "fetch of no RRef: \"%s\"",
	      r.text);
	r = ask(&port, MSG_SCRIPT_REMOTE_CALL, 13, "\xc1", 1);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "malformed SCRIPT_REMOTE_CALL"),
	      "garbage remote call: \"%s\"", r.text);
	r = ask(&port, MSG_RREF_USER_DELETE, 14, "\x92\x05\x03", 3);
	CHECK(r.type == MSG_RREF_ACK, "a delete of an RRef that is not there is harmless: type %u "
	      "\"%s\"", r.type, r.text);
	r = ask(&port, MSG_RREF_FORK_REQUEST, 15, "\x90", 1);
	CHECK(r.type == MSG_EXCEPTION && strstr(r.text, "malformed RREF_FORK_REQUEST"),
	      "malformed fork request: \"%s\"", r.text);
	r = ask(&port, MSG_SCRIPT_CALL, 10, call, sizeof(call) - 1);
	CHECK(r.type == MSG_SCRIPT_RET, "the agent stopped serving: type %u \"%s\"", r.type, r.text);
	atomic_store_explicit(&shm_worker(&seg, 0)->agent_state, SHM_AGENT_GONE, memory_order_release);
	ipc_port_close(&port);
	shm_seg_detach(&seg);
	return 0;
}

static int fn_one(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_int(1);
	return 0;
}

static int worker(void)
{
	if (atoi(getenv("SHMRPC_RANK")) == 0)
		return raw_worker();
	CHECK_OK(shmrpc_register("one", "", fn_one, NULL));
	CHECK_OK(shmrpc_init(NULL));
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "2", NULL);
}
