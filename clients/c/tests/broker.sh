# Sourced by the shell tests: a real `baton serve --jobs 2` in a temporary
# directory ($dir, with its socket at $dir/socket), stopped by pid at exit,
# and the check that a run of the example printed the right thing.
baton=${BATON_BIN:-$(cd "$(dirname "$0")/../../.." && pwd)/target/debug/baton}
dir=$(mktemp -d /tmp/baton-c-XXXXXX)
"$baton" serve --jobs 2 --socket "$dir/socket" 2>"$dir/log" &
broker=$!
trap 'kill "$broker" 2>/dev/null; wait "$broker" 2>/dev/null; rm -rf "$dir"' EXIT
i=0
until "$baton" status --socket "$dir/socket" >/dev/null 2>&1; do
    i=$((i + 1)); [ "$i" -lt 5000 ] || { echo "the broker did not start" >&2; exit 1; }
    sleep 0.002
done

# check_example OUTPUT: what parallel.c prints under a limit of 2.
check_example() {
    echo "$1"
    echo "$1" | grep -Eq '^24 iterations, sum of squares 4324, at most [12] at once$' \
        || { echo "the example printed something else (above)" >&2; exit 1; }
}

# check_all_back GRANTED: the broker has every token back after GRANTED grants in all.
check_all_back() {
    status=$("$baton" status --json --socket "$dir/socket")
    for want in '"free": 2,' '"held": 0,' "\"granted\": $1,"; do
        echo "$status" | grep -q "$want" || { echo "tokens missing at the end: no $want in $status" >&2; exit 1; }
    done
}
