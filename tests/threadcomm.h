/* threadcomm.h - a strata communicator whose ranks are threads of one process (host
 * collectives over a barrier), for the tests of distributed saves and loads. Each rank's
 * strata_comm_host gets &tops and its own tcomm {hub, rank}; the hub's arrays hold one
 * entry per rank and the barrier counts every rank. */
#ifndef STRATA_THREADCOMM_H
#define STRATA_THREADCOMM_H
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"

typedef struct {
    int size;
    pthread_barrier_t bar;
    const void **send;      /* per rank, published for one collective */
    const size_t **scounts; /* alltoallv: per rank */
    unsigned long calls[3]; /* the collectives rank 0 took part in: allgather, alltoallv,
                               bcast (the tests that count them read them between calls) */
    unsigned long long moved; /* bytes rank 0 received through them */
} hub;

static inline void hub_init(hub *h, int n)
{
    memset(h, 0, sizeof *h);
    h->size = n;
    pthread_barrier_init(&h->bar, NULL, (unsigned)n);
    h->send = calloc((size_t)n, sizeof *h->send);
    h->scounts = calloc((size_t)n, sizeof *h->scounts);
}

static inline void hub_free(hub *h)
{
    pthread_barrier_destroy(&h->bar);
    free(h->send);
    free(h->scounts);
}

typedef struct {
    hub *h;
    int rank;
} tcomm;

static int t_allgather(void *ctx, const void *send, size_t n, void *recv)
{
    tcomm *c = ctx;
    hub *h = c->h;
    if (c->rank == 0) {
        h->calls[0]++;
        h->moved += (unsigned long long)n * (unsigned long long)h->size;
    }
    h->send[c->rank] = send;
    pthread_barrier_wait(&h->bar);
    for (int r = 0; r < h->size; r++)
        if (n)
            memcpy((char *)recv + (size_t)r * n, h->send[r], n);
    pthread_barrier_wait(&h->bar);
    return 0;
}

static int t_alltoallv(void *ctx, const void *send, const size_t *sc, void *recv,
                       const size_t *rc)
{
    tcomm *c = ctx;
    hub *h = c->h;
    h->send[c->rank] = send;
    h->scounts[c->rank] = sc;
    pthread_barrier_wait(&h->bar);
    int bad = 0;
    size_t at = 0;
    if (c->rank == 0)
        h->calls[1]++;
    for (int s = 0; s < h->size; s++) {
        if (c->rank == 0)
            h->moved += rc[s];
        size_t off = 0;
        for (int d = 0; d < c->rank; d++)
            off += h->scounts[s][d];
        if (h->scounts[s][c->rank] != rc[s])
            bad = 1;
        else if (rc[s])
            memcpy((char *)recv + at, (const char *)h->send[s] + off, rc[s]);
        at += rc[s];
    }
    pthread_barrier_wait(&h->bar);
    return bad ? STRATA_EINVAL : 0;
}

static int t_bcast(void *ctx, void *buf, size_t n, int root)
{
    tcomm *c = ctx;
    hub *h = c->h;
    if (c->rank == 0) {
        h->calls[2]++;
        h->moved += n;
    }
    if (c->rank == root)
        h->send[root] = buf;
    pthread_barrier_wait(&h->bar);
    if (c->rank != root && n)
        memcpy(buf, h->send[root], n);
    pthread_barrier_wait(&h->bar);
    return 0;
}

/* Version 2 ops: no dup (the twins' own). */
static const strata_comm_ops tops_v2 = {2, t_allgather, t_alltoallv, t_bcast, NULL, NULL};

/* dup: a hub may have a twin (another hub of as many ranks, with its own tcomm per rank),
 * registered with tc_set_twin; the duplicate of rank r is the twin's rank r. Without one,
 * dup fails (the saver then commits on the caller's thread). Set before the ranks start,
 * unset (twin NULL) before the hub goes. */
#define TC_MAX_TWINS 8
static struct {
    const hub *h;
    tcomm *tc;
} tc_twins[TC_MAX_TWINS];

static inline void tc_set_twin(const hub *h, tcomm *twin_tc)
{
    for (int i = 0; i < TC_MAX_TWINS; i++)
        if (tc_twins[i].h == h || (!tc_twins[i].h && twin_tc)) {
            tc_twins[i].h = twin_tc ? h : NULL;
            tc_twins[i].tc = twin_tc;
            return;
        }
}

static int t_dup(void *ctx, strata_comm **out)
{
    tcomm *c = ctx;
    for (int i = 0; i < TC_MAX_TWINS; i++)
        if (tc_twins[i].h == c->h)
            return strata_comm_host(out, &tops_v2, &tc_twins[i].tc[c->rank], c->rank,
                                    c->h->size);
    return strata_error_set(STRATA_EINVAL, "this thread communicator has no twin");
}

static const strata_comm_ops tops = {STRATA_COMM_OPS_VERSION, t_allgather, t_alltoallv, t_bcast,
                                     NULL, t_dup};

#endif
