/* bench_incr.c - incremental saves (strata_save_opts.base) against full ones, for
 * `make bench`: a LoRA-style state (a frozen base of --base-mb, adapters of --adapter-mb and
 * their two AdamW moments) saved asynchronously and synced (time to durable: start to
 * strata_wait_durable), full and incremental, and a dense state (every tensor changes) in
 * both modes. Bytes written per save are taken from the data files on disk (data-*.bin,
 * not the ref-*.bin links). Prints medians of --runs saves of each kind and writes them as
 * markdown to --out (default stdout only).
 * Usage: bench_incr --dir D [--base-mb 1024] [--adapter-mb 10] [--dense-mb 256] [--runs 5]
 *                   [--out FILE] */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "strata.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Bytes of the data files a save wrote (data-*.bin) under path. */
static uint64_t written(const char *path)
{
    DIR *d = opendir(path);
    uint64_t n = 0;
    struct dirent *e;
    char p[4400];
    while (d && (e = readdir(d))) {
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        if (!strncmp(e->d_name, "data-", 5) && stat(p, &st) == 0)
            n += (uint64_t)st.st_size;
    }
    if (d)
        closedir(d);
    return n;
}

static void rmrf(const char *path)
{
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0)
        fprintf(stderr, "bench_incr: %s failed\n", cmd);
}

typedef struct {
    int n;
    float **t;
    uint64_t *elems;
    const char **names;
    strata_state *st;
} state;

static void state_add(state *s, const char *name, uint64_t bytes)
{
    s->t = realloc(s->t, (size_t)(s->n + 1) * sizeof *s->t);
    s->elems = realloc(s->elems, (size_t)(s->n + 1) * sizeof *s->elems);
    s->names = realloc(s->names, (size_t)(s->n + 1) * sizeof *s->names);
    uint64_t n = bytes / 4;
    float *p = malloc(n * 4);
    for (uint64_t i = 0; i < n; i++)
        p[i] = (float)(i % 1000) * 0.5f;
    s->t[s->n] = p;
    s->elems[s->n] = n;
    s->names[s->n] = strdup(name);
    uint64_t shape[1] = {n};
    strata_shard sh = {.name = s->names[s->n], .dtype = STRATA_F32, .ndim = 1,
                       .global_shape = shape, .data = p};
    if (strata_state_add_shard(s->st, &sh)) {
        fprintf(stderr, "bench_incr: %s\n", strata_error_last());
        exit(1);
    }
    s->n++;
}

/* The training step: tensors [from, n) change (a value every 64 elements). */
static void step(state *s, int from, int k)
{
    for (int i = from; i < s->n; i++)
        for (uint64_t j = (uint64_t)k % 64; j < s->elems[i]; j += 64)
            s->t[i][j] += 1.0f;
}

/* One save of s to dir/name (base: NULL for a full one); returns seconds to durable. */
static double save(state *s, const char *dir, const char *name, const char *base,
                   strata_saver *sv, uint64_t *bytes)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = base || getenv("BENCH_INCR_FLAG") ? STRATA_SAVE_INCREMENTAL : 0;
    o.base = base;
    const char *u = path;
    double t0 = now();
    strata_handle *h;
    int rc = strata_save_start(&h, sv, &u, 1, &s->st, 1, &o);
    if (!rc) {
        rc = strata_wait_durable(NULL, h);
        strata_handle_free(h);
    }
    double t = now() - t0;
    if (rc) {
        fprintf(stderr, "bench_incr: saving %s: %s\n", path, strata_error_last());
        exit(1);
    }
    *bytes = written(path);
    return t;
}

/* runs x (a step, then a full save and an incremental one naming the previous
 * incremental save as its base), alternated so that both see the same machine; the first
 * incremental save (full, with STRATA_SAVE_INCREMENTAL, the chain's start) is not counted.
 * Each base is removed once used (retention keeping 1): its bytes stay linked. */
static void series(state *s, int from, const char *dir, strata_saver *sv, int runs,
                   double med_t[2], double med_b[2])
{
    double *t[2], *b[2];
    for (int m = 0; m < 2; m++) {
        t[m] = calloc((size_t)runs, sizeof *t[m]);
        b[m] = calloc((size_t)runs, sizeof *b[m]);
    }
    char name[64], prev[64], old[4200];
    uint64_t bytes;
    if (strlen(dir) > 4000)
        exit(2);
    rmrf(dir);
    mkdir(dir, 0755);
    snprintf(prev, sizeof prev, "i-0");
    setenv("BENCH_INCR_FLAG", "1", 1);
    save(s, dir, prev, NULL, sv, &bytes);
    for (int r = 0; r < runs; r++) {
        step(s, from, r + 1);
        unsetenv("BENCH_INCR_FLAG"); /* the full save: as without incremental saves */
        snprintf(name, sizeof name, "f-%d", r + 1);
        t[0][r] = save(s, dir, name, NULL, sv, &bytes);
        b[0][r] = (double)bytes;
        snprintf(old, sizeof old, "%s/%s", dir, name);
        rmrf(old);
        setenv("BENCH_INCR_FLAG", "1", 1);
        snprintf(name, sizeof name, "i-%d", r + 1);
        t[1][r] = save(s, dir, name, prev, sv, &bytes);
        b[1][r] = (double)bytes;
        snprintf(old, sizeof old, "%s/%s", dir, prev);
        rmrf(old);
        snprintf(prev, sizeof prev, "%s", name);
    }
    unsetenv("BENCH_INCR_FLAG");
    for (int m = 0; m < 2; m++) {
        med_t[m] = median(t[m], runs);
        med_b[m] = median(b[m], runs);
        free(t[m]);
        free(b[m]);
    }
    rmrf(dir);
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *out = NULL;
    uint64_t base_mb = 1024, adapter_mb = 10, dense_mb = 256;
    int runs = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--dir"))
            dir = argv[i + 1];
        else if (!strcmp(argv[i], "--base-mb"))
            base_mb = strtoull(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--adapter-mb"))
            adapter_mb = strtoull(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--dense-mb"))
            dense_mb = strtoull(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--runs"))
            runs = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--out"))
            out = argv[i + 1];
    }
    if (!dir || runs < 1) {
        fprintf(stderr, "usage: bench_incr --dir D [--base-mb N] [--adapter-mb N] "
                        "[--dense-mb N] [--runs N] [--out FILE]\n");
        return 2;
    }
    strata_saver *sv;
    if (strata_saver_new(&sv, NULL, NULL)) {
        fprintf(stderr, "bench_incr: %s\n", strata_error_last());
        return 1;
    }
    char d[4096];
    snprintf(d, sizeof d, "%s/bench-incr", dir);
    /* LoRA: the frozen base as 16 tensors (layers), adapters and their two moments */
    state lora = {0};
    strata_state_new(&lora.st);
    for (int i = 0; i < 16; i++) {
        char n[64];
        snprintf(n, sizeof n, "base.layers.%d.weight", i);
        state_add(&lora, n, (base_mb << 20) / 16);
    }
    const char *kinds[3] = {"lora", "exp_avg", "exp_avg_sq"};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 16; i++) {
            char n[64];
            snprintf(n, sizeof n, "%s.layers.%d", kinds[k], i);
            state_add(&lora, n, (adapter_mb << 20) / 16);
        }
    double lt[2], lb[2];
    series(&lora, 16, d, sv, runs, lt, lb);
    /* dense: every tensor changes */
    state dense = {0};
    strata_state_new(&dense.st);
    for (int i = 0; i < 16; i++) {
        char n[64];
        snprintf(n, sizeof n, "dense.%d", i);
        state_add(&dense, n, (dense_mb << 20) / 16);
    }
    double dt[2], db[2];
    series(&dense, 0, d, sv, runs, dt, db);
    char report[4096];
    snprintf(report, sizeof report,
             "| state | mode | bytes written per save (median) | time to durable (median) |\n"
             "|---|---|---|---|\n"
             "| LoRA: %llu MiB frozen + 3 x %llu MiB | full | %.1f MiB | %.3f s |\n"
             "| | incremental | %.2f MiB (%.2f %% of full) | %.3f s (%.1f %% of full) |\n"
             "| dense: %llu MiB, all changed | full | %.1f MiB | %.3f s |\n"
             "| | incremental | %.1f MiB | %.3f s (%+.1f %% vs full) |\n",
             (unsigned long long)base_mb, (unsigned long long)adapter_mb, lb[0] / 1048576,
             lt[0], lb[1] / 1048576, 100 * lb[1] / lb[0], lt[1], 100 * lt[1] / lt[0],
             (unsigned long long)dense_mb, db[0] / 1048576, dt[0], db[1] / 1048576, dt[1],
             100 * (dt[1] - dt[0]) / dt[0]);
    printf("bench_incr: medians of %d saves each, asynchronous, synced, one process\n%s",
           runs, report);
    if (out) {
        FILE *f = fopen(out, "w");
        if (f) {
            fprintf(f, "# Incremental saves (make bench: bench/bench_incr.c)\n\n"
                       "Medians of %d saves of each kind (strata_save_start + "
                       "strata_wait_durable, synced to disk, one process); bytes written are "
                       "the sizes of the data files each save wrote (data-*.bin), from the "
                       "disk. Full and incremental saves alternate after each training step; each "
                       "incremental save names the previous incremental one as its base, which "
                       "is then removed (retention keeping 1). The machine: 2 cores shared "
                       "with other jobs, so times are noisy.\n\n%s",
                    runs, report);
            fclose(f);
        }
    }
    strata_saver_free(sv);
    return 0;
}
