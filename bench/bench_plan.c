/* bench_plan.c - planning at scale, in one process: the local plans of 512..4096 simulated
 * ranks of a 1000-tensor GPT-style model laid out as tp=8, pp=8, dp=N/64 with ZeRO flat
 * optimizer shards. Times the global save plan, encoding and decoding the metadata, and
 * the load plan of one rank of another layout (tp=4, pp=4, dp=N/16, zero=1). Medians of 3.
 * Goals at 4096 ranks: plan <= 1 s, <= 64 metadata bytes per shard, load plan <= 50 ms;
 * growth no faster than n log n. Then the overlap check on crafted shard sets (only those:
 * `bench_plan overlap`). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/cli/synth.h"
#include "core/util.h"
#include "meta/meta.h"
#include "plan/plan.h"

#define REPS 3

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v)
{
    qsort(v, REPS, sizeof *v, cmp_d);
    return v[REPS / 2];
}

/* One run of the overlap check on t: the median of REPS times, or of one run when a run
 * takes more than 10 s. want: the expected result (0 or STRATA_EOVERLAP). */
static double time_overlap(const st_mtensor *t, int want)
{
    double v[REPS];
    for (int r = 0; r < REPS; r++) {
        double t0 = st_now();
        int rc = st_meta_check_overlap(t);
        v[r] = st_now() - t0;
        if (rc != want)
            fprintf(stderr, "overlap check of '%s': %s, want %s (%s)\n", t->name,
                    strata_error_name(rc), strata_error_name(want), strata_error_last());
        if (v[r] > 10.0)
            return v[r];
    }
    return median(v);
}

/* The overlap check of metadata decoding on crafted shard sets of 65,536 shards: an 8-dim
 * grid of one-element boxes, and one-element flat pieces of a single [1, 65536] box. */
static void bench_overlap_grid(void)
{
    enum { N = 65536 };
    st_mshard *sh = calloc(N, sizeof *sh);
    uint64_t *dims = calloc((size_t)N * 16, sizeof *dims);
    st_mtensor t = {.name = "crafted", .shards = sh, .nshards = N};
    for (int kind = 0; kind < 2; kind++) {
        t.ndim = kind ? 2 : 8;
        for (int d = 0; d < t.ndim; d++)
            t.shape[d] = kind ? (d ? N : 1) : 4;
        for (size_t i = 0; i < N; i++) {
            uint64_t *off = dims + i * 16, *len = off + 8;
            for (int d = 0; d < t.ndim; d++) {
                off[d] = kind ? 0 : (i >> (2 * (7 - d))) & 3;
                len[d] = kind ? t.shape[d] : 1;
            }
            sh[i] = (st_mshard){off, len, kind ? i : 0, kind ? i + 1 : 1, kind, {0}, 0};
        }
        printf("overlap check, %d shards, %s: %.3f s\n", N,
               kind ? "one-element flat pieces of one box" : "8-dim grid of one-element boxes",
               time_overlap(&t, 0));
    }
    free(sh);
    free(dims);
}

/* Issue 10's crafted set: n one-element shards in n distinct boxes that all intersect.
 * Tensor [2, n]; shard i is the box rows [0, 2) x cols [0, i + 1), narrowed to its element
 * i, (0, i): no two shards share an element, every two boxes share (0, 0). With extra, one
 * more shard, the box rows [0, 1) x cols [3, n / 2 + 1) narrowed to its element n / 2 - 3,
 * (0, n / 2): it shares that element with shard n / 2, so the check must fail. */
static void issue_family(st_mtensor *t, st_mshard *sh, uint64_t *dims, size_t n, int extra)
{
    t->ndim = 2;
    t->shape[0] = 2;
    t->shape[1] = n;
    t->nshards = n + (extra != 0);
    t->shards = sh;
    for (size_t i = 0; i < t->nshards; i++) {
        uint64_t *off = dims + i * 4, *len = off + 2;
        off[0] = 0;
        off[1] = i < n ? 0 : 3;
        len[0] = i < n ? 2 : 1;
        len[1] = i < n ? i + 1 : n / 2 - 2;
        uint64_t fs = i < n ? i : n / 2 - 3;
        sh[i] = (st_mshard){off, len, fs, fs + 1, 1, {0}, 0};
    }
}

static void bench_overlap_issue(void)
{
    static const size_t ns[] = {2000, 16000, 64000};
    for (size_t k = 0; k < sizeof ns / sizeof *ns; k++) {
        size_t n = ns[k];
        st_mshard *sh = calloc(n + 1, sizeof *sh);
        uint64_t *dims = calloc((n + 1) * 4, sizeof *dims);
        st_mtensor t = {.name = "issue10"};
        issue_family(&t, sh, dims, n, 0);
        double clean = time_overlap(&t, 0);
        issue_family(&t, sh, dims, n, 1);
        double bad = time_overlap(&t, STRATA_EOVERLAP);
        printf("overlap check, %zu one-element pieces of %zu distinct intersecting boxes: "
               "%.3f s (disjoint), %.3f s (one overlapping pair)\n",
               n, n, clean, bad);
        fflush(stdout);
        free(sh);
        free(dims);
    }
}

/* The slowest family known for the check (work ~ n log^2 n): sticks along each of 3 dims of
 * a cube of side 3k, woven so that none meet (a stick along dim j sits at residue j mod 3
 * in the other two dims). No dim separates them, and they are whole boxes. */
static void bench_overlap_sticks(void)
{
    const uint64_t k = 160, side = 3 * k;
    size_t n = 3 * k * k;
    st_mshard *sh = calloc(n, sizeof *sh);
    uint64_t *dims = calloc(n * 6, sizeof *dims);
    st_mtensor t = {.name = "sticks", .ndim = 3, .shape = {side, side, side}, .shards = sh,
                    .nshards = n};
    size_t i = 0;
    for (int j = 0; j < 3; j++)
        for (uint64_t a = 0; a < k; a++)
            for (uint64_t b = 0; b < k; b++, i++) {
                uint64_t *off = dims + i * 6, *len = off + 3, v[2] = {a, b};
                for (int d = 0, u = 0; d < 3; d++) {
                    off[d] = d == j ? 0 : 3 * v[u++] + (uint64_t)j;
                    len[d] = d == j ? side : 1;
                }
                sh[i] = (st_mshard){off, len, 0, side, 0, {0}, 0};
            }
    printf("overlap check, %zu sticks woven along 3 dims: %.3f s\n", n, time_overlap(&t, 0));
    free(sh);
    free(dims);
}

static void bench_overlap(void)
{
    bench_overlap_grid();
    bench_overlap_issue();
    bench_overlap_sticks();
}

/* The rank views of a layout: entries with geometry only (data NULL). */
static st_rank_view *views_of(const synth_model *m, const synth_ranks *rs, st_entry **store)
{
    size_t total = 0;
    for (int r = 0; r < rs->nranks; r++)
        total += (size_t)rs->nshards[r];
    st_entry *e = calloc(total + 1, sizeof *e);
    st_rank_view *v = calloc((size_t)rs->nranks, sizeof *v);
    size_t k = 0;
    for (int r = 0; r < rs->nranks; r++) {
        v[r].sh = e + k;
        v[r].nsh = (size_t)rs->nshards[r];
        for (int i = 0; i < rs->nshards[r]; i++, k++) {
            const synth_shard *s = &rs->shards[r][i];
            const synth_tensor *t = &m->t[s->tensor];
            st_entry *x = &e[k];
            x->name = t->name;
            x->dtype = t->dtype;
            x->ndim = t->ndim;
            for (int d = 0; d < t->ndim; d++) {
                x->shape[d] = t->shape[d];
                x->off[d] = s->off[d];
                x->len[d] = s->len[d];
            }
            x->fs = s->fs;
            x->fe = s->fe;
            x->bytes = (s->fe - s->fs) * strata_dtype_size(t->dtype);
        }
    }
    *store = e;
    return v;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "overlap") == 0) { /* only the crafted overlap sets */
        bench_overlap();
        return 0;
    }
    int max_ranks = argc > 1 ? atoi(argv[1]) : 4096;
    synth_model m;
    /* 20 layers: 4 * (3 + 12 * 20) = 972 tensors; hidden ~4k: about a 4B-parameter model */
    if (synth_model_build_layers(&m, 60000, 20))
        return 1;
    printf("bench plan: %d tensors (hidden %llu, ffn %llu, vocab %llu, %d layers), save "
           "layout tp=8,pp=8,dp=N/64,zero=1, load layout tp=4,pp=4,dp=N/16,zero=1; medians "
           "of %d\n",
           m.ntensors, (unsigned long long)m.hidden, (unsigned long long)m.ffn,
           (unsigned long long)m.vocab, m.layers, REPS);
    printf("%6s %9s %9s %10s %9s %9s %9s %10s %12s\n", "ranks", "local", "shards", "plan_s",
           "encode_s", "decode_s", "B/shard", "meta_MB", "loadplan_ms");
    double prev_plan = 0, prev_load = 0;
    int prev_n = 0, ok = 1;
    for (int n = 512; n <= max_ranks; n *= 2) {
        layout ls = {8, 8, n / 64, 1}, ll = {4, 4, n / 16, 1};
        synth_ranks rs = {0}, rl = {0};
        if (synth_layout(&rs, &m, &ls) || synth_layout(&rl, &m, &ll))
            return 1;
        st_entry *es, *el;
        st_rank_view *vs = views_of(&m, &rs, &es), *vl = views_of(&m, &rl, &el);
        size_t local = 0;
        for (int r = 0; r < n; r++)
            local += vs[r].nsh;
        double tp[REPS], te[REPS], td[REPS], tl[REPS];
        size_t shards = 0, mlen = 0;
        for (int k = 0; k < REPS; k++) {
            st_save_plan sp;
            double t0 = st_now();
            if (st_plan_save(&sp, vs, n, 4u << 20, 1)) {
                fprintf(stderr, "plan failed: %s\n", strata_error_last());
                return 1;
            }
            double t1 = st_now();
            for (size_t i = 0; i < sp.meta->ntensors; i++) /* checksums: any values */
                for (size_t j = 0; j < sp.meta->tensors[i].nshards; j++) {
                    st_extent *x = &sp.meta->tensors[i].shards[j].ext;
                    memset(x->sums, 0x5c, st_nchunks(x->bytes, sp.meta->chunk) * 8);
                }
            unsigned char *buf;
            st_meta_encode(sp.meta, &buf, &mlen);
            double t2 = st_now();
            st_meta *back;
            if (st_meta_decode(&back, buf, mlen)) {
                fprintf(stderr, "decode failed: %s\n", strata_error_last());
                return 1;
            }
            double t3 = st_now();
            st_io_plan lp;
            if (st_plan_load(&lp, back, vl, 1, 16u << 20)) { /* rank 0 of the other layout */
                fprintf(stderr, "load plan failed: %s\n", strata_error_last());
                return 1;
            }
            double t4 = st_now();
            shards = 0;
            for (size_t i = 0; i < back->ntensors; i++)
                shards += back->tensors[i].nshards;
            tp[k] = t1 - t0;
            te[k] = t2 - t1;
            td[k] = t3 - t2;
            tl[k] = t4 - t3;
            st_io_plan_free(&lp);
            st_meta_free(back);
            free(buf);
            st_save_plan_free(&sp);
        }
        double p = median(tp), e = median(te), d = median(td), l = median(tl);
        printf("%6d %9zu %9zu %10.3f %9.3f %9.3f %9.1f %10.2f %12.2f\n", n, local, shards, p, e,
               d, (double)mlen / (double)shards, (double)mlen / 1e6, l * 1e3);
        if (prev_n) /* n log n from prev_n to n: factor 2 * log(n) / log(prev) */
            printf("       growth x%.2f plan, x%.2f load plan (n log n allows x%.2f)\n",
                   p / prev_plan, l / prev_load, 2.0 * __builtin_log(n) / __builtin_log(prev_n));
        if (n == 4096)
            ok = p <= 1.0 && (double)mlen / (double)shards <= 64.0 && l <= 0.050;
        prev_plan = p;
        prev_load = l;
        prev_n = n;
        free(es);
        free(el);
        free(vs);
        free(vl);
        synth_ranks_free(&rs);
        synth_ranks_free(&rl);
    }
    bench_overlap();
    if (max_ranks >= 4096)
        printf("goals at 4096 ranks (plan <= 1 s, <= 64 B/shard, load plan <= 50 ms): %s\n",
               ok ? "met" : "NOT met");
    synth_model_free(&m);
    return 0;
}
