/* The function registry; see registry.h. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common/error.h"
#include "worker/registry.h"

#define BUCKETS 256u
#define NAME_MAX_LEN 256u

static struct {
	pthread_rwlock_t lock;
	struct registry_entry *bucket[BUCKETS];
} reg = { .lock = PTHREAD_RWLOCK_INITIALIZER };

static uint32_t bucket_of(const char *name)
{
	return (uint32_t)(XXH3_64bits(name, strlen(name)) % BUCKETS);
}

static struct registry_entry *lookup(const char *name, uint32_t b)
{
	for (struct registry_entry *e = reg.bucket[b]; e; e = e->next)
		if (strcmp(e->name, name) == 0)
			return e;
	return NULL;
}

const struct registry_entry *registry_find(const char *name)
{
	const struct registry_entry *e;

	pthread_rwlock_rdlock(&reg.lock);
	e = lookup(name, bucket_of(name));
	pthread_rwlock_unlock(&reg.lock);
	return e;
}

int shmrpc_register(const char *name, const char *sig, shmrpc_fn fn, void *user)
{
	struct registry_entry *e;
	size_t n;
	uint32_t b;

	if (!name || !fn || !(n = strlen(name)) || n > NAME_MAX_LEN)
		return shmrpc__fail(-EINVAL, "shmrpc_register: a function needs a name of 1 to %u "
				    "bytes and a function pointer", NAME_MAX_LEN);
	if (sig && sig[strspn(sig, "nbifsylmtrv")])
		return shmrpc__fail(-EINVAL, "shmrpc_register(\"%s\"): signature \"%s\" has a letter "
				    "other than n b i f s y l m t r v", name, sig);
	if (!(e = calloc(1, sizeof(*e) + n + 1)) || (sig && !(e->sig = strdup(sig)))) {
		free(e);
		return shmrpc__fail(-ENOMEM, "out of memory registering %s", name);
	}
	memcpy(e->name, name, n + 1);
	e->fn = fn;
	e->user = user;
	b = bucket_of(name);
	pthread_rwlock_wrlock(&reg.lock);
	if (lookup(name, b)) {
		pthread_rwlock_unlock(&reg.lock);
		free(e->sig);
		free(e);
		return shmrpc__fail(-EEXIST, "a function named \"%s\" is already registered", name);
	}
	e->next = reg.bucket[b];
	reg.bucket[b] = e;
	pthread_rwlock_unlock(&reg.lock);
	return 0;
}
