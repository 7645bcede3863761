/* test_property.c - seeded random round trips: random tensors (mostly 0..4 dims, a few
 * 5..8; all dtypes; odd sizes) saved from one random layout (grid boxes, FSDP flat pieces,
 * replicas) on 1..8 ranks and loaded into another on 1..8 ranks, compared bitwise; blobs
 * too; cases on 4 threads at once.
 * STRATA_SEED sets the seed, STRATA_PROP_CASES the number of cases (default 1000),
 * STRATA_PROP_ONLY runs one case. Plus a few fixed round trips of edge cases. */
#include <pthread.h>

#include "testutil.h"

#define MAXT 3
#define MAXP 64

typedef struct {
    char name[64];
    strata_dtype dt;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS];
} tspec;

typedef struct {
    uint64_t off[STRATA_MAX_DIMS], len[STRATA_MAX_DIMS];
    int flat;
    uint64_t fs, fe;
} piece;

static char base_dir[512];

static uint64_t numel(int nd, const uint64_t *len)
{
    uint64_t n = 1;
    for (int d = 0; d < nd; d++)
        n *= len[d];
    return n;
}

static void rand_shape(tu_rng *g, tspec *t)
{
    static const uint64_t sizes[] = {1, 1, 2, 3, 4, 5, 7, 8, 13, 16, 23, 31, 63, 64, 100, 127,
                                     257, 511, 1000, 2532};
    static const int nd_weights[] = {2, 6, 8, 4, 2, 1}; /* ndim 0..4; 5..8 */
    uint64_t w = tu_below(g, 23);
    t->ndim = 0;
    while (w >= (uint64_t)nd_weights[t->ndim])
        w -= (uint64_t)nd_weights[t->ndim++];
    if (t->ndim == 5)
        t->ndim = (int)tu_range(g, 5, STRATA_MAX_DIMS);
    t->dt = (strata_dtype)tu_below(g, STRATA_DTYPE_COUNT);
    uint64_t cap = tu_chance(g, 10) ? 50000 : 6000;
    for (int d = 0; d < t->ndim; d++)
        t->shape[d] = t->ndim > 4 ? tu_range(g, 1, 4)
                                  : sizes[tu_below(g, sizeof sizes / sizeof sizes[0])];
    while (numel(t->ndim, t->shape) > cap) { /* shrink the largest dim */
        int m = 0;
        for (int d = 1; d < t->ndim; d++)
            if (t->shape[d] > t->shape[m])
                m = d;
        t->shape[m] = t->shape[m] / 2 + (t->shape[m] % 4 == 1);
    }
}

/* Sorted random cut points c[0] = 0 <= ... <= c[k] = n (equal points: empty parts). */
static void rand_cuts(tu_rng *g, uint64_t n, int k, uint64_t *c)
{
    c[0] = 0;
    c[k] = n;
    for (int i = 1; i < k; i++)
        c[i] = tu_range(g, 0, n);
    for (int i = 1; i < k; i++) /* insertion sort */
        for (int j = i; j > 1 && c[j] < c[j - 1]; j--) {
            uint64_t x = c[j];
            c[j] = c[j - 1];
            c[j - 1] = x;
        }
}

/* Splits the tensor into pieces that cover it exactly: the whole tensor, a grid of uneven
 * boxes, uneven flat ranges of the whole (FSDP), or flat ranges inside grid cells. */
static size_t rand_pieces(tu_rng *g, const tspec *t, piece *out, const char **mode)
{
    static const char *modes[] = {"whole", "grid", "flat", "grid+flat"};
    int m = (int)tu_below(g, 4);
    *mode = modes[m];
    /* grid */
    uint64_t cuts[STRATA_MAX_DIMS][5];
    int parts[STRATA_MAX_DIMS], ncells = 1;
    for (int d = 0; d < t->ndim; d++) {
        parts[d] = 1;
        if (m & 1 && ncells < 16)
            parts[d] = (int)tu_range(g, 1, 4);
        if (ncells * parts[d] > 16)
            parts[d] = 1;
        ncells *= parts[d];
        rand_cuts(g, t->shape[d], parts[d], cuts[d]);
    }
    size_t n = 0;
    for (int cell = 0; cell < ncells; cell++) {
        piece box = {0};
        int rest = cell;
        for (int d = t->ndim - 1; d >= 0; d--) {
            int i = rest % parts[d];
            rest /= parts[d];
            box.off[d] = cuts[d][i];
            box.len[d] = cuts[d][i + 1] - cuts[d][i];
        }
        uint64_t bn = numel(t->ndim, box.len);
        box.fe = bn;
        if (!(m & 2) || (m == 3 && tu_chance(g, 40)) || n + 5 > MAXP) {
            out[n++] = box; /* flat = 0 */
            continue;
        }
        int k = (int)tu_range(g, 1, 5);
        uint64_t c[6];
        rand_cuts(g, bn, k, c);
        for (int i = 0; i < k; i++) {
            out[n] = box;
            out[n].flat = 1;
            out[n].fs = c[i];
            out[n].fe = c[i + 1];
            n++;
        }
    }
    return n;
}

/* Registers the pieces on ranks: each on one random rank, some replicated on more (drop:
 * percentage of pieces nobody asks for; only for loads). */
static void assign(tu_rng *g, tu_set *s, const tspec *t, const piece *p, size_t np, int fill,
                   unsigned drop, uint64_t *distinct)
{
    size_t esz = strata_dtype_size(t->dt);
    for (size_t i = 0; i < np; i++) {
        if (drop && tu_chance(g, drop))
            continue;
        int r0 = (int)tu_below(g, (uint64_t)s->n), rep = tu_chance(g, 30);
        for (int r = 0; r < s->n; r++)
            if (r == r0 || (rep && tu_chance(g, 50)))
                tu_set_shard(s, r, t->name, t->dt, t->ndim, t->shape, p[i].off, p[i].len,
                             p[i].flat, p[i].fs, p[i].fe, fill);
        if (distinct)
            *distinct += (p[i].fe - p[i].fs) * esz;
    }
}

static void dump_set(const char *what, const tu_set *s)
{
    for (size_t i = 0; i < s->nsh; i++) {
        const tu_shard_rec *x = &s->sh[i];
        print_error("  %s: rank %d %s box", what, x->rank, x->name);
        for (int d = 0; d < x->sh.ndim; d++)
            print_error(" %" PRIu64 "+%" PRIu64, x->off[d], x->len[d]);
        if (x->sh.flat)
            print_error(" flat [%" PRIu64 ", %" PRIu64 ")", x->sh.flat_start, x->sh.flat_end);
        print_error("\n");
    }
    for (size_t i = 0; i < s->nbl; i++)
        print_error("  %s: rank %d blob %s owner %d size %" PRIu64 "\n", what, s->bl[i].rank,
                    s->bl[i].name, s->bl[i].owner, s->bl[i].size);
}

/* One random case; 0 if it passed, -1 after printing what failed. */
static int run_case(uint64_t seed, unsigned idx)
{
    tu_rng g = {seed};
    int nsrc = (int)tu_range(&g, 1, 8), ndst = (int)tu_range(&g, 1, 8);
    int nt = (int)tu_range(&g, 1, MAXT);
    static const uint32_t chunks[] = {4096, 8192, 65536, 4u << 20};
    static const uint32_t max_ios[] = {0, 4096, 12345, 65536, 1u << 20};
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.step = idx;
    so.chunk_bytes = chunks[tu_below(&g, 4)];
    so.io_threads = (int)tu_range(&g, 1, 4);
    so.flags |= STRATA_SAVE_NO_SYNC;
    if (tu_chance(&g, 50))
        so.flags |= STRATA_SAVE_NO_DIRECT;
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.io_threads = (int)tu_range(&g, 1, 4);
    lo.max_io_bytes = max_ios[tu_below(&g, 5)];
    if (tu_chance(&g, 50))
        lo.flags |= STRATA_LOAD_NO_DIRECT;

    tu_set src, dst;
    tu_set_init(&src, nsrc);
    tu_set_init(&dst, ndst);
    tspec t[MAXT];
    piece ps[MAXP], pd[MAXP];
    const char *ms[MAXT], *md[MAXT];
    uint64_t distinct = 0;
    for (int i = 0; i < nt; i++) {
        snprintf(t[i].name, sizeof t[i].name, "case%u.layers.%d.w", idx, i);
        rand_shape(&g, &t[i]);
        size_t np = rand_pieces(&g, &t[i], ps, &ms[i]);
        assign(&g, &src, &t[i], ps, np, 1, 0, &distinct);
        np = rand_pieces(&g, &t[i], pd, &md[i]);
        assign(&g, &dst, &t[i], pd, np, 0, tu_chance(&g, 20) ? 15 : 0, NULL);
    }
    /* blobs: a global one on some ranks, per-rank ones, each maybe empty */
    if (tu_chance(&g, 35)) {
        uint64_t gsize = tu_chance(&g, 10) ? 0 : tu_range(&g, 1, 3000);
        int any = 0;
        for (int r = 0; r < nsrc; r++)
            if (tu_chance(&g, 50) || (!any && r == nsrc - 1)) {
                tu_set_blob(&src, r, "train.cfg", 0, 0, gsize, 1);
                any = 1;
            }
        distinct += gsize;
        uint64_t lsize[8];
        int owners[8], nown = 0;
        for (int r = 0; r < nsrc; r++)
            if (tu_chance(&g, 60)) {
                lsize[r] = tu_chance(&g, 10) ? 0 : tu_range(&g, 1, 600);
                tu_set_blob(&src, r, "rng.state", 1, 0, lsize[r], 1);
                distinct += lsize[r];
                owners[nown++] = r;
            }
        for (int r = 0; r < ndst; r++) {
            if (tu_chance(&g, 60))
                tu_set_blob(&dst, r, "train.cfg", 0, -1, gsize, 0);
            if (nown && tu_chance(&g, 60)) {
                int o = owners[tu_below(&g, (uint64_t)nown)];
                tu_set_blob(&dst, r, "rng.state", 1, o, lsize[o], 0);
            }
        }
    }

    char ck[600];
    snprintf(ck, sizeof ck, "%s/case-%u", base_dir, idx);
    const char *why = NULL;
    strata_stats ss = STRATA_STATS_INIT, ls = STRATA_STATS_INIT;
    int rc = strata_save(&ss, NULL, (const char *[]){ck}, 1, src.st, nsrc, &so);
    if (rc)
        why = "save failed";
    else if (ss.data_bytes != distinct || ss.bytes != distinct)
        why = "save stats: data_bytes is not the distinct bytes";
    else if (distinct && (ss.writers < 1 || ss.max_writer_bytes * (uint64_t)nsrc < distinct))
        why = "save stats: writers";
    else if (ss.balance_bound > ss.max_writer_bytes)
        why = "save stats: the balance bound exceeds the largest writer";
    if (!why && (rc = strata_load(&ls, NULL, (const char *[]){ck}, 1, dst.st, ndst, &lo)) != 0)
        why = "load failed";
    if (!why && ls.bytes > distinct)
        why = "load read more than the checkpoint holds";
    if (!why && tu_set_check(&dst) != 0)
        why = "loaded values differ";
    if (!why && idx % 16 == 0) {
        strata_ckpt *c = NULL;
        if ((rc = strata_ckpt_open(&c, ck, 0)) != 0 || (rc = strata_ckpt_verify(c, NULL, NULL)))
            why = "verify failed";
        else if (strata_ckpt_ntensors(c) != (size_t)nt || strata_ckpt_step(c) != idx)
            why = "ckpt counts differ";
        strata_ckpt_free(c);
    }
    if (why) {
        print_error("case %u (seed %#" PRIx64 "): %s: %s (%s)\n", idx, seed, why,
                    strata_error_name(rc), strata_error_last());
        print_error("  %d -> %d ranks, chunk %u, save threads %d direct %d, load threads %d "
                    "max_io %u direct %d\n",
                    nsrc, ndst, so.chunk_bytes, so.io_threads,
                    !(so.flags & STRATA_SAVE_NO_DIRECT), lo.io_threads, lo.max_io_bytes,
                    !(lo.flags & STRATA_LOAD_NO_DIRECT));
        for (int i = 0; i < nt; i++) {
            print_error("  %s %s [", t[i].name, strata_dtype_name(t[i].dt));
            for (int d = 0; d < t[i].ndim; d++)
                print_error(d ? ",%" PRIu64 : "%" PRIu64, t[i].shape[d]);
            print_error("] saved %s, loaded %s\n", ms[i], md[i]);
        }
        if (getenv("STRATA_PROP_ONLY")) { /* the full layouts, when rerunning one case */
            dump_set("saved", &src);
            dump_set("loaded", &dst);
        }
    }
    tu_rmrf(ck);
    tu_set_free(&src);
    tu_set_free(&dst);
    return why ? -1 : 0;
}

static void test_random_roundtrips(void **state)
{
    (void)state;
    uint64_t seed = tu_env_u64("STRATA_SEED", 20240601);
    unsigned cases = (unsigned)tu_env_u64("STRATA_PROP_CASES", 1000);
    const char *only = getenv("STRATA_PROP_ONLY");
    print_message("property: %u cases, STRATA_SEED=%" PRIu64 "\n", cases, seed);
    unsigned first = only ? (unsigned)atoi(only) : 0, last = only ? first + 1 : cases;
    for (unsigned i = first; i < last; i++)
        if (run_case(tu_mix(seed + i), i) != 0)
            fail_msg("case %u failed (rerun: STRATA_SEED=%" PRIu64 " STRATA_PROP_ONLY=%u)", i,
                     seed, i);
}

/* ---- threads: saves and loads of different checkpoints at once, one shared handle ---- */

typedef struct {
    unsigned first, n;
    int failed;
    const strata_ckpt *shared;
    char msg_ok;
} worker;

static void *worker_main(void *p)
{
    worker *w = p;
    for (unsigned i = w->first; i < w->first + w->n; i++)
        if (run_case(tu_mix(0xc0ffee + i), i) != 0)
            w->failed = 1;
    if (strata_ckpt_verify(w->shared, NULL, NULL) != 0)
        w->failed = 1;
    /* the error message is per thread */
    char uri[64];
    snprintf(uri, sizeof uri, "gs://bucket-%u/x", w->first);
    strata_state *st;
    strata_state_new(&st);
    const char *u = uri;
    w->msg_ok = strata_load(NULL, NULL, &u, 1, &st, 1, NULL) == STRATA_ESCHEME &&
                strstr(strata_error_last(), uri) != NULL;
    strata_state_free(st);
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    tu_set src;
    tu_set_init(&src, 2);
    uint64_t shape[] = {100, 300};
    for (int r = 0; r < 2; r++)
        tu_set_shard(&src, r, "shared", STRATA_F32, 2, shape, NULL, NULL, 1, 15000 * (uint64_t)r,
                     15000 * (uint64_t)(r + 1), 1);
    char ck[600];
    snprintf(ck, sizeof ck, "%s/shared", base_dir);
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.chunk_bytes = 4096;
    so.flags |= STRATA_SAVE_NO_SYNC;
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, src.st, 2, &so));
    tu_set_free(&src);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    enum { NT = 4 };
    pthread_t th[NT];
    worker w[NT];
    for (int t = 0; t < NT; t++) {
        w[t] = (worker){.first = 100000 + 1000 * (unsigned)t, .n = 20, .shared = c};
        assert_int_equal(pthread_create(&th[t], NULL, worker_main, &w[t]), 0);
    }
    for (int t = 0; t < NT; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(w[t].failed, 0);
        assert_true(w[t].msg_ok);
    }
    strata_ckpt_free(c);
    tu_rmrf(ck);
}

/* ---- fixed edge cases ---- */

/* Saves src to a fresh checkpoint and loads dst from it; checks dst. */
static void roundtrip_lo(tu_set *src, tu_set *dst, const strata_save_opts *so,
                         const strata_load_opts *lo, const char *uri_fmt)
{
    char ck[700];
    snprintf(ck, sizeof ck, uri_fmt, base_dir);
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, src->st, src->n, so));
    for (size_t i = 0; i < dst->nsh; i++) /* poison again: dst may be reused */
        if (dst->sh[i].sh.data)
            memset(dst->sh[i].sh.data, 0xA5,
                   tu_shard_numel(&dst->sh[i].sh) * strata_dtype_size(dst->sh[i].sh.dtype));
    assert_ok(strata_load(NULL, NULL, (const char *[]){ck}, 1, dst->st, dst->n, lo));
    assert_int_equal(tu_set_check(dst), 0);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    assert_ok(strata_ckpt_verify(c, NULL, NULL));
    strata_ckpt_free(c);
    assert_rc(strata_remove_incomplete(ck), STRATA_EEXIST);
    tu_rmrf(ck[0] == 'f' ? ck + 7 : ck);
}

static void roundtrip(tu_set *src, tu_set *dst, const strata_save_opts *so, const char *uri_fmt)
{
    roundtrip_lo(src, dst, so, NULL, uri_fmt);
}

static void test_empty_blobs(void **state)
{
    (void)state;
    tu_set src, dst;
    tu_set_init(&src, 2);
    tu_set_init(&dst, 1);
    tu_set_blob(&src, 0, "empty.global", 0, 0, 0, 1);
    tu_set_blob(&src, 1, "empty.global", 0, 0, 0, 1);
    tu_set_blob(&src, 1, "empty.local", 1, 0, 0, 1);
    tu_set_blob(&src, 0, "full", 1, 0, 5000, 1);
    tu_set_blob(&dst, 0, "empty.global", 0, -1, 0, 0);
    tu_set_blob(&dst, 0, "empty.local", 1, 1, 0, 0);
    tu_set_blob(&dst, 0, "full", 1, 0, 5000, 0);
    roundtrip(&src, &dst, NULL, "%s/empty-blobs");
    tu_set_free(&src);
    tu_set_free(&dst);
}

static void test_big_chunk(void **state)
{
    (void)state;
    /* chunks larger than the save path's 8 MiB write tasks: 12 MiB shards, 16 MiB chunks */
    tu_set src, dst;
    tu_set_init(&src, 2);
    tu_set_init(&dst, 3);
    uint64_t shape[] = {2, 3u << 20}, off[] = {0, 0}, len[] = {1, 3u << 20};
    for (int r = 0; r < 2; r++) {
        off[0] = (uint64_t)r;
        tu_set_shard(&src, r, "big", STRATA_F32, 2, shape, off, len, 0, 0, 0, 1);
    }
    tu_set_shard(&dst, 0, "big", STRATA_F32, 2, shape, NULL, NULL, 1, 0, 3u << 20, 0);
    tu_set_shard(&dst, 1, "big", STRATA_F32, 2, shape, NULL, NULL, 1, 3u << 20, 6u << 20, 0);
    tu_set_shard(&dst, 2, "big", STRATA_F32, 2, shape, NULL, NULL, 1, 1000, 1001, 0);
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.chunk_bytes = 16u << 20;
    so.flags |= STRATA_SAVE_NO_SYNC;
    roundtrip(&src, &dst, &so, "%s/big-chunk");
    /* default 4 MiB chunks: each 12 MiB extent takes two write tasks, and with 1 MiB
     * reads (rounded up to a chunk) three reads */
    so.chunk_bytes = 0;
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.max_io_bytes = 1u << 20;
    roundtrip_lo(&src, &dst, &so, &lo, "%s/big-default");
    tu_set_free(&src);
    tu_set_free(&dst);
}

static void test_synced_scalars_and_uris(void **state)
{
    (void)state;
    /* default options (fsync on), a file:// URI with a trailing slash whose parent
     * directories do not exist yet, scalars of every dtype replicated on 3 ranks, loaded
     * on 1 */
    tu_set src, dst;
    tu_set_init(&src, 3);
    tu_set_init(&dst, 1);
    char name[32];
    for (int dt = 0; dt < STRATA_DTYPE_COUNT; dt++) {
        snprintf(name, sizeof name, "scalar.%s", strata_dtype_name((strata_dtype)dt));
        for (int r = 0; r < 3; r++)
            tu_set_shard(&src, r, name, (strata_dtype)dt, 0, NULL, NULL, NULL, 0, 0, 0, 1);
        tu_set_shard(&dst, 0, name, (strata_dtype)dt, 0, NULL, NULL, NULL, 0, 0, 0, 0);
    }
    roundtrip(&src, &dst, NULL, "file://%s/synced/parents/are/made/");
    tu_set_free(&src);
    tu_set_free(&dst);
}

static void test_load_subset(void **state)
{
    (void)state;
    /* a load may ask for a subset of tensors, from several calls and threads of states */
    tu_set src, dst;
    tu_set_init(&src, 4);
    uint64_t shape[] = {63, 511};
    for (int r = 0; r < 4; r++) {
        uint64_t off[] = {0, (uint64_t)r * 127}, len[] = {63, r == 3 ? 130u : 127u};
        tu_set_shard(&src, r, "a", STRATA_BF16, 2, shape, off, len, 0, 0, 0, 1);
        tu_set_shard(&src, r, "b", STRATA_I64, 2, shape, NULL, NULL, 1, 63 * 511 * r / 4,
                     63 * 511 * (r + 1) / 4, 1);
    }
    tu_set_init(&dst, 2);
    uint64_t off[] = {62, 0}, len[] = {1, 511};
    tu_set_shard(&dst, 0, "b", STRATA_I64, 2, shape, off, len, 0, 0, 0, 0);
    tu_set_shard(&dst, 1, "b", STRATA_I64, 2, shape, NULL, NULL, 1, 8000, 8001, 0);
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags |= STRATA_SAVE_NO_SYNC;
    roundtrip(&src, &dst, &so, "%s/subset");
    tu_set_free(&src);
    tu_set_free(&dst);
}

TU_TMPDIR_GROUP(base_dir, "prop")

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_empty_blobs),
        cmocka_unit_test(test_big_chunk),
        cmocka_unit_test(test_synced_scalars_and_uris),
        cmocka_unit_test(test_load_subset),
        cmocka_unit_test(test_random_roundtrips),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
