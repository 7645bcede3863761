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

static int run(int save, int argc, char **argv, int rank, int world)
{
    args a;
    char err[256];
    layout l;
    strata_pool *pool = NULL;
    strata_saver *sv = NULL;
    if (agree(parse(argc, argv, &a, world) ? EXIT_USAGE : 0))
        return EXIT_USAGE;
    const char *why = layout_parse(&l, a.layout, err, sizeof err) ? err : NULL;
    if (!why && layout_world(&l) != world) {
        snprintf(err, sizeof err, "%d process%s; the layout %s needs %d (tp*pp*dp: one rank "
                 "each): run it with mpiexec -n %d", world, world == 1 ? "" : "es", a.layout,
                 layout_world(&l), layout_world(&l));
        why = err;
    }
    if (why) {
        if (rank == 0)
            fprintf(stderr, "strata demo: %s\n", why);
        return EXIT_USAGE;
    }
    synth_model m;
    synth_ranks rs = {0};
    if (synth_model_build(&m, (uint64_t)a.size_mb) || synth_layout(&rs, &m, &l)) {
        fprintf(stderr, "strata demo: out of memory\n");
        return EXIT_OPFAIL;
    }
    strata_comm *comm;
    int rc = strata_comm_mpi(&comm, NULL);
    if (rc)
        return cli_fail("demo", rc);
    strata_comm_set_timeout(comm, (int)a.timeout_ms);
    timeout_ms = (int)a.timeout_ms;
    int n = rs.nshards[rank], status = 0;
    synth_shard *sh = rs.shards[rank];
    uint64_t step = (uint64_t)a.step, bad = 0;
    char config[256];
    synth_config(&m, config, sizeof config);
    for (int i = 0; i < n; i++) {
        uint64_t b = synth_shard_bytes(&m, &sh[i]);
        sh[i].data = malloc(b ? b : 1);
        if (save)
            synth_fill(&m, &sh[i]);
        else
            memset(sh[i].data, 0xa5, b);
    }
    strata_state *st;
    strata_state_new(&st);
    rc = synth_register(st, &m, sh, n);
    /* blobs: save registers this rank's; load asks for the saved ranks o = rank mod world */
    int saved_world = world;
    if (!save) { /* from the first tier that opens */
        strata_ckpt *ck;
        saved_world = 0;
        if (rank == 0 && (strata_ckpt_open(&ck, a.dir, 0) == 0 ||
                          (a.also && strata_ckpt_open(&ck, a.also, 0) == 0))) {
            for (size_t i = 0; i < strata_ckpt_nblobs(ck); i++) {
                strata_blob_info b;
                strata_ckpt_blob(&b, ck, i);
                if (strcmp(b.name, "rng") == 0)
                    saved_world++;
            }
            strata_ckpt_free(ck);
        }
        MPI_Bcast(&saved_world, 1, MPI_INT, 0, MPI_COMM_WORLD);
    }
    int nmine = 0;
    for (int o = rank; o < saved_world; o += world)
        nmine++;
    unsigned char *blobs = calloc((size_t)nmine + 1, SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES);
    unsigned char got_cfg[256] = {0};
    uint64_t got_step = 0;
    int k = 0;
    for (int o = rank; !rc && o < saved_world; o += world, k++) {
        unsigned char *b = blobs + (size_t)k * (SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES);
        if (save) {
            synth_blob("rng", o, b, SYNTH_RNG_BYTES);
            synth_blob("dataloader", o, b + SYNTH_RNG_BYTES, SYNTH_LOADER_BYTES);
        }
        rc = strata_state_add_blob(st, "rng", STRATA_BLOB_RANK_LOCAL, o, b, SYNTH_RNG_BYTES);
        if (!rc)
            rc = strata_state_add_blob(st, "dataloader", STRATA_BLOB_RANK_LOCAL, o,
                                       b + SYNTH_RNG_BYTES, SYNTH_LOADER_BYTES);
    }
    if (!rc)
        rc = strata_state_add_blob(st, "train.step", 0, -1, save ? (void *)&step : &got_step, 8);
    if (!rc)
        rc = strata_state_add_blob(st, "train.config", 0, -1, save ? (void *)config : got_cfg,
                                   strlen(config));
    /* one saver for every save (its plan cached), with a pool when asynchronous */
    if (!rc && save && a.async)
        rc = strata_pool_new(&pool, (uint64_t)a.pool_mb << 20);
    if (!rc && save)
        rc = strata_saver_new(&sv, comm, pool);
    if (rc) {
        status = cli_fail("demo", rc);
        goto out;
    }
    /* for the killed-rank test: STRATA_DEMO_DIE_RANK=r STRATA_DEMO_DIE_MS=t makes rank r
     * SIGKILL itself t ms into the save (t = -1: just before it), leaving the others in its
     * collectives; with STRATA_DEMO_STOP=1 it stops (SIGSTOP) instead: a silent peer */
    const char *die = getenv("STRATA_DEMO_DIE_RANK"), *die_ms = getenv("STRATA_DEMO_DIE_MS");
    if (die && die_ms && atoi(die_ms) >= 0) { /* connect every pair before the timer runs */
        int *x = calloc(2 * (size_t)world, sizeof *x);
        MPI_Alltoall(x, 1, MPI_INT, x + world, 1, MPI_INT, MPI_COMM_WORLD);
        free(x);
    }
    if (die) /* every rank is past MPI's own start-up before one dies */
        MPI_Barrier(MPI_COMM_WORLD);
    if (die && atoi(die) == rank) {
        int ms = die_ms ? atoi(die_ms) : -1;
        if (ms < 0) /* never reach the save: the others wait for this rank in it */
            die_later((void *)(intptr_t)100);
        pthread_t th;
        pthread_create(&th, NULL, die_later, (void *)(intptr_t)ms);
    }
    char dir[4096], dir2[4096];
    const long long reps = save ? a.repeat : 1;
    for (long long i = 1; i <= reps; i++) {
        if (i == 1) {
            snprintf(dir, sizeof dir, "%s", a.dir);
            snprintf(dir2, sizeof dir2, "%s", a.also ? a.also : "");
        } else {
            snprintf(dir, sizeof dir, "%s.%lld", a.dir, i);
            snprintf(dir2, sizeof dir2, "%s.%lld", a.also ? a.also : "", i);
        }
        const char *uris[2] = {dir, dir2};
        const int nuris = a.also ? 2 : 1;
        strata_stats s = STRATA_STATS_INIT;
        strata_save_opts so = STRATA_SAVE_OPTS_INIT;
        so.step = step;
        if (rank == 0) /* progress, and the markers the kill test waits for */
            fprintf(stderr, "%s %s ...\n", save ? "saving to" : "loading", dir);
        double t_start = 0, t_snap = 0, t_done = 0, t0 = cli_now();
        if (save && a.async) {
            strata_handle *h = NULL;
            rc = strata_save_start(&h, sv, uris, nuris, &st, 1, &so);
            t_start = cli_now() - t0;
            if (!rc) {
                int src = strata_wait_snapshot(h);
                t_snap = cli_now() - t0;
                if (a.die_when_done)
                    die_when_done(h, rank, t_snap + t0);
                rc = strata_wait_durable(&s, h); /* with a communicator: every rank calls it */
                rc = rc ? rc : src;
                t_done = cli_now() - t0;
                strata_handle_free(h);
            }
        } else {
            rc = save ? strata_save(&s, sv, uris, nuris, &st, 1, &so)
                      : strata_load(&s, comm, uris, nuris, &st, 1, NULL);
        }
        if (rc) {
            status = cli_fail("demo", rc);
            if (rc == STRATA_EABORTED) /* a peer is gone: MPI cannot finish cleanly */
                _exit(status);
            goto out;
        }
        double mx = s.seconds;
        reduce(&s.seconds, &mx, 1, MPI_DOUBLE, MPI_MAX);
        if (rank == 0)
            fprintf(stderr, "%s %s\n", save ? "saved" : "loaded", dir);
        if (save && rank == 0)
            printf("save %lld: %s, %d ranks, %llu bytes in %.3f s (%.3f GB/s), plan %s\n", i,
                   dir, world, (unsigned long long)s.all_bytes, mx, (double)s.all_bytes / mx / 1e9,
                   s.plan_cached ? "cached" : "built");
        if (save && a.async) { /* the slowest rank's start, snapshot and commit */
            double t[3] = {t_start, t_snap, t_done}, mx3[3];
            reduce(t, mx3, 3, MPI_DOUBLE, MPI_MAX);
            const char *why;
            int bg = strata_saver_background(&why, sv);
            if (rank == 0)
                printf("  async: started in %.3f ms, snapshot after %.1f ms, committed after "
                       "%.1f ms %s%s%s\n", mx3[0] * 1e3, mx3[1] * 1e3, mx3[2] * 1e3,
                       bg == 1 ? "(in the background)" : "(in strata_wait_durable: ",
                       bg == 1 ? "" : why, bg == 1 ? "" : ")");
        }
        if (!save) {
            for (int j = 0; j < n; j++) {
                uint64_t first, nb = synth_check(&m, &sh[j], &first);
                if (nb && !bad)
                    fprintf(stderr, "rank %d: tensor %s: %llu wrong elements, first at %llu\n",
                            rank, m.t[sh[j].tensor].name, (unsigned long long)nb,
                            (unsigned long long)first);
                bad += nb;
            }
            unsigned char want[SYNTH_RNG_BYTES];
            k = 0;
            for (int o = rank; o < saved_world; o += world, k++) {
                unsigned char *b = blobs + (size_t)k * (SYNTH_RNG_BYTES + SYNTH_LOADER_BYTES);
                synth_blob("rng", o, want, SYNTH_RNG_BYTES);
                bad += memcmp(b, want, SYNTH_RNG_BYTES) != 0;
                synth_blob("dataloader", o, want, SYNTH_LOADER_BYTES);
                bad += memcmp(b + SYNTH_RNG_BYTES, want, SYNTH_LOADER_BYTES) != 0;
            }
            bad += memcmp(got_cfg, config, strlen(config)) != 0;
            uint64_t all_bad = 0;
            reduce(&bad, &all_bad, 1, MPI_UINT64_T, MPI_SUM);
            if (rank == 0) {
                const int tier = s.tier >= 0 && s.tier < nuris ? s.tier : 0;
                char which[32] = "";
                if (a.also)
                    snprintf(which, sizeof which, " (tier %d of 2)", tier + 1);
                printf("load: %s%s into %s on %d ranks: %llu bytes read in %.3f s (%.3f GB/s), "
                       "step %llu, %s\n",
                       uris[tier], which, a.layout, world, (unsigned long long)s.all_bytes, mx,
                       (double)s.all_bytes / mx / 1e9, (unsigned long long)got_step,
                       all_bad ? "MISMATCH" : "every element and blob byte matches");
                printf("saved_bytes=%llu read_bytes=%llu save_gbps=0 load_gbps=%.3f ok=%d\n",
                       (unsigned long long)s.data_bytes, (unsigned long long)s.all_bytes,
                       (double)s.all_bytes / mx / 1e9, all_bad == 0);
            }
            status = all_bad ? EXIT_OPFAIL : 0;
        } else if (rank == 0 && i == reps) {
            printf("checkpoint: %s\n", a.dir);
            printf("saved_bytes=%llu read_bytes=0 save_gbps=%.3f load_gbps=0 ok=1\n",
                   (unsigned long long)s.all_bytes, (double)s.all_bytes / mx / 1e9);
        }
    }
out:
    fflush(stdout);
    strata_saver_free(sv);
    strata_pool_free(pool);
    strata_state_free(st);
    strata_comm_free(comm);
    for (int i = 0; i < n; i++)
        free(sh[i].data);
    free(blobs);
    synth_ranks_free(&rs);
    synth_model_free(&m);
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
