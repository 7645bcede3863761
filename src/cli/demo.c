/* demo.c - `strata demo` (save a synthetic GPT-style state in one layout, load it into
 * another, check every element bitwise) and `strata bench io` (the same, timed with a
 * cold page cache). Logical ranks live in this one process. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "synth.h"


typedef struct {
    synth_model m;
    layout from, to;
    synth_ranks src, dst;
    void **src_bufs; /* distinct source buffers (replicas share one) */
    int nsrc_bufs;
    unsigned char **blobs; /* per save rank: rng + loader; then per load rank */
    uint64_t step;
    int async;
    char config[256];
} demo_state;

static int same_box(const synth_shard *a, const synth_shard *b)
{
    return a->tensor == b->tensor && a->off[0] == b->off[0] && a->off[1] == b->off[1] &&
           a->len[0] == b->len[0] && a->len[1] == b->len[1] && a->fs == b->fs && a->fe == b->fe;
}

/* Source buffers: one per distinct shard, filled with the deterministic values. */
static int build_source(demo_state *d)
{
    if (synth_layout(&d->src, &d->m, &d->from))
        return -1;
    int total = 0;
    for (int r = 0; r < d->src.nranks; r++)
        total += d->src.nshards[r];
    d->src_bufs = calloc((size_t)total + 1, sizeof *d->src_bufs);
    if (!d->src_bufs)
        return -1;
    for (int r = 0; r < d->src.nranks; r++)
        for (int i = 0; i < d->src.nshards[r]; i++) {
            synth_shard *s = &d->src.shards[r][i];
            for (int q = 0; q < r && !s->data; q++) /* a replica on an earlier rank? */
                for (int j = 0; j < d->src.nshards[q]; j++)
                    if (same_box(s, &d->src.shards[q][j])) {
                        s->data = d->src.shards[q][j].data;
                        break;
                    }
            if (s->data)
                continue;
            uint64_t n = synth_shard_bytes(&d->m, s);
            if (!(s->data = malloc(n ? n : 1)))
                return -1;
            d->src_bufs[d->nsrc_bufs++] = s->data;
            synth_fill(&d->m, s);
        }
    return 0;
}

static int build_dest(demo_state *d)
{
    if (synth_layout(&d->dst, &d->m, &d->to))
        return -1;
    for (int r = 0; r < d->dst.nranks; r++)
        for (int i = 0; i < d->dst.nshards[r]; i++) {
            synth_shard *s = &d->dst.shards[r][i];
            uint64_t n = synth_shard_bytes(&d->m, s);
            if (!(s->data = malloc(n ? n : 1)))
                return -1;
            memset(s->data, 0xa5, n); /* poison: an unfilled byte cannot pass the check */
        }
    return 0;
}

static void free_states(strata_state **st, int n)
{
    for (int i = 0; i < n; i++)
        strata_state_free(st ? st[i] : NULL);
    free(st);
}

/* The lazy path: start, wait for the snapshot (the sources may change after it), then
 * for the commit. No saver: the save makes a pool of its own and frees it. */
static int save_async(const char *dir, strata_state **st, int W, const strata_save_opts *o,
                      strata_stats *stats)
{
    strata_handle *h;
    int rc = strata_save_start(&h, NULL, &dir, 1, st, W, o);
    if (rc)
        return rc;
    rc = strata_wait_snapshot(h);
    if (!rc)
        fprintf(stderr, "snapshot taken, flushing ...\n");
    int rc2 = strata_wait_durable(stats, h);
    strata_handle_free(h);
    return rc ? rc : rc2;
}

static int do_save(demo_state *d, const char *dir, strata_stats *stats)
{
    int W = d->src.nranks, rc = 0;
    strata_state **st = calloc((size_t)W, sizeof *st);
    d->blobs = calloc((size_t)W, sizeof *d->blobs);
    if (!st || !d->blobs)
        return STRATA_ENOMEM;
    for (int r = 0; r < W && !rc; r++) {
        if ((rc = strata_state_new(&st[r])))
            break;
        if ((rc = synth_register(st[r], &d->m, d->src.shards[r], d->src.nshards[r])))
            break;
        if (!(d->blobs[r] = malloc(SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES))) {
            rc = STRATA_ENOMEM;
            break;
        }
        synth_blob("rng", r, d->blobs[r], SYNTH_RNG_BYTES);
        synth_blob("dataloader", r, d->blobs[r] + SYNTH_RNG_BYTES, SYNTH_LOADER_BYTES);
        if ((rc = strata_state_add_blob(st[r], "rng", STRATA_BLOB_RANK_LOCAL, 0, d->blobs[r],
                                        SYNTH_RNG_BYTES)) ||
            (rc = strata_state_add_blob(st[r], "dataloader", STRATA_BLOB_RANK_LOCAL, 0,
                                        d->blobs[r] + SYNTH_RNG_BYTES, SYNTH_LOADER_BYTES)) ||
            (rc = strata_state_add_blob(st[r], "train.step", 0, -1, &d->step, sizeof d->step)) ||
            (rc = strata_state_add_blob(st[r], "train.config", 0, -1, d->config,
                                        strlen(d->config))))
            break;
    }
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.step = d->step;
    if (!rc)
        rc = d->async ? save_async(dir, st, W, &o, stats)
                      : strata_save(stats, NULL, &dir, 1, st, W, &o);
    free_states(st, W);
    return rc;
}

/* Loads into the destination layout; *bad gets the count of wrong elements/bytes. */
static int do_load(demo_state *d, const char *dir, strata_stats *stats, uint64_t *bad,
                   int check)
{
    int W = d->dst.nranks, Wf = d->src.nranks, rc = 0;
    strata_state **st = calloc((size_t)W, sizeof *st);
    unsigned char *bl = calloc((size_t)W, SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES + 256 + 8);
    if (!st || !bl) {
        free(st);
        free(bl);
        return STRATA_ENOMEM;
    }
    const size_t per = SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES + 256 + 8;
    for (int r = 0; r < W && !rc; r++) {
        unsigned char *b = bl + (size_t)r * per;
        if ((rc = strata_state_new(&st[r])) ||
            (rc = synth_register(st[r], &d->m, d->dst.shards[r], d->dst.nshards[r])) ||
            (rc = strata_state_add_blob(st[r], "rng", STRATA_BLOB_RANK_LOCAL, r % Wf, b,
                                        SYNTH_RNG_BYTES)) ||
            (rc = strata_state_add_blob(st[r], "dataloader", STRATA_BLOB_RANK_LOCAL, r % Wf,
                                        b + SYNTH_RNG_BYTES, SYNTH_LOADER_BYTES)) ||
            (rc = strata_state_add_blob(st[r], "train.step", 0, -1, b + per - 8, 8)) ||
            (rc = strata_state_add_blob(st[r], "train.config", 0, -1, b + SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES,
                                        strlen(d->config))))
            break;
    }
    if (!rc)
        rc = strata_load(stats, NULL, &dir, 1, st, W, NULL);
    *bad = 0;
    if (!rc && check) {
        unsigned char want[SYNTH_RNG_BYTES];
        for (int r = 0; r < W; r++) {
            for (int i = 0; i < d->dst.nshards[r]; i++) {
                uint64_t first, n = synth_check(&d->m, &d->dst.shards[r][i], &first);
                if (n && *bad == 0)
                    fprintf(stderr, "mismatch: rank %d tensor %s: %llu wrong elements, first at global index %llu\n",
                            r, d->m.t[d->dst.shards[r][i].tensor].name, (unsigned long long)n,
                            (unsigned long long)first);
                *bad += n;
            }
            unsigned char *b = bl + (size_t)r * per;
            synth_blob("rng", r % Wf, want, SYNTH_RNG_BYTES);
            *bad += memcmp(b, want, SYNTH_RNG_BYTES) != 0;
            synth_blob("dataloader", r % Wf, want, SYNTH_LOADER_BYTES);
            *bad += memcmp(b + SYNTH_RNG_BYTES, want, SYNTH_LOADER_BYTES) != 0;
            *bad += memcmp(b + SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES, d->config, strlen(d->config)) != 0;
            *bad += memcmp(b + per - 8, &d->step, 8) != 0;
        }
    }
    free_states(st, W);
    free(bl);
    return rc;
}

static void demo_free(demo_state *d)
{
    for (int i = 0; i < d->nsrc_bufs; i++)
        free(d->src_bufs[i]);
    free(d->src_bufs);
    for (int r = 0; r < d->dst.nranks; r++)
        for (int i = 0; i < d->dst.nshards[r]; i++)
            free(d->dst.shards[r][i].data);
    if (d->blobs)
        for (int r = 0; r < d->src.nranks; r++)
            free(d->blobs[r]);
    free(d->blobs);
    synth_ranks_free(&d->src);
    synth_ranks_free(&d->dst);
    synth_model_free(&d->m);
}

/* Makes the page cache forget a checkpoint's files: drop_caches when root, else
 * POSIX_FADV_DONTNEED on each file. Returns a word saying which worked. */
static const char *drop_cache(const char *dir)
{
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    if (f) {
        int ok = fputs("3\n", f) >= 0;
        if (fclose(f) == 0 && ok)
            return "drop_caches";
    }
    strata_ckpt *ck;
    if (strata_ckpt_open(&ck, dir, STRATA_OPEN_INCOMPLETE) == 0) {
        for (size_t i = 0; i < strata_ckpt_nfiles(ck); i++) {
            strata_file_info fi;
            char p[8192];
            strata_ckpt_file(&fi, ck, i);
            if (snprintf(p, sizeof p, "%s/%s", dir, fi.name) >= (int)sizeof p)
                continue;
            int fd = open(p, O_RDONLY);
            if (fd >= 0) {
                posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
                close(fd);
            }
        }
        strata_ckpt_free(ck);
    }
    return "fadvise";
}

static const char DEMO_HELP[] =
    "usage: strata demo [--dir D] [--size-mb N] [--from LAYOUT] [--to LAYOUT] [--step N] [--async]\n"
    "       mpiexec.mpich -n N strata demo save|load --dir D --layout L   (see demo save --help)\n"
    "\n"
    "Builds a synthetic GPT-style training state (bf16 embeddings and per-layer qkv, proj,\n"
    "mlp and norm weights with odd sizes, plus fp32 master weights and Adam exp_avg and\n"
    "exp_avg_sq, and rng / data-loader / step / config blobs) whose values are a\n"
    "deterministic function of (tensor name, global element index). Lays it out as the\n"
    "--from layout, saves it, loads it into the --to layout and checks every element and\n"
    "blob byte bitwise.\n"
    "\n"
    "  --dir D       keep the checkpoint at D (default: a temporary directory, removed)\n"
    "  --size-mb N   size of the distinct state in MiB (default 256)\n"
    "  --from L      layout saved (default tp=2,pp=2,dp=2,zero=1)\n"
    "  --to L        layout loaded (default tp=1,pp=3,dp=2)\n"
    "  --step N      training step recorded in the checkpoint (default 1000)\n"
    "  --async       save with strata_save_start (snapshot into a pool, then flush)\n"
    "\n"
    "LAYOUT is tp=T,pp=P,dp=D with an optional ,zero=1: tensor-parallel (Megatron column /\n"
    "row splits, uneven when sizes do not divide), pipeline stages, data-parallel replicas;\n"
    "zero=1 flat-shards the optimizer state across dp as in ZeRO-1 / Megatron's distributed\n"
    "optimizer (pieces cut rows in the middle). Ranks = T*P*D, all in this process.\n"
    "\n"
    "Last line: saved_bytes=N read_bytes=N save_gbps=X load_gbps=X ok=1 (ok=0 and exit\n"
    "status 1 on any mismatch).\n";

typedef struct {
    const char *dir;
    long long size_mb, step, runs;
    const char *from, *to;
    int async;
} demo_args;

/* Options of demo (bench = 0: --from, --to, --step) or bench io (--layout, --runs). */
static int parse_args(int argc, char **argv, demo_args *a, int bench, const char *cmd,
                      const char *help)
{
    for (int i = 1; i < argc; i += 2) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(k, "--help") == 0 || strcmp(k, "-h") == 0) {
            fputs(help, stdout);
            return -1;
        }
        if (!bench && strcmp(k, "--async") == 0) { /* a flag: no value */
            a->async = 1;
            i--;
            continue;
        }
        if (!v) {
            fprintf(stderr, "strata %s: %s needs a value (see --help)\n", cmd, k);
            return EXIT_USAGE;
        }
        if (strcmp(k, "--dir") == 0)
            a->dir = v;
        else if (strcmp(k, "--size-mb") == 0 && (a->size_mb = cli_parse_num(v)) >= 1)
            ;
        else if (!bench && strcmp(k, "--step") == 0 && (a->step = cli_parse_num(v)) >= 0)
            ;
        else if (bench && strcmp(k, "--runs") == 0 && (a->runs = cli_parse_num(v)) >= 1)
            ;
        else if (strcmp(k, bench ? "--layout" : "--from") == 0)
            a->from = v;
        else if (!bench && strcmp(k, "--to") == 0)
            a->to = v;
        else {
            fprintf(stderr, "strata %s: bad option or value '%s %s' (see --help)\n", cmd, k, v);
            return EXIT_USAGE;
        }
    }
    return 0;
}

static int setup(demo_state *d, const demo_args *a, const char *cmd)
{
    char err[256];
    if (layout_parse(&d->from, a->from, err, sizeof err) ||
        layout_parse(&d->to, a->to, err, sizeof err)) {
        fprintf(stderr, "strata %s: %s\n", cmd, err);
        return EXIT_USAGE;
    }
    if (synth_model_build(&d->m, (uint64_t)a->size_mb)) {
        fprintf(stderr, "strata %s: out of memory\n", cmd);
        return EXIT_OPFAIL;
    }
    d->step = (uint64_t)a->step;
    d->async = a->async;
    synth_config(&d->m, d->config, sizeof d->config);
    fprintf(stderr, "building the state (%llu MiB) ...\n", (unsigned long long)a->size_mb);
    if (build_source(d) || build_dest(d)) {
        fprintf(stderr, "strata %s: out of memory building the state\n", cmd);
        return EXIT_OPFAIL;
    }
    return 0;
}

static int make_dir(char *out, size_t cap, const char *dir, int *temp)
{
    *temp = !dir;
    if (dir) {
        snprintf(out, cap, "%s", dir);
        return 0;
    }
    const char *t = getenv("TMPDIR");
    snprintf(out, cap, "%s/strata-demo-XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(out))
        return -1;
    rmdir(out); /* strata_save creates it */
    return 0;
}

int cmd_demo(int argc, char **argv)
{
    if (argc > 1 && (strcmp(argv[1], "save") == 0 || strcmp(argv[1], "load") == 0))
        return cmd_demo_mpi(argc, argv);
    demo_args a = {NULL, 256, 1000, 1, "tp=2,pp=2,dp=2,zero=1", "tp=1,pp=3,dp=2", 0};
    int rc = parse_args(argc, argv, &a, 0, "demo", DEMO_HELP);
    if (rc)
        return rc < 0 ? 0 : rc;
    demo_state d = {0};
    char dir[4096], f1[64], f2[64];
    int temp;
    if ((rc = setup(&d, &a, "demo")) || make_dir(dir, sizeof dir, a.dir, &temp)) {
        demo_free(&d);
        return rc ? rc : EXIT_OPFAIL;
    }
    layout_format(&d.from, f1, sizeof f1);
    layout_format(&d.to, f2, sizeof f2);
    printf("strata demo: GPT-style state, %d layers, hidden %llu, ffn %llu, vocab %llu\n",
           d.m.layers, (unsigned long long)d.m.hidden, (unsigned long long)d.m.ffn,
           (unsigned long long)d.m.vocab);
    printf("  save layout %-24s %4d ranks\n  load layout %-24s %4d ranks\n", f1, d.src.nranks,
           f2, d.dst.nranks);
    int nshards_src = 0, nshards_dst = 0;
    for (int r = 0; r < d.src.nranks; r++)
        nshards_src += d.src.nshards[r];
    for (int r = 0; r < d.dst.nranks; r++)
        nshards_dst += d.dst.nshards[r];

    fprintf(stderr, "saving to %s ...\n", dir);
    strata_stats ss = STRATA_STATS_INIT, ls = STRATA_STATS_INIT;
    rc = do_save(&d, dir, &ss);
    if (rc) {
        int e = cli_fail("demo", rc);
        demo_free(&d);
        return e;
    }
    fprintf(stderr, "loading into %s and checking every element ...\n", f2);
    uint64_t bad = 0;
    rc = do_load(&d, dir, &ls, &bad, 1);
    if (rc) {
        int e = cli_fail("demo", rc);
        printf("checkpoint: %s\n", dir);
        printf("saved_bytes=%llu read_bytes=0 save_gbps=%.3f load_gbps=0 ok=0\n",
               (unsigned long long)ss.bytes, (double)ss.bytes / ss.seconds / 1e9);
        demo_free(&d);
        return e;
    }
    double sg = (double)ss.bytes / ss.seconds / 1e9, lg = (double)ls.bytes / ls.seconds / 1e9;
    printf("\n  %-6s %8s %8s %14s %9s %8s\n", "phase", "tensors", "shards", "bytes", "seconds",
           "GB/s");
    printf("  %-6s %8d %8d %14llu %9.3f %8.3f\n", "save", d.m.ntensors, nshards_src,
           (unsigned long long)ss.bytes, ss.seconds, sg);
    printf("  %-6s %8d %8d %14llu %9.3f %8.3f\n", "load", d.m.ntensors, nshards_dst,
           (unsigned long long)ls.bytes, ls.seconds, lg);
    printf("  writers %llu: the largest writes %.1f%% of the mean (the layout allows no less "
           "than %.1f%%)\n",
           (unsigned long long)ss.writers,
           100.0 * (double)ss.max_writer_bytes * (double)ss.writers / (double)ss.data_bytes,
           100.0 * (double)ss.balance_bound * (double)ss.writers / (double)ss.data_bytes);
    printf("  check: %s\n\n", bad ? "MISMATCH" : "every element and blob byte matches");
    printf("checkpoint: %s%s\n", dir, temp ? " (temporary, removed)" : "");
    printf("saved_bytes=%llu read_bytes=%llu save_gbps=%.3f load_gbps=%.3f ok=%d\n",
           (unsigned long long)ss.bytes, (unsigned long long)ls.bytes, sg, lg, bad == 0);
    if (temp)
        cli_rm_rf(dir);
    demo_free(&d);
    return bad ? EXIT_OPFAIL : 0;
}

static const char BENCH_HELP[] =
    "usage: strata bench io [--dir D] [--size-mb N] [--layout L] [--runs R]\n"
    "       strata bench disk --help    (the disk itself, through strata's I/O buffers)\n"
    "       strata bench async --help   (the training-loop simulator)\n"
    "\n"
    "Saves a synthetic state of N MiB (default 2048) laid out as L (default\n"
    "tp=2,pp=1,dp=2,zero=1) into D (default a temporary directory under $TMPDIR), empties\n"
    "the page cache (drop_caches as root, else POSIX_FADV_DONTNEED), loads it back into the\n"
    "same layout, checks it, and removes it; R times. Before each, the disk itself is\n"
    "measured the way strata uses it (as `strata bench disk`, through strata's I/O buffers).\n"
    "Two lines per run:\n"
    "  run=I buffers=strata write_gbps=X read_gbps=X ... pages=\"...\"   (the disk)\n"
    "  run=I save_s=S load_s=S save_gbps=X load_gbps=X bytes=N cache=HOW ok=1\n"
    "      save_of_disk=F load_of_disk=F load_req_kib=K\n"
    "GB/s are 1e9 bytes per second of payload; F: strata's rate over the disk's (same\n"
    "buffers); load_req_kib: the average device request during the load (/proc/diskstats).\n"
    "bench/bench_io.sh runs it beside fio.\n";

int cmd_bench(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "async") == 0)
        return cmd_bench_async(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "disk") == 0)
        return cmd_bench_disk(argc, argv);
    if (argc < 2 || strcmp(argv[1], "io") != 0) {
        if (cli_wants_help(argc, argv)) {
            fputs(BENCH_HELP, stdout);
            return 0;
        }
        fprintf(stderr, "strata bench: unknown or missing benchmark (known: io, disk, async)\n%s",
                BENCH_HELP);
        return EXIT_USAGE;
    }
    demo_args a = {NULL, 2048, 1, 1, "tp=2,pp=1,dp=2,zero=1", NULL, 0};
    int rc = parse_args(argc - 1, argv + 1, &a, 1, "bench io", BENCH_HELP);
    if (rc)
        return rc < 0 ? 0 : rc;
    a.to = a.from;
    demo_state d = {0};
    if ((rc = setup(&d, &a, "bench io"))) {
        demo_free(&d);
        return rc;
    }
    int failed = 0;
    for (long long i = 1; i <= a.runs && !failed; i++) {
        char dir[4096];
        int temp = 0;
        if (a.dir)
            snprintf(dir, sizeof dir, "%s/bench-%lld", a.dir, i);
        else if (make_dir(dir, sizeof dir, NULL, &temp)) {
            perror("strata bench io: mkdtemp");
            failed = 1;
            break;
        }
        cli_rm_rf(dir);
        /* the disk, where the checkpoint goes, through strata's own I/O buffers */
        char parent[4096];
        snprintf(parent, sizeof parent, "%s", dir);
        char *slash = strrchr(parent, '/');
        if (slash && slash != parent)
            *slash = 0;
        strata_disk_rate disk = STRATA_DISK_RATE_INIT;
        if ((rc = strata_disk_rate_measure(&disk, parent, (uint64_t)a.size_mb << 20, 0, 0))) {
            failed = cli_fail("bench io", rc);
            break;
        }
        printf("run=%lld buffers=strata write_gbps=%.3f read_gbps=%.3f write_req_kib=%.0f "
               "read_req_kib=%.0f max_request_kib=%llu read_kib=%llu pages=\"%s\"\n",
               i, disk.write_gbps, disk.read_gbps, disk.write_request / 1024,
               disk.read_request / 1024, (unsigned long long)(disk.max_request >> 10),
               (unsigned long long)(disk.read_block >> 10), disk.pages);
        strata_stats ss = STRATA_STATS_INIT, ls = STRATA_STATS_INIT;
        uint64_t bad = 0, c0[4] = {0}, c1[4] = {0};
        rc = do_save(&d, dir, &ss);
        for (int r = 0; d.blobs && r < d.src.nranks; r++)
            free(d.blobs[r]);
        free(d.blobs);
        d.blobs = NULL;
        const char *how = rc ? "" : drop_cache(dir);
        int counted = !rc && strata_disk_counters(parent, c0) == 0;
        if (!rc)
            rc = do_load(&d, dir, &ls, &bad, i == 1);
        counted &= !rc && strata_disk_counters(parent, c1) == 0 && c1[0] > c0[0];
        if (rc) {
            failed = cli_fail("bench io", rc);
        } else {
            double sg = (double)ss.bytes / ss.seconds / 1e9, lg = (double)ls.bytes / ls.seconds / 1e9;
            printf("run=%lld save_s=%.3f load_s=%.3f save_gbps=%.3f load_gbps=%.3f bytes=%llu "
                   "cache=%s ok=%d save_of_disk=%.3f load_of_disk=%.3f load_req_kib=%.0f\n",
                   i, ss.seconds, ls.seconds, sg, lg, (unsigned long long)ss.bytes, how,
                   bad == 0, sg / disk.write_gbps, lg / disk.read_gbps,
                   counted ? (double)(c1[1] - c0[1]) / (double)(c1[0] - c0[0]) / 1024 : 0.0);
            fflush(stdout);
            if (bad)
                failed = EXIT_OPFAIL;
        }
        cli_rm_rf(dir);
    }
    demo_free(&d);
    return failed;
}
