#include "shmrpc.h"

const char *shmrpc_version(void)
{
	return SHMRPC_VERSION_STRING;
}
