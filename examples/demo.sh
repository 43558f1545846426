#!/bin/sh
# examples/demo.sh BUILD_DIR: what `make demo` shows. First a real job:
# shmrun starts four workers of examples/quickstart, which call each other.
# Then the layer beneath: two processes pass messages through shmrpc's
# shared-memory rings, and the figures bench/ring_pingpong measured are told
# in words.
set -eu

if [ $# -ne 1 ]; then
	echo "usage: sh examples/demo.sh BUILD_DIR" >&2
	exit 2
fi
BUILD=$1

echo "shmrpc demo, part 1: a job of four workers."
echo "\$ shmrun -n 4 -- $BUILD/examples/quickstart"
"$BUILD/bin/shmrun" -n 4 -- "$BUILD/examples/quickstart"

cat <<'EOF'

shmrpc demo, part 2, the layer beneath: two processes on this machine send each other messages through
shared memory. A message is written into a ring buffer that both processes
map; the receiver is woken by a "doorbell" word it waits on (with io_uring,
futex or busy spinning). First the bare cost of waking the other process,
then the same trip through shmrpc's rings. Figures are the median of many
trips (half were faster); on a shared machine they vary from run to run,
so compare lines of the same run with each other.

EOF

# Through a file: a pipe would hide the bench's exit status from set -e.
out=$(mktemp "${TMPDIR:-/tmp}/shmrpc-demo.XXXXXX")
trap 'rm -f "$out"' EXIT
trap 'exit 130' INT TERM
"$BUILD/bench/ring_pingpong" -q >"$out"
awk '
function kv(    i, eq) {
	split("", v)
	for (i = 3; i <= NF; i++) {
		eq = index($i, "=")
		if (eq)
			v[substr($i, 1, eq - 1)] = substr($i, eq + 1)
	}
}
function t(ns) {
	ns += 0
	if (ns < 1000)
		return sprintf("%d ns", ns)
	if (ns < 1000000)
		return sprintf("%.1f µs", ns / 1000)
	return sprintf("%.1f ms", ns / 1000000)
}
BEGIN {
	how["spin"] = "busy-waiting (no sleep)"
	how["futex"] = "sleeping in futex(2)"
	how["uring"] = "sleeping in io_uring (FUTEX_WAIT)"
	how["pipe"] = "a pipe pair, for reference"
}
$1 != "BENCH" { print; next }
{ kv() }
$2 == "floor" {
	if (!shown_floor++)
		print "Bare wake-up: one process changes a shared word, the other notices and answers."
	printf "  %-40s round trip %9s   (1 in 100 slower than %s)\n", how[v["mode"]] ":",
		t(v["median_ns"]), t(v["p99_ns"])
	next
}
$2 == "ring_rtt" {
	if (!shown_rtt++)
		print "\nAn empty message there and back through shmrpc (rings, doorbells, waiters)."
	printf "  %-40s round trip %9s   (%sx the bare wake-up of the same kind)\n",
		how[v["mode"]] ":", t(v["median_ns"]), v["vs_floor"]
	next
}
$2 == "ring_stream" {
	if (!shown_stream++)
		print "\nOne way, as fast as the sender can go (the receiver checks every message):"
	if (v["size"] + 0 >= 1024)
		printf "  %d KiB messages: %.0f thousand per second, %s GB/s\n", v["size"] / 1024,
			v["frames_per_s"] / 1000, v["GB_per_s"]
	else
		printf "  %d-byte messages: %.1f million per second, %s MB/s\n", v["size"],
			v["frames_per_s"] / 1000000, v["MB_per_s"]
	next
}
{ print }
' "$out"

cat <<'EOF'

The spinning modes answer fastest but keep a core busy; the sleeping ones
free it, and shmrpc spins briefly before it sleeps, which is why its round
trip can beat the bare sleeping wake-up. `make bench` prints the full figures.
EOF
