/*
 * Carry lists (struct tensor_list, worker/tensor.h): the tensors and RRefs
 * a message or a value holds, and the CUDA events its descriptors keep
 * busy. RRefs are of a level above (worker/rref.c): the list frees them,
 * and the value and client levels pack and charge them, through the
 * operations agent.c sets at init (rref_ops).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/spare.h"
#include "worker/carry.h"
#include "worker/cuda.h"

struct rref_ops rref_ops;

/* A list's first array of handles (LIST_FIRST of them; most lists never
 * grow past it), made on one thread and freed on another as the
 * handles are (common/spare.h). */
#define LIST_FIRST 4
static struct spare spare_arrays;

/* arr, an array of *cap pointers (of any type), grown: the new array, *cap
 * updated; or NULL, arr and *cap left as they were. */
static void *pointers_grow(void *arr, uint32_t *cap)
{
	void *n = *cap ? realloc(arr, 2 * (size_t)*cap * sizeof(void *))
		       : spare_take(&spare_arrays, LIST_FIRST * sizeof(void *));

	if (n)
		*cap = *cap ? 2 * *cap : LIST_FIRST;
	return n;
}

static void pointers_free(void *a, uint32_t cap)
{
	if (cap == LIST_FIRST)
		spare_put(&spare_arrays, a);
	else
		free(a);
}

void carry_set_rref_ops(const struct rref_ops *ops)
{
	rref_ops = *ops;
}

int tensor_list_add(struct tensor_list *l, shmrpc_tensor *t)
{
	if (l->n == l->cap) {
		shmrpc_tensor **grown = pointers_grow(l->t, &l->cap);

		if (!grown)
			return shmrpc__fail(-ENOMEM, "out of memory listing tensors");
		l->t = grown;
	}
	l->t[l->n++] = t;
	return 0;
}

int tensor_list_add_made(struct tensor_list *l, shmrpc_tensor *t)
{
	if (l->nmade == l->madecap) {
		shmrpc_tensor **grown = pointers_grow(l->made, &l->madecap);

		if (!grown)
			return shmrpc__fail(-ENOMEM, "out of memory listing tensors");
		l->made = grown;
	}
	l->made[l->nmade++] = t;
	return 0;
}

int tensor_list_add_rref(struct tensor_list *l, shmrpc_rref *r)
{
	if (l->nr == l->rcap) {
		shmrpc_rref **grown = pointers_grow(l->r, &l->rcap);

		if (!grown)
			return shmrpc__fail(-ENOMEM, "out of memory listing RRefs");
		l->r = grown;
	}
	l->r[l->nr++] = r;
	return 0;
}

void tensor_list_free(struct tensor_list *l)
{
	for (uint32_t i = 0; i < l->n; i++)
		shmrpc_tensor_free(l->t[i]);
	for (uint32_t i = 0; i < l->nr; i++)
		rref_ops.free(l->r[i]);
	tensor_list_forget(l);
}

void tensor_list_forget(struct tensor_list *l)
{
	for (uint32_t i = 0; i < l->nmade; i++)
		shmrpc_tensor_free(l->made[i]);
	for (uint32_t i = 0; i < l->nev; i++)
		cuda_export_done(&l->ev[i]);
	free(l->ev);
	pointers_free(l->made, l->madecap);
	pointers_free(l->t, l->cap);
	pointers_free(l->r, l->rcap);
	*l = (struct tensor_list){ 0 };
}

int tensor_list_add_event(struct tensor_list *l, const struct cuda_ipc_desc *d)
{
	if (l->nev == l->evcap) {
		uint32_t cap = l->evcap ? 2 * l->evcap : 4;
		struct cuda_ipc_desc *n = realloc(l->ev, cap * sizeof(*n));

		if (!n)
			return shmrpc__fail(-ENOMEM, "out of memory listing CUDA events");
		l->ev = n;
		l->evcap = cap;
	}
	l->ev[l->nev++] = *d;
	return 0;
}

/* Whether sent's i-th tensor (its made ones after its own) is sent by
 * reference and not covered: what a pin must hold. */
static bool by_ref(const struct tensor_list *sent, uint32_t i)
{
	const shmrpc_tensor *s = i < sent->n ? sent->t[i] : sent->made[i - sent->n];

	return !s->heap && !(i < sent->n && sent->covers && tensor_list_covers(sent->covers, s));
}

bool tensor_list_pins(const struct tensor_list *sent)
{
	for (uint32_t i = 0; i < sent->n + sent->nmade; i++)
		if (by_ref(sent, i))
			return true;
	return sent->nev != 0;
}

int tensor_list_hold(struct tensor_list *sent, struct tensor_list *held)
{
	uint32_t had = held->nev;
	int rc = 0;

	/* The events first, moved: whatever fails after, held gives them back. */
	for (uint32_t i = 0; i < sent->nev && rc == 0; i++)
		rc = tensor_list_add_event(held, &sent->ev[i]);
	if (rc) {
		held->nev = had; /* still sent's alone */
		return rc;
	}
	free(sent->ev);
	sent->ev = NULL;
	sent->nev = sent->evcap = 0;

	for (uint32_t i = 0; i < sent->n + sent->nmade && rc == 0; i++) {
		shmrpc_tensor *s = i < sent->n ? sent->t[i] : sent->made[i - sent->n], *t;

		/* Inline (its bytes in the message), or covered (the caller's
		 * request pin keeps it). */
		if (!by_ref(sent, i))
			continue;
		if (sent->give && s->spent)
			continue; /* given already: listed twice */
		rc = sent->give && i < sent->n ? tensor_take_over(s, &t) : shmrpc_tensor_retain(s, &t);
		if (rc == 0 && (rc = tensor_list_add(held, t)))
			shmrpc_tensor_free(t);
	}
	return rc;
}

uint32_t tensor_list_by_ref(const struct tensor_list *l)
{
	uint32_t n = l->nmade;

	for (uint32_t i = 0; i < l->n; i++)
		n += !l->t[i]->heap;
	return n - l->ncovered;
}

bool tensor_list_covers(const struct tensor_list *request, const shmrpc_tensor *t)
{
	if (t->heap || t->dev)
		return false;
	for (uint32_t i = 0; i < request->n; i++) {
		const shmrpc_tensor *r = request->t[i];

		if (!r->heap && !r->dev && r->off == t->off && r->nbytes == t->nbytes &&
		    r->dl.dtype.code == t->dl.dtype.code && r->dl.dtype.bits == t->dl.dtype.bits &&
		    r->dl.dtype.lanes == t->dl.dtype.lanes && r->dl.ndim == t->dl.ndim &&
		    !memcmp(r->shape, t->shape, (size_t)t->dl.ndim * sizeof(t->shape[0])))
			return true;
	}
	return false;
}

bool tensor_list_has_before(const struct tensor_list *l, uint32_t n, const shmrpc_tensor *t)
{
	for (uint32_t i = 0; i < n && i < l->n; i++)
		if (l->t[i] == t)
			return true;
	return false;
}

bool tensor_list_has(const struct tensor_list *l, const shmrpc_tensor *t)
{
	return tensor_list_has_before(l, l->n, t);
}
