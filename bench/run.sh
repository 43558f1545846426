#!/bin/sh
# bench/run.sh BUILD_DIR [ARGS...]: every bench of the build, beside its peers.
#
# The Python peers (bench/*.py, measuring torch.distributed.rpc) run first,
# with Debian's /usr/bin/python3 (SHMRPC_PYTHON: another interpreter, a GPU
# machine's) when it can import torch; then every program
# in BUILD_DIR/bench, in name order. Each BENCH line printed so far is in the
# file named by SHMRPC_BENCH_PEERS, so a program can print its figures as
# ratios against peers measured in the same run (bench/rpc reads the floor
# that bench/ring_pingpong printed before it, and the torch figures;
# bench/rref reads bench/torch_rref.py's).
# bench/python_rpc.py measures shmrpc's Python package beside torch; without
# torch it still runs, and prints shmrpc's figures alone.
# ARGS (e.g. -q) go to every bench. Exits non-zero if any bench failed.
set -eu

if [ $# -lt 1 ]; then
	echo "usage: sh bench/run.sh BUILD_DIR [ARGS...]" >&2
	exit 2
fi
BUILD=$1
shift
here=$(dirname "$0")
peers=$(mktemp "${TMPDIR:-/tmp}/shmrpc-bench-peers.XXXXXX")
rc_file=$(mktemp "${TMPDIR:-/tmp}/shmrpc-bench-rc.XXXXXX")
trap 'rm -f "$peers" "$rc_file"' EXIT
trap 'exit 130' INT TERM
export SHMRPC_BUILD="$BUILD" SHMRPC_BENCH_PEERS="$peers"
failed=0

# Runs one bench, showing its lines as they come and keeping them for the
# ones after it; a failure is counted, and the others still run.
run() {
	{
		rc=0
		"$@" || rc=$?
		echo "$rc" >"$rc_file"
	} | tee -a "$peers"
	rc=$(cat "$rc_file")
	if [ "$rc" -ne 0 ]; then
		echo "bench: $* failed (exit $rc)" >&2
		failed=$((failed + 1))
	fi
}

python=${SHMRPC_PYTHON:-/usr/bin/python3}
if "$python" -c 'import torch' 2>/dev/null; then
	for py in "$here"/*.py; do
		[ -f "$py" ] || continue
		run "$python" "$py" "$@"
	done
else
	echo "bench: $python cannot import torch; the torch peers are skipped" \
		"(make bench-deps installs python3-torch)" >&2
	run "$python" "$here/python_rpc.py" "$@"
fi

for prog in "$BUILD"/bench/*; do
	if [ -f "$prog" ] && [ -x "$prog" ]; then
		run "$prog" "$@"
	fi
done

[ "$failed" -eq 0 ]
