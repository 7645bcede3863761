/* bench_export.c - the export's peak memory and rate (make bench): saves a checkpoint holding
 * one f32 tensor of --size-mb MiB (default 1024, odd shape, saved by two ranks as row halves)
 * and a few small tensors, then exports it with strata_export_safetensors in a child process
 * of its own and prints that child's peak RSS (ru_maxrss from wait4: the exporter alone, not
 * the saver) and the export's rate, then checks every exported element of the big tensor.
 * The page cache is dropped before the export when allowed (root), as bench_io.sh does.
 * Uses only the public API. Prints one line:
 *   export: 1.07 GB in 0.9 s (1.2 GB/s), peak RSS 148 MiB (cache: dropped, ok=1) */
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "strata.h"

#define COLS 4099u /* odd: windows and the row halves cut rows in the middle */

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The value of element i of the big tensor: an integer below 2^24, exact in f32. */
static float value(uint64_t i) { return (float)((uint32_t)(i * 2654435761u) >> 8); }

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void rm_rf(const char *dir) { nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

static int fail(const char *what, int rc)
{
    fprintf(stderr, "bench_export: %s: %s (%s)\n", what, strata_error_last(),
            strata_error_name(rc));
    return 1;
}

/* The child that saves: two ranks holding the big tensor's row halves, and small tensors. */
static int save(const char *ck, uint64_t rows)
{
    float *big = malloc(rows * COLS * sizeof *big);
    if (!big)
        return fprintf(stderr, "bench_export: out of memory\n"), 1;
    for (uint64_t i = 0; i < rows * COLS; i++)
        big[i] = value(i);
    uint64_t shape[2] = {rows, COLS}, top[2] = {0, 0}, bot[2] = {rows / 2, 0};
    uint64_t lt[2] = {rows / 2, COLS}, lb[2] = {rows - rows / 2, COLS};
    static uint16_t bias[1001];
    static int64_t step = 1000;
    static double scale[7] = {0.5, 1, 2, 3, 4, 5, 6};
    uint64_t nb = 1001, ns = 7;
    strata_state *st[2];
    int rc = strata_state_new(&st[0]);
    if (!rc)
        rc = strata_state_new(&st[1]);
    if (!rc)
        rc = strata_state_add_shard(st[0], &(strata_shard){"model.big", STRATA_F32, 2, shape, top,
                                                           lt, .data = big});
    if (!rc)
        rc = strata_state_add_shard(st[1], &(strata_shard){"model.big", STRATA_F32, 2, shape, bot,
                                                           lb, .data = big + rows / 2 * COLS});
    for (int r = 0; r < 2 && !rc; r++) { /* replicas on both ranks */
        rc = strata_state_add_shard(st[r], &(strata_shard){"model.bias", STRATA_BF16, 1, &nb,
                                                           .data = bias});
        if (!rc)
            rc = strata_state_add_shard(st[r], &(strata_shard){"model.scale", STRATA_F64, 1, &ns,
                                                               .data = scale});
        if (!rc)
            rc = strata_state_add_shard(st[r], &(strata_shard){"step", STRATA_I64, 0, NULL,
                                                               .data = &step});
    }
    if (!rc)
        rc = strata_save(NULL, NULL, &ck, 1, st, 2, NULL);
    strata_state_free(st[0]);
    strata_state_free(st[1]);
    free(big);
    return rc ? fail("save", rc) : 0;
}

/* Checks the big tensor in the exported file, 8 MiB at a time: 1 if every element is right. */
static int check(const char *out, uint64_t rows)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return perror(path), 0;
    unsigned char len8[8];
    int ok = pread(fd, len8, 8, 0) == 8;
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)len8[i] << (8 * i);
    char *hdr = ok && hlen < (1u << 20) ? calloc(1, hlen + 1) : NULL;
    ok = hdr && pread(fd, hdr, hlen, 8) == (ssize_t)hlen;
    char want[128];
    snprintf(want, sizeof want, "\"model.big\":{\"dtype\":\"F32\",\"shape\":[%llu,%u],"
             "\"data_offsets\":[", (unsigned long long)rows, COLS);
    const char *at = ok ? strstr(hdr, want) : NULL;
    unsigned long long begin = 0, end = 0;
    ok = at && sscanf(at + strlen(want), "%llu,%llu]", &begin, &end) == 2 &&
         end - begin == rows * COLS * 4;
    free(hdr);
    enum { N = 2u << 20 };
    float *buf = malloc(N * sizeof *buf);
    uint64_t total = rows * COLS;
    for (uint64_t i = 0; ok && buf && i < total; i += N) {
        uint64_t n = total - i < N ? total - i : N;
        ok = pread(fd, buf, n * 4, (off_t)(8 + hlen + begin + i * 4)) == (ssize_t)(n * 4);
        for (uint64_t k = 0; ok && k < n; k++)
            ok = buf[k] == value(i + k);
    }
    free(buf);
    close(fd);
    return ok;
}

int main(int argc, char **argv)
{
    const char *dir = "build/bench";
    long long size_mb = 1024;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc) {
            dir = argv[++i];
        } else if (strcmp(argv[i], "--size-mb") == 0 && i + 1 < argc) {
            size_mb = atoll(argv[++i]);
        } else {
            fprintf(stderr, "usage: bench_export [--dir D] [--size-mb N]\n");
            return 2;
        }
    }
    if (size_mb < 1) {
        fprintf(stderr, "bench_export: --size-mb must be at least 1\n");
        return 2;
    }
    uint64_t rows = (uint64_t)size_mb * 1048576 / 4 / COLS | 1;
    char ck[4096], out[4096];
    mkdir(dir, 0755);
    snprintf(ck, sizeof ck, "%s/export-ck-%d", dir, (int)getpid());
    snprintf(out, sizeof out, "%s/export-out-%d", dir, (int)getpid());

    pid_t pid = fork();
    if (pid == 0)
        _exit(save(ck, rows));
    int status;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status)) {
        fprintf(stderr, "bench_export: the save failed\n");
        rm_rf(ck);
        return 1;
    }
    sync();
    int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
    int dropped = fd >= 0 && write(fd, "3\n", 2) == 2;
    if (fd >= 0)
        close(fd);

    int pfd[2];
    if (pipe(pfd)) {
        perror("pipe");
        rm_rf(ck);
        return 1;
    }
    double t0 = now();
    pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        strata_stats s = STRATA_STATS_INIT;
        int rc = strata_export_safetensors(&s, ck, out, NULL);
        if (rc)
            _exit(fail("export", rc));
        _exit(write(pfd[1], &s, sizeof s) == (ssize_t)sizeof s ? 0 : 1);
    }
    close(pfd[1]);
    strata_stats s = STRATA_STATS_INIT;
    int got = pid > 0 && read(pfd[0], &s, sizeof s) == (ssize_t)sizeof s;
    close(pfd[0]);
    struct rusage ru;
    memset(&ru, 0, sizeof ru);
    int ok = pid > 0 && wait4(pid, &status, 0, &ru) == pid && WIFEXITED(status) &&
             !WEXITSTATUS(status) && got;
    double wall = now() - t0;
    if (ok)
        ok = check(out, rows);
    if (got)
        printf("export: %.2f GB in %.2f s (%.2f GB/s), peak RSS %.0f MiB (cache: %s, ok=%d)\n",
               (double)s.bytes / 1e9, s.seconds, (double)s.bytes / 1e9 / s.seconds,
               (double)ru.ru_maxrss / 1024.0, dropped ? "dropped" : "warm", ok);
    else
        fprintf(stderr, "bench_export: the export failed (%.1f s)\n", wall);
    rm_rf(ck);
    rm_rf(out);
    return ok ? 0 : 1;
}
