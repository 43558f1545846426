#!/bin/sh
# tests/gpu.sh [BUILD]: what needs a GPU, on a machine that has one.
#
# The device machine some sessions are lent has a GPU and a Python with
# CUDA torch, but no network and none of our Debian packages. Here, run
# `make gpu`: build/gpu (BUILD's default) holds only what this script
# runs, plain files of about 12 MiB (liburing and msgpack-c are linked
# statically, xxHash inline); carry it with the source tree, and run
# `sh tests/gpu.sh` from the top folder there.
#
# First a preflight that prints the GPU, the driver, the Python, torch and
# its CUDA, and pytest, and FAILS when a GPU test cannot run (no GPU,
# torch without CUDA, no pytest, a file not built): on this machine a
# skip is a failure. Then the GPU tests, each with a time limit (a skip,
# 77, fails too), then the benches with their CUDA figures (BENCH
# tensor_handoff device=cuda ...). SHMRPC_PYTHON: the interpreter (default
# python3 on PATH). Under 8 minutes in all (4 on an H100 machine); exits non-zero on any failure.
set -u
build=${1:-build/gpu}
py=${SHMRPC_PYTHON:-$(command -v python3)}
fail() {
	echo "gpu.sh: FAIL: $*" >&2
	exit 1
}

echo "gpu.sh: preflight"
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi is not here: no NVIDIA driver"
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total --format=csv,noheader ||
	fail "nvidia-smi lists no GPU"
[ -n "$py" ] && [ -x "$py" ] || fail "no python3 on PATH: set SHMRPC_PYTHON to one with CUDA torch"
"$py" - <<'PY' || fail "$py cannot run the GPU tests (above: what it lacks)"
import sys
print("gpu.sh: python", sys.version.split()[0], sys.executable)
import torch
print("gpu.sh: torch", torch.__version__, "built for CUDA", torch.version.cuda)
import pytest
print("gpu.sh: pytest", pytest.__version__)
assert torch.cuda.is_available(), "torch.cuda.is_available() is false"
print("gpu.sh:", torch.cuda.device_count(), "device(s), cuda:0 is", torch.cuda.get_device_name(0))
PY
for f in bin/shmrun bin/shmrpc-inspect tests/cuda_ipc tests/python_test bench/tensor_handoff \
	python/shmrpc/_shmrpc.abi3.so; do
	[ -f "$build/$f" ] || fail "$build/$f is missing: run make gpu where it is built, carry $build"
done
before=$(mktemp)
trap 'rm -f "$before"' EXIT
ls /dev/shm >"$before" 2>/dev/null

export SHMRPC_BUILD="$build" SHMRPC_PYTHON="$py"
unset SHMRPC_LIBCUDA # the real driver, never the tests' stand-in
rc=0
# Runs one test with a limit of $1 seconds; any status but 0 fails.
run() {
	limit=$1
	name=$2
	shift 2
	t0=$(date +%s)
	timeout "$limit" "$@"
	r=$?
	echo "gpu.sh: $name exited $r in $(($(date +%s) - t0)) s"
	if [ "$r" -ne 0 ]; then
		echo "gpu.sh: FAIL: $name (77 is a skip: a failure on a GPU machine; 124: over $limit s)" >&2
		rc=1
	fi
}
run 100 cuda_ipc "$build/tests/cuda_ipc"
run 120 py_cuda_torch "$build/tests/python_test" cuda_torch
run 120 py_data_gpu "$build/tests/python_test" data_gpu
# Ours, and the CUDA driver's (cuda.shm.UID.PID.N) of the processes that
# ended: shmrun and the tests remove them (common/cuda_leftovers.h).
left=$(ls /dev/shm 2>/dev/null | grep -vxF -f "$before")
if [ -n "$left" ]; then
	echo "gpu.sh: FAIL: files left in /dev/shm:" $left >&2
	rc=1
fi
# The CUDA figures first: the torch peers of bench/run.sh take minutes
# on a big machine (a 1 GiB tensor through torch.distributed.rpc).
run 60 bench_cuda "$build/bench/tensor_handoff" -q
run 300 benches sh bench/run.sh "$build" -q
# Named, not failed: the benches run torch's own peers too (mp.spawn
# children that end with os._exit leave the driver's files, and no
# reaper of ours sees them), so a file here may not be ours.
left=$(ls /dev/shm 2>/dev/null | grep -vxF -f "$before")
[ -z "$left" ] || echo "gpu.sh: note: after the benches, /dev/shm holds (ours or torch's peers'):" $left >&2
echo "gpu.sh: $([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"
exit "$rc"
