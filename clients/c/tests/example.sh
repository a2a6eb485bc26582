#!/bin/sh
# Runs the example (built through pkg-config) against a real broker with a
# limit of 2, then checks what it printed and that every token is back.
set -eu
example=$1
. "$(dirname "$0")/broker.sh"
out=$(BATON_SOCKET="$dir/socket" "$example")
check_example "$out"
check_all_back 24
echo "clients: 1 passed, 0 failed, 0 skipped (C example)"
