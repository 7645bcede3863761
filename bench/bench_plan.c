/* bench_plan.c - planning at scale, in one process: the coordinator of a distributed save
 * of 4,096 to 131,072 simulated ranks of a 972-tensor GPT-style model laid out as tp=8,
 * pp=8, dp=N/64 with ZeRO flat optimizer shards, registered as Megatron registers them (one
 * main copy of each piece, the others STRATA_SHARD_REPLICA). Its input is what rank 0 of a
 * save holds: every rank's local plan encoded as the save sends it (marked copies as refs),
 * gathered into one buffer and decoded. Times the decoding and the global save plan
 * (medians of 5) and measures the coordinator's memory - resident growth from before the
 * gather to the peak of the plan (VmHWM, reset before), over the registrations - then
 * encodes and decodes the metadata and times the load plan of one rank of another layout
 * (tp=4, pp=4, dp=N/16, zero=1). Goals: 131,072 ranks decoded and planned in <= 2 s with
 * peak RSS <= 2 GB, <= 500 bytes of coordinator memory per registration, <= 64 metadata
 * bytes per shard, a rank's load plan <= 50 ms at every size, growth no faster than
 * n log n. Per size, too, the bytes the coordinator would gather with and without refs
 * and node leaders (BENCH_PLAN_NO_GATHER=1 skips them). Then a mixture-of-experts tensor of
 * 4,096 pieces (planner work counted), and the overlap check on crafted shard sets (only
 * those: `bench_plan overlap`; BENCH_PLAN_TABLE_ONLY=1 skips both).
 * Usage: bench_plan [max_ranks [min_ranks]]. */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/cli/synth.h"
#include "core/util.h"
#include "engine/dist.h"
#include "meta/meta.h"
#include "plan/plan.h"

#define REPS 5

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

/* This thread's CPU time, seconds: what a step costs on a machine others share (wall
 * time counts their turns too). */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
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

/* The coordinator's input for a layout, as a distributed save's rank 0 holds it: every
 * rank's local plan encoded (st_encode_local_plan: marked copies as refs), gathered into
 * one buffer, and decoded (st_decode_all) into views. A load's request (full): rank 0's
 * shards as entries. */
typedef struct {
    st_rank_view *v;
    st_arena arena;
    st_buf all;     /* the gathered local plans */
    st_entry *e;    /* full: the request's entries */
    size_t nlocal, nmain, nref;
    double decode, decode_cpu; /* the gathered local plans' decoding, s (median; CPU) */
} input;

static void input_free(input *in)
{
    free(in->v);
    free(in->e);
    free(in->all.p);
    st_arena_free(&in->arena);
    memset(in, 0, sizeof *in);
}

static st_entry entry_of(const synth_model *m, const synth_shard *s)
{
    const synth_tensor *t = &m->t[s->tensor];
    st_entry x = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .fs = s->fs,
                  .fe = s->fe, .replica = s->replica};
    for (int d = 0; d < t->ndim; d++) {
        x.shape[d] = t->shape[d];
        x.off[d] = s->off[d];
        x.len[d] = s->len[d];
    }
    x.bytes = (s->fe - s->fs) * strata_dtype_size(t->dtype);
    return x;
}

/* Ranks [0, n) of layout l, gathered and decoded: as a save's local plans (how 0), or as
 * a load's requests, every shard in full (st_encode_state: what a distributed load
 * gathers on every rank; how 2); how 1: rank n's request alone, not encoded. */
enum { AS_SAVE, AS_ONE, AS_LOAD };
static int input_build(input *in, const synth_model *m, const layout *l, int n, int how)
{
    memset(in, 0, sizeof *in);
    int r0 = how == AS_ONE ? n : 0;
    n = how == AS_ONE ? n + 1 : n;
    synth_shard *sv = malloc(((size_t)m->ntensors + 1) * sizeof *sv);
    uint64_t *base = malloc(((size_t)m->nparams + 1) * sizeof *base);
    st_entry *e = malloc(((size_t)m->ntensors + 1) * sizeof *e);
    size_t *counts = calloc((size_t)n + 1, sizeof *counts);
    in->v = calloc((size_t)n, sizeof *in->v);
    int rc = sv && base && e && counts && in->v ? 0 : -1;
    for (int r = r0; r < n && !rc; r++) {
        int k = synth_layout_rank(sv, m, l, r, base);
        for (int i = 0; i < k; i++) {
            e[i] = entry_of(m, &sv[i]);
            in->nlocal++;
            in->nref += e[i].replica && e[i].bytes;
        }
        if (how == AS_ONE) {
            in->v[0] = (st_rank_view){.sh = e, .nsh = (size_t)k};
            in->e = e;
            e = NULL;
            break;
        }
        size_t at = in->all.n;
        st_rank_view v = {.sh = e, .nsh = (size_t)k};
        if (how == AS_LOAD)
            st_encode_state(&in->all, &v);
        else
            st_encode_local_plan(&in->all, &v);
        counts[r] = in->all.n - at;
    }
    in->nmain = in->nlocal - in->nref;
    double td[REPS], tc[REPS];
    for (int k = 0; k < REPS && !rc && how != AS_ONE; k++) { /* the last one is kept */
        st_arena_free(&in->arena);
        double t0 = st_now(), c0 = cpu_now();
        if (in->all.oom || st_decode_all(&in->arena, in->all.p, counts, n, -1, NULL, in->v))
            rc = -1;
        td[k] = st_now() - t0;
        tc[k] = cpu_now() - c0;
    }
    in->decode = !rc && how != AS_ONE ? median(td) : 0;
    in->decode_cpu = !rc && how != AS_ONE ? median(tc) : 0;
    free(sv);
    free(base);
    free(e);
    free(counts);
    return rc;
}

/* This process's resident memory now and at its peak since the last reset (bytes). */
static uint64_t status_kb(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    uint64_t v = 0;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, key, strlen(key)) == 0)
            v = strtoull(line + strlen(key), NULL, 10);
    if (f)
        fclose(f);
    return v << 10;
}

static void reset_peak(void)
{
    malloc_trim(0);
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f); /* resets VmHWM to VmRSS */
        fclose(f);
    }
}

typedef struct {
    int n;
    size_t local, mains, refs, shards, mlen, gathered;
    double gdecode, plan, encode, decode, load;
    double cpu_plan, cpu_load; /* CPU: decoding and planning; the slowest own load plan */
    uint64_t rss0, peak, work;
    /* every rank's load plan, as a distributed load makes it on every rank today: the
     * requests gathered (bytes), decoded and planned together (seconds), the growth */
    size_t lgathered, lruns;
    double ldecode, lplan;
    uint64_t lgrowth;
} row;

/* The global load plan of n ranks of layout l over metadata meta, as dist_load.c makes it
 * on every rank: every rank's request gathered, decoded, st_plan_load over all of them.
 * Medians of up to REPS runs (one run when it takes over 5 s). */
static int bench_load_all(const synth_model *m, const st_meta *meta, int n, row *x)
{
    layout ll = {4, 4, n / 16, 1};
    input in;
    reset_peak();
    uint64_t rss0 = status_kb("VmRSS:");
    if (input_build(&in, m, &ll, n, AS_LOAD)) {
        fprintf(stderr, "out of memory building the load layout\n");
        return -1;
    }
    double t[REPS];
    int k = 0;
    while (k < REPS) {
        st_io_plan lp;
        double t0 = st_now();
        if (st_plan_load(&lp, meta, in.v, n, 16u << 20)) {
            fprintf(stderr, "global load plan failed: %s\n", strata_error_last());
            return -1;
        }
        t[k++] = st_now() - t0;
        if (k == 1) {
            x->lgrowth = status_kb("VmHWM:") - rss0;
            x->lruns = lp.nruns;
        }
        st_io_plan_free(&lp);
        if (t[k - 1] > 5.0)
            break;
    }
    if (k == REPS)
        x->lplan = median(t);
    else
        x->lplan = t[k - 1];
    x->lgathered = in.all.n;
    x->ldecode = in.decode;
    input_free(&in);
    return 0;
}

static int bench_size(const synth_model *m, int n, int load_all, row *out)
{
    enum { LTP = 4, LPP = 4 };
    layout ls = {8, 8, n / 64, 1}, ll = {LTP, LPP, n / 16, 1};
    /* the requests of one rank at each tensor- and pipeline-parallel place of the load
     * layout (data-parallel rank 0): a rank's load plan is the slowest of theirs */
    input in, req[LTP * LPP];
    reset_peak();
    uint64_t rss0 = status_kb("VmRSS:");
    if (input_build(&in, m, &ls, n, AS_SAVE))
        return -1;
    for (int i = 0; i < LTP * LPP; i++)
        if (input_build(&req[i], m, &ll, i % LTP + LTP * ll.dp * (i / LTP), AS_ONE))
            return -1;
    double tp[REPS], te[REPS], td[REPS], tl[REPS], cp[REPS], cl[REPS];
    st_meta *keep = NULL;
    row x = {.n = n, .local = in.nlocal, .mains = in.nmain, .refs = in.nref, .rss0 = rss0,
             .gathered = in.all.n, .gdecode = in.decode};
    for (int k = 0; k < REPS; k++) {
        st_save_plan sp;
        double t0 = st_now(), c0 = cpu_now();
        if (st_plan_save(&sp, in.v, n, 4u << 20, 1)) {
            fprintf(stderr, "plan failed: %s\n", strata_error_last());
            return -1;
        }
        double t1 = st_now();
        cp[k] = cpu_now() - c0 + in.decode_cpu;
        if (k == 0) {
            x.peak = status_kb("VmHWM:");
            x.work = st_plan_save_work();
        }
        for (size_t i = 0; i < sp.meta->ntensors; i++) /* checksums: any values */
            for (size_t j = 0; j < sp.meta->tensors[i].nshards; j++) {
                st_extent *e = &sp.meta->tensors[i].shards[j].ext;
                memset(e->sums, 0x5c, st_nchunks(e->bytes, sp.meta->chunk) * 8);
            }
        unsigned char *buf;
        st_meta_encode(sp.meta, &buf, &x.mlen);
        double t2 = st_now();
        st_meta *back;
        if (st_meta_decode(&back, buf, x.mlen)) {
            fprintf(stderr, "decode failed: %s\n", strata_error_last());
            return -1;
        }
        double t3 = st_now();
        tl[k] = cl[k] = 0;
        for (int i = 0; i < LTP * LPP; i++) {
            st_io_plan lp;
            double t5 = st_now(), c5 = cpu_now();
            if (st_plan_load(&lp, back, req[i].v, 1, 16u << 20)) {
                fprintf(stderr, "load plan failed: %s\n", strata_error_last());
                return -1;
            }
            double t6 = st_now(), c6 = cpu_now();
            tl[k] = t6 - t5 > tl[k] ? t6 - t5 : tl[k];
            cl[k] = c6 - c5 > cl[k] ? c6 - c5 : cl[k];
            st_io_plan_free(&lp);
        }
        x.shards = 0;
        for (size_t i = 0; i < back->ntensors; i++)
            x.shards += back->tensors[i].nshards;
        tp[k] = t1 - t0;
        te[k] = t2 - t1;
        td[k] = t3 - t2;
        if (k == REPS - 1)
            keep = back;
        else
            st_meta_free(back);
        free(buf);
        st_save_plan_free(&sp);
    }
    x.plan = median(tp);
    x.encode = median(te);
    x.decode = median(td);
    x.load = median(tl);
    x.cpu_plan = median(cp);
    x.cpu_load = median(cl);
    input_free(&in);
    for (int i = 0; i < LTP * LPP; i++)
        input_free(&req[i]);
    int rc = load_all ? bench_load_all(m, keep, n, &x) : 0;
    st_meta_free(keep);
    *out = x;
    return rc;
}

/* Megatron's mixture-of-experts case: one tensor [512 experts, 256, 128] cut into 4,096
 * pieces (each expert's rows over 8 tensor-parallel ranks) by 4,096 ranks, with 8 data-
 * parallel copies of each (7 marked), planned; then loaded by 4,096 ranks of a layout
 * that cuts it by columns. Planner work counted (st_plan_save_work, st_plan_load_work). */
static void bench_moe(void)
{
    enum { E = 512, TP = 8, DP = 8, RANKS = E * TP * DP };
    static const uint64_t shape[3] = {E, 256, 128};
    st_entry *e = calloc(RANKS, sizeof *e);
    st_rank_view *v = calloc(RANKS, sizeof *v);
    for (int r = 0; r < RANKS; r++) {
        int piece = r % (E * TP), d = r / (E * TP);
        st_entry *x = &e[r];
        *x = (st_entry){.name = "moe.experts.fc1", .dtype = STRATA_BF16, .ndim = 3,
                        .replica = d != 0};
        memcpy(x->shape, shape, sizeof shape);
        x->off[0] = (uint64_t)(piece / TP);
        x->len[0] = 1;
        x->off[1] = (uint64_t)(piece % TP) * (shape[1] / TP);
        x->len[1] = shape[1] / TP;
        x->len[2] = shape[2];
        x->fe = x->len[1] * x->len[2];
        x->bytes = x->fe * 2;
        v[r] = (st_rank_view){.sh = x, .nsh = 1};
    }
    st_save_plan sp;
    double t0 = st_now();
    int rc = st_plan_save(&sp, v, RANKS, 4u << 20, 1);
    double t1 = st_now();
    uint64_t sw = st_plan_save_work();
    if (rc) {
        fprintf(stderr, "moe plan failed: %s\n", strata_error_last());
        free(e), free(v);
        return;
    }
    /* the load: 4,096 ranks, 128-way expert-parallel (4 experts each) by 32-way tensor-
     * parallel (8 rows each) */
    int L = E * TP;
    for (int r = 0; r < L; r++) {
        st_entry *x = &e[r];
        x->replica = 0;
        x->off[0] = (uint64_t)(r / 32) * 4;
        x->len[0] = 4;
        x->off[1] = (uint64_t)(r % 32) * 8;
        x->len[1] = 8;
        x->off[2] = 0;
        x->len[2] = shape[2];
        x->fe = 4 * 8 * shape[2];
        x->bytes = x->fe * 2;
    }
    st_io_plan lp;
    double t2 = st_now();
    rc = st_plan_load(&lp, sp.meta, v, L, 16u << 20);
    double t3 = st_now();
    if (rc)
        fprintf(stderr, "moe load plan failed: %s\n", strata_error_last());
    else
        printf("moe: 1 tensor in %zu pieces from %d registrations: save plan %.3f s, work %llu "
               "(%.1f per registration); load plan of %d ranks (%zu runs) %.3f s, work %llu "
               "(%.1f per request)\n", sp.npieces, RANKS, t1 - t0, (unsigned long long)sw,
               (double)sw / RANKS, L, lp.nruns, t3 - t2,
               (unsigned long long)st_plan_load_work(), (double)st_plan_load_work() / L);
    if (!rc)
        st_io_plan_free(&lp);
    st_save_plan_free(&sp);
    free(e);
    free(v);
}

/* What the coordinator would gather for layout l of n ranks, in bytes: every shard
 * described (st_encode_state, as without marks), the marked copies as refs
 * (st_encode_local_plan, what a save sends), and node leaders of 8 ranks (one tensor-
 * parallel group) each sending its node's distinct descriptions once (plus a byte per
 * holder), without and with refs. */
typedef struct {
    uint64_t full, refs, node_full, node_refs;
} gathered;

static int same_piece(const st_entry *a, const st_entry *b)
{
    if (a->name != b->name || a->fs != b->fs || a->fe != b->fe)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->off[d] != b->off[d] || a->len[d] != b->len[d])
            return 0;
    return 1;
}

static void gather_bytes(const synth_model *m, const layout *l, int n, gathered *g)
{
    enum { NODE = 8 };
    memset(g, 0, sizeof *g);
    synth_shard *sv = malloc(((size_t)m->ntensors + 1) * sizeof *sv);
    uint64_t *base = malloc(((size_t)m->nparams + 1) * sizeof *base);
    st_entry *node = malloc(((size_t)m->ntensors * NODE + 1) * sizeof *node);
    st_entry *uniq = malloc(((size_t)m->ntensors * NODE + 1) * sizeof *uniq);
    for (int r0 = 0; r0 < n; r0 += NODE) {
        size_t nn = 0;
        for (int r = r0; r < r0 + NODE && r < n; r++) {
            int k = synth_layout_rank(sv, m, l, r, base);
            for (int i = 0; i < k; i++)
                node[nn + (size_t)i] = entry_of(m, &sv[i]);
            st_rank_view v = {.sh = node + nn, .nsh = (size_t)k};
            st_buf a = {0}, b = {0};
            st_encode_state(&a, &v);
            st_encode_local_plan(&b, &v);
            g->full += a.n;
            g->refs += b.n;
            free(a.p);
            free(b.p);
            nn += (size_t)k;
        }
        /* the node's distinct pieces (a node holds a few hundred: pairwise is fine here) */
        size_t nu = 0;
        for (size_t i = 0; i < nn; i++) {
            size_t j = 0;
            while (j < nu && !same_piece(&uniq[j], &node[i]))
                j++;
            if (j == nu)
                uniq[nu++] = node[i];
            else if (!node[i].replica)
                uniq[j].replica = 0; /* a main copy among them: the summary's is main */
        }
        st_rank_view v = {.sh = uniq, .nsh = nu};
        st_buf a = {0}, b = {0};
        st_encode_state(&a, &v);
        st_encode_local_plan(&b, &v);
        g->node_full += a.n + nn;
        g->node_refs += b.n + nn;
        free(a.p);
        free(b.p);
    }
    free(sv);
    free(base);
    free(node);
    free(uniq);
}

static double loadavg(void)
{
    double a = 0;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &a) != 1)
            a = 0;
        fclose(f);
    }
    return a;
}

/* The worst over the table's sizes; growth: work per doubling over what n log n allows. */
typedef struct {
    double per, bshd, load, load_cpu, growth;
} worst;

#define MAXOF(a, b) ((b) > (a) ? (b) : (a))

/* Row x of the table (after prev: the growth), and the worst so far in w. */
static void print_row(const row *x, const row *prev, worst *w)
{
    double per = (double)(x->peak - x->rss0) / (double)x->local;
    double bshd = (double)x->mlen / (double)x->shards;
    printf("%6d %8zu %7zu %8zu %7zu %7.3f %7.3f %7.3f %8.1f %7.1f %8.0f %8.0f %6.0f %7.3f "
           "%7.3f %6.1f %7.2f %8.2f %8.2f\n",
           x->n, x->local, x->mains, x->refs, x->shards, x->gdecode, x->plan, x->cpu_plan,
           (double)x->work / (double)x->local, (double)x->gathered / 1e6,
           (double)(x->peak - x->rss0) / 1e6, (double)x->peak / 1e6, per, x->encode, x->decode,
           bshd, (double)x->mlen / 1e6, x->load * 1e3, x->cpu_load * 1e3);
    w->per = MAXOF(w->per, per);
    w->bshd = MAXOF(w->bshd, bshd);
    w->load = MAXOF(w->load, x->load);
    w->load_cpu = MAXOF(w->load_cpu, x->cpu_load);
    if (!prev->n)
        return;
    double nlogn = 2.0 * __builtin_log(x->n) / __builtin_log(prev->n); /* prev -> n */
    printf("       growth x%.2f decode + plan wall, x%.2f CPU, x%.2f work; x%.2f load plan CPU "
           "(n log n allows x%.2f)\n",
           (x->gdecode + x->plan) / (prev->gdecode + prev->plan), x->cpu_plan / prev->cpu_plan,
           (double)x->work / (double)prev->work, x->cpu_load / prev->cpu_load, nlogn);
    w->growth = MAXOF(w->growth, (double)x->work / (double)prev->work / nlogn);
}

/* What a distributed load plans on every rank today (dist_load.c): all ranks' requests
 * (st_plan_load over every view), where the table times one rank's own. It grows with the
 * ranks times the runs per rank, so only small worlds (4,096 ranks need over 23 GB). The
 * last size's row in la. */
static int bench_loads(const synth_model *m, row *la)
{
    for (int n = 128; n <= 512; n *= 2) {
        if (bench_size(m, n, 1, la))
            return -1;
        printf("a distributed load of %d ranks (tp=4,pp=4,dp=%d,zero=1): every rank plans all "
               "%d requests: gathered %.1f MB, decoded %.3f s, planned %.3f s, %zu runs, "
               "growth %.0f MB (one rank's own plan: %.2f ms)\n", n, n / 16, n,
               (double)la->lgathered / 1e6, la->ldecode, la->lplan, la->lruns,
               (double)la->lgrowth / 1e6, la->load * 1e3);
        fflush(stdout);
    }
    return 0;
}

#define MET(c) ((c) ? "met" : "NOT met")

/* The goals, each with its figure and verdict: last, the table's 131,072 ranks; la, the
 * largest distributed load (la->n == 0: not run). */
static void print_goals(const row *last, const worst *w, const row *la)
{
    if (last->n != 131072) {
        printf("goals: not run to 131,072 ranks; load average %.2f\n", loadavg());
        return;
    }
    double t = last->gdecode + last->plan;
    printf("goals at 131,072 ranks: decoded and planned in %.2f s wall, %.2f s CPU (<= 2 s: %s "
           "wall, %s CPU); peak RSS %.0f MB (<= 2 GB: %s); at every size: <= %.0f B of "
           "coordinator memory per registration (<= 500: %s), <= %.1f metadata B per shard "
           "(<= 64: %s), a rank's own load plan <= %.1f ms wall, %.1f ms CPU (<= 50 ms: %s "
           "wall, %s CPU), planner work per doubling <= %.2f of what n log n allows (<= 1: %s)",
           t, last->cpu_plan, MET(t <= 2.0), MET(last->cpu_plan <= 2.0),
           (double)last->peak / 1e6, MET(last->peak <= (2ull << 30)), w->per,
           MET(w->per <= 500), w->bshd, MET(w->bshd <= 64), w->load * 1e3, w->load_cpu * 1e3,
           MET(w->load <= 0.050), MET(w->load_cpu <= 0.050), w->growth, MET(w->growth <= 1.0));
    if (la->n)
        printf("; a distributed load's plan, every rank planning all requests: %.2f s at %d "
               "ranks (<= 50 ms: %s)", la->lplan, la->n, MET(la->lplan <= 0.050));
    printf("; load average %.2f\n", loadavg());
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "overlap") == 0) { /* only the crafted overlap sets */
        bench_overlap();
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "moe") == 0) {
        bench_moe();
        return 0;
    }
    int max_ranks = argc > 1 ? atoi(argv[1]) : 131072;
    int min_ranks = argc > 2 ? atoi(argv[2]) : 4096;
    int gather = !getenv("BENCH_PLAN_NO_GATHER"); /* the hierarchy's figures (slow-ish) */
    int table_only = getenv("BENCH_PLAN_TABLE_ONLY") != NULL;
    synth_model m;
    /* 20 layers: 4 * (3 + 12 * 20) = 972 tensors; hidden ~4k: about a 4B-parameter model */
    if (synth_model_build_layers(&m, 60000, 20))
        return 1;
    printf("bench plan: %d tensors (hidden %llu, ffn %llu, vocab %llu, %d layers), save "
           "layout tp=8,pp=8,dp=N/64,zero=1 (copies marked: refs), load layout "
           "tp=4,pp=4,dp=N/16,zero=1; medians of %d; load average %.2f\n"
           "  local: registrations; gdec_s: decoding the gathered local plans; plan_s: "
           "st_plan_save; cpu_s: the thread's CPU time of both; load_ms, load_cpu: the slowest "
           "of 16 ranks' own load plans (one per tp x pp place); gath_MB: the local plans "
           "gathered; coord_MB: the coordinator's growth (gathered, decoded, planned) at its "
           "peak; B/loc: that per registration; peak_MB: the process's peak\n",
           m.ntensors, (unsigned long long)m.hidden, (unsigned long long)m.ffn,
           (unsigned long long)m.vocab, m.layers, REPS, loadavg());
    printf("%6s %8s %7s %8s %7s %7s %7s %7s %8s %7s %8s %8s %6s %7s %7s %6s %7s %8s %8s\n",
           "ranks", "local", "mains", "refs", "shards", "gdec_s", "plan_s", "cpu_s",
           "work/loc", "gath_MB", "coord_MB", "peak_MB", "B/loc", "enc_s", "dec_s", "B/shd",
           "meta_MB", "load_ms", "load_cpu");
    row prev = {0}, la = {0};
    worst w = {0};
    for (int n = min_ranks; n <= max_ranks; n *= 2) {
        row x;
        if (bench_size(&m, n, 0, &x))
            return 1;
        print_row(&x, &prev, &w);
        if (gather) {
            layout ls = {8, 8, n / 64, 1};
            gathered g;
            gather_bytes(&m, &ls, n, &g);
            printf("       gathered at the coordinator: every shard described %.1f MB; copies "
                   "as refs %.1f MB; node leaders (8 ranks) %.1f MB, with refs %.1f MB\n",
                   (double)g.full / 1e6, (double)g.refs / 1e6, (double)g.node_full / 1e6,
                   (double)g.node_refs / 1e6);
        }
        fflush(stdout);
        prev = x;
    }
    if (!table_only) {
        if (bench_loads(&m, &la))
            return 1;
        bench_moe();
        bench_overlap();
    }
    print_goals(&prev, &w, &la);
    synth_model_free(&m);
    return 0;
}
