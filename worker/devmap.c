/* CUDA device maps; see devmap.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "worker/link.h"
#include "worker/cuda.h"
#include "worker/devmap.h"
#include "worker/tensor.h"

static struct shm_devmap_head *head(const struct agent *ag, uint32_t r)
{
	return shm_devmap_head(&ag->seg, r);
}

int devmap_join_begin(struct agent *ag, const struct shmrpc_options *o)
{
	struct shm_devmap_head *h = head(ag, ag->rank);

	if (o->num_device_maps && !o->device_maps)
		return shmrpc__fail(-EINVAL, "shmrpc_init: num_device_maps is %u but device_maps "
				    "is NULL", o->num_device_maps);
	/* Relaxed and plain: peers read these only after our READY (release),
	 * and the state only once we set it again after the startup barrier. */
	atomic_store_explicit(&h->state, SHM_DEVMAP_NONE, memory_order_relaxed);
	h->entries = o->num_device_maps;
	h->device_count = -1;
	h->error[0] = '\0';
	return 0;
}

/* Our maps into our rows, resolved; the first error in err (empty: none). */
static void publish_rows(struct agent *ag, const struct shmrpc_options *o, char *err, size_t len)
{
	char self[SHM_NAME_MAX];
	int devices = 0;

	agent_peer_name(ag, ag->rank, self, sizeof(self));
	for (uint32_t dst = 0; dst < ag->world; dst++)
		memset(shm_devmap_row(&ag->seg, ag->rank, dst)->to, -1, SHM_DEVMAP_DEVICES);
	/* torch counts the devices of every worker, mapped or not: a target's
	 * count bounds the maps to it. */
	if (cuda_device_count(&devices) && o->num_device_maps)
		snprintf(err, len, "Node %s has device maps, but %s", self, shmrpc_errmsg());
	head(ag, ag->rank)->device_count = devices;
	for (uint32_t i = 0; i < o->num_device_maps && !*err; i++) {
		const struct shmrpc_device_map_entry *e = &o->device_maps[i];
		/* Not found: the sentence below says it in torch's words. */
		int dst = e->worker ? agent_rank_named(ag, e->worker) : -1;
		int8_t *to;

		if (dst < 0) {
			snprintf(err, len, "Node %s has invalid target node names in its device maps\n"
				 "device maps = {'%.48s'}\nnode names: the job's workers (no worker is "
				 "named so)", self, e->worker ? e->worker : "(null)");
			break;
		}
		if (e->from < 0 || e->from >= SHM_DEVMAP_DEVICES || e->to < 0 ||
		    e->to >= SHM_DEVMAP_DEVICES) {
			snprintf(err, len, "Node %s has a device map for %s from cuda:%d to cuda:%d: "
				 "device maps take devices 0 to %d", self, e->worker, (int)e->from,
				 (int)e->to, SHM_DEVMAP_DEVICES - 1);
			break;
		}
		to = shm_devmap_row(&ag->seg, ag->rank, (uint32_t)dst)->to;
		if (to[e->from] >= 0 && to[e->from] != e->to) {
			snprintf(err, len, "`set_device_map` only supports 1-to-1 mapping, trying to map "
				 "cuda:%d to cuda:%d and cuda:%d (device maps of %s for %s)",
				 (int)e->from, (int)e->to, (int)to[e->from], self, e->worker);
			break;
		}
		to[e->from] = (int8_t)e->to;
	}
}

/* "{0: 1, 2: 3}", torch's repr of a map, from a row. */
static void map_text(const int8_t *to, char *buf, size_t len)
{
	size_t at = (size_t)snprintf(buf, len, "{");

	for (int i = 0; i < SHM_DEVMAP_DEVICES && at < len; i++)
		if (to[i] >= 0)
			at += (size_t)snprintf(buf + at, len - at, "%s%d: %d", at > 1 ? ", " : "", i,
					       (int)to[i]);
	if (at < len)
		snprintf(buf + at, len - at, "}");
}

/* Checks src's map for dst (a row read from the segment: every entry
 * -1 or a device), torch's checks in torch's order. */
static int check_row(const struct agent *ag, uint32_t src, uint32_t dst, const int8_t *to)
{
	int32_t src_count = head(ag, src)->device_count, dst_count = head(ag, dst)->device_count;
	char s[SHM_NAME_MAX], d[SHM_NAME_MAX], map[160];
	bool seen[SHM_DEVMAP_DEVICES] = { false }, dup = false, bad_src = false, bad_dst = false;

	for (int i = 0; i < SHM_DEVMAP_DEVICES; i++) {
		if (to[i] < -1 || to[i] >= SHM_DEVMAP_DEVICES)
			return shmrpc__fail(-EBADMSG, "worker %u's device map for worker %u in the job "
					    "segment holds device %d: the segment is corrupt", src, dst,
					    (int)to[i]);
		if (to[i] < 0)
			continue;
		dup |= seen[to[i]];
		seen[to[i]] = true;
		bad_src |= i >= src_count;
		bad_dst |= to[i] >= dst_count;
	}
	if (!dup && !bad_src && !bad_dst)
		return 0;
	agent_peer_name(ag, src, s, sizeof(s));
	agent_peer_name(ag, dst, d, sizeof(d));
	map_text(to, map, sizeof(map));
	if (dup)
		return shmrpc__fail(-EINVAL, "Node %s has duplicated target devices in its device map "
				    "for %s\ndevice map = %s", s, d, map);
	return shmrpc__fail(-EINVAL, "Node %s has %s devices with invalid indices in its device map "
			    "for %s\ndevice map = %s\ndevice count = %d", s,
			    bad_src ? "source" : "target", d, map,
			    (int)(bad_src ? src_count : dst_count));
}

static bool any_maps(const struct agent *ag)
{
	for (uint32_t r = 0; r < ag->world; r++)
		if (head(ag, r)->entries)
			return true;
	return false;
}

static bool published(const struct agent *ag, uint32_t r)
{
	/* Acquire pairs with the release in devmap_join: r's rows, count
	 * and error are there. */
	return atomic_load_explicit(&head(ag, r)->state, memory_order_acquire) == SHM_DEVMAP_DONE;
}

static bool row_mapped(const int8_t *to)
{
	for (int i = 0; i < SHM_DEVMAP_DEVICES; i++)
		if (to[i] >= 0)
			return true;
	return false;
}

/* Every worker's maps, in rank order: the first error is the same on
 * every worker. */
static int check_all(const struct agent *ag)
{
	for (uint32_t s = 0; s < ag->world; s++) {
		const char *err = head(ag, s)->error;
		int rc;

		if (err[0])
			return shmrpc__fail(-EINVAL, "%.*s", (int)strnlen(err, SHM_DEVMAP_ERROR_MAX),
					    err);
		for (uint32_t d = 0; d < ag->world; d++)
			if ((rc = check_row(ag, s, d, shm_devmap_row(&ag->seg, s, d)->to)))
				return rc;
	}
	return 0;
}

/* The rows that concern us, checked, into the agent. */
static int keep_ours(struct agent *ag)
{
	struct devmap_landing *l = calloc(2 * (size_t)ag->world, sizeof(*l));

	if (!l)
		return shmrpc__fail(-ENOMEM, "out of memory keeping the device maps");
	for (uint32_t p = 0; p < ag->world; p++) {
		const int8_t *theirs = shm_devmap_row(&ag->seg, p, ag->rank)->to;
		const int8_t *mine = shm_devmap_row(&ag->seg, ag->rank, p)->to;
		struct devmap_landing *req = &l[2 * p], *rep = &l[2 * p + 1];

		/* Their requests by their map for us; their replies by the
		 * inverse of ours for them. */
		memcpy(req->to, theirs, SHM_DEVMAP_DEVICES);
		memset(rep->to, -1, SHM_DEVMAP_DEVICES);
		for (int i = 0; i < SHM_DEVMAP_DEVICES; i++)
			if (mine[i] >= 0)
				rep->to[mine[i]] = (int8_t)i;
		req->peer = rep->peer = p;
		rep->reply = true;
		ag->devmap_mapped[2 * p] = row_mapped(theirs);
		ag->devmap_mapped[2 * p + 1] = row_mapped(mine);
	}
	ag->devmap = l;
	return 0;
}

int devmap_join(struct agent *ag, const struct shmrpc_options *o, uint64_t deadline)
{
	struct shm_devmap_head *h = head(ag, ag->rank);
	char err[SHM_DEVMAP_ERROR_MAX];
	int rc;

	if (!any_maps(ag))
		return 0;
	err[0] = '\0';
	publish_rows(ag, o, err, sizeof(err));
	memcpy(h->error, err, sizeof(err));
	/* Release: our rows, count and error before DONE (published()). */
	atomic_store_explicit(&h->state, SHM_DEVMAP_DONE, memory_order_release);
	ag->devmap_mapped = calloc(2 * (size_t)ag->world, sizeof(*ag->devmap_mapped));
	if (!ag->devmap_mapped)
		return shmrpc__fail(-ENOMEM, "out of memory keeping the device maps");
	rc = agent_wait_all(ag, deadline, published, "publish its device maps");
	return rc ?: check_all(ag) ?: keep_ours(ag);
}

void devmap_free(struct agent *ag)
{
	free(ag->devmap);
	free(ag->devmap_mapped);
	ag->devmap = NULL;
	ag->devmap_mapped = NULL;
}

const struct devmap_landing *devmap_landing(const struct agent *ag, uint32_t peer, bool reply)
{
	uint32_t i = 2 * peer + reply;

	return ag && ag->devmap && peer < ag->world && ag->devmap_mapped[i] ? &ag->devmap[i] : NULL;
}

/* torch's sentence for a tensor on device of the caller's (reply: of the
 * callee's) that the caller's map for the callee does not cover. */
static int unmapped(const struct agent *ag, uint32_t caller, uint32_t callee, bool reply,
		    int32_t device, int err)
{
	char a[SHM_NAME_MAX], b[SHM_NAME_MAX];

	agent_peer_name(ag, caller, a, sizeof(a));
	agent_peer_name(ag, callee, b, sizeof(b));
	return shmrpc__fail(err, "%s device mapping is not available for destination %s for "
			    "device cuda:%d but received a tensor on that device (the device map "
			    "of %s for %s %s cuda:%d: add it with set_device_map, or move the "
			    "tensor)", reply ? "Response" : "Request", reply ? a : b, (int)device,
			    a, b, reply ? "maps no device to" : "does not map", (int)device);
}

int devmap_land(const struct agent *ag, const struct devmap_landing *l, int32_t device,
		int32_t *land)
{
	if (device >= 0 && device < SHM_DEVMAP_DEVICES && l->to[device] >= 0) {
		*land = l->to[device];
		return 0;
	}
	return l->reply ? unmapped(ag, ag->rank, l->peer, true, device, -EBADMSG)
			: unmapped(ag, l->peer, ag->rank, false, device, -EBADMSG);
}

int devmap_check_send(const struct agent *ag, uint32_t peer, bool reply,
		      const struct tensor_list *sent)
{
	/* What we may send peer is what lands here from it the other way:
	 * the maps are one-to-one. */
	const struct devmap_landing *back = devmap_landing(ag, peer, !reply);

	for (uint32_t i = 0; back && i < sent->n; i++) {
		int32_t dev = sent->t[i]->dl.device.device_id;
		bool ok = false;

		if (sent->t[i]->dl.device.device_type != kDLCUDA)
			continue;
		for (int j = 0; j < SHM_DEVMAP_DEVICES && !ok; j++)
			ok = back->to[j] == dev;
		if (!ok)
			return reply ? unmapped(ag, peer, ag->rank, true, dev, -EINVAL)
				     : unmapped(ag, ag->rank, peer, false, dev, -EINVAL);
	}
	return 0;
}
