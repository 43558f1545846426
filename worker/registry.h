/* The functions this worker serves, by name (shmrpc_register). */
#ifndef SHMRPC_WORKER_REGISTRY_H
#define SHMRPC_WORKER_REGISTRY_H

#include "shmrpc.h"
#include "common/compiler.h"

struct registry_entry {
	struct registry_entry *next;
	shmrpc_fn fn;
	void *user;
	char *sig;  /* NULL: unchecked */
	char name[];
};

/* The entry for name, or NULL. Entries are never removed while the
 * process runs, so the pointer stays valid. */
SHMRPC_HIDDEN const struct registry_entry *registry_find(const char *name);

#endif
