"""torch.distributed.rpc.backend_registry's names: one backend, shmrpc's."""
from .options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = ["BackendType", "RpcBackendOptions", "backend_registered",
           "construct_rpc_backend_options", "register_backend"]


def backend_registered(backend_name):
    return backend_name in BackendType.__members__


def register_backend(backend_name, construct_rpc_backend_options_handler, init_backend_handler):
    raise NotImplementedError(f"registering the RPC backend {backend_name!r} is not supported "
                              "by shmrpc: every backend name runs on shmrpc's own")


def construct_rpc_backend_options(backend, rpc_timeout=None, init_method=None, **kwargs):
    """Options for backend (any: they are shmrpc's), as torch's helper."""
    from .constants import DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT_SEC
    return TensorPipeRpcBackendOptions(
        rpc_timeout=DEFAULT_RPC_TIMEOUT_SEC if rpc_timeout is None else rpc_timeout,
        init_method=DEFAULT_INIT_METHOD if init_method is None else init_method, **kwargs)
