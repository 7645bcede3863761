/* mpi_plan.c - the stored save plan across a restart, on MPI ranks (run by tests/mpi_test.sh
 * under mpiexec, on 8 processes, three jobs in a row). The collectives are counted through
 * the communicator: this program wraps MPI_Iallgather, MPI_Ialltoallv and MPI_Ibcast (the
 * MPI communicator's only collectives; the PMPI interface) and counts the calls and bytes
 * of each save on every rank.
 *   first DIR    saves the state to DIR/a (a plan made) and DIR/a2 (the plan cached in the
 *                saver), writing the two saves' counts to DIR/counts;
 *   restart DIR  a new job: strata_saver_reuse_plan(DIR/a), then a save to DIR/b, which
 *                must be cached on every rank and make the cached save's collectives,
 *                no more (no planning collective);
 *   changed DIR  a new job whose rank 1 registers one more tensor: reuse_plan(DIR/a), then
 *                a save to DIR/c, which must plan afresh (the change found) with the first
 *                save's collectives.
 * Each phase loads what it saved on every rank and checks it bitwise. The state: a weight
 * by rows over tp = 2, a bias replicated (tensor-parallel copies marked), their data-
 * parallel copies marked, ZeRO flat pieces of an f32 state (the bias's cut elsewhere on tp
 * rank 1), a per-rank blob. Prints "ok <check>" / "FAIL <check>" on rank 0 and the counts;
 * exits 1 if anything failed. Usage: mpiexec -n P (even, 4+) build/tests/mpi_plan PHASE DIR */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"
#include "strata_mpi.h"

static int me, P, failed;
static strata_comm *comm;

/* ---- the collectives, counted ---- */

static unsigned long calls[3];
static unsigned long long moved; /* bytes this rank received */

int MPI_Iallgather(const void *sendbuf, int sendcount, MPI_Datatype sendtype, void *recvbuf,
                   int recvcount, MPI_Datatype recvtype, MPI_Comm c, MPI_Request *request)
{
    int n;
    PMPI_Comm_size(c, &n);
    calls[0]++;
    moved += (unsigned long long)recvcount * (unsigned long long)n;
    return PMPI_Iallgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, c, request);
}

int MPI_Ialltoallv(const void *sendbuf, const int sendcounts[], const int sdispls[],
                   MPI_Datatype sendtype, void *recvbuf, const int recvcounts[],
                   const int rdispls[], MPI_Datatype recvtype, MPI_Comm c, MPI_Request *request)
{
    int n;
    PMPI_Comm_size(c, &n);
    calls[1]++;
    for (int i = 0; i < n; i++)
        moved += (unsigned long long)recvcounts[i];
    return PMPI_Ialltoallv(sendbuf, sendcounts, sdispls, sendtype, recvbuf, recvcounts, rdispls,
                           recvtype, c, request);
}

int MPI_Ibcast(void *buffer, int count, MPI_Datatype datatype, int root, MPI_Comm c,
               MPI_Request *request)
{
    calls[2]++;
    moved += (unsigned long long)count;
    return PMPI_Ibcast(buffer, count, datatype, root, c, request);
}

/* ---- checks ---- */

static void check(const char *what, int ok)
{
    int all = 0;
    PMPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    if (me == 0)
        printf("%s %s\n", all ? "ok  " : "FAIL", what);
    failed |= !all;
}

static int ok_rc(int rc, const char *what)
{
    if (rc)
        fprintf(stderr, "rank %d: %s: %s: %s\n", me, what, strata_error_name(rc),
                strata_error_last());
    return rc == 0;
}

/* ---- the state ---- */

#define ROWS 37
#define COLS 64
#define BIAS 45
static const uint64_t wshape[] = {ROWS, COLS}, bshape[] = {BIAS}, xshape[] = {7};

typedef struct {
    float w[ROWS * COLS], b[BIAS], ow[ROWS * COLS], ob[BIAS], x[7];
    unsigned char blob[100];
} model;

static void model_fill(model *m, int poison)
{
    for (int i = 0; i < ROWS * COLS; i++) {
        m->w[i] = poison ? -1.0f : (float)i * 0.5f;
        m->ow[i] = poison ? -1.0f : (float)i * 0.25f + 3;
    }
    for (int i = 0; i < BIAS; i++) {
        m->b[i] = poison ? -1.0f : (float)i + 0.125f;
        m->ob[i] = poison ? -1.0f : (float)i * 3 + 0.5f;
    }
    for (int i = 0; i < 7; i++)
        m->x[i] = poison ? -1.0f : (float)i * 9;
    for (int i = 0; i < 100; i++)
        m->blob[i] = poison ? 0 : (unsigned char)(i + me);
}

static int add(strata_state *st, const char *name, int ndim, const uint64_t *shape,
               const uint64_t *off, const uint64_t *len, int flat, uint64_t fs, uint64_t fe,
               float *data, unsigned flags)
{
    strata_shard s = {name, STRATA_F32, ndim, shape, off, len, flat, fs, fe, data, 0, flags};
    return strata_state_add_shard(st, &s);
}

/* This rank's state over m (its pieces point into m's arrays at their places: the load
 * writes them there); extra: one more tensor (rank 1's changed layout). */
static strata_state *state_of(model *m, int extra)
{
    strata_state *st;
    strata_state_new(&st);
    int tp = me % 2, dp = me / 2, DP = P / 2;
    uint64_t r0 = tp ? 18 : 0, nr = tp ? ROWS - 18 : 18;
    uint64_t off[] = {r0, 0}, len[] = {nr, COLS};
    unsigned copy = dp ? STRATA_SHARD_REPLICA : 0;
    int rc = add(st, "w", 2, wshape, off, len, 0, 0, 0, m->w + r0 * COLS, copy);
    rc = rc ? rc : add(st, "b", 1, bshape, NULL, NULL, 0, 0, 0, m->b,
                       copy | (tp ? STRATA_SHARD_REPLICA : 0));
    /* ZeRO: the f32 state of (this tp rank's rows of w, b), cut over dp */
    uint64_t wn = nr * COLS, total = wn + BIAS;
    uint64_t lo = total * (uint64_t)dp / (uint64_t)DP, hi = total * (uint64_t)(dp + 1) / (uint64_t)DP;
    if (!rc && lo < wn)
        rc = add(st, "ow", 2, wshape, off, len, 1, lo, hi < wn ? hi : wn, m->ow + r0 * COLS + lo, 0);
    if (!rc && hi > wn) {
        uint64_t a = lo > wn ? lo - wn : 0;
        rc = add(st, "ob", 1, bshape, NULL, NULL, 1, a, hi - wn, m->ob + a,
                 tp ? STRATA_SHARD_REPLICA : 0);
    }
    if (!rc && extra)
        rc = add(st, "x", 1, xshape, NULL, NULL, 0, 0, 0, m->x, 0);
    if (!rc)
        rc = strata_state_add_blob(st, "rng", STRATA_BLOB_RANK_LOCAL, me, m->blob, sizeof m->blob);
    if (rc) {
        ok_rc(rc, "registering the state");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return st;
}

typedef struct {
    unsigned long calls[3];
    unsigned long long moved;
    int cached;
} counted;

/* One synchronous save of st to path; its collectives on this rank. */
static int save(strata_saver *sv, strata_state *st, const char *path, counted *c)
{
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = STRATA_SAVE_NO_SYNC;
    o.chunk_bytes = 4096;
    strata_stats stats = STRATA_STATS_INIT;
    unsigned long c0[3] = {calls[0], calls[1], calls[2]};
    unsigned long long m0 = moved;
    int rc = strata_save(&stats, sv, &path, 1, &st, 1, &o);
    for (int i = 0; i < 3; i++)
        c->calls[i] = calls[i] - c0[i];
    c->moved = moved - m0;
    c->cached = stats.plan_cached;
    return ok_rc(rc, path);
}

/* path loads on every rank into this rank's layout, bitwise. */
static int loads(const char *path, int extra)
{
    model want, got;
    model_fill(&want, 0);
    model_fill(&got, 1);
    strata_state *st = state_of(&got, extra);
    int rc = strata_load(NULL, comm, &path, 1, &st, 1, NULL);
    strata_state_free(st);
    if (!ok_rc(rc, path))
        return 0;
    /* compare what this rank registered: its rows of w, all of b, its ZeRO range */
    int tp = me % 2;
    uint64_t r0 = tp ? 18 : 0, nr = tp ? ROWS - 18 : 18;
    if (memcmp(got.w + r0 * COLS, want.w + r0 * COLS, nr * COLS * 4) ||
        memcmp(got.b, want.b, sizeof got.b) || memcmp(got.blob, want.blob, sizeof got.blob) ||
        (extra && memcmp(got.x, want.x, sizeof got.x)))
        return 0;
    for (int i = 0; i < ROWS * COLS; i++)
        if (got.ow[i] != -1.0f && got.ow[i] != want.ow[i])
            return 0;
    for (int i = 0; i < BIAS; i++)
        if (got.ob[i] != -1.0f && got.ob[i] != want.ob[i])
            return 0;
    return 1;
}

static void say(const char *what, const counted *c)
{
    if (me == 0)
        printf("     %s: allgather %lu, alltoallv %lu, bcast %lu; %llu bytes to rank 0; plan %s\n",
               what, c->calls[0], c->calls[1], c->calls[2], c->moved,
               c->cached ? "cached" : "made");
}

static int same_calls(const counted *a, const counted *b)
{
    return memcmp(a->calls, b->calls, sizeof a->calls) == 0;
}

static int all_cached(const counted *c, int want)
{
    return c->cached == want;
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    if (argc != 3 || P < 4 || P % 2) {
        if (me == 0)
            fprintf(stderr, "usage: mpiexec -n P (even, 4 or more) %s first|restart|changed DIR\n",
                    argv[0]);
        MPI_Finalize();
        return 2;
    }
    const char *phase = argv[1], *dir = argv[2];
    MPI_Comm world = MPI_COMM_WORLD;
    if (!ok_rc(strata_comm_mpi(&comm, &world), "strata_comm_mpi"))
        MPI_Abort(MPI_COMM_WORLD, 2);
    strata_saver *sv;
    strata_saver_new(&sv, comm, NULL);
    char a[600], a2[600], out[600], counts[600], what[256];
    snprintf(a, sizeof a, "%s/a", dir);
    snprintf(a2, sizeof a2, "%s/a2", dir);
    snprintf(counts, sizeof counts, "%s/counts", dir);
    model m;
    model_fill(&m, 0);
    int extra = strcmp(phase, "changed") == 0 && me == 1;
    strata_state *st = state_of(&m, extra);
    counted fresh, cached, now;
    if (strcmp(phase, "first") == 0) {
        check("save 1 on fresh ranks: the plan made", save(sv, st, a, &fresh) &&
              all_cached(&fresh, 0));
        check("save 2 through the same saver: the plan cached", save(sv, st, a2, &cached) &&
              all_cached(&cached, 1));
        say("save 1", &fresh);
        say("save 2", &cached);
        check("the cached save makes fewer collectives", cached.calls[0] + cached.calls[1] +
              cached.calls[2] < fresh.calls[0] + fresh.calls[1] + fresh.calls[2]);
        FILE *f = me == 0 ? fopen(counts, "w") : NULL;
        if (f) {
            fprintf(f, "%lu %lu %lu %lu %lu %lu\n", fresh.calls[0], fresh.calls[1],
                    fresh.calls[2], cached.calls[0], cached.calls[1], cached.calls[2]);
            fclose(f);
        }
        check("save 1 loads bitwise on every rank", loads(a, 0));
    } else {
        FILE *f = fopen(counts, "r");
        int n = f ? fscanf(f, "%lu %lu %lu %lu %lu %lu", &fresh.calls[0], &fresh.calls[1],
                           &fresh.calls[2], &cached.calls[0], &cached.calls[1],
                           &cached.calls[2]) : 0;
        if (f)
            fclose(f);
        check("the first job's counts are there", n == 6);
        int rc = strata_saver_reuse_plan(sv, a);
        check("strata_saver_reuse_plan(a) on every rank", ok_rc(rc, "strata_saver_reuse_plan"));
        int changed = strcmp(phase, "changed") == 0;
        snprintf(out, sizeof out, "%s/%s", dir, changed ? "c" : "b");
        int ok = save(sv, st, out, &now);
        say(changed ? "restarted, rank 1 changed" : "restarted", &now);
        if (changed) {
            snprintf(what, sizeof what, "restarted with rank 1's layout changed: found, the plan "
                     "made afresh (the first save's %lu collectives)",
                     fresh.calls[0] + fresh.calls[1] + fresh.calls[2]);
            check(what, ok && all_cached(&now, 0) && same_calls(&now, &fresh));
        } else {
            snprintf(what, sizeof what, "restarted with the same layout: the stored plan used, no "
                     "planning collective (the cached save's %lu, not the %lu of a save that plans)",
                     cached.calls[0] + cached.calls[1] + cached.calls[2],
                     fresh.calls[0] + fresh.calls[1] + fresh.calls[2]);
            check(what, ok && all_cached(&now, 1) && same_calls(&now, &cached));
        }
        check("what it saved loads bitwise on every rank", loads(out, extra));
    }
    strata_state_free(st);
    strata_saver_free(sv);
    strata_comm_free(comm);
    MPI_Finalize();
    return failed;
}
