/* bench_peer.c - peer-memory replicas (issue 34), for `make bench-peer` (part of `make
 * bench`): 8 ranks as threads of this process, on 4 simulated nodes of 2 (STRATA_LOAD_NODES),
 * each node's memory tier a directory of its own under --mem (tmpfs), save a state of
 * --size-mb (one f32 tensor split by rows) to every node's memory and to disk (--dir), and
 * measure:
 *  - restore after losing node 2, from the survivors' memory (strata_peer_restore, then
 *    strata_load on 3 nodes x 2 ranks), against strata_load of the disk copy on the same 6
 *    ranks with its files dropped from the page cache (posix_fadvise DONTNEED): --runs
 *    rounds, alternating, the survivors' memory put back as it was between rounds;
 *  - bytes sent per node over the node's share: strata_peer_replicate (R = 1) and
 *    strata_peer_encode (k = 2, m = 2) of the same save;
 *  - the stall a training loop sees (a save every step: wait for the previous save, start,
 *    wait for the snapshot; the step's compute is a sleep of --step-ms, as a GPU-bound
 *    step leaves the CPU idle) with peer_replicas = 1 and without, alternating rounds;
 *  - with ISA-L: the parity's encode (k = 4, m = 2) and decode rates against one thread's
 *    memcpy of the same bytes.
 * Prints medians and writes markdown to --out, ending with the line
 * "peer: restore_ratio_vs_disk=X stall_pct=Y bytes_ratio=Z".
 * Usage: bench_peer --dir D [--mem M] [--size-mb 512] [--runs 5] [--steps 8]
 *                   [--step-ms 200] [--out FILE] */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "strata.h"
#include "threadcomm.h"
#ifdef ST_HAVE_ISAL
#include <isa-l/erasure_code.h>
#endif

#define COLS 1024
static uint64_t rows;
static char mem[512], disk[512];

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
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

static void die(const char *what)
{
    fprintf(stderr, "bench_peer: %s: %s\n", what, strata_error_last());
    exit(1);
}

static void sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void sh(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_peer: %s failed\n", cmd);
        exit(1);
    }
}

/* ---- a world of thread ranks ---- */

typedef struct {
    int n;
    hub h, twin;
    tcomm *tc, *ttc;
    strata_comm **comm;
    strata_saver **sv;
} world;

static void world_new(world *w, int n, int nodes)
{
    char v[16];
    snprintf(v, sizeof v, "%d", nodes);
    setenv("STRATA_LOAD_NODES", v, 1);
    w->n = n;
    hub_init(&w->h, n);
    hub_init(&w->twin, n);
    w->tc = calloc((size_t)n, sizeof *w->tc);
    w->ttc = calloc((size_t)n, sizeof *w->ttc);
    w->comm = calloc((size_t)n, sizeof *w->comm);
    w->sv = calloc((size_t)n, sizeof *w->sv);
    for (int r = 0; r < n; r++)
        w->ttc[r] = (tcomm){&w->twin, r};
    tc_set_twin(&w->h, w->ttc);
    for (int r = 0; r < n; r++) {
        w->tc[r] = (tcomm){&w->h, r};
        if (strata_comm_host(&w->comm[r], &tops, &w->tc[r], r, n) ||
            strata_saver_new(&w->sv[r], w->comm[r], NULL))
            die("world");
    }
}

static void world_free(world *w)
{
    for (int r = 0; r < w->n; r++) {
        strata_saver_free(w->sv[r]);
        strata_comm_free(w->comm[r]);
    }
    tc_set_twin(&w->h, NULL);
    hub_free(&w->h);
    hub_free(&w->twin);
    free(w->tc), free(w->ttc), free(w->comm), free(w->sv);
}

/* rank r of n: its rows of the tensor, its state (data: filled with the pattern, or
 * zeroed for a load) */
typedef struct {
    strata_state *st;
    float *data;
    uint64_t off, len;
} part;

static uint64_t shape[2];

static void part_new(part *p, int r, int n, int fill)
{
    p->off = rows * (uint64_t)r / (uint64_t)n;
    p->len = rows * (uint64_t)(r + 1) / (uint64_t)n - p->off;
    p->data = malloc(p->len * COLS * 4 + 4);
    for (uint64_t i = 0; i < p->len * COLS; i++)
        p->data[i] = fill ? (float)((p->off * COLS + i) % 100003) : 0.0f;
    uint64_t off[2] = {p->off, 0}, len[2] = {p->len, COLS};
    strata_shard s = {.name = "w", .dtype = STRATA_F32, .ndim = 2, .global_shape = shape,
                      .offsets = off, .lengths = len, .data = p->data};
    if (strata_state_new(&p->st) || strata_state_add_shard(p->st, &s))
        die("state");
}

static int part_check(const part *p)
{
    for (uint64_t i = 0; i < p->len * COLS; i++)
        if (p->data[i] != (float)((p->off * COLS + i) % 100003))
            return 0;
    return 1;
}

static void part_free(part *p)
{
    strata_state_free(p->st);
    free(p->data);
}

/* ---- one call on every rank ---- */

enum { SAVE, REPLICATE, ENCODE, RESTORE_LOAD, LOAD_DISK, LOOP };

typedef struct {
    world *w;
    int rank, what, nodes, peer;
    const int *dirs; /* per node: the memory directory it has */
    part p;
    const char *ck;
    strata_peer_info info;
    double stall;    /* LOOP: median stall per step */
    int steps, step_ms, round;
    int rc;
} job;

static void node_uri(char *out, size_t cap, const job *j, const char *ck)
{
    snprintf(out, cap, "mem://node%d/%s", j->dirs[j->rank * j->nodes / j->w->n], ck);
}

static void *run(void *arg)
{
    job *j = arg;
    char u[700], d[1100];
    node_uri(u, sizeof u, j, j->ck);
    snprintf(d, sizeof d, "%s/%s", disk, j->ck);
    const char *both[2] = {u, d};
    strata_comm *c = j->w->comm[j->rank];
    strata_saver *sv = j->w->sv[j->rank];
    if (j->what == SAVE) {
        strata_save_opts o = STRATA_SAVE_OPTS_INIT;
        o.flags = STRATA_SAVE_NO_SYNC;
        strata_handle *h;
        if (!(j->rc = strata_save_start(&h, sv, both, 2, &j->p.st, 1, &o))) {
            j->rc = strata_wait_durable(NULL, h);
            strata_handle_free(h);
        }
    } else if (j->what == REPLICATE) {
        j->rc = strata_peer_replicate(&j->info, c, u, 1);
    } else if (j->what == ENCODE) {
        j->rc = strata_peer_encode(&j->info, c, u, 2, 2);
    } else if (j->what == RESTORE_LOAD) {
        double t0 = now();
        j->rc = strata_peer_restore(&j->info, c, u);
        j->stall = now() - t0; /* the restore's part */
        const char *one = u;
        if (!j->rc)
            j->rc = strata_load(NULL, c, &one, 1, &j->p.st, 1, NULL);
    } else if (j->what == LOAD_DISK) {
        const char *one = d;
        j->rc = strata_load(NULL, c, &one, 1, &j->p.st, 1, NULL);
    } else { /* LOOP: a save every step */
        double *st = calloc((size_t)j->steps, sizeof *st);
        strata_handle *prev = NULL;
        for (int s = 0; s < j->steps && !j->rc; s++) {
            double t0 = now();
            if (prev) {
                j->rc = strata_wait_durable(NULL, prev);
                strata_handle_free(prev);
                prev = NULL;
            }
            char ck[64];
            snprintf(ck, sizeof ck, "loop-%d-%d-%d", j->peer, j->round, s);
            node_uri(u, sizeof u, j, ck);
            const char *one = u;
            strata_save_opts o = STRATA_SAVE_OPTS_INIT;
            o.flags = STRATA_SAVE_NO_SYNC;
            o.step = (uint64_t)s;
            o.peer_replicas = j->peer;
            if (!j->rc && !(j->rc = strata_save_start(&prev, sv, &one, 1, &j->p.st, 1, &o)))
                j->rc = strata_wait_snapshot(prev);
            st[s] = now() - t0;
            usleep((useconds_t)j->step_ms * 1000); /* the step's compute */
        }
        if (prev) {
            int rc = strata_wait_durable(NULL, prev);
            j->rc = j->rc ? j->rc : rc;
            strata_handle_free(prev);
        }
        j->stall = median(st + 1, j->steps - 1); /* the first waits for nothing */
        free(st);
    }
    return NULL;
}

static void run_all(world *w, job *jobs)
{
    pthread_t th[16];
    for (int r = 0; r < w->n; r++)
        pthread_create(&th[r], NULL, run, &jobs[r]);
    for (int r = 0; r < w->n; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < w->n; r++)
        if (jobs[r].rc) {
            fprintf(stderr, "rank %d: ", r);
            die(strata_error_name(jobs[r].rc));
        }
}

/* Drops the disk checkpoint's files from the page cache. */
static void drop_cache(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char p[1400];
    while (d && (e = readdir(d))) {
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        int fd = open(p, O_RDONLY);
        if (fd >= 0) {
            fdatasync(fd);
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            close(fd);
        }
    }
    if (d)
        closedir(d);
}

static const int four[] = {0, 1, 2, 3}, three[] = {0, 1, 3};

static void jobs_init(job *jobs, world *w, int what, int nodes, const int *dirs, int fill,
                      const char *ck)
{
    for (int r = 0; r < w->n; r++) {
        jobs[r] = (job){.w = w, .rank = r, .what = what, .nodes = nodes, .dirs = dirs,
                        .ck = ck};
        part_new(&jobs[r].p, r, w->n, fill);
    }
}

static void jobs_free(job *jobs, int n)
{
    for (int r = 0; r < n; r++)
        part_free(&jobs[r].p);
}

/* Bytes sent per node over the node's share (the median node's), from every rank's info. */
static double bytes_ratio(const job *jobs, int n, int nodes)
{
    double v[16];
    for (int i = 0; i < nodes; i++) {
        uint64_t sent = 0, share = 0;
        for (int r = 0; r < n; r++)
            if (r * nodes / n == i)
                sent += jobs[r].info.bytes_sent, share = jobs[r].info.share_bytes;
        v[i] = (double)sent / (double)share;
    }
    return median(v, nodes);
}

static double memcpy_rate(size_t bytes)
{
    char *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes), memset(b, 2, bytes);
    double t[5];
    for (int i = 0; i < 5; i++) {
        double t0 = now();
        memcpy(b, a, bytes);
        t[i] = now() - t0;
    }
    double r = (double)bytes / median(t, 5) / 1e9;
    free(a), free(b);
    return r;
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *out = NULL;
    int size_mb = 512, runs = 5, steps = 8, step_ms = 200;
    snprintf(mem, sizeof mem, "/dev/shm/strata-bench-peer-%d", (int)getpid());
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--dir"))
            dir = argv[i + 1];
        else if (!strcmp(argv[i], "--mem"))
            snprintf(mem, sizeof mem, "%s", argv[i + 1]);
        else if (!strcmp(argv[i], "--size-mb"))
            size_mb = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--runs"))
            runs = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps"))
            steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--step-ms"))
            step_ms = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--out"))
            out = argv[i + 1];
    }
    if (!dir || runs < 1 || steps < 2 || size_mb < 1) {
        fprintf(stderr, "usage: bench_peer --dir D [--mem M] [--size-mb 512] [--runs 5] "
                        "[--steps 8] [--step-ms 200] [--out FILE]\n");
        return 2;
    }
    rows = (uint64_t)size_mb * (1u << 20) / (COLS * 4);
    shape[0] = rows, shape[1] = COLS;
    snprintf(disk, sizeof disk, "%s/peer-disk", dir);
    sh("rm -rf '%s' '%s'", mem, disk);
    sh("mkdir -p '%s' '%s'", mem, disk);
    chmod(mem, 0700);
    setenv("STRATA_MEM_ROOT", mem, 1);

    /* the save, replicated (R = 1) and encoded (k = 2, m = 2; another directory) */
    world w;
    job jobs[8];
    world_new(&w, 8, 4);
    jobs_init(jobs, &w, SAVE, 4, four, 1, "ck");
    run_all(&w, jobs);
    for (int r = 0; r < 8; r++)
        jobs[r].what = REPLICATE;
    double t0 = now();
    run_all(&w, jobs);
    double t_rep = now() - t0;
    double br = bytes_ratio(jobs, 8, 4);
    uint64_t held = jobs[0].info.bytes_held, share = jobs[0].info.share_bytes;
    double br_rs = -1, t_enc = -1;
    uint64_t held_rs = 0;
#ifdef ST_HAVE_ISAL
    for (int r = 0; r < 8; r++)
        jobs[r].what = SAVE, jobs[r].ck = "ck-rs";
    run_all(&w, jobs);
    for (int r = 0; r < 8; r++)
        jobs[r].what = ENCODE;
    t0 = now();
    run_all(&w, jobs);
    t_enc = now() - t0;
    br_rs = bytes_ratio(jobs, 8, 4);
    held_rs = jobs[0].info.bytes_held;
#endif
    jobs_free(jobs, 8);
    world_free(&w);
    /* node 2 is lost; the survivors' memory kept aside to put back before each round */
    char pr[600], nd[600];
    snprintf(pr, sizeof pr, "%s/pristine", mem);
    sh("rm -rf '%s/node2' && mkdir -p '%s'", mem, pr);
    for (int i = 0; i < 3; i++)
        sh("cp -a '%s/node%d' '%s/'", mem, three[i], pr);

    double tp[64], td[64], ratio[64], trs[64];
    for (int k = 0; k < runs && k < 64; k++) {
        for (int i = 0; i < 3; i++) /* the survivors' memory as it was */
            sh("rm -rf '%s/node%d' && cp -a '%s/node%d' '%s/node%d'", mem, three[i], pr,
               three[i], mem, three[i]);
        drop_cache(disk);
        snprintf(nd, sizeof nd, "%s/ck", disk);
        drop_cache(nd);
        for (int order = 0; order < 2; order++) {
            int peer = (order + k) % 2 == 0; /* alternate which goes first */
            world_new(&w, 6, 3);
            jobs_init(jobs, &w, peer ? RESTORE_LOAD : LOAD_DISK, 3, three, 0, "ck");
            t0 = now();
            run_all(&w, jobs);
            double t = now() - t0;
            for (int r = 0; r < 6; r++)
                if (!part_check(&jobs[r].p)) {
                    fprintf(stderr, "bench_peer: rank %d loaded wrong bytes\n", r);
                    return 1;
                }
            *(peer ? &tp[k] : &td[k]) = t;
            if (peer)
                trs[k] = jobs[0].stall;
            jobs_free(jobs, 6);
            world_free(&w);
        }
        ratio[k] = tp[k] / td[k];
        printf("round %d: restore from peers %.3f s (of which strata_peer_restore %.3f s), "
               "from disk (cold) %.3f s, ratio %.3f\n", k, tp[k], trs[k], td[k], ratio[k]);
    }
    double mtp = median(tp, runs), mtd = median(td, runs), mratio = median(ratio, runs);

    /* the training loop: a save every step, with peer replicas and without */
    sh("rm -rf '%s' '%s'", pr, disk);
    double sn[64], sp[64];
    for (int k = 0; k < runs && k < 64; k++)
        for (int order = 0; order < 2; order++) {
            int peer = (order + k) % 2;
            world_new(&w, 8, 4);
            jobs_init(jobs, &w, LOOP, 4, four, 1, NULL);
            for (int r = 0; r < 8; r++)
                jobs[r].peer = peer, jobs[r].steps = steps, jobs[r].step_ms = step_ms,
                jobs[r].round = k;
            run_all(&w, jobs);
            double v[8];
            for (int r = 0; r < 8; r++)
                v[r] = jobs[r].stall;
            *(peer ? &sp[k] : &sn[k]) = median(v, 8);
            jobs_free(jobs, 8);
            world_free(&w);
            sh("rm -rf '%s'/node*/loop-*", mem);
        }
    double msn = median(sn, runs), msp = median(sp, runs);
    double stall_pct = (msp - msn) / ((double)step_ms / 1e3 + msn) * 100;

    /* the parity's encode and decode rates against memcpy */
    double enc = -1, dec = -1, mc = memcpy_rate((size_t)64 << 20);
#ifdef ST_HAVE_ISAL
    {
        const int k = 4, m = 2;
        const size_t b = (size_t)16 << 20;
        unsigned char a[6 * 4], inv[16], sub[16], tbl[32 * 4 * 2], *d[6];
        for (int i = 0; i < k + m; i++) {
            d[i] = malloc(b);
            memset(d[i], i * 7 + 1, b);
        }
        gf_gen_cauchy1_matrix(a, k + m, k);
        ec_init_tables(k, m, a + k * k, tbl);
        double te[5], tdd[5];
        for (int i = 0; i < 5; i++) {
            double s = now();
            ec_encode_data((int)b, k, m, tbl, d, d + k);
            te[i] = now() - s;
        }
        /* data block 0 lost: from data 1..3 and parity 0 */
        unsigned char *src[4] = {d[1], d[2], d[3], d[4]};
        for (int i = 0; i < 5; i++) {
            unsigned char *o = malloc(b);
            double s = now();
            for (int r = 0; r < 4; r++) /* rows 1, 2, 3 (data) and 4 (parity 0); the
                                           inversion destroys its input */
                memcpy(sub + r * k, a + (r + 1) * k, (size_t)k);
            gf_invert_matrix(sub, inv, k);
            ec_init_tables(k, 1, inv, tbl);
            ec_encode_data((int)b, k, 1, tbl, src, &o);
            tdd[i] = now() - s;
            if (memcmp(o, d[0], b) != 0) {
                fprintf(stderr, "bench_peer: decode wrong\n");
                return 1;
            }
            free(o);
        }
        enc = (double)(k * b) / median(te, 5) / 1e9;
        dec = (double)(k * b) / median(tdd, 5) / 1e9;
        for (int i = 0; i < k + m; i++)
            free(d[i]);
    }
#endif
    sh("rm -rf '%s'", mem);

    double la[3] = {0};
    getloadavg(la, 3);
    char text[4096];
    int n = snprintf(text, sizeof text,
        "# Peer-memory replicas (bench/bench_peer.c)\n\n"
        "8 ranks as threads on 4 simulated nodes of 2 (each node's memory a directory of its "
        "own in tmpfs), %d MiB state (one f32 tensor split by rows); medians of %d rounds, "
        "alternating; load average %.2f %.2f %.2f.\n\n"
        "| what | figure |\n|---|---|\n"
        "| replicate R = 1 (explicit call, after the save) | %.3f s |\n"
        "| bytes sent per node / node's share, R = 1 | %.3f |\n"
        "| bytes held by node 0 / its share, R = 1 | %.3f |\n"
        "| encode k = 2, m = 2 (explicit call) | %.3f s |\n"
        "| bytes sent per node / node's share, k = 2, m = 2 | %.3f |\n"
        "| bytes held by node 0 / its share, k = 2, m = 2 | %.3f |\n"
        "| node 2 lost: restore from peers + load on 3 nodes x 2 | %.3f s |\n"
        "| the same from disk, page cache dropped | %.3f s |\n"
        "| ratio (median of per-round ratios) | %.3f |\n"
        "| loop stall per step, no replicas (step %d ms, %d steps) | %.4f s |\n"
        "| loop stall per step, peer_replicas = 1 | %.4f s |\n"
        "| added stall / step time | %.2f %% |\n"
        "| encode k = 4, m = 2 (16 MiB blocks, data in) | %.2f GB/s |\n"
        "| decode one block from 4 | %.2f GB/s |\n"
        "| memcpy, one thread | %.2f GB/s |\n\n"
        "peer: restore_ratio_vs_disk=%.3f stall_pct=%.2f bytes_ratio=%.3f\n",
        size_mb, runs, la[0], la[1], la[2], t_rep, br, (double)held / (double)share, t_enc,
        br_rs, (double)held_rs / (double)share, mtp, mtd, mratio, step_ms, steps, msn, msp,
        stall_pct, enc, dec, mc, mratio, stall_pct, br);
    fwrite(text, 1, (size_t)n, stdout);
    if (out) {
        FILE *f = fopen(out, "w");
        if (!f || fwrite(text, 1, (size_t)n, f) != (size_t)n || fclose(f)) {
            fprintf(stderr, "bench_peer: cannot write %s\n", out);
            return 1;
        }
    }
    return 0;
}
