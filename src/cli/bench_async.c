/* bench_async.c - `strata bench async`: a training-loop simulator. Each iteration runs a
 * "forward/backward" that reads the whole state (a memory-bandwidth kernel, --passes
 * times) and an "update" that writes it; every k-th iteration checkpoints. Compares, in
 * one run: no checkpoints, a synchronous strata_save, and the lazy strata_save_start on
 * one saver with a pool (started before forward/backward, waited for with
 * strata_wait_snapshot before the update, made durable in the background). One process,
 * one rank. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

static const char HELP[] =
    "usage: strata bench async [--dir D] [--size-mb N] [--iters I] [--every K] [--passes P]\n"
    "                          [--pool-mb M] [--rounds R]\n"
    "\n"
    "A training loop over an N MiB state (default 512) in 16 MiB f32 tensors: forward/\n"
    "backward reads the state P times (default 4), the update writes it once; a checkpoint\n"
    "every K iterations (default 5) into D (default $TMPDIR), I iterations (default 20)\n"
    "per mode. Modes: none, sync (strata_save), async (strata_save_start on one saver with\n"
    "a pool of M MiB, default min(1024, N), allocated once). The modes take turns, R rounds\n"
    "(default 3, each round in another order); for each mode, the medians over the rounds\n"
    "of: the mean iteration time, the overhead over none, and the stall per checkpoint\n"
    "(time the loop was blocked by strata; the last async checkpoint's flush after the loop\n"
    "is shown apart, as the final drain).\n"
    "Last line: stall_ratio=X overhead=Y peak_extra_bytes=Z pool_bytes=P\n"
    "(async stall / sync stall; async overhead over none; the largest peak RSS growth during\n"
    "an async run, pool included).\n";

/* kB of a /proc/self/status field. */
static long long status_kb(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0 && line[n] == ':')
            v = atoll(line + n + 1);
    if (f)
        fclose(f);
    return v;
}

/* Resets the RSS high-water mark (Linux: write 5 to clear_refs). */
static void reset_hwm(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f);
        fclose(f);
    }
}

typedef struct {
    float **t;
    int nt;
    size_t per; /* floats per tensor */
    volatile double sink;
} model;

static void forward_backward(model *m, int passes)
{
    double s = 0;
    for (int p = 0; p < passes; p++)
        for (int i = 0; i < m->nt; i++)
            for (size_t k = 0; k < m->per; k += 16)
                s += m->t[i][k];
    m->sink = s;
}

static void update(model *m, float step)
{
    for (int i = 0; i < m->nt; i++)
        for (size_t k = 0; k < m->per; k++)
            m->t[i][k] += step;
}

typedef struct {
    double iter_s, stall_s, drain_s;
    int ckpts;
} result;

static const char *const mode_names[3] = {"none", "sync", "async"};

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* One mode's run of the loop: mode 0 no checkpoints, 1 strata_save (no saver: straight
 * from the buffers), 2 strata_save_start on sv (its pool). The checkpoints are removed
 * afterwards (the disk stays bounded). */
static int run_mode(model *m, strata_state *st, int mode, strata_saver *sv, const char *base,
                    long long iters, long long every, long long passes, result *res)
{
    strata_handle *pending = NULL;
    double t0 = cli_now(), stall = 0;
    int ck = 0, rc = 0;
    for (long long it = 1; it <= iters && !rc; it++) {
        int checkpoint = mode > 0 && it % every == 0;
        char path[4200];
        snprintf(path, sizeof path, "%s/m%d-%lld", base, mode, it);
        const char *uri = path;
        strata_save_opts o = STRATA_SAVE_OPTS_INIT;
        o.step = (uint64_t)it;
        strata_handle *h = NULL;
        if (checkpoint && mode == 2) { /* lazy: starts now, copies during forward */
            double s0 = cli_now();
            if (pending) { /* the previous one must be durable before it is removed */
                rc = strata_wait_durable(NULL, pending);
                strata_handle_free(pending);
                pending = NULL;
            }
            if (!rc)
                rc = strata_save_start(&h, sv, &uri, 1, &st, 1, &o);
            stall += cli_now() - s0;
        }
        forward_backward(m, (int)passes);
        if (checkpoint && mode == 1) { /* synchronous: the loop waits for the disk */
            double s0 = cli_now();
            rc = strata_save(NULL, NULL, &uri, 1, &st, 1, &o);
            stall += cli_now() - s0;
        }
        if (h) { /* the update may not start before the snapshot is taken */
            double s0 = cli_now();
            rc = strata_wait_snapshot(h);
            stall += cli_now() - s0;
            pending = h;
        }
        update(m, 1.0f);
        ck += checkpoint;
    }
    double total = cli_now() - t0;
    if (pending) { /* after the loop: the last checkpoint drains (not a stall) */
        double s0 = cli_now();
        int r2 = strata_wait_durable(NULL, pending);
        res->drain_s = cli_now() - s0;
        rc = rc ? rc : r2;
        strata_handle_free(pending);
    }
    res->iter_s = total / (double)iters;
    res->stall_s = ck ? stall / ck : 0;
    res->ckpts = ck;
    for (long long it = every; it <= iters; it += every) {
        char path[4200];
        snprintf(path, sizeof path, "%s/m%d-%lld", base, mode, it);
        cli_rm_rf(path);
    }
    return rc;
}

int cmd_bench_async(int argc, char **argv)
{
    const char *dir = NULL;
    long long size_mb = 512, iters = 20, every = 5, passes = 4, pool_mb = -1, rounds = 3;
    for (int i = 2; i < argc; i += 2) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(k, "--help") == 0 || strcmp(k, "-h") == 0)
            return fputs(HELP, stdout), 0;
        long long n = v ? cli_parse_num(v) : -1;
        if (v && strcmp(k, "--dir") == 0)
            dir = v;
        else if (strcmp(k, "--size-mb") == 0 && n >= 16)
            size_mb = n;
        else if (strcmp(k, "--iters") == 0 && n >= 1)
            iters = n;
        else if (strcmp(k, "--every") == 0 && n >= 1)
            every = n;
        else if (strcmp(k, "--passes") == 0 && n >= 1)
            passes = n;
        else if (strcmp(k, "--pool-mb") == 0 && n >= 1)
            pool_mb = n;
        else if (strcmp(k, "--rounds") == 0 && n >= 1 && n <= 15)
            rounds = n;
        else
            return fprintf(stderr, "strata bench async: bad option '%s %s' (see --help)\n", k,
                           v ? v : ""), EXIT_USAGE;
    }
    if (pool_mb < 0)
        pool_mb = size_mb < 1024 ? size_mb : 1024;
    char base[4096];
    const char *tmp = getenv("TMPDIR");
    snprintf(base, sizeof base, "%s/strata-bench-async-XXXXXX", dir ? dir : tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(base))
        return perror("strata bench async: mkdtemp"), EXIT_OPFAIL;

    model m = {0};
    m.per = (16u << 20) / sizeof(float);
    m.nt = (int)(size_mb / 16);
    m.t = calloc((size_t)m.nt, sizeof *m.t);
    strata_state *st;
    strata_state_new(&st);
    for (int i = 0; i < m.nt; i++) {
        m.t[i] = malloc(m.per * sizeof(float));
        for (size_t k = 0; k < m.per; k++)
            m.t[i][k] = (float)(k % 1000) * 0.001f;
        char name[64];
        snprintf(name, sizeof name, "layers.%d.weight", i);
        uint64_t shape[1] = {m.per};
        strata_shard sh = {name, STRATA_F32, 1, shape, NULL, NULL, 0, 0, 0, m.t[i], 0, 0};
        strata_state_add_shard(st, &sh);
    }
    printf("strata bench async: %lld MiB state, %lld iterations per mode and round, a "
           "checkpoint every %lld, forward/backward = %lld reads of the state, pool %lld MiB, "
           "%lld rounds\n",
           size_mb, iters, every, passes, pool_mb, rounds);
    forward_backward(&m, (int)passes); /* warm up: caches, page tables, clocks */
    update(&m, 0.0f);
    enum { MAX_ROUNDS = 15 };
    result res[MAX_ROUNDS][3];
    memset(res, 0, sizeof res);
    long long peak_extra = 0;
    uint64_t pool_bytes = 0;
    strata_pool *pool = NULL; /* allocated once, at the first async run, and reused */
    strata_saver *sv = NULL;  /* the same: one saver, its pool that one */
    int rc = 0;
    for (long long round = 0; round < rounds && !rc; round++)
        for (int turn = 0; turn < 3 && !rc; turn++) {
            int mode = (int)((turn + round) % 3); /* none sync async, sync async none, ... */
            result *r = &res[round][mode];
            reset_hwm();
            long long rss0 = status_kb("VmRSS");
            if (mode == 2 && !pool) {
                if ((rc = strata_pool_new(&pool, (uint64_t)pool_mb << 20)) ||
                    (rc = strata_saver_new(&sv, NULL, pool)))
                    break;
                pool_bytes = strata_pool_bytes(pool);
            } else if (mode == 2) {
                rss0 -= (long long)(pool_bytes >> 10); /* the pool counts as extra */
            }
            rc = run_mode(&m, st, mode, sv, base, iters, every, passes, r);
            if (mode == 2) {
                long long extra = (status_kb("VmHWM") - rss0) * 1024;
                peak_extra = extra > peak_extra ? extra : peak_extra;
            }
            printf("  round %lld: %-5s iter %.1f ms, stall %.1f ms per checkpoint\n", round + 1,
                   mode_names[mode], r->iter_s * 1e3, r->stall_s * 1e3);
            fflush(stdout);
        }
    strata_saver_free(sv);
    strata_pool_free(pool);
    rmdir(base);
    int status = 0;
    if (rc) {
        status = cli_fail("bench async", rc);
    } else {
        result med[3];
        for (int i = 0; i < 3; i++) {
            double it[MAX_ROUNDS], sl[MAX_ROUNDS], dr[MAX_ROUNDS];
            for (long long k = 0; k < rounds; k++)
                it[k] = res[k][i].iter_s, sl[k] = res[k][i].stall_s, dr[k] = res[k][i].drain_s;
            med[i] = (result){median(it, (int)rounds), median(sl, (int)rounds),
                              median(dr, (int)rounds), res[0][i].ckpts};
        }
        printf("\n  medians of %lld rounds\n  %-6s %12s %10s %16s %18s\n", rounds, "mode",
               "iter_ms", "overhead", "stall_ms/ckpt", "final_drain_ms");
        for (int i = 0; i < 3; i++)
            printf("  %-6s %12.1f %9.1f%% %16.1f %18.1f\n", mode_names[i], med[i].iter_s * 1e3,
                   100.0 * (med[i].iter_s / med[0].iter_s - 1.0), med[i].stall_s * 1e3,
                   med[i].drain_s * 1e3);
        printf("stall_ratio=%.3f overhead=%.3f peak_extra_bytes=%lld pool_bytes=%llu\n",
               med[1].stall_s > 0 ? med[2].stall_s / med[1].stall_s : 0.0,
               med[2].iter_s / med[0].iter_s - 1.0, peak_extra, (unsigned long long)pool_bytes);
    }
    for (int i = 0; i < m.nt; i++)
        free(m.t[i]);
    free(m.t);
    strata_state_free(st);
    return status;
}
