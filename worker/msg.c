/* Names and kinds of the message types. */
#include <stddef.h>

#include "worker/msg.h"

static const struct {
	const char *name;
	bool is_request;
} msg_info[MSG_TYPE_END] = {
#define X(n, value, req) [value] = { #n, req },
	WORKER_MSG_TYPES(X)
#undef X
};

const char *worker_msg_name(uint32_t type)
{
	return type < MSG_TYPE_END ? msg_info[type].name : NULL;
}

bool worker_msg_is_request(uint32_t type)
{
	return type < MSG_TYPE_END && msg_info[type].is_request;
}
