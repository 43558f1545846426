/*
 * The agent's mapping of the job's tensor pool (struct tensor_view,
 * tensor.h), shared with every handle into it: unmapped by the last.
 */
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "common/error.h"
#include "worker/tensor.h"

int tensor_view_open(struct shm_pool *p, struct tensor_view **out)
{
	struct tensor_view *v = malloc(sizeof(*v));

	if (!v)
		return shmrpc__fail(-ENOMEM, "out of memory attaching the tensor pool");
	v->base = p->base;
	v->size = p->size;
	atomic_init(&v->refs, 1);
	*out = v;
	return 0;
}

void tensor_view_put(struct tensor_view *v)
{
	/* acq_rel: the last one out sees every other holder's use of the bytes done. */
	if (v && atomic_fetch_sub_explicit(&v->refs, 1, memory_order_acq_rel) == 1) {
		munmap(v->base, v->size);
		free(v);
	}
}
