/*
 * Pins (pins.h): each message's held tensors, listed until the receiver
 * takes them, and the TENSOR_ACK that says it did.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/error.h"
#include "common/spare.h"
#include "worker/executor.h"
#include "worker/msg.h"
#include "worker/pins.h"
#include "worker/trace.h"

struct pin {
	struct pin *next;
	uint32_t peer;
	enum pin_kind kind;
	uint64_t msg_id;
	struct tensor_list held;
};

static struct {
	pthread_mutex_t lock;
	struct pin *head;
} pins = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* A reply's pin is made by the executor that sends it and dropped by the
 * thread that takes the caller's ack: passed back (common/spare.h). */
static struct spare spare_pin;

/* The pin's handoff as the flight recorder shows it: kind PINNED or
 * UNPINNED, with its tensors and their bytes. */
static void trace_pin(const struct pin *pin, uint32_t kind, uint32_t status)
{
	uint64_t bytes = 0;

	if (!trace_on())
		return;
	for (uint32_t i = 0; i < pin->held.n; i++)
		bytes += pin->held.t[i]->nbytes;
	trace_pins(kind, pin->peer, pin->kind == PIN_REPLY, pin->msg_id, pin->held.n, bytes, status);
}

int pins_add(uint32_t peer, uint64_t msg_id, enum pin_kind kind, struct tensor_list *sent)
{
	struct pin *pin;
	int rc;

	/* Nothing by reference (all inline or covered: an echo's reply):
	 * nothing to wait for, and no pin made to find that out. */
	if (!tensor_list_pins(sent))
		return 0;
	if (!(pin = spare_take(&spare_pin, sizeof(*pin))))
		return shmrpc__fail(-ENOMEM, "out of memory pinning tensors");
	*pin = (struct pin){ .peer = peer, .kind = kind, .msg_id = msg_id };
	rc = tensor_list_hold(sent, &pin->held);
	if (rc) {
		tensor_list_free(&pin->held);
		spare_put(&spare_pin, pin);
		return rc;
	}
	/* Before the pin is listed: its release, and so its UNPINNED, cannot
	 * come first. */
	trace_pin(pin, SHM_TRACE_PINNED, SHM_TRACE_OK);
	pthread_mutex_lock(&pins.lock);
	pin->next = pins.head;
	pins.head = pin;
	pthread_mutex_unlock(&pins.lock);
	return 0;
}

/* A pin taken out of the list goes: its UNPINNED (status), its handles. */
static void drop(struct pin *pin, uint32_t status)
{
	trace_pin(pin, SHM_TRACE_UNPINNED, status);
	tensor_list_free(&pin->held);
	spare_put(&spare_pin, pin);
}

struct pin *pins_take(uint32_t peer, uint64_t msg_id, enum pin_kind kind)
{
	struct pin **at, *pin;

	pthread_mutex_lock(&pins.lock);
	for (at = &pins.head; (pin = *at) && (pin->peer != peer || pin->msg_id != msg_id ||
					      pin->kind != kind);)
		at = &pin->next;
	if (pin)
		*at = pin->next;
	pthread_mutex_unlock(&pins.lock);
	return pin;
}

struct tensor_list *pins_held(struct pin *pin)
{
	return pin ? &pin->held : NULL;
}

void pins_drop(struct pin *pin)
{
	if (pin)
		drop(pin, SHM_TRACE_OK);
}

void pins_release(uint32_t peer, uint64_t msg_id, enum pin_kind kind)
{
	pins_drop(pins_take(peer, msg_id, kind));
}

/* Takes out the pins of peer (every one if all); frees them after the
 * lock is dropped. */
static void release_if(bool all, uint32_t peer)
{
	struct pin **at, *pin, *gone = NULL;

	pthread_mutex_lock(&pins.lock);
	for (at = &pins.head; (pin = *at);) {
		if (all || pin->peer == peer) {
			*at = pin->next;
			pin->next = gone;
			gone = pin;
		} else {
			at = &pin->next;
		}
	}
	pthread_mutex_unlock(&pins.lock);
	while ((pin = gone)) {
		gone = pin->next;
		drop(pin, all ? SHM_TRACE_SHUTDOWN : SHM_TRACE_PEER_DEAD);
	}
}

void pins_release_peer(uint32_t peer)
{
	release_if(false, peer);
}

void pins_release_all(void)
{
	release_if(true, 0);
}

/* ---- TENSOR_ACK ---- */

/* How long a quiet TENSOR_ACK may wait for a frame to ride with: longer
 * than a data loader's trainer takes between a worker's reply and its next
 * request to it (a few batches' time), short next to a training step. */
#define ACK_DELAY_NS (1000u * 1000u)

struct ack_job {
	struct job base;
	struct agent *ag;
	uint32_t peer;
	uint64_t msg_id;
};

static void run_ack(struct job *j)
{
	struct ack_job *a = (struct ack_job *)j;
	int rc = agent_send(a->ag, a->peer, MSG_TENSOR_ACK, a->msg_id, 0, 0, NULL, NULL, 0);

	/* A peer that died has had its pins released by its own sweep. */
	if (rc && rc != -SHMRPC_EPEERDEAD)
		fprintf(stderr, "shmrpc: worker %u: cannot acknowledge tensors to worker %u: %s\n",
			a->ag->rank, a->peer, shmrpc_errmsg());
	free(a);
}

void pins_ack(struct agent *ag, uint32_t peer, uint64_t msg_id)
{
	struct ack_job *a;
	struct ipc_msg m;
	int rc;

	if (peer == ag->rank) {
		pins_release(peer, msg_id, PIN_REPLY);
		return;
	}
	/* The poller never blocks in a send (port.h): it sends the ack itself
	 * when the ring is free and has room, which spares a thread's wake-up
	 * per reply that carried tensors, and else leaves it to an executor
	 * thread. It goes quietly, from any thread that polls: it rides with
	 * our next frame to the peer (the next request of a caller that calls
	 * in a loop, a data loader's next request), which wakes the peer for
	 * both, so an echo in a loop costs the peer no wake-up of its loop
	 * thread per call (issue 23). Its pins wait ACK_DELAY_NS at least:
	 * then our loop thread flushes the debt at its next turn (at once if
	 * it is the loop thread, else when it next wakes: at most
	 * LOOP_MAX_SLEEP_NS, worker/agent.c), and the peer takes the ack
	 * sooner whenever it polls its rings for another frame. A peer that
	 * died has had its pins released by its sweep. */
	m = (struct ipc_msg){ .type = MSG_TENSOR_ACK, .msg_id = msg_id };
	rc = ipc_port_try_send_quiet(&ag->port, peer, &m, ACK_DELAY_NS);
	if (rc == 0 || rc == -SHMRPC_EPEERDEAD)
		return;
	if (!(a = malloc(sizeof(*a)))) {
		fprintf(stderr, "shmrpc: worker %u: out of memory acknowledging tensors; worker %u "
			"keeps them until it ends\n", ag->rank, peer);
		return;
	}
	*a = (struct ack_job){ { .run = run_ack }, ag, peer, msg_id };
	executor_submit(&a->base);
}
