"""torch.distributed.rpc.constants' names, with torch's values."""
from datetime import timedelta

DEFAULT_RPC_TIMEOUT_SEC = 60.0
UNSET_RPC_TIMEOUT = -1.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_SHUTDOWN_TIMEOUT = 0
DEFAULT_NUM_WORKER_THREADS = 16
# torch's process-group timeout (its rendezvous store's): shmrpc has none,
# kept for programs that read it.
DEFAULT_PROCESS_GROUP_TIMEOUT = timedelta(milliseconds=2 ** 31 - 1)

_DEFAULT_RPC_TIMEOUT_SEC = DEFAULT_RPC_TIMEOUT_SEC
_UNSET_RPC_TIMEOUT = UNSET_RPC_TIMEOUT
_DEFAULT_INIT_METHOD = DEFAULT_INIT_METHOD
_DEFAULT_NUM_WORKER_THREADS = DEFAULT_NUM_WORKER_THREADS
