/* make_seeds.c - saves a few small checkpoints through the public API, whose metadata.bin
 * and COMMIT files seed fuzz/corpus/fuzz_meta and fuzz/corpus/fuzz_commit. Each one covers
 * other parts of the format: scalars, 8-dim tensors, flat (ZeRO) pieces, uneven boxes,
 * replicas, several checksum chunks per extent, global, rank-local and empty blobs.
 *
 *   make && gcc -std=c11 -Iinclude -o build/make_seeds fuzz/make_seeds.c build/libstrata.a \
 *       -lxxhash -lpthread && build/make_seeds /tmp/seeds
 *   for d in /tmp/seeds/[a-z]*; do n=$(basename $d)
 *     cp $d/metadata.bin fuzz/corpus/fuzz_meta/seed-$n; cp $d/COMMIT fuzz/corpus/fuzz_commit/seed-$n
 *   done
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"

#define MAXR 4

static strata_state *st[MAXR];
static void *bufs[256];
static int nbufs;

static void *buf(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    for (size_t i = 0; i < n; i++)
        ((unsigned char *)p)[i] = (unsigned char)(i * 131 + 7);
    bufs[nbufs++] = p;
    return p;
}

static void check(int rc, const char *what)
{
    if (rc) {
        fprintf(stderr, "%s: %s (%s)\n", what, strata_error_name(rc), strata_error_last());
        exit(1);
    }
}

static void reset(int n)
{
    for (int r = 0; r < MAXR; r++) {
        strata_state_free(st[r]);
        st[r] = NULL;
    }
    for (int r = 0; r < n; r++)
        check(strata_state_new(&st[r]), "state");
}

static void shard(int r, const char *name, strata_dtype dt, int nd, const uint64_t *shape,
                  const uint64_t *off, const uint64_t *len, int flat, uint64_t fs, uint64_t fe)
{
    strata_shard s = {name, dt, nd, shape, off, len, flat, fs, fe, NULL, 0, 0};
    s.data = buf(strata_shard_numel(&s) * strata_dtype_size(dt));
    check(strata_state_add_shard(st[r], &s), name);
}

static void save(const char *dir, const char *name, int n, uint64_t step, uint32_t chunk)
{
    char uri[4096];
    snprintf(uri, sizeof uri, "%s/%s", dir, name);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.step = step;
    o.chunk_bytes = chunk;
    o.flags |= STRATA_SAVE_NO_SYNC;
    const char *u = uri;
    check(strata_save(NULL, NULL, &u, 1, st, n, &o), uri);
    printf("%s\n", uri);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make_seeds DIR\n");
        return 2;
    }
    const char *dir = argv[1];

    /* 1: one rank, a scalar, a vector, global + rank-local + empty blobs */
    reset(1);
    uint64_t s1[] = {5};
    shard(0, "scalar", STRATA_F64, 0, NULL, NULL, NULL, 0, 0, 0);
    shard(0, "vec", STRATA_BF16, 1, s1, NULL, NULL, 0, 0, 0);
    check(strata_state_add_blob(st[0], "step", 0, -1, buf(8), 8), "blob");
    check(strata_state_add_blob(st[0], "rng", STRATA_BLOB_RANK_LOCAL, 0, buf(13), 13), "blob");
    check(strata_state_add_blob(st[0], "empty", 0, -1, buf(0), 0), "blob");
    save(dir, "basic", 1, 7, 0);

    /* 2: two ranks, a 2-D tensor in uneven row boxes, replicated norm, flat optimizer
     * pieces cutting rows in the middle, 4 KiB chunks so extents have several checksums */
    reset(2);
    uint64_t w[] = {37, 129}, o0[] = {0, 0}, l0[] = {19, 129}, o1[] = {19, 0}, l1[] = {18, 129};
    uint64_t n1[] = {129};
    for (int r = 0; r < 2; r++) {
        shard(r, "w", STRATA_F32, 2, w, r ? o1 : o0, r ? l1 : l0, 0, 0, 0);
        shard(r, "norm", STRATA_F16, 1, n1, NULL, NULL, 0, 0, 0);
        shard(r, "adam.w", STRATA_F32, 2, w, NULL, NULL, 1, r ? 2000 : 0, r ? 37 * 129 : 2000);
        check(strata_state_add_blob(st[r], "loader", STRATA_BLOB_RANK_LOCAL, r,
                                    buf(100 + (size_t)r), 100 + (uint64_t)r),
              "blob");
    }
    save(dir, "zero", 2, 123456789, 4096);

    /* 3: three ranks, 8-dim and 3-D tensors split along inner dims, fp8 and bool */
    reset(3);
    uint64_t s8[] = {2, 1, 3, 1, 2, 1, 1, 2};
    uint64_t s3[] = {4, 6, 5};
    for (int r = 0; r < 3; r++) {
        uint64_t off8[8] = {0, 0, (uint64_t)r, 0, 0, 0, 0, 0}, len8[8] = {2, 1, 1, 1, 2, 1, 1, 2};
        shard(r, "t8", STRATA_FP8_E4M3, 8, s8, off8, len8, 0, 0, 0);
        uint64_t off3[3] = {0, (uint64_t)r * 2, 0}, len3[3] = {4, 2, 5};
        shard(r, "t3", STRATA_BOOL, 3, s3, off3, len3, 0, 0, 0);
    }
    shard(0, "i64", STRATA_I64, 1, s1, NULL, NULL, 1, 1, 4);
    save(dir, "dims", 3, 0, 0);

    reset(0);
    for (int i = 0; i < nbufs; i++)
        free(bufs[i]);
    return 0;
}
