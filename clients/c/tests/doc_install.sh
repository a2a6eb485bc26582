#!/bin/sh
# Does what docs/clients.md tells a user to do to install libbaton under
# $HOME and build against it: the shell block after the marker line, run as
# it is from the top of the tree, with HOME a temporary directory and no
# PKG_CONFIG_PATH or LD_LIBRARY_PATH of ours. The example it builds must
# then run against a real broker.
set -eu
. "$(dirname "$0")/broker.sh"
top=$(cd ../.. && pwd)
doc=$top/docs/clients.md
block=$(awk '/<!-- clients\/c\/tests\/doc_install.sh runs the next block -->/ {found = 1; next}
             found == 1 && /^```/ {found = 2; next}
             found == 2 && /^```/ {exit}
             found == 2 {print}' "$doc")
[ -n "$block" ] || { echo "$doc: no block after the doc_install.sh marker" >&2; exit 1; }
mkdir "$dir/home"
out=$(cd "$top" && env -u PKG_CONFIG_PATH -u LD_LIBRARY_PATH -u PKG_CONFIG_LIBDIR -u MAKEFLAGS -u MAKELEVEL \
    HOME="$dir/home" BATON_SOCKET="$dir/socket" sh -eu -c "$block")
check_example "$out"
check_all_back 24
echo "clients: 1 passed, 0 failed, 0 skipped (C install as docs/clients.md says)"
