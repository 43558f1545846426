"""Running an unchanged torch.distributed.rpc program on shmrpc.

    shmrun -n 2 -- python3 -m shmrpc.as_torch prog.py args...
    shmrun -n 2 --as-torch -- python3 prog.py args...     (the same)
    python3 -m shmrpc.as_torch -m package.module args...

runs prog.py as __main__ after install(), which makes these names resolve
to shmrpc, in sys.modules and as attributes of their parent packages:

- torch.distributed.rpc          -> shmrpc
- torch.distributed.rpc.functions, .api, .constants, .backend_registry,
  .options                       -> shmrpc's (shmrpc.functions, ...)
- torch.distributed.autograd     -> shmrpc.autograd
- torch.distributed.optim.DistributedOptimizer
                                 -> shmrpc.optim.DistributedOptimizer
- torch.futures.wait_all / collect_all: given shmrpc Futures (rpc_async's),
  shmrpc's; given only torch Futures, torch's own. (`import shmrpc` does
  this one by itself, whenever torch.futures is loaded, and from then on
  shmrpc's Futures are torch.futures.Futures too: shmrpc.Future.)

Everything else of torch stays torch's, torch.distributed.rpc's other
submodules (internal, ...) too: they become attributes of shmrpc so
that code reaching them through the package finds them. A program calls
`shmrpc.install_as_torch()` itself to the same effect; either way it must
run before the program binds the names (`import torch.distributed.rpc as
rpc` after install() gets shmrpc). torch imports torch.distributed.rpc as
part of `import torch`, so install() imports torch first.
"""
import os
import runpy
import sys

from . import (_core, _futures, _marshal, api, autograd, backend_registry, constants, optim,
               options, profiler)

_installed = False


def patch_futures(torch_futures):
    """torch.futures' wait_all and collect_all take shmrpc's Futures too
    (shmrpc's do the work when any is shmrpc's; torch's own otherwise).
    Done by `import shmrpc` as soon as torch.futures is imported, before or
    after it (torch_hooks)."""
    if getattr(torch_futures.wait_all, "_shmrpc", False):
        return
    _futures._adopt_torch_futures(torch_futures)
    torch_futures.wait_all, torch_futures.collect_all = _futures_patched(torch_futures)


def _patch_profiler(legacy):
    profiler.watch_torch_profiles(legacy)


# What `import shmrpc` patches in torch's modules, once each is loaded.
_PATCHES = {"torch.futures": patch_futures,
            "torch.autograd.profiler_legacy": _patch_profiler}


class _TorchHook:
    """A meta path finder that patches torch's modules (_PATCHES) as they
    are loaded."""

    def find_spec(self, fullname, path=None, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        real = spec.loader.exec_module

        def exec_module(module):
            real(module)
            patch(module)
        spec.loader.exec_module = exec_module
        return spec


def torch_hooks():
    """Patches torch's modules (_PATCHES) now where they are loaded, and the
    others when they are."""
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _TorchHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchHook())


def _futures_patched(torch_futures):
    """torch.futures' wait_all and collect_all, taking shmrpc's Futures too."""
    torch_wait_all, torch_collect_all = torch_futures.wait_all, torch_futures.collect_all

    def ours(futures):
        return any(isinstance(f, _futures.Future) for f in futures)

    def wait_all(futures):
        futures = list(futures)
        return _futures.wait_all(futures) if ours(futures) else torch_wait_all(futures)

    def collect_all(futures):
        futures = list(futures)
        return _futures.collect_all(futures) if ours(futures) else torch_collect_all(futures)

    wait_all.__doc__ = torch_wait_all.__doc__
    collect_all.__doc__ = torch_collect_all.__doc__
    wait_all._shmrpc = collect_all._shmrpc = True
    return wait_all, collect_all


def install():
    """Makes torch's RPC names resolve to shmrpc (above). Needs torch."""
    global _installed
    if _installed:
        return
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.optim as dist_optim
        import torch.futures as torch_futures
    except ImportError as e:
        raise ImportError(f"shmrpc.install_as_torch needs torch ({e}): install python3-torch") \
            from None
    shmrpc = sys.modules[__package__]  # the package, imported before this module

    replaced = {
        "torch.distributed.rpc": shmrpc,
        "torch.distributed.rpc.functions": shmrpc.functions,
        "torch.distributed.rpc.api": api,
        "torch.distributed.rpc.constants": constants,
        "torch.distributed.rpc.backend_registry": backend_registry,
        "torch.distributed.rpc.options": options,
        "torch.distributed.autograd": autograd,
    }
    # torch's other submodules stay torch's, reachable as before from the
    # package that replaces theirs (torch.distributed.rpc.internal...).
    for name, module in list(sys.modules.items()):
        parent, _, child = name.rpartition(".")
        if parent == "torch.distributed.rpc" and name not in replaced and \
                not hasattr(shmrpc, child):
            setattr(shmrpc, child, module)
    if sys.modules.get("torch.distributed.rpc.api") is not api:
        _core._torch_api_module = sys.modules.get("torch.distributed.rpc.api")
    for name, module in replaced.items():
        sys.modules[name] = module
    dist.rpc = shmrpc
    dist.autograd = autograd
    dist_optim.DistributedOptimizer = optim.DistributedOptimizer
    patch_futures(torch_futures)
    # torch's pickler is the default one (what _use_rpc_pickler restores).
    _marshal._default_pickler = _marshal._torch_internal_pickler()
    _core._state_changed()
    _installed = True


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help") or (argv[1] == "-m" and len(argv) < 3):
        print("usage: python3 -m shmrpc.as_torch PROG.py [ARGS...] | -m MODULE [ARGS...]: "
              "runs the program with torch.distributed.rpc, .autograd and "
              "DistributedOptimizer resolving to shmrpc", file=sys.stderr)
        return 2
    install()
    if argv[1] == "-m":
        # As `python3 -m MODULE`: sys.argv[0] becomes the module's file.
        sys.argv = argv[2:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        return 0
    sys.argv = argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
    runpy.run_path(argv[1], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
