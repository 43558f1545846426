/*
 * Helpers for the stress and crash tests: frame payloads that a receiver
 * checks from (src, dst, sequence number) alone, and the all-to-all
 * exchange that stress_2proc and stress_8proc run at different sizes.
 */
#ifndef SHMRPC_TESTS_STRESS_H
#define SHMRPC_TESTS_STRESS_H

#include <stdbool.h>
#include <stdint.h>

#include "ipc/port.h"

#define TL_PAYLOAD_MAX 2048u

/* Writes the payload of frame seq from src to dst into buf (room for
 * TL_PAYLOAD_MAX bytes); returns its length, 0..TL_PAYLOAD_MAX. */
uint32_t tl_payload(uint32_t src, uint32_t dst, uint64_t seq, uint8_t *buf);
/* True when [p, p + len) is exactly that payload. */
bool tl_payload_ok(uint32_t src, uint32_t dst, uint64_t seq, const uint8_t *p, uint32_t len);

/*
 * Lost wake-ups. A loop thread that found nothing to do calls tl_idle_wait
 * (ipc_port_wait for at most wait_ns); one that did something calls
 * tl_idle_busy. A wait that ran out its time although work came meanwhile
 * means a wake-up was lost, and no progress for 10 s means a hang: both
 * fail the test, naming `who`.
 */
struct tl_idle {
	uint64_t since; /* 0: not idle */
	bool timed_out;
};
void tl_idle_wait(struct tl_idle *s, struct ipc_port *p, uint64_t wait_ns, const char *who);
void tl_idle_busy(struct tl_idle *s, const char *who);

/*
 * Forks world processes; each sends `frames` frames to every other one and
 * checks that it receives exactly `frames` from each, in order and intact,
 * using the wait mode named. Fails the test (exit 1) on any problem,
 * including a wait that makes no progress for 10 s. Returns the seconds the
 * exchange took.
 */
double tl_stress_all_to_all(uint32_t world, uint64_t frames, const char *mode);

#endif
