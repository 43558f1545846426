/* --trace: one worker's flight recorder, as text or JSON (worker/trace.h). */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tools/inspect/inspect.h"
#include "common/json.h"
#include "worker/msg.h"
#include "worker/trace.h"

static void print_trace_text(const struct shm_seg *seg, uint32_t rank, const struct trace_entry *e,
			     size_t n, uint64_t head, uint64_t dropped)
{
	char name[SHM_NAME_MAX + 1], pbuf[SHM_NAME_MAX + 1], line[192];
	uint64_t newest = trace_newest_ns(e, n);

	copy_name(name, shm_worker(seg, rank)->name);
	printf("rank %u (%s): %zu of %llu records (the ring holds %u; %llu dropped), oldest first,\n"
	       "time in seconds before the newest\n%s\n", rank, printable(name, pbuf), n,
	       (unsigned long long)head, seg->trace_records, (unsigned long long)dropped,
	       trace_header());
	for (size_t i = 0; i < n; i++) {
		trace_format(e, i, newest, line, sizeof(line));
		printf("%s\n", line);
	}
}

static void print_trace_json(const struct shm_seg *seg, uint32_t rank, const struct trace_entry *e,
			     size_t n, uint64_t head, uint64_t dropped)
{
	char name[SHM_NAME_MAX + 1];
	uint64_t newest = trace_newest_ns(e, n), ns;

	copy_name(name, shm_worker(seg, rank)->name);
	printf("{\"rank\":%u,\"name\":", rank);
	json_put_str(stdout, name);
	printf(",\"capacity\":%u,\"claimed\":%llu,\"dropped\":%llu,\"records\":[", seg->trace_records,
	       (unsigned long long)head, (unsigned long long)dropped);
	for (size_t i = 0; i < n; i++) {
		const struct trace_entry *r = &e[i];
		const char *type = worker_msg_name(r->type), *step = trace_step(e, i, &ns);

		printf("%s{\"index\":%llu,\"lane\":%u,\"time_ns\":%llu,\"age_ns\":%llu,"
		       "\"kind\":\"%s\",\"type\":", i ? "," : "", (unsigned long long)r->index,
		       r->lane, (unsigned long long)r->time_ns,
		       (unsigned long long)(newest - r->time_ns), trace_kind_name(r->kind));
		if (type)
			printf("\"%s\"", type);
		else
			fputs("null", stdout);
		printf(",\"type_id\":%u,\"peer\":%u,\"msg_id\":%llu,\"size\":%llu,", r->type,
		       r->peer, (unsigned long long)r->msg_id, (unsigned long long)r->size);
		if (trace_is_pin(r->kind))
			printf("\"tensors\":%u,\"with\":\"%s\",", r->tensors,
			       r->reply ? "reply" : "request");
		else
			fputs("\"tensors\":null,\"with\":null,", stdout);
		printf("\"status\":\"%s\",\"step\":", trace_status_name(r->status));
		if (step)
			printf("\"%s\",\"step_ns\":%llu}", step, (unsigned long long)ns);
		else
			fputs("null,\"step_ns\":null}", stdout);
	}
	printf("]}\n");
}

/* --trace: the flight recorder of one worker. */
int show_trace(pid_t pid, uint32_t rank, bool json)
{
	struct trace_entry *e;
	uint64_t head, dropped;
	struct shm_seg seg;
	size_t n;
	int rc = 0;

	if (attach_job(pid, &seg, false))
		return EXIT_ANOMALY;
	if (rank >= seg.world) {
		rc = fail("no worker of rank %u: the job has %u workers", rank, seg.world);
	} else if (!(e = calloc(seg.trace_records, sizeof(*e)))) {
		rc = fail("out of memory");
	} else {
		n = trace_read(&seg, rank, seg.trace_records, e, &head, &dropped);
		if (json)
			print_trace_json(&seg, rank, e, n, head, dropped);
		else
			print_trace_text(&seg, rank, e, n, head, dropped);
		free(e);
	}
	shm_seg_detach(&seg);
	return rc;
}
