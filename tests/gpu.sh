#!/bin/sh
# tests/gpu.sh [BUILD]: what needs a GPU, on a machine that has one.
#
# The device machine some sessions are lent has a GPU and torch with CUDA
# but no network and no Debian packages of ours: build here with `make`
# (liburing and msgpack-c are linked statically, xxHash inline), carry the
# build folder there, and run this from the top folder. It runs the tests
# that skip without a GPU (each still skips, 77, if this machine has none)
# and then the benches, whose tensor_handoff prints the CUDA figures
# (BENCH tensor_handoff device=cuda ...) when CUDA is available.
# Exits non-zero if a test failed.
set -u
build=${1:-build}
export SHMRPC_BUILD="$build"
rc=0
"$build/bin/shmrpc-test-runner" -t 300 "$build/tests/cuda_ipc" \
	"$build/tests/py_cuda_torch" "$build/tests/py_data_gpu" || rc=$?
sh bench/run.sh "$build" -q || true
exit "$rc"
