/* Two forked processes exchange a few frames through real rings and
 * doorbells, in every wait mode; the consumer sees them in order and intact. */
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "ipc/port.h"
#include "tests/lib/testlib.h"

#define N 1000

struct rx {
	uint64_t next;
	int bad;
};

static void on_frame(void *arg, const struct ipc_frame *f)
{
	struct rx *rx = arg;
	uint64_t v;

	if (f->hdr.payload_len != sizeof(v) || f->hdr.msg_id != rx->next) {
		rx->bad++;
		return;
	}
	memcpy(&v, f->payload, sizeof(v));
	if (v != rx->next * 3)
		rx->bad++;
	rx->next++;
}

static int child(struct shm_seg *seg, uint32_t rank, enum ipc_wait_mode mode)
{
	struct ipc_port port;
	struct rx rx = { 0 };
	uint32_t peer = 1 - rank;
	uint64_t sent = 0;

	CHECK_OK(ipc_port_open(&port, seg, rank, mode));
	while (atomic_load(&shm_worker(seg, peer)->pid) == 0)
		usleep(100);
	CHECK_OK(ipc_port_watch(&port, peer, (pid_t)atomic_load(&shm_worker(seg, peer)->pid)));
	while (sent < N || rx.next < N) {
		int progress = 0;

		if (sent < N) {
			uint64_t v = sent * 3;
			struct iovec iov = { &v, sizeof(v) };
			struct ipc_msg m = { .type = 1, .msg_id = sent, .iov = &iov, .iovcnt = 1 };
			int rc = ipc_port_try_send(&port, peer, &m);

			if (rc == 0) {
				sent++;
				progress = 1;
			} else {
				CHECK(rc == -EAGAIN, "send: %d", rc);
			}
		}
		progress += ipc_port_poll(&port, on_frame, &rx, 64);
		if (!progress) {
			if (sent < N && ipc_port_want_space(&port, peer, sizeof(uint64_t)))
				continue;
			ipc_port_wait(&port, 1000000000ull);
		}
	}
	CHECK(rx.bad == 0, "%d bad frames", rx.bad);
	ipc_port_close(&port);
	return 0;
}

int main(void)
{
	const char *modes[] = { "uring", "futex", "spin" };

	for (int m = 0; m < 3; m++) {
		struct shm_seg seg;
		struct shm_seg_params p = { .world_size = 2 };

		CHECK_OK(shm_seg_create(&seg, &p));
		for (uint32_t r = 0; r < 2; r++) {
			if (fork() == 0)
				_exit(child(&seg, r, (enum ipc_wait_mode)ipc_wait_mode_parse(modes[m])));
		}
		CHECK(tl_wait_children(), "a child failed in mode %s", modes[m]);
		shm_seg_detach(&seg);
	}
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
