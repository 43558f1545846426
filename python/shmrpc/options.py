"""torch's RPC backend options and backend types, as shmrpc takes them.

A torch program builds `TensorPipeRpcBackendOptions(...)` (or any object
with the same attributes) and passes it to init_rpc; shmrpc uses
num_worker_threads, rpc_timeout, init_method (where the workers meet when
no shmrun started them) and device_maps, and ignores devices and the
transports with one warning (init_rpc). Whatever `backend` is given, the
backend is shmrpc's: BackendType.TENSORPIPE is accepted as a name for it.
"""
import enum

from . import constants


class BackendType(enum.Enum):
    """torch's backend types; every one runs on shmrpc's rings."""

    TENSORPIPE = "TENSORPIPE"
    SHMRPC = "SHMRPC"

    def __repr__(self):
        return f"BackendType.{self.name}"


def _device_key(d):
    """A device as torch's options keep it: torch.device when torch is
    loaded (an int is cuda:N), else as given."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None:
        return d
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cuda", d)
    return torch.device(d)


class RpcBackendOptions:
    """torch's base options: the default timeout and the init method."""

    def __init__(self, rpc_timeout=constants.DEFAULT_RPC_TIMEOUT_SEC,
                 init_method=constants.DEFAULT_INIT_METHOD):
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's TensorPipeRpcBackendOptions, same arguments and attributes."""

    def __init__(self, *, num_worker_threads=constants.DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout=constants.DEFAULT_RPC_TIMEOUT_SEC,
                 init_method=constants.DEFAULT_INIT_METHOD, device_maps=None, devices=None,
                 _transports=None, _channels=None):
        super().__init__(rpc_timeout, init_method)
        self.num_worker_threads = num_worker_threads
        self.device_maps = {}
        for to, m in (device_maps or {}).items():
            self.set_device_map(to, m)
        self.devices = [_device_key(d) for d in devices or []]
        self._transports = _transports
        self._channels = _channels

    def set_device_map(self, to, device_map):
        """Adds device_map (this worker's device -> to's) for callee to;
        only 1-to-1 mappings, as torch's."""
        current = self.device_maps.setdefault(to, {})
        full = {_device_key(k): _device_key(v) for k, v in device_map.items()}
        for k, v in full.items():
            if k in current and current[k] != v:
                raise ValueError("`set_device_map` only supports 1-to-1 mapping, trying"
                                 f" to map {k} to {v} and {current[k]}")
        current.update(full)

    def set_devices(self, devices):
        self.devices = [_device_key(d) for d in devices]
