"""pip install --no-build-isolation --no-index ./python: the package shmrpc
with its C extension built from the repository's sources, as `make python`
builds it (the Makefile's PY_* rules): python/*.c, launcher/job_shm.c,
launcher/keeper.c, launcher/seg_watch.c and libshmrpc's objects (common,
shm, ipc, worker), on the stable ABI (abi3, Python >= 3.9). It downloads
nothing: Debian's python3-pip brings setuptools and wheel.
"""
import glob
import os
import sysconfig

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the C sources are beside python/, not in it


def sources():
    found = []
    for pattern in ("python/*.c", "launcher/job_shm.c", "launcher/keeper.c", "launcher/seg_watch.c",
                    "common/*.c", "shm/*.c", "ipc/*.c", "worker/*.c"):
        found += sorted(glob.glob(os.path.join(ROOT, pattern)))
    return found


def static_or(name):
    """The Makefile's static_or: lib<name>.a where Debian has it (the
    extension then runs where only it is carried), else -l<name>."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for d in (os.path.join("/usr/lib", multiarch), "/usr/lib"):
        archive = os.path.join(d, f"lib{name}.a")
        if os.path.exists(archive):
            return [archive], []
    return [], [name]


objects, libraries = [], []
for lib in ("uring", "msgpackc"):
    archive, shared = static_or(lib)
    objects += archive
    libraries += shared

setup(
    name="shmrpc",
    version="0.1.0",
    description="torch.distributed.rpc's API over shared memory, for one machine",
    python_requires=">=3.9",
    packages=["shmrpc"],
    ext_modules=[Extension(
        "shmrpc._shmrpc",
        sources=sources(),
        include_dirs=[ROOT, os.path.join(ROOT, "include")],
        define_macros=[("_GNU_SOURCE", None)],
        extra_compile_args=["-std=gnu11", "-fvisibility=hidden"],
        extra_objects=objects,
        libraries=libraries + ["pthread"],
        py_limited_api=True,
    )],
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    zip_safe=False,
)
