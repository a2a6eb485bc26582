#!/bin/sh
# Installs libbaton as users and packagers do, from this one tree: into a
# first prefix, then a second (after which the first is removed), then
# staged with DESTDIR and copied to its final prefix. Each time the example
# is built with `pkg-config --cflags --libs baton` and nothing else (no -I,
# -L or LD_LIBRARY_PATH of ours) and run against a real broker; it must load
# the libbaton of the prefix at hand, and nothing installed may name another
# prefix, the staging directory or the build tree.
set -eu
. "$(dirname "$0")/broker.sh"
tree=$(pwd)
unset LD_LIBRARY_PATH PKG_CONFIG_PATH PKG_CONFIG_LIBDIR

# build_and_run PREFIX: the example built against PREFIX's baton.pc, run.
build_and_run() {
    prefix=$1
    pc=$prefix/lib/pkgconfig/baton.pc
    grep -qx "prefix=$prefix" "$pc" || { echo "$pc names another prefix:" >&2; cat "$pc" >&2; exit 1; }
    flags=$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs baton)
    ${CC:-cc} -o "$dir/parallel" examples/parallel.c $flags -lpthread
    loaded=$(ldd "$dir/parallel" | awk '$1 == "libbaton.so.0" {print $3}')
    [ "$loaded" = "$prefix/lib/libbaton.so.0" ] || { echo "the example built against $prefix loads libbaton from '$loaded'" >&2; exit 1; }
    out=$(BATON_SOCKET="$dir/socket" "$dir/parallel")
    check_example "$out"
}

# nothing_points_elsewhere PREFIX WORD...: no text file under PREFIX names WORD.
nothing_points_elsewhere() {
    prefix=$1; shift
    for word in "$@"; do
        if grep -rIl -- "$word" "$prefix"; then
            echo "the files above, installed under $prefix, name $word" >&2
            exit 1
        fi
    done
}

first=$dir/first
second=$dir/second
${MAKE:-make} -s install PREFIX="$first" >/dev/null
build_and_run "$first"
${MAKE:-make} -s install PREFIX="$second" >/dev/null
rm -rf "$first"
build_and_run "$second"
nothing_points_elsewhere "$second" "$first" "$tree/build"

stage=$dir/stage
final=$dir/final
${MAKE:-make} -s install DESTDIR="$stage" PREFIX="$final" >/dev/null
mkdir -p "$final"
cp -a "$stage$final/." "$final/"
rm -rf "$stage"
build_and_run "$final"
nothing_points_elsewhere "$final" "$stage" "$second" "$tree/build"

# A distribution's package: PREFIX=/usr, with LIBDIR /usr/lib and, where
# the compiler has one, Debian's multiarch directory, staged. ld.so searches
# those itself, so baton.pc must carry no rpath (lintian calls an rpath to a
# system directory an error, and it would outrank ld.so.conf), and its
# libdir must be the LIBDIR given, not PREFIX/lib.
multiarch=$(${CC:-cc} -print-multiarch 2>/dev/null || true)
distro=$dir/distro
for libdir in /usr/lib ${multiarch:+/usr/lib/$multiarch}; do
    ${MAKE:-make} -s install DESTDIR="$distro" PREFIX=/usr LIBDIR="$libdir" >/dev/null
    pc=$distro$libdir/pkgconfig/baton.pc
    grep -qx "libdir=$libdir" "$pc" || { echo "$pc names another libdir than $libdir:" >&2; cat "$pc" >&2; exit 1; }
    if grep -q -- -rpath "$pc"; then
        echo "$pc gives programs an rpath to $libdir, a directory ld.so searches anyway:" >&2; cat "$pc" >&2; exit 1
    fi
    rm -rf "$distro"
done

check_all_back 72
echo "clients: 1 passed, 0 failed, 0 skipped (C install: two prefixes, DESTDIR, a distribution's /usr)"
