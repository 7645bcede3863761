/* mpi_incr.c - incremental saves on MPI ranks (run by tests/mpi_test.sh under mpiexec, on
 * 2 and 3 processes): a LoRA-style state (a frozen weight, adapters and AdamW moments,
 * split by rows over the ranks) saved 6 times, each save naming the one before as its
 * base, synchronously and asynchronously, through one saver (its plan cached). Checks,
 * from the files on disk: each rank's frozen rows are its base file, hard-linked, and
 * each rank's own data file holds only its adapters; every step loads bitwise on every
 * rank (the same layout) and on one process (whole tensors), and verifies; retention
 * keeping 3 removes the bases the newer steps refer to, which still load; a save where
 * rank 1 cannot link (EXDEV) has rank 1 write its frozen rows itself, losing nothing.
 * Prints "ok <check>" / "FAIL <check>" lines on rank 0 and the bytes each rank wrote;
 * exits 1 if anything failed.
 * Usage: mpiexec -n P build/tests/mpi_incr DIR */
#include <dirent.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "io/vfs_fault.h"
#include "strata.h"
#include "strata_mpi.h"

#define CHUNK 16384u
#define NT 5
#define COLS 512
#define STEPS 6
static const char *names[NT] = {"base.w", "lora.a", "lora.b", "opt.a.exp_avg", "opt.a.exp_avg_sq"};
static const uint64_t rows[NT] = {96, 8, 8, 8, 8};

static int me, P, failed;
static strata_comm *comm;

static uint64_t tbytes(int i) { return rows[i] * COLS * 4; }
static uint64_t lo(int i, int r) { return rows[i] * (uint64_t)r / (uint64_t)P; }

typedef struct {
    float *t[NT];
    unsigned char blob[64];
} vals;

static uint64_t mix(uint64_t x)
{
    x ^= x >> 31;
    x *= 0x9e3779b97f4a7c15ULL;
    return x ^ (x >> 29);
}

static void vals_init(vals *v)
{
    for (int i = 0; i < NT; i++) {
        v->t[i] = malloc(tbytes(i));
        for (uint64_t k = 0; k < rows[i] * COLS; k++)
            v->t[i][k] = (float)(mix(k * 31 + (uint64_t)i) % 1000) / 7.0f;
    }
    memset(v->blob, 0, sizeof v->blob);
}

/* A training step: every tensor but the frozen one changes (the same on every rank). */
static void vals_step(vals *v, int step)
{
    for (int i = 1; i < NT; i++)
        for (uint64_t k = mix((uint64_t)step) % 7; k < rows[i] * COLS; k += 5)
            v->t[i][k] += (float)step;
    memset(v->blob, step, sizeof v->blob);
}

static vals *vals_copy(const vals *s)
{
    vals *d = malloc(sizeof *d);
    for (int i = 0; i < NT; i++) {
        d->t[i] = malloc(tbytes(i));
        memcpy(d->t[i], s->t[i], tbytes(i));
    }
    memcpy(d->blob, s->blob, sizeof d->blob);
    return d;
}

/* This rank's state: rows lo..hi of each tensor of v (whole tensors with whole = 1). */
static strata_state *state_of(vals *v, int whole)
{
    strata_state *st;
    strata_state_new(&st);
    for (int i = 0; i < NT; i++) {
        uint64_t shape[2] = {rows[i], COLS}, off[2] = {whole ? 0 : lo(i, me), 0},
                 len[2] = {whole ? rows[i] : lo(i, me + 1) - lo(i, me), COLS};
        strata_shard sh = {.name = names[i], .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .offsets = off, .lengths = len,
                           .data = v->t[i] + off[0] * COLS};
        strata_state_add_shard(st, &sh);
    }
    strata_state_add_blob(st, "step", 0, -1, v->blob, sizeof v->blob);
    return st;
}

/* Every rank's verdict on a check (each rank's own failure is printed by that rank). */
static void check(const char *what, int ok)
{
    int all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    if (!all)
        failed = 1;
    if (me == 0)
        printf("%s %s\n", all ? "ok  " : "FAIL", what);
    fflush(stdout);
}

static int ok_rc(int rc, const char *what)
{
    if (rc)
        fprintf(stderr, "rank %d: %s: %s: %s\n", me, what, strata_error_name(rc),
                strata_error_last());
    return rc == 0;
}

/* Loads path into a fresh copy (on every rank, this rank's rows; or, on rank 0 alone,
 * whole tensors) and compares with want. */
static int loads_same(const char *path, const vals *want, int alone)
{
    vals d;
    vals_init(&d);
    for (int i = 0; i < NT; i++)
        memset(d.t[i], 0xff, tbytes(i));
    strata_state *st = state_of(&d, alone);
    int ok = ok_rc(strata_load(NULL, alone ? NULL : comm, &path, 1, &st, 1, NULL), path);
    for (int i = 0; ok && i < NT; i++) {
        uint64_t a = alone ? 0 : lo(i, me), b = alone ? rows[i] : lo(i, me + 1);
        if (memcmp(d.t[i] + a * COLS, want->t[i] + a * COLS, (b - a) * COLS * 4) != 0) {
            fprintf(stderr, "rank %d: %s: %s differs\n", me, path, names[i]);
            ok = 0;
        }
    }
    if (ok && memcmp(d.blob, want->blob, sizeof d.blob) != 0)
        ok = 0;
    strata_state_free(st);
    for (int i = 0; i < NT; i++)
        free(d.t[i]);
    return ok;
}

/* From the disk: this rank's data file's size, and whether its base file is linked (a
 * ref-...-<rank>.bin with more than one name). */
static void on_disk(const char *path, uint64_t *mine, int *linked, int *nref)
{
    char p[1200];
    struct stat st;
    snprintf(p, sizeof p, "%s/data-%06d.bin", path, me);
    *mine = stat(p, &st) == 0 ? (uint64_t)st.st_size : 0;
    *linked = 0;
    *nref = 0;
    DIR *d = opendir(path);
    for (struct dirent *e; d && (e = readdir(d));) {
        int r;
        const char *dash = strrchr(e->d_name, '-');
        if (strncmp(e->d_name, "ref-", 4) != 0 || !dash)
            continue;
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        if (stat(p, &st) != 0 || st.st_nlink < 2)
            continue;
        (*nref)++;
        if (sscanf(dash, "-%d.bin", &r) == 1 && r == me)
            *linked = 1;
    }
    if (d)
        closedir(d);
}

static int save(strata_saver *sv, const char *uri, strata_state *st, const char *base,
                int async, strata_stats *stats)
{
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = CHUNK;
    o.flags = STRATA_SAVE_NO_SYNC | STRATA_SAVE_INCREMENTAL;
    o.base = base;
    *stats = (strata_stats)STRATA_STATS_INIT;
    if (!async)
        return strata_save(stats, sv, &uri, 1, &st, 1, &o);
    strata_handle *h;
    int rc = strata_save_start(&h, sv, &uri, 1, &st, 1, &o);
    if (!rc) {
        rc = strata_wait_durable(stats, h);
        strata_handle_free(h);
    }
    return rc;
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    if (argc != 2 || P < 2) {
        if (me == 0)
            fprintf(stderr, "usage: mpiexec -n P (2 or more) %s DIR\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    MPI_Comm world = MPI_COMM_WORLD;
    st_vfs_fault_register();
    if (!ok_rc(strata_comm_mpi(&comm, &world), "strata_comm_mpi"))
        MPI_Abort(MPI_COMM_WORLD, 2);
    strata_saver *sv;
    strata_saver_new(&sv, comm, NULL);
    const char *dir = argv[1];
    char path[STEPS + 1][600], name[32], what[256];
    vals v, *keep[STEPS + 1];
    vals_init(&v);
    strata_state *st = state_of(&v, 0);
    uint64_t frozen_mine = (lo(0, me + 1) - lo(0, me)) * COLS * 4, total = 0, adapters = 4096;
    for (int i = 1; i < NT; i++) /* this rank's adapter rows, each extent 4 KiB aligned (and
                                    the blob, if this rank writes it) */
        adapters += ((lo(i, me + 1) - lo(i, me)) * COLS * 4 + 4095) / 4096 * 4096;
    for (int i = 0; i < NT; i++)
        total += tbytes(i);
    total += sizeof v.blob;
    for (int s = 0; s <= STEPS; s++)
        snprintf(path[s], sizeof path[s], "%s/step-%02d", dir, s);

    for (int s = 0; s < STEPS; s++) {
        if (s)
            vals_step(&v, s);
        keep[s] = vals_copy(&v);
        snprintf(name, sizeof name, "step-%02d", s - 1);
        strata_stats stats;
        int ok = ok_rc(save(sv, path[s], st, s ? name : NULL, s % 2, &stats), path[s]);
        snprintf(what, sizeof what, "step %d saved on %d ranks (%s%s)", s, P,
                 s % 2 ? "async" : "sync", s ? ", base: the step before" : ", full");
        check(what, ok);
        uint64_t mine;
        int linked, nref;
        on_disk(path[s], &mine, &linked, &nref);
        /* each rank: its frozen rows linked from the base, its own file without them */
        ok = s ? linked && nref == P && mine <= adapters && mine < frozen_mine &&
                     stats.all_bytes == total - tbytes(0) && stats.data_bytes == total
               : !linked && nref == 0 && mine >= frozen_mine && stats.all_bytes == total;
        if (!ok)
            fprintf(stderr, "rank %d: step %d: data file %llu bytes, own base file linked "
                    "%d, %d links, written by all %llu of %llu\n", me, s,
                    (unsigned long long)mine, linked, nref,
                    (unsigned long long)stats.all_bytes, (unsigned long long)stats.data_bytes);
        unsigned long long all_mine[8] = {0}, m = mine;
        MPI_Gather(&m, 1, MPI_UNSIGNED_LONG_LONG, all_mine, 1, MPI_UNSIGNED_LONG_LONG, 0,
                   MPI_COMM_WORLD);
        if (me == 0 && P <= 8) {
            printf("     step %d: bytes written per rank (data files on disk):", s);
            for (int r = 0; r < P; r++)
                printf(" %llu", all_mine[r]);
            printf(" of %llu in the checkpoint\n", (unsigned long long)total);
        }
        snprintf(what, sizeof what, "step %d: %s", s,
                 s ? "each rank's frozen rows are its base file, hard-linked; only adapters "
                     "written"
                   : "everything written, nothing linked");
        check(what, ok);
    }
    for (int s = 0; s < STEPS; s++) {
        snprintf(what, sizeof what, "step %d loads bitwise on %d ranks", s, P);
        check(what, loads_same(path[s], keep[s], 0));
        int ok = 1;
        if (me == 0) {
            strata_ckpt *ck = NULL;
            ok = loads_same(path[s], keep[s], 1) &&
                 ok_rc(strata_ckpt_open(&ck, path[s], 0), "open") &&
                 ok_rc(strata_ckpt_verify(ck, NULL, NULL), "verify");
            strata_ckpt_free(ck);
        }
        snprintf(what, sizeof what, "step %d loads bitwise on 1 process and verifies", s);
        check(what, ok);
    }
    /* retention keeps 3: steps 0..2 go (bases of 3..5), which still load */
    int removed = -1, ok = 1;
    if (me == 0)
        ok = ok_rc(strata_retain(&removed, dir, 3), "retain") && removed == 3;
    check("retention keeping 3 removes steps 0-2", ok);
    for (int s = 3; s < STEPS; s++) {
        snprintf(what, sizeof what, "step %d loads bitwise on %d ranks after its bases went",
                 s, P);
        check(what, loads_same(path[s], keep[s], 0));
    }
    /* rank 1 cannot link (EXDEV on every link it tries): it writes its frozen rows */
    vals_step(&v, STEPS);
    keep[STEPS] = vals_copy(&v);
    char fault[800];
    snprintf(fault, sizeof fault, "fault+file://%s?op=rename&n=1&sticky=1&errno=EXDEV",
             path[STEPS]);
    snprintf(name, sizeof name, "step-%02d", STEPS - 1);
    strata_stats stats;
    ok = ok_rc(save(sv, me == 1 ? fault : path[STEPS], st, name, 1, &stats), "save");
    uint64_t mine;
    int linked, nref;
    on_disk(path[STEPS], &mine, &linked, &nref);
    ok = ok && (me == 1 ? !linked && mine >= frozen_mine : linked && mine <= adapters) &&
         nref == P - 1;
    if (!ok)
        fprintf(stderr, "rank %d: data file %llu bytes, own base file linked %d, %d links\n",
                me, (unsigned long long)mine, linked, nref);
    check("rank 1 cannot link: it writes its frozen rows itself, the others link theirs", ok);
    ok = 1;
    if (me == 0)
        ok = ok_rc(strata_retain(&removed, dir, 1), "retain");
    check("retention keeping 1 removes its base", ok);
    check("the step where rank 1 could not link loads bitwise on every rank",
          loads_same(path[STEPS], keep[STEPS], 0));

    strata_state_free(st);
    strata_saver_free(sv);
    strata_comm_free(comm);
    MPI_Finalize();
    return failed;
}
