/* demo_mpi.c - `strata demo save` and `strata demo load`: the demo state saved or loaded
 * by N processes (mpiexec.mpich -n N build/strata demo save ...), one rank each, through
 * one strata_saver on an MPI communicator (reused by every save, so that its plan stays
 * cached) and strata_load with that communicator. */
#include <mpi.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "strata_mpi.h"
#include "synth.h"


static const char HELP[] =
    "usage: mpiexec.mpich -n N build/strata demo save --dir D --layout L [options]\n"
    "       mpiexec.mpich -n M build/strata demo load --dir D --layout L2 [options]\n"
    "\n"
    "The demo's synthetic GPT-style state saved, or loaded and checked bitwise, by N MPI\n"
    "processes, one rank each (N must equal tp*pp*dp of the layout). save writes one data\n"
    "file per writing rank; the coordinator (rank 0) plans and commits. load reads each\n"
    "saved chunk once, on one of the ranks that need it, and sends it to the others.\n"
    "\n"
    "  --dir D          the checkpoint (required)\n"
    "  --layout L       tp=T,pp=P,dp=D[,zero=1] (default tp=1,pp=1,dp=N)\n"
    "  --size-mb N      size of the distinct state in MiB (default 64; save and load must agree)\n"
    "  --step N         training step recorded (save; default 1000)\n"
    "  --repeat K       save K times, to D, D.2, ... D.K, with one saver (shows the plan\n"
    "                   cache; default 1)\n"
    "  --async          save through a pool of --pool-mb MiB per rank (default 64): return\n"
    "                   at strata_save_start, then wait for the snapshot and the commit, and\n"
    "                   print how long each took, and where the commit ran (the saver's own\n"
    "                   thread, or strata_wait_durable where MPI lacks MPI_THREAD_MULTIPLE)\n"
    "  --die-when-done  with --async: after the snapshot, call nothing until\n"
    "                   strata_handle_done says the save is over (committed in the\n"
    "                   background), print how long that took, then SIGKILL this rank\n"
    "  --also D2        save: to D2 as well, a second tier (for example --dir mem://ck\n"
    "                   --also /shared/ck); each tier commits on its own. load: fall back to\n"
    "                   D2 when D does not load (the tier used is printed)\n"
    "  --timeout-ms T   give up on ranks that do not answer within T ms (default 60000)\n"
    "\n"
    "Rank 0 prints the one-process demo's last line:\n"
    "  saved_bytes=N read_bytes=N save_gbps=X load_gbps=X ok=1\n"
    "with bytes summed over all ranks. A dead rank makes the others stop with\n"
    "STRATA_EABORTED after the time limit (run mpiexec with -disable-auto-cleanup to see\n"
    "them do so rather than be killed by mpiexec).\n";

typedef struct {
    const char *dir, *layout, *also;
    long long size_mb, step, repeat, timeout_ms, pool_mb;
    int async, die_when_done;
} args;

static int parse(int argc, char **argv, args *a, int world)
{
    static char def[64];
    snprintf(def, sizeof def, "tp=1,pp=1,dp=%d", world);
    *a = (args){NULL, def, NULL, 64, 1000, 1, 60000, 64, 0, 0};
    for (int i = 2; i < argc; i += 2) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(k, "--async") == 0 || strcmp(k, "--die-when-done") == 0) {
            *(k[2] == 'a' ? &a->async : &a->die_when_done) = 1;
            i--;
            continue;
        }
        long long n = v ? cli_parse_num(v) : -1;
        if (!v)
            return fprintf(stderr, "strata demo: %s needs a value\n", k), -1;
        if (strcmp(k, "--dir") == 0)
            a->dir = v;
        else if (strcmp(k, "--layout") == 0)
            a->layout = v;
        else if (strcmp(k, "--size-mb") == 0 && n >= 1)
            a->size_mb = n;
        else if (strcmp(k, "--step") == 0 && n >= 0)
            a->step = n;
        else if (strcmp(k, "--repeat") == 0 && n >= 1)
            a->repeat = n;
        else if (strcmp(k, "--timeout-ms") == 0 && n >= 0)
            a->timeout_ms = n;
        else if (strcmp(k, "--pool-mb") == 0 && n >= 1)
            a->pool_mb = n;
        else if (strcmp(k, "--also") == 0)
            a->also = v;
        else
            return fprintf(stderr, "strata demo: bad option or value '%s %s' (see --help)\n", k, v), -1;
    }
    if (!a->dir)
        return fprintf(stderr, "strata demo: --dir is required (see --help)\n"), -1;
    return 0;
}

static void *die_later(void *ms)
{
    usleep((useconds_t)(intptr_t)ms * 1000);
    raise(getenv("STRATA_DEMO_STOP") ? SIGSTOP : SIGKILL);
    return NULL;
}

static int timeout_ms = 60000;


/* The demo's own collectives have the same time limit as strata's: a peer that died
 * after the save must not leave this process waiting forever. */
static void reduce(const void *in, void *out, int n, MPI_Datatype t, MPI_Op op)
{
    MPI_Request req;
    MPI_Iallreduce(in, out, n, t, op, MPI_COMM_WORLD, &req);
    double t0 = cli_now();
    for (int done = 0; !done;) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done && timeout_ms && (cli_now() - t0) * 1e3 > timeout_ms) {
            fprintf(stderr, "strata demo: another rank stopped answering (%d ms)\n", timeout_ms);
            _exit(EXIT_OPFAIL);
        }
        if (!done)
            usleep(200);
    }
}

/* Every rank's verdict: the worst exit status. */
static int agree(int status)
{
    int worst = status;
    reduce(&status, &worst, 1, MPI_INT, MPI_MAX);
    return worst;
}

/* --die-when-done: no strata call but strata_handle_done until the save is over (a commit
 * thread committed it, or it failed), then SIGKILL once every rank is there, as a job dies
 * between two saves. */
static void die_when_done(strata_handle *h, int rank, double t_snap)
{
    while (!strata_handle_done(h)) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    const char *msg;
    int rc = strata_handle_status(&msg, h);
    fprintf(stderr, "rank %d: done %.1f ms after the snapshot (%s%s%s), killing myself\n", rank,
            (cli_now() - t_snap) * 1e3, rc ? strata_error_name(rc) : "committed", rc ? ": " : "",
            rc ? msg : "");
    const char *flags = getenv("STRATA_DEMO_DONE_DIR"); /* tests: a file per rank done */
    char f[4096];
    if (flags && !rc && snprintf(f, sizeof f, "%s/done-%d", flags, rank) < (int)sizeof f) {
        FILE *fp = fopen(f, "w");
        if (fp)
            fclose(fp);
    }
    /* every rank is done before any dies (MPICH ends a job's other ranks once one is gone) */
    MPI_Barrier(MPI_COMM_WORLD);
    raise(SIGKILL);
}

/* MPI_Finalize waits for every rank: if one is dead it must not wait forever. */
static void *finalize_watchdog(void *arg)
{
    (void)arg;
    usleep((useconds_t)(timeout_ms ? timeout_ms : 60000) * 1000);
    fprintf(stderr, "strata demo: MPI_Finalize did not finish (a rank is gone)\n");
    _exit(EXIT_OPFAIL);
    return NULL;
}

/* One run of the demo on this rank: its arguments, the synthetic state it saves or checks,
 * and what strata needs for it. */
typedef struct {
    args a;
    int save, rank, world;
    layout l;
    synth_model m;
    synth_ranks rs;
    synth_shard *sh; /* this rank's shards (rs.shards[rank]), n of them */
    int n;
    strata_comm *comm;
    strata_state *st;
    strata_pool *pool;
    strata_saver *sv;
    int saved_world;      /* the saved world's ranks (rng blobs), this rank's o = rank mod world */
    unsigned char *blobs; /* this rank's rng and dataloader blobs, one pair per o */
    uint64_t step, got_step;
    char config[256];
    unsigned char got_cfg[256];
} demo;

#define DEMO_BLOB_BYTES (SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES)

/* The arguments and the layout, which must fit the world; EXIT_USAGE (said once) if not. */
static int demo_args(demo *d, int argc, char **argv)
{
    char err[256];
    if (agree(parse(argc, argv, &d->a, d->world) ? EXIT_USAGE : 0))
        return EXIT_USAGE;
    const char *why = layout_parse(&d->l, d->a.layout, err, sizeof err) ? err : NULL;
    int need = why ? 0 : layout_world(&d->l);
    if (!why && need != d->world) {
        snprintf(err, sizeof err, "%d process%s; the layout %s needs %d (tp*pp*dp: one rank "
                 "each): run it with mpiexec -n %d", d->world, d->world == 1 ? "" : "es",
                 d->a.layout, need, need);
        why = err;
    }
    if (why && d->rank == 0)
        fprintf(stderr, "strata demo: %s\n", why);
    return why ? EXIT_USAGE : 0;
}

/* A load's saved world: the rng blobs of the first tier that opens (rank 0's answer). */
static int saved_world(const demo *d)
{
    int world = 0;
    strata_ckpt *ck;
    if (d->rank == 0 && (strata_ckpt_open(&ck, d->a.dir, 0) == 0 ||
                         (d->a.also && strata_ckpt_open(&ck, d->a.also, 0) == 0))) {
        for (size_t i = 0; i < strata_ckpt_nblobs(ck); i++) {
            strata_blob_info b;
            strata_ckpt_blob(&b, ck, i);
            world += strcmp(b.name, "rng") == 0;
        }
        strata_ckpt_free(ck);
    }
    MPI_Bcast(&world, 1, MPI_INT, 0, MPI_COMM_WORLD);
    return world;
}

/* The blobs: save registers this rank's; load asks for the saved ranks o = rank mod world
 * (d->saved_world known). */
static int add_blobs(demo *d)
{
    int nmine = 0, rc = 0, k = 0;
    for (int o = d->rank; o < d->saved_world; o += d->world)
        nmine++;
    if (!(d->blobs = calloc((size_t)nmine + 1, DEMO_BLOB_BYTES)))
        return STRATA_ENOMEM;
    for (int o = d->rank; !rc && o < d->saved_world; o += d->world, k++) {
        unsigned char *b = d->blobs + (size_t)k * DEMO_BLOB_BYTES;
        if (d->save) {
            synth_blob("rng", o, b, SYNTH_RNG_BYTES);
            synth_blob("dataloader", o, b + SYNTH_RNG_BYTES, SYNTH_LOADER_BYTES);
        }
        rc = strata_state_add_blob(d->st, "rng", STRATA_BLOB_RANK_LOCAL, o, b, SYNTH_RNG_BYTES);
        if (!rc)
            rc = strata_state_add_blob(d->st, "dataloader", STRATA_BLOB_RANK_LOCAL, o,
                                       b + SYNTH_RNG_BYTES, SYNTH_LOADER_BYTES);
    }
    if (!rc)
        rc = strata_state_add_blob(d->st, "train.step", 0, -1,
                                   d->save ? (void *)&d->step : &d->got_step, 8);
    if (!rc)
        rc = strata_state_add_blob(d->st, "train.config", 0, -1,
                                   d->save ? (void *)d->config : d->got_cfg, strlen(d->config));
    return rc;
}

/* This rank's state (filled to save, poisoned to load), its blobs, and with save one saver
 * for every save (its plan cached), with a pool when asynchronous. */
static int demo_state(demo *d)
{
    d->n = d->rs.nshards[d->rank];
    d->sh = d->rs.shards[d->rank];
    d->step = (uint64_t)d->a.step;
    d->saved_world = d->save ? d->world : saved_world(d); /* collective: before any failure */
    synth_config(&d->m, d->config, sizeof d->config);
    for (int i = 0; i < d->n; i++) {
        uint64_t b = synth_shard_bytes(&d->m, &d->sh[i]);
        if (!(d->sh[i].data = malloc(b ? b : 1)))
            return STRATA_ENOMEM;
        if (d->save)
            synth_fill(&d->m, &d->sh[i]);
        else
            memset(d->sh[i].data, 0xa5, b);
    }
    int rc = strata_state_new(&d->st);
    if (!rc)
        rc = synth_register(d->st, &d->m, d->sh, d->n);
    if (!rc)
        rc = add_blobs(d);
    if (!rc && d->save && d->a.async)
        rc = strata_pool_new(&d->pool, (uint64_t)d->a.pool_mb << 20);
    if (!rc && d->save)
        rc = strata_saver_new(&d->sv, d->comm, d->pool);
    return rc;
}

/* For the killed-rank test: STRATA_DEMO_DIE_RANK=r STRATA_DEMO_DIE_MS=t makes rank r
 * SIGKILL itself t ms into the save (t = -1: just before it), leaving the others in its
 * collectives; with STRATA_DEMO_STOP=1 it stops (SIGSTOP) instead: a silent peer. */
static void arm_die(const demo *d)
{
    const char *die = getenv("STRATA_DEMO_DIE_RANK"), *die_ms = getenv("STRATA_DEMO_DIE_MS");
    if (die && die_ms && atoi(die_ms) >= 0) { /* connect every pair before the timer runs */
        int *x = calloc(2 * (size_t)d->world, sizeof *x);
        MPI_Alltoall(x, 1, MPI_INT, x + d->world, 1, MPI_INT, MPI_COMM_WORLD);
        free(x);
    }
    if (die) /* every rank is past MPI's own start-up before one dies */
        MPI_Barrier(MPI_COMM_WORLD);
    if (die && atoi(die) == d->rank) {
        int ms = die_ms ? atoi(die_ms) : -1;
        if (ms < 0) /* never reach the save: the others wait for this rank in it */
            die_later((void *)(intptr_t)100);
        pthread_t th;
        pthread_create(&th, NULL, die_later, (void *)(intptr_t)ms);
    }
}

/* An asynchronous save: started, its snapshot and commit waited for; t[] when each was
 * over, from the start. */
static int save_async(demo *d, const char *const *uris, int nuris, const strata_save_opts *so,
                      strata_stats *s, double t[3])
{
    strata_handle *h = NULL;
    double t0 = cli_now();
    int rc = strata_save_start(&h, d->sv, uris, nuris, &d->st, 1, so);
    t[0] = cli_now() - t0;
    if (rc)
        return rc;
    int src = strata_wait_snapshot(h);
    t[1] = cli_now() - t0;
    if (d->a.die_when_done)
        die_when_done(h, d->rank, t[1] + t0);
    rc = strata_wait_durable(s, h); /* with a communicator: every rank calls it */
    t[2] = cli_now() - t0;
    strata_handle_free(h);
    return rc ? rc : src;
}

/* Rank 0 says where the asynchronous save's slowest rank started, snapshot and committed. */
static void report_async(const demo *d, const double t[3])
{
    double mx[3];
    reduce(t, mx, 3, MPI_DOUBLE, MPI_MAX);
    const char *why;
    int bg = strata_saver_background(&why, d->sv);
    if (d->rank == 0)
        printf("  async: started in %.3f ms, snapshot after %.1f ms, committed after "
               "%.1f ms %s%s%s\n", mx[0] * 1e3, mx[1] * 1e3, mx[2] * 1e3,
               bg == 1 ? "(in the background)" : "(in strata_wait_durable: ", bg == 1 ? "" : why,
               bg == 1 ? "" : ")");
}

/* The wrong elements and blob bytes this rank loaded. */
static uint64_t count_bad(const demo *d)
{
    uint64_t bad = 0;
    for (int j = 0; j < d->n; j++) {
        uint64_t first, nb = synth_check(&d->m, &d->sh[j], &first);
        if (nb && !bad)
            fprintf(stderr, "rank %d: tensor %s: %llu wrong elements, first at %llu\n", d->rank,
                    d->m.t[d->sh[j].tensor].name, (unsigned long long)nb,
                    (unsigned long long)first);
        bad += nb;
    }
    unsigned char want[SYNTH_RNG_BYTES > SYNTH_LOADER_BYTES ? SYNTH_RNG_BYTES
                                                            : SYNTH_LOADER_BYTES];
    int k = 0;
    for (int o = d->rank; o < d->saved_world; o += d->world, k++) {
        const unsigned char *b = d->blobs + (size_t)k * DEMO_BLOB_BYTES;
        synth_blob("rng", o, want, SYNTH_RNG_BYTES);
        bad += memcmp(b, want, SYNTH_RNG_BYTES) != 0;
        synth_blob("dataloader", o, want, SYNTH_LOADER_BYTES);
        bad += memcmp(b + SYNTH_RNG_BYTES, want, SYNTH_LOADER_BYTES) != 0;
    }
    return bad + (memcmp(d->got_cfg, d->config, strlen(d->config)) != 0);
}

/* The load's check over every rank; rank 0 prints it. Returns the exit status. */
static int report_load(const demo *d, const strata_stats *s, double mx, const char *const *uris,
                       int nuris)
{
    uint64_t bad = count_bad(d), all_bad = 0;
    reduce(&bad, &all_bad, 1, MPI_UINT64_T, MPI_SUM);
    if (d->rank == 0) {
        const int tier = s->tier >= 0 && s->tier < nuris ? s->tier : 0;
        char which[32] = "";
        if (d->a.also)
            snprintf(which, sizeof which, " (tier %d of 2)", tier + 1);
        printf("load: %s%s into %s on %d ranks: %llu bytes read in %.3f s (%.3f GB/s), "
               "step %llu, %s\n",
               uris[tier], which, d->a.layout, d->world, (unsigned long long)s->all_bytes, mx,
               (double)s->all_bytes / mx / 1e9, (unsigned long long)d->got_step,
               all_bad ? "MISMATCH" : "every element and blob byte matches");
        printf("saved_bytes=%llu read_bytes=%llu save_gbps=0 load_gbps=%.3f ok=%d\n",
               (unsigned long long)s->data_bytes, (unsigned long long)s->all_bytes,
               (double)s->all_bytes / mx / 1e9, all_bad == 0);
    }
    return all_bad ? EXIT_OPFAIL : 0;
}

/* Save i of --repeat (to D, then D.i), or the load. Returns the exit status. */
static int demo_once(demo *d, long long i, long long reps)
{
    char dir[4096], dir2[4096];
    const char *also = d->a.also ? d->a.also : "";
    if (i == 1) {
        snprintf(dir, sizeof dir, "%s", d->a.dir);
        snprintf(dir2, sizeof dir2, "%s", also);
    } else {
        snprintf(dir, sizeof dir, "%s.%lld", d->a.dir, i);
        snprintf(dir2, sizeof dir2, "%s.%lld", also, i);
    }
    const char *uris[2] = {dir, dir2};
    const int nuris = d->a.also ? 2 : 1;
    strata_stats s = STRATA_STATS_INIT;
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.step = d->step;
    if (d->rank == 0) /* progress, and the markers the kill test waits for */
        fprintf(stderr, "%s %s ...\n", d->save ? "saving to" : "loading", dir);
    double t[3] = {0, 0, 0};
    int rc = d->save && d->a.async ? save_async(d, uris, nuris, &so, &s, t)
             : d->save ? strata_save(&s, d->sv, uris, nuris, &d->st, 1, &so)
                       : strata_load(&s, d->comm, uris, nuris, &d->st, 1, NULL);
    if (rc) {
        int status = cli_fail("demo", rc);
        if (rc == STRATA_EABORTED) /* a peer is gone: MPI cannot finish cleanly */
            _exit(status);
        return status;
    }
    double mx = s.seconds;
    reduce(&s.seconds, &mx, 1, MPI_DOUBLE, MPI_MAX);
    if (d->rank == 0)
        fprintf(stderr, "%s %s\n", d->save ? "saved" : "loaded", dir);
    if (!d->save)
        return report_load(d, &s, mx, uris, nuris);
    if (d->rank == 0)
        printf("save %lld: %s, %d ranks, %llu bytes in %.3f s (%.3f GB/s), plan %s\n", i, dir,
               d->world, (unsigned long long)s.all_bytes, mx, (double)s.all_bytes / mx / 1e9,
               s.plan_cached ? "cached" : "built");
    if (d->a.async)
        report_async(d, t);
    if (d->rank == 0 && i == reps) {
        printf("checkpoint: %s\n", d->a.dir);
        printf("saved_bytes=%llu read_bytes=0 save_gbps=%.3f load_gbps=0 ok=1\n",
               (unsigned long long)s.all_bytes, (double)s.all_bytes / mx / 1e9);
    }
    return 0;
}

static void demo_free(demo *d)
{
    fflush(stdout);
    strata_saver_free(d->sv);
    strata_pool_free(d->pool);
    strata_state_free(d->st);
    strata_comm_free(d->comm);
    for (int i = 0; i < d->n; i++)
        free(d->sh[i].data);
    free(d->blobs);
    synth_ranks_free(&d->rs);
    synth_model_free(&d->m);
}

static int run(int save, int argc, char **argv, int rank, int world)
{
    demo d = {.save = save, .rank = rank, .world = world};
    if (demo_args(&d, argc, argv))
        return EXIT_USAGE;
    if (synth_model_build(&d.m, (uint64_t)d.a.size_mb) || synth_layout(&d.rs, &d.m, &d.l)) {
        fprintf(stderr, "strata demo: out of memory\n");
        return EXIT_OPFAIL;
    }
    int rc = strata_comm_mpi(&d.comm, NULL), status = 0;
    if (rc)
        return cli_fail("demo", rc);
    strata_comm_set_timeout(d.comm, (int)d.a.timeout_ms);
    timeout_ms = (int)d.a.timeout_ms;
    if ((rc = demo_state(&d)))
        status = cli_fail("demo", rc);
    if (!status)
        arm_die(&d);
    const long long reps = save ? d.a.repeat : 1;
    for (long long i = 1; !status && i <= reps; i++)
        status = demo_once(&d, i, reps);
    demo_free(&d);
    return agree(status);
}

int cmd_demo_mpi(int argc, char **argv)
{
    int save = strcmp(argv[1], "save") == 0;
    if (cli_wants_help(argc, argv)) {
        fputs(HELP, stdout);
        return 0;
    }
    /* a saver's commit thread calls MPI beside this one (else the commits stay on this
     * one); STRATA_DEMO_MPI_FUNNELED=1 asks for less, to show that */
    int level;
    MPI_Init_thread(NULL, NULL, getenv("STRATA_DEMO_MPI_FUNNELED") ? MPI_THREAD_FUNNELED
                                                                    : MPI_THREAD_MULTIPLE,
                    &level);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    int status = run(save, argc, argv, rank, world);
    pthread_t wd;
    pthread_create(&wd, NULL, finalize_watchdog, NULL);
    MPI_Finalize();
    return status;
}
