#!/usr/bin/env bash
# install_test.sh - strata as installed, used the way a user would: `make install` into a
# temporary PREFIX, then examples/reshard.c built with `cc ... $(pkg-config --cflags --libs
# strata)` and run against the installed libstrata.so, and once more linked statically
# (`pkg-config --static`: Libs.private); an MPI program built through strata-mpi.pc and run on
# 2 ranks; the installed `strata` verifies what they saved. Checks that libstrata.so needs no
# MPI, has its soname and exports strata_* only, each under the version node of the release
# that added it (src/libstrata.map: STRATA_0.2, ..., STRATA_<major>.<minor> of
# strata_types.h), every function the public headers declare among them; that
# libstrata_mpi.so exports strata_comm_mpi alone; that DESTDIR stages under PREFIX; that
# `make uninstall` removes every file.
# Prints one line per check and a summary. Uses the build in $BUILD (default build).
# Skipped (exit 77) under the sanitizers (SANITIZED=1): a sanitized library does not link
# into a plain program.
set -u
cd "$(dirname "$0")/.."
B=${BUILD:-build}
if [ -n "${SANITIZED:-}" ]; then
    echo "install: skipped under the sanitizers"
    exit 77
fi
T=$(mktemp -d "${TMPDIR:-/tmp}/strata-install-XXXXXX")
trap 'rm -rf "$T"' EXIT
P=$T/prefix
CC=${CC:-cc}
# the make that runs this test has no jobserver to lend a make started from a script
unset MAKEFLAGS MFLAGS MAKELEVEL
pass=0 fail=0
check() { # name, then a command that must succeed
    local name=$1; shift
    if "$@" >"$T/out" 2>&1; then pass=$((pass + 1)); echo "ok   $name"
    else fail=$((fail + 1)); echo "FAIL $name"; sed 's/^/     /' "$T/out" | tail -n 15; fi
}
major=$(sed -n 's/.*define STRATA_VERSION_MAJOR \([0-9][0-9]*\).*/\1/p' include/strata_types.h)
minor=$(sed -n 's/.*define STRATA_VERSION_MINOR \([0-9][0-9]*\).*/\1/p' include/strata_types.h)
node=STRATA_$major.$minor

check "make install PREFIX=$P" make --no-print-directory BUILD="$B" PREFIX="$P" install
if [ ! -f "$P/lib/pkgconfig/strata.pc" ]; then
    echo "install: $pass passed, $((fail + 1)) failed (nothing installed)"
    exit 1
fi
check "installed: headers, libraries (soname links), command, pkg-config files" bash -c "
    cd '$P' && for f in include/strata.h include/strata_types.h include/strata_comm.h \
        include/strata_mpi.h lib/libstrata.a lib/libstrata.so lib/libstrata.so.$major \
        lib/libstrata.so.$major.$minor lib/libstrata_mpi.a lib/libstrata_mpi.so \
        lib/libstrata_mpi.so.$major lib/libstrata_mpi.so.$major.$minor bin/strata \
        lib/pkgconfig/strata.pc lib/pkgconfig/strata-mpi.pc; do
        [ -e \"\$f\" ] || { echo \"missing: \$f\"; exit 1; }
    done"

export PKG_CONFIG_PATH=$P/lib/pkgconfig
check "pkg-config --modversion strata is $major.$minor" \
    bash -c "[ \"\$(pkg-config --modversion strata)\" = $major.$minor ]"

# the library itself
check "libstrata.so needs no MPI (ldd)" bash -c "ldd '$P/lib/libstrata.so' && ! ldd '$P/lib/libstrata.so' | grep -i mpi"
check "libstrata.so has the soname libstrata.so.$major" \
    bash -c "readelf -d '$P/lib/libstrata.so' | grep -F 'Library soname: [libstrata.so.$major]'"
check "libstrata.so exports strata_* under version nodes up to $node, nothing else" bash -c "
    syms=\$(readelf --dyn-syms -W '$P/lib/libstrata.so' | awk '\$7 != \"UND\" && \$8 ~ /@/ { print \$8 }')
    echo \"\$syms\" | grep -qx 'strata_load@@STRATA_0.2' || { echo 'no strata_load@@STRATA_0.2'; exit 1; }
    echo \"\$syms\" | grep -qx 'strata_pickle_parse@@STRATA_0.3' || { echo 'no strata_pickle_parse@@STRATA_0.3'; exit 1; }
    bad=\$(echo \"\$syms\" | grep -v '^strata_[a-z0-9_]*@@STRATA_$major\.[0-9]*\$' |
         grep -v '^STRATA_$major\.[0-9]*@@STRATA_$major\.[0-9]*\$')
    [ -z \"\$bad\" ] || { echo \"exported besides strata_*@@STRATA_$major.*:\"; echo \"\$bad\"; exit 1; }
    later=\$(echo \"\$syms\" | sed -n 's/.*@@STRATA_$major\.\([0-9]*\)\$/\1/p' | awk '\$1 > $minor')
    [ -z \"\$later\" ] || { echo \"a node after $node\"; exit 1; }"
check "every function the public headers declare is exported" bash -c "
    syms=\$(readelf --dyn-syms -W '$P/lib/libstrata.so' | awk '\$7 != \"UND\" { sub(/@.*/, \"\", \$8); print \$8 }')
    for f in \$(cat include/strata.h include/strata_types.h include/strata_comm.h |
                 grep -o 'strata_[a-z0-9_]*(' | tr -d '(' | sort -u); do
        echo \"\$syms\" | grep -qx \"\$f\" || { echo \"not exported: \$f (src/libstrata.map)\"; exit 1; }
    done"
check "libstrata_mpi.so exports strata_comm_mpi alone (STRATA_MPI_0.2, its release's node)" bash -c "
    syms=\$(readelf --dyn-syms -W '$P/lib/libstrata_mpi.so' | awk '\$7 != \"UND\" && \$8 ~ /@/ { print \$8 }')
    echo \"\$syms\"; [ \"\$syms\" = 'strata_comm_mpi@@STRATA_MPI_0.2' ]"

# the README's example, built as its user builds it
check "examples/reshard.c builds with \$(pkg-config --cflags --libs strata)" bash -c "
    $CC -Wall -Wextra -Werror -o '$T/reshard' examples/reshard.c \$(pkg-config --cflags --libs strata)"
# a PREFIX outside the dynamic linker's directories: strata.pc's rpath finds the library
# when the program starts, no LD_LIBRARY_PATH (issue 30)
check "the example runs against the installed libstrata.so, no LD_LIBRARY_PATH (rpath)" bash -c "
    unset LD_LIBRARY_PATH; ldd '$T/reshard' | grep -F '$P/lib/libstrata.so.$major' &&
    '$T/reshard' '$T/ck' && test -f '$T/ck/COMMIT'"
check "the example needs versioned symbols (STRATA_0.2: the functions it calls)" bash -c "readelf -V '$T/reshard' | grep -F 'Name: STRATA_0.2'"
# pkg-config --static lists every library a static link needs, libcurl's own private ones
# included (Requires.private: libcurl); linked here with libstrata.a and libcurl's shared
# library (this machine lacks some of libcurl's private libraries' -dev packages)
if pkg-config --exists libcurl && nm "$B/libstrata.a" 2>/dev/null | grep -q ' U curl_easy_init'; then
    check "pkg-config --static --libs strata holds libcurl's, libxxhash's and zlib's --static libs" bash -c "
        have=\" \$(pkg-config --static --libs strata) \"
        for f in \$(pkg-config --static --libs libcurl libxxhash zlib); do
            case \"\$have\" in *\" \$f \"*) ;; *) echo \"missing \$f in:\$have\"; exit 1;; esac
        done"
fi
check "the example links statically (pkg-config --static, Libs.private)" bash -c "
    curl_private=\$(pkg-config --static --libs libcurl 2>/dev/null | sed 's/-lcurl\\b//; s/-lz\\b//')
    flags=\$(pkg-config --static --libs strata | sed 's/-lstrata\\b/-l:libstrata.a/')
    for f in \$curl_private; do flags=\$(echo \" \$flags \" | sed \"s/ \$f / /g\"); done
    $CC -o '$T/reshard_static' examples/reshard.c \$(pkg-config --cflags strata) \$flags &&
    ! ldd '$T/reshard_static' | grep strata && '$T/reshard_static' '$T/ck_static'"
check "installed with PC_RPATH= (no rpath): the example needs LD_LIBRARY_PATH, as the README says" bash -c "
    make --no-print-directory BUILD='$B' PREFIX='$T/p2' PC_RPATH= install >/dev/null &&
    ! grep -q rpath '$T/p2/lib/pkgconfig/strata.pc' &&
    $CC -o '$T/reshard2' examples/reshard.c \$(PKG_CONFIG_PATH='$T/p2/lib/pkgconfig' pkg-config --cflags --libs strata) &&
    { unset LD_LIBRARY_PATH; ! '$T/reshard2' '$T/ck2' 2>'$T/err2'; } &&
    grep -F 'libstrata.so.$major: cannot open shared object file' '$T/err2' &&
    LD_LIBRARY_PATH='$T/p2/lib' '$T/reshard2' '$T/ck2'"
check "the installed strata verifies what the example saved" "$P/bin/strata" verify "$T/ck"

# the MPI add-on, through strata-mpi.pc
cat >"$T/mpi_example.c" <<'EOF'
/* Each of N ranks saves row r of an N x 5 matrix through an MPI communicator, then every
 * rank loads the whole matrix and checks it. */
#include <mpi.h>
#include <stdio.h>

#include "strata.h"
#include "strata_mpi.h"

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    const char *uri = argv[1];
    strata_comm *comm;
    strata_saver *sv = NULL;
    strata_state *st = NULL, *ld = NULL;
    int rc = strata_comm_mpi(&comm, NULL);
    if (rc)
        return fprintf(stderr, "strata_comm_mpi: %s\n", strata_error_last()), 1;
    int r = strata_comm_rank(comm), n = strata_comm_size(comm), bad = 0;
    double row[5], all[64 * 5];
    for (int c = 0; c < 5; c++)
        row[c] = r * 10 + c;
    uint64_t shape[2] = {(uint64_t)n, 5}, off[2] = {(uint64_t)r, 0}, len[2] = {1, 5};
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags = STRATA_SAVE_NO_SYNC;
    if (!(rc = strata_state_new(&st)) && !(rc = strata_state_new(&ld)) &&
        !(rc = strata_state_add_shard(st, &(strata_shard){"m", STRATA_F64, 2, shape, off, len,
                                                          .data = row})) &&
        !(rc = strata_state_add_shard(ld, &(strata_shard){"m", STRATA_F64, 2, shape,
                                                          .data = all})) &&
        !(rc = strata_saver_new(&sv, comm, NULL)) &&
        !(rc = strata_save(NULL, sv, &uri, 1, &st, 1, &so)))
        rc = strata_load(NULL, comm, &uri, 1, &ld, 1, NULL);
    if (rc)
        fprintf(stderr, "rank %d: %s: %s\n", r, strata_error_name(rc), strata_error_last());
    else
        for (int i = 0; i < n * 5; i++)
            bad += all[i] != (i / 5) * 10 + i % 5;
    if (!rc)
        printf("rank %d of %d: loaded %d x 5, wrong=%d\n", r, n, n, bad);
    strata_saver_free(sv);
    strata_state_free(st);
    strata_state_free(ld);
    strata_comm_free(comm);
    MPI_Finalize();
    return rc || bad;
}
EOF
check "an MPI program builds with \$(pkg-config --cflags --libs strata-mpi)" bash -c "
    $CC -std=c11 -Wall -Wextra -Werror -o '$T/mpi_example' '$T/mpi_example.c' \
        \$(pkg-config --cflags --libs strata-mpi)"
check "it saves and loads on 2 MPI ranks against the installed libraries" bash -c "
    LD_LIBRARY_PATH='$P/lib' timeout 120 mpiexec.mpich -n 2 '$T/mpi_example' '$T/ck_mpi' &&
    '$P/bin/strata' verify '$T/ck_mpi'"

# DESTDIR stages the same files under DESTDIR/PREFIX, with PREFIX in the pkg-config files
check "make install DESTDIR=... PREFIX=/opt/strata stages under DESTDIR" bash -c "
    make --no-print-directory BUILD='$B' DESTDIR='$T/stage' PREFIX=/opt/strata install &&
    [ \"\$(ls '$T/stage')\" = opt ] && test -f '$T/stage/opt/strata/lib/libstrata.so.$major.$minor' &&
    grep -qx 'prefix=/opt/strata' '$T/stage/opt/strata/lib/pkgconfig/strata.pc' &&
    grep -qx 'prefix=/opt/strata' '$T/stage/opt/strata/lib/pkgconfig/strata-mpi.pc'"
check "make uninstall removes every installed file" bash -c "
    make --no-print-directory BUILD='$B' PREFIX='$P' uninstall &&
    left=\$(find '$P' ! -type d) && [ -z \"\$left\" ] || { echo \"left: \$left\"; exit 1; }"

echo "install: $pass passed, $fail failed"
[ "$fail" = 0 ]
