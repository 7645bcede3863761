/* bench_cast.c - a load with STRATA_LOAD_CAST against a plain one (make bench): saves one f32
 * tensor of --size-mb MiB (default 1024, saved by two ranks as row halves), then loads it
 * --runs times (default 3) each way, alternating, each load in a child process of its own:
 * into an f32 buffer (no conversion), and into a bf16 buffer with STRATA_LOAD_CAST. Prints
 * the median load time and each way's largest peak RSS (ru_maxrss of the child: the load
 * alone), and checks the loaded values. The page cache is dropped before each load when
 * allowed (root); loads read with O_DIRECT unless --no-direct (then the cache is warm after
 * the first). Uses only the public API. Prints, per way:
 *   f32 -> f32: 1.07 GB in 0.80 s median of 3 (1.34 GB/s), peak RSS 1040 MiB, ok=1 */
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "strata.h"

#define COLS 4099u

/* Element i: an integer below 256, exact in bf16, so both loads can be checked exactly
 * (the rounding itself is test_cast's). */
static float value(uint64_t i) { return (float)((uint32_t)(i * 2654435761u) >> 24); }

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static int fail(const char *what, int rc)
{
    fprintf(stderr, "bench_cast: %s: %s (%s)\n", what, strata_error_last(),
            strata_error_name(rc));
    return 1;
}

static int save(const char *ck, uint64_t rows)
{
    float *big = malloc(rows * COLS * sizeof *big);
    if (!big)
        return fprintf(stderr, "bench_cast: out of memory\n"), 1;
    for (uint64_t i = 0; i < rows * COLS; i++)
        big[i] = value(i);
    uint64_t shape[2] = {rows, COLS}, top[2] = {0, 0}, bot[2] = {rows / 2, 0};
    uint64_t lt[2] = {rows / 2, COLS}, lb[2] = {rows - rows / 2, COLS};
    strata_state *st[2] = {NULL, NULL};
    int rc = strata_state_new(&st[0]);
    if (!rc)
        rc = strata_state_new(&st[1]);
    if (!rc)
        rc = strata_state_add_shard(st[0], &(strata_shard){"w", STRATA_F32, 2, shape, top, lt,
                                                           .data = big});
    if (!rc)
        rc = strata_state_add_shard(st[1], &(strata_shard){"w", STRATA_F32, 2, shape, bot, lb,
                                                           .data = big + rows / 2 * COLS});
    if (!rc)
        rc = strata_save(NULL, NULL, &ck, 1, st, 2, NULL);
    strata_state_free(st[0]);
    strata_state_free(st[1]);
    free(big);
    return rc ? fail("save", rc) : 0;
}

/* The child: loads the whole tensor as dt (f32, or bf16 cast), checks it, sends the stats. */
static int load(const char *ck, uint64_t rows, strata_dtype dt, int direct, int out)
{
    size_t esz = strata_dtype_size(dt);
    unsigned char *buf = malloc(rows * COLS * esz);
    uint64_t shape[2] = {rows, COLS};
    strata_state *st = NULL;
    int rc = buf ? strata_state_new(&st) : STRATA_ENOMEM;
    if (!rc)
        rc = strata_state_add_shard(st, &(strata_shard){"w", dt, 2, shape, .data = buf});
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.flags = (dt != STRATA_F32 ? STRATA_LOAD_CAST : 0) | (direct ? 0 : STRATA_LOAD_NO_DIRECT);
    strata_stats s = STRATA_STATS_INIT;
    if (!rc)
        rc = strata_load(&s, NULL, &ck, 1, &st, 1, &lo);
    if (rc)
        return fail("load", rc);
    int ok = 1;
    for (uint64_t i = 0; ok && i < rows * COLS; i++) {
        float f = value(i), g;
        if (dt == STRATA_F32) {
            memcpy(&g, buf + 4 * i, 4);
        } else {
            uint32_t u = 0;
            memcpy((char *)&u + 2, buf + 2 * i, 2); /* bf16: the high half (little-endian) */
            memcpy(&g, &u, 4);
        }
        ok = f == g; /* integers below 256: exact in bf16 */
    }
    s.tier = ok;
    strata_state_free(st);
    free(buf);
    return write(out, &s, sizeof s) == (ssize_t)sizeof s ? 0 : 1;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const char *dir = "build/bench";
    long long size_mb = 1024;
    int runs = 3, direct = 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc) {
            dir = argv[++i];
        } else if (strcmp(argv[i], "--size-mb") == 0 && i + 1 < argc) {
            size_mb = atoll(argv[++i]);
        } else if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc) {
            runs = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--no-direct") == 0) {
            direct = 0;
        } else {
            fprintf(stderr, "usage: bench_cast [--dir D] [--size-mb N] [--runs R] [--no-direct]\n");
            return 2;
        }
    }
    if (size_mb < 1 || runs < 1 || runs > 99) {
        fprintf(stderr, "bench_cast: --size-mb at least 1, --runs 1..99\n");
        return 2;
    }
    uint64_t rows = (uint64_t)size_mb * 1048576 / 4 / COLS | 1;
    char ck[4096];
    mkdir(dir, 0755);
    snprintf(ck, sizeof ck, "%s/cast-ck-%d", dir, (int)getpid());
    pid_t pid = fork();
    if (pid == 0)
        _exit(save(ck, rows));
    int status, dropped = 0, bad = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status)) {
        fprintf(stderr, "bench_cast: the save failed\n");
        nftw(ck, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        return 1;
    }
    static const strata_dtype ways[2] = {STRATA_F32, STRATA_BF16};
    double secs[2][99];
    long rss[2] = {0, 0};
    int ok[2] = {1, 1};
    for (int r = 0; r < runs && !bad; r++)
        for (int w = 0; w < 2 && !bad; w++) {
            sync();
            int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
            dropped = fd >= 0 && write(fd, "3\n", 2) == 2;
            if (fd >= 0)
                close(fd);
            int pfd[2];
            if (pipe(pfd))
                return perror("pipe"), 1;
            pid = fork();
            if (pid == 0) {
                close(pfd[0]);
                _exit(load(ck, rows, ways[w], direct, pfd[1]));
            }
            close(pfd[1]);
            strata_stats s = STRATA_STATS_INIT;
            int got = pid > 0 && read(pfd[0], &s, sizeof s) == (ssize_t)sizeof s;
            close(pfd[0]);
            struct rusage ru;
            memset(&ru, 0, sizeof ru);
            bad = !(pid > 0 && wait4(pid, &status, 0, &ru) == pid && WIFEXITED(status) &&
                    !WEXITSTATUS(status) && got);
            secs[w][r] = s.seconds;
            rss[w] = ru.ru_maxrss > rss[w] ? ru.ru_maxrss : rss[w];
            ok[w] &= s.tier;
        }
    nftw(ck, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    if (bad)
        return fprintf(stderr, "bench_cast: a load failed\n"), 1;
    double gb = (double)rows * COLS * 4 / 1e9;
    for (int w = 0; w < 2; w++) {
        qsort(secs[w], (size_t)runs, sizeof secs[w][0], cmp_d);
        double med = secs[w][runs / 2];
        printf("f32 -> %s%s: %.2f GB in %.2f s median of %d (%.2f GB/s), peak RSS %.0f MiB, "
               "ok=%d (%s, cache: %s)\n",
               strata_dtype_name(ways[w]), w ? " (cast)" : "", gb, med, runs, gb / med,
               (double)rss[w] / 1024.0, ok[w], direct ? "O_DIRECT" : "buffered",
               dropped ? "dropped" : direct ? "bypassed" : "warm");
    }
    return ok[0] && ok[1] ? 0 : 1;
}
