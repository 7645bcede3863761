/* bench_incr.c - incremental saves (strata_save_opts.base) against full ones, for
 * `make bench` (or `make bench-incr`): a LoRA-style state (a frozen base of --base-mb,
 * adapters of --adapter-mb and their two AdamW moments) saved asynchronously and synced
 * (time to durable: start to strata_wait_durable) in three modes - full, incremental with
 * the frozen base found equal by hashing, and incremental with the frozen base marked
 * STRATA_SHARD_UNCHANGED (not read) - and a dense state (every tensor changes) full and
 * incremental. Bytes written per save are taken from the files on disk: the data files
 * (data-*.bin, not the ref-*.bin links) and the rest (metadata.bin, COMMIT). Prints medians
 * of --runs saves of each kind, the modes alternating after each training step, and the
 * median of the per-step ratios to the full save of that step; writes them as markdown to
 * --out (default stdout only).
 * Usage: bench_incr --dir D [--base-mb 1024] [--adapter-mb 10] [--dense-mb 256] [--runs 5]
 *                   [--out FILE] */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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

/* Bytes of the files a save wrote under path: *data gets the data files' (data-*.bin),
 * *meta the rest but the links (metadata.bin, COMMIT); ref-*.bin are the base's. */
static void written(const char *path, uint64_t *data, uint64_t *meta)
{
    DIR *d = opendir(path);
    struct dirent *e;
    char p[4400];
    *data = *meta = 0;
    while (d && (e = readdir(d))) {
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        if (e->d_name[0] == '.' || !strncmp(e->d_name, "ref-", 4) || stat(p, &st) != 0)
            continue;
        *(strncmp(e->d_name, "data-", 5) ? meta : data) += (uint64_t)st.st_size;
    }
    if (d)
        closedir(d);
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
    strata_state *marked; /* the same buffers, the first `frozen` marked unchanged */
    int frozen;
} state;

static void state_add(state *s, const char *name, uint64_t bytes, int frozen)
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
    int rc = strata_state_add_shard(s->st, &sh);
    sh.flags = frozen ? STRATA_SHARD_UNCHANGED : 0;
    if (rc || strata_state_add_shard(s->marked, &sh)) {
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

/* One save of st to dir/name (base: NULL for a full one; flag: STRATA_SAVE_INCREMENTAL or
 * 0); returns seconds to durable, and the bytes of the files it wrote. */
static double save(strata_state *st, const char *dir, const char *name, const char *base,
                   unsigned flag, strata_saver *sv, uint64_t *data, uint64_t *meta)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = flag;
    o.base = base;
    const char *u = path;
    double t0 = now();
    strata_handle *h;
    int rc = strata_save_start(&h, sv, &u, 1, &st, 1, &o);
    if (!rc) {
        rc = strata_wait_durable(NULL, h);
        strata_handle_free(h);
    }
    double t = now() - t0;
    if (rc) {
        fprintf(stderr, "bench_incr: saving %s: %s\n", path, strata_error_last());
        exit(1);
    }
    written(path, data, meta);
    return t;
}

#define MODES 3 /* full, incremental (hashed), incremental (marked) */

typedef struct {
    double t, data, meta, rt, rb; /* medians: seconds, bytes, ratio of time and bytes to full */
    double first; /* the first counted save's seconds (an incremental one: the first to read
                     and check its base's files, which later ones remember) */
} result;

/* runs x (a step, then a save in each of nmodes modes: a full one, then incremental ones,
 * each naming the previous save of its own chain as its base - mode 2 from the marked
 * state), alternated so that all see the same machine (the order rotating from step to
 * step, and the removals synced outside the timed saves); each chain's first save (full,
 * with STRATA_SAVE_INCREMENTAL: the chain's start) is not counted. Each base is removed
 * once used (retention keeping 1): its bytes stay linked. */
static void series(state *s, int from, const char *dir, strata_saver *sv, int runs,
                   int nmodes, result *res)
{
    double *v[MODES][5];
    for (int m = 0; m < nmodes; m++)
        for (int k = 0; k < 5; k++)
            v[m][k] = calloc((size_t)runs, sizeof(double));
    char name[64], prev[MODES][64], old[4200];
    uint64_t data, meta;
    if (strlen(dir) > 4000)
        exit(2);
    rmrf(dir);
    mkdir(dir, 0755);
    for (int m = 1; m < nmodes; m++) {
        snprintf(prev[m], sizeof prev[m], "c%d-0", m);
        save(s->st, dir, prev[m], NULL, STRATA_SAVE_INCREMENTAL, sv, &data, &meta);
    }
    for (int r = 0; r < runs; r++) {
        step(s, from, r + 1);
        for (int q = 0; q < nmodes; q++) {
            int m = (q + r) % nmodes; /* each mode first, second, ... in turn */
            snprintf(name, sizeof name, "c%d-%d", m, r + 1);
            strata_state *st = m == 2 ? s->marked : s->st;
            v[m][0][r] = save(st, dir, name, m ? prev[m] : NULL, m ? STRATA_SAVE_INCREMENTAL : 0,
                              sv, &data, &meta);
            v[m][1][r] = (double)data;
            v[m][2][r] = (double)meta;
            snprintf(old, sizeof old, "%s/%s", dir, m ? prev[m] : name);
            rmrf(old);
            sync(); /* the removal's journal commit: not in the next save's fsyncs */
            if (m)
                snprintf(prev[m], sizeof prev[m], "%s", name);
        }
        for (int m = 0; m < nmodes; m++) {
            v[m][3][r] = v[m][0][r] / v[0][0][r];
            v[m][4][r] = (v[m][1][r] + v[m][2][r]) / (v[0][1][r] + v[0][2][r]);
        }
    }
    for (int m = 0; m < nmodes; m++) {
        double first = v[m][0][0];
        res[m] = (result){median(v[m][0], runs), median(v[m][1], runs), median(v[m][2], runs),
                          median(v[m][3], runs), median(v[m][4], runs), first};
        for (int k = 0; k < 5; k++)
            free(v[m][k]);
    }
    rmrf(dir);
}

static void row(char *out, size_t cap, const char *state, const char *mode, const result *r,
                int ratios)
{
    size_t n = strlen(out);
    snprintf(out + n, cap - n, "| %s | %s | %.2f MiB + %.1f KiB | %.3f s |", state, mode,
             r->data / 1048576, r->meta / 1024, r->t);
    n = strlen(out);
    if (ratios)
        snprintf(out + n, cap - n, " %.2f %% | %.1f %% |\n", 100 * r->rb, 100 * r->rt);
    else
        snprintf(out + n, cap - n, " | |\n");
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
    strata_state_new(&lora.marked);
    for (int i = 0; i < 16; i++) {
        char n[64];
        snprintf(n, sizeof n, "base.layers.%d.weight", i);
        state_add(&lora, n, (base_mb << 20) / 16, 1);
    }
    const char *kinds[3] = {"lora", "exp_avg", "exp_avg_sq"};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 16; i++) {
            char n[64];
            snprintf(n, sizeof n, "%s.layers.%d", kinds[k], i);
            state_add(&lora, n, (adapter_mb << 20) / 16, 0);
        }
    result lr[MODES], dr[MODES];
    series(&lora, 16, d, sv, runs, 3, lr);
    /* dense: every tensor changes */
    state dense = {0};
    strata_state_new(&dense.st);
    strata_state_new(&dense.marked);
    for (int i = 0; i < 16; i++) {
        char n[64];
        snprintf(n, sizeof n, "dense.%d", i);
        state_add(&dense, n, (dense_mb << 20) / 16, 0);
    }
    series(&dense, 0, d, sv, runs, 2, dr);
    char report[8192] = "", what[128];
    snprintf(report, sizeof report,
             "| state | mode | written per save: data + metadata (median) | time to durable "
             "(median) | bytes / full (median of per-step ratios) | time / full (median of "
             "per-step ratios) |\n|---|---|---|---|---|---|\n");
    snprintf(what, sizeof what, "LoRA: %llu MiB frozen + 3 x %llu MiB changed",
             (unsigned long long)base_mb, (unsigned long long)adapter_mb);
    row(report, sizeof report, what, "full", &lr[0], 0);
    row(report, sizeof report, "", "incremental, frozen base hashed", &lr[1], 1);
    row(report, sizeof report, "", "incremental, frozen base marked", &lr[2], 1);
    snprintf(what, sizeof what, "dense: %llu MiB, all changed", (unsigned long long)dense_mb);
    row(report, sizeof report, what, "full", &dr[0], 0);
    row(report, sizeof report, "", "incremental", &dr[1], 1);
    double floor = 3.0 * (double)(adapter_mb << 20);
    char firsts[512];
    snprintf(firsts, sizeof firsts, "First counted save of each chain (an incremental one reads "
             "and checks its base's files once per process): LoRA full %.3f s, hashed %.3f s, "
             "marked %.3f s; dense full %.3f s, incremental %.3f s.\n", lr[0].first,
             lr[1].first, lr[2].first, dr[0].first, dr[1].first);
    printf("bench_incr: medians of %d saves each, asynchronous, synced, one process\n%s"
           "LoRA: the changed bytes are %.2f %% of the full save's data\n%s",
           runs, report, 100 * floor / lr[0].data, firsts);
    if (out) {
        FILE *f = fopen(out, "w");
        if (f) {
            fprintf(f, "# Incremental saves (make bench-incr: bench/bench_incr.c)\n\n"
                       "Medians of %d saves of each kind (strata_save_start + "
                       "strata_wait_durable, synced to disk, one process); bytes written are "
                       "the sizes of the files each save wrote, from the disk: the data files "
                       "(data-*.bin) + metadata.bin and COMMIT (the ref-*.bin links are the "
                       "base's). After each training step the modes save in turn (the order "
                       "rotating from step to step; removals synced between saves); each "
                       "incremental chain names its own previous save as its base, which is "
                       "then removed (retention keeping 1). The ratios are the medians of each "
                       "step's ratio to that step's full save. The machine: 2 cores shared "
                       "with other jobs, so times are noisy.\n\n%s\n"
                       "The LoRA state's changed bytes (adapters + two moments) are %.2f %% of "
                       "its full save's: no incremental save of it can write less without "
                       "compressing.\n\n%s",
                    runs, report, 100 * floor / lr[0].data, firsts);
            fclose(f);
        }
    }
    strata_saver_free(sv);
    return 0;
}
