#!/bin/sh
# Runs the example (built through pkg-config) against a real broker with a
# limit of 2, then checks what it printed and that every token is back.
set -eu
example=$1
baton=${BATON_BIN:-../../target/debug/baton}
dir=$(mktemp -d /tmp/baton-c-example-XXXXXX)
"$baton" serve --jobs 2 --socket "$dir/socket" 2>"$dir/log" &
broker=$!
trap 'kill "$broker" 2>/dev/null; wait "$broker" 2>/dev/null; rm -rf "$dir"' EXIT
i=0
until "$baton" status --socket "$dir/socket" >/dev/null 2>&1; do
    i=$((i + 1)); [ "$i" -lt 5000 ] || { echo "the broker did not start" >&2; exit 1; }
    sleep 0.002
done
out=$(BATON_SOCKET="$dir/socket" "$example")
echo "$out"
echo "$out" | grep -Eq '^24 iterations, sum of squares 4324, at most [12] at once$'
status=$("$baton" status --json --socket "$dir/socket")
for want in '"free": 2,' '"held": 0,' '"granted": 24,'; do
    echo "$status" | grep -q "$want" || { echo "tokens missing at the end: no $want in $status" >&2; exit 1; }
done
echo "clients: 1 passed, 0 failed, 0 skipped (C example)"
