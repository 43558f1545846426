/* The newest-first bell; see lifo.h. */
#include <errno.h>
#include <linux/futex.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ipc/doorbell.h"
#include "ipc/lifo.h"

static void publish(struct ipc_lifo *l)
{
	/* Relaxed: a hint that pairs with nothing; a waker that reads a stale
	 * one wakes any sleeper instead (lifo.h). */
	atomic_store_explicit(l->newest, l->top ? l->top->bit : 0u, memory_order_relaxed);
}

void ipc_lifo_push(struct ipc_lifo *l, struct ipc_lifo_sleeper *s)
{
	s->newer = NULL;
	s->older = l->top;
	if (l->top)
		l->top->newer = s;
	l->top = s;
	publish(l);
}

void ipc_lifo_remove(struct ipc_lifo *l, struct ipc_lifo_sleeper *s)
{
	if (s->newer)
		s->newer->older = s->older;
	else
		l->top = s->older;
	if (s->older)
		s->older->newer = s->newer;
	s->newer = s->older = NULL;
	publish(l);
}

/* Shared futexes (no FUTEX_PRIVATE_FLAG): wakers are other processes. */
int ipc_lifo_wait(_Atomic uint32_t *bell, uint32_t seq, const struct ipc_lifo_sleeper *s)
{
	if (syscall(SYS_futex, (uint32_t *)bell, FUTEX_WAIT_BITSET, seq, NULL, NULL, s->bit) == 0)
		return 0;
	return -errno == -EWOULDBLOCK ? -EAGAIN : -errno;
}

void ipc_lifo_wake(_Atomic uint32_t *bell, const _Atomic uint32_t *newest, struct shm_worker *me)
{
	/* Relaxed: a hint (lifo.h); 0 (no sleeper, or written so by anyone)
	 * is not a bitset the kernel takes: any one then. */
	uint32_t bit = atomic_load_explicit(newest, memory_order_relaxed);
	long n = 0;

	/* seq_cst RMW: a sleeper that read the bell before this bump sees the
	 * word changed in its FUTEX_WAIT (the doorbell's argument, doorbell.h). */
	atomic_fetch_add_explicit(bell, 1, memory_order_seq_cst);
	if (bit)
		n = syscall(SYS_futex, (uint32_t *)bell, FUTEX_WAKE_BITSET, 1, NULL, NULL, bit);
	if (n <= 0)
		ipc_futex_wake(bell, 1);
	if (me) /* relaxed: a statistic read by inspectors only */
		atomic_fetch_add_explicit(&me->wakeups_sent, bit && n <= 0 ? 2 : 1,
					  memory_order_relaxed);
}
