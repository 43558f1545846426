#!/bin/sh
# Exits 0 when $1 (clang) can link a libFuzzer target here.
cc=${1:-clang}
command -v "$cc" >/dev/null 2>&1 || exit 1
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n){(void)d;(void)n;return 0;}\n' > "$tmp/f.c"
"$cc" -fsanitize=fuzzer -o "$tmp/f" "$tmp/f.c" >/dev/null 2>&1
