/* comm_mpi.c - the MPI communicator (MPICH), libstrata_mpi: host collectives plugged in
 * through strata_comm_host, on the public API alone. Every collective is nonblocking
 * underneath and polled against the communicator's time limit, so a dead peer makes the
 * call return STRATA_EABORTED instead of hanging. Errors are returned, never fatal
 * (MPI_ERRORS_RETURN on a private duplicate of the caller's communicator). One thread at
 * a time, as every strata_comm; the duplicate a saver makes for its commit thread (m_dup)
 * needs MPI_THREAD_MULTIPLE, since that thread calls MPI while the caller's may. */
#include <limits.h>
#include <mpi.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "strata_mpi.h"

typedef struct {
    MPI_Comm comm;
    strata_comm *owner; /* for the time limit */
    int *ic;            /* 4 * size ints: counts and displacements */
} mpi_ctx;

/* Monotonic seconds. */
static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int mpi_err(int e, const char *what)
{
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(e, s, &n);
    return strata_error_set(STRATA_EABORTED, "MPI %s: %s", what, s);
}

/* Polls req until done or the time limit passes. MPI progresses a transfer only inside
 * its calls, so the first second polls back to back (yielding the core to other ranks on
 * it); after that the wait is for a slow or dead peer, and polls back off to 1 ms apart. */
static int wait_for(mpi_ctx *m, MPI_Request *req, const char *what)
{
    int timeout_ms = strata_comm_timeout(m->owner);
    double t0 = now_s();
    double limit = timeout_ms > 0 ? t0 + timeout_ms / 1000.0 : 0;
    long sleep_ns = 1000;
    for (;;) {
        int done = 0;
        int e = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (e != MPI_SUCCESS)
            return mpi_err(e, what);
        if (done)
            return 0;
        double now = now_s();
        if (limit && now > limit)
            return strata_error_set(STRATA_EABORTED,
                           "MPI %s: no answer from the other ranks within %d ms (a rank died "
                           "or stopped)",
                           what, timeout_ms);
        if (now - t0 < 1.0) {
            sched_yield();
            continue;
        }
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 1000000)
            sleep_ns *= 2;
    }
}

static int m_allgather(void *ctx, const void *send, size_t n, void *recv)
{
    mpi_ctx *m = ctx;
    if (n > INT_MAX)
        return strata_error_set(STRATA_EINVAL, "MPI allgather of %zu bytes is too large", n);
    MPI_Request req;
    int e = MPI_Iallgather(send, (int)n, MPI_BYTE, recv, (int)n, MPI_BYTE, m->comm, &req);
    return e != MPI_SUCCESS ? mpi_err(e, "allgather") : wait_for(m, &req, "allgather");
}

static int m_alltoallv(void *ctx, const void *send, const size_t *sc, void *recv,
                       const size_t *rc)
{
    mpi_ctx *m = ctx;
    int P;
    MPI_Comm_size(m->comm, &P);
    int *scnt = m->ic, *sdis = m->ic + P, *rcnt = m->ic + 2 * P, *rdis = m->ic + 3 * P;
    size_t so = 0, ro = 0;
    for (int r = 0; r < P; r++) {
        if (sc[r] > INT_MAX || rc[r] > INT_MAX || so > INT_MAX || ro > INT_MAX)
            return strata_error_set(STRATA_EINVAL, "MPI alltoallv: more than 2 GiB in one exchange");
        scnt[r] = (int)sc[r];
        sdis[r] = (int)so;
        rcnt[r] = (int)rc[r];
        rdis[r] = (int)ro;
        so += sc[r];
        ro += rc[r];
    }
    MPI_Request req;
    int e = MPI_Ialltoallv(send, scnt, sdis, MPI_BYTE, recv, rcnt, rdis, MPI_BYTE, m->comm, &req);
    return e != MPI_SUCCESS ? mpi_err(e, "alltoallv") : wait_for(m, &req, "alltoallv");
}

static int m_bcast(void *ctx, void *buf, size_t n, int root)
{
    mpi_ctx *m = ctx;
    char *p = buf;
    while (n) { /* in pieces below 2 GiB */
        int k = n > (1u << 30) ? 1 << 30 : (int)n;
        MPI_Request req;
        int e = MPI_Ibcast(p, k, MPI_BYTE, root, m->comm, &req);
        if (e != MPI_SUCCESS)
            return mpi_err(e, "bcast");
        if ((e = wait_for(m, &req, "bcast")))
            return e;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static void m_destroy(void *ctx)
{
    mpi_ctx *m = ctx;
    MPI_Comm_free(&m->comm);
    free(m->ic);
    free(m);
}

static int m_dup(void *ctx, strata_comm **out);

static const strata_comm_ops mpi_ops = {STRATA_COMM_OPS_VERSION, m_allgather, m_alltoallv,
                                        m_bcast, m_destroy, m_dup};

/* A strata communicator over a duplicate of base (made nonblocking and polled when
 * `owner` gives a time limit: a rank that never joins the duplication cannot hang it). */
static int make(strata_comm **out, MPI_Comm base, strata_comm *owner)
{
    *out = NULL;
    mpi_ctx *m = calloc(1, sizeof *m);
    if (!m)
        return strata_error_set(STRATA_ENOMEM, "out of memory");
    int e;
    if (owner) {
        MPI_Request req;
        m->owner = owner;
        e = MPI_Comm_idup(base, &m->comm, &req);
        if (e == MPI_SUCCESS && (e = wait_for(m, &req, "comm_idup")))
            return e; /* m is left: MPI may still complete the request into m->comm */
    } else {
        e = MPI_Comm_dup(base, &m->comm);
    }
    if (e != MPI_SUCCESS) {
        free(m);
        return mpi_err(e, "comm_dup");
    }
    MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    int rank, size;
    MPI_Comm_rank(m->comm, &rank);
    MPI_Comm_size(m->comm, &size);
    m->ic = malloc(4 * (size_t)size * sizeof *m->ic);
    int rc = m->ic ? strata_comm_host(out, &mpi_ops, m, rank, size)
                   : strata_error_set(STRATA_ENOMEM, "out of memory");
    if (rc) { /* strata_comm_host failed: it did not take ctx */
        m_destroy(m);
        return rc;
    }
    m->owner = *out;
    return 0;
}

static const char *level_name(int l)
{
    return l == MPI_THREAD_SINGLE       ? "MPI_THREAD_SINGLE"
           : l == MPI_THREAD_FUNNELED   ? "MPI_THREAD_FUNNELED"
           : l == MPI_THREAD_SERIALIZED ? "MPI_THREAD_SERIALIZED"
                                        : "MPI_THREAD_MULTIPLE";
}

/* The saver's commit thread calls MPI while the caller's thread may: that needs
 * MPI_THREAD_MULTIPLE (MPI_Init_thread), else the commits stay on the caller's thread. */
static int m_dup(void *ctx, strata_comm **out)
{
    mpi_ctx *m = ctx;
    *out = NULL;
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE)
        return strata_error_set(STRATA_EINVAL, "MPI was initialised with %s, not "
                                "MPI_THREAD_MULTIPLE (MPI_Init_thread): a commit thread cannot "
                                "call MPI beside the caller's", level_name(level));
    return make(out, m->comm, m->owner);
}

int strata_comm_mpi(strata_comm **out, const void *mpi_comm)
{
    *out = NULL;
    int init = 0;
    MPI_Initialized(&init);
    if (!init)
        return strata_error_set(STRATA_EINVAL, "MPI is not initialised");
    return make(out, mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD, NULL);
}
