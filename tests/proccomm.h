/* proccomm.h - a strata communicator whose ranks are processes (forked after pc_world_init),
 * joined by a full mesh of socket pairs: the collectives poll every peer's socket until all
 * bytes have gone and come. A peer that died (EOF, a reset) fails the collective with
 * STRATA_EABORTED, so the other ranks end instead of waiting. pc_kill_at makes the rank kill
 * itself (SIGKILL) when it enters its k-th collective: a deterministic fault point. */
#ifndef STRATA_PROCCOMM_H
#define STRATA_PROCCOMM_H
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "strata.h"

#define PC_MAX 8

typedef struct {
    int size, rank;
    int fd[PC_MAX][PC_MAX]; /* fd[a][b]: a's end of the pair between a and b */
    int calls, kill_at;     /* collectives entered; kill on entering this one (0: never) */
} pcomm;

/* The mesh for n ranks (before fork); each child then calls pc_become(rank). */
static inline int pc_world_init(pcomm *c, int n)
{
    memset(c, 0, sizeof *c);
    c->size = n;
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++) {
            int sv[2];
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv))
                return -1;
            c->fd[a][b] = sv[0];
            c->fd[b][a] = sv[1];
        }
    return 0;
}

/* In the child of rank r: closes the other ranks' ends. */
static inline void pc_become(pcomm *c, int r)
{
    c->rank = r;
    for (int a = 0; a < c->size; a++)
        for (int b = 0; b < c->size; b++)
            if (a != b && a != r)
                close(c->fd[a][b]);
}

/* In the parent: closes every end. */
static inline void pc_world_close(pcomm *c)
{
    for (int a = 0; a < c->size; a++)
        for (int b = 0; b < c->size; b++)
            if (a != b)
                close(c->fd[a][b]);
}

/* Sends out[p] (nout[p] bytes) to and receives in[p] (nin[p] bytes) from every peer p. */
static int pc_exchange(pcomm *c, const char *const *out, const size_t *nout, char *const *in,
                       const size_t *nin)
{
    if (++c->calls == c->kill_at)
        raise(SIGKILL);
    size_t sent[PC_MAX] = {0}, got[PC_MAX] = {0};
    for (;;) {
        struct pollfd pf[PC_MAX];
        int peer[PC_MAX], n = 0;
        for (int p = 0; p < c->size; p++) {
            if (p == c->rank || (sent[p] == nout[p] && got[p] == nin[p]))
                continue;
            pf[n] = (struct pollfd){c->fd[c->rank][p],
                                    (short)((sent[p] < nout[p] ? POLLOUT : 0) |
                                            (got[p] < nin[p] ? POLLIN : 0)),
                                    0};
            peer[n++] = p;
        }
        if (n == 0)
            return 0;
        if (poll(pf, (nfds_t)n, -1) < 0) {
            if (errno == EINTR)
                continue;
            return STRATA_EABORTED;
        }
        for (int k = 0; k < n; k++) {
            int p = peer[k];
            if (pf[k].revents & POLLIN) {
                ssize_t r = recv(pf[k].fd, in[p] + got[p], nin[p] - got[p], 0);
                if (r <= 0 && !(r < 0 && errno == EINTR))
                    return STRATA_EABORTED; /* the peer is gone */
                got[p] += r > 0 ? (size_t)r : 0;
            } else if (pf[k].revents & (POLLERR | POLLHUP | POLLNVAL)) {
                return STRATA_EABORTED;
            }
            if (pf[k].revents & POLLOUT) {
                ssize_t w = send(pf[k].fd, out[p] + sent[p], nout[p] - sent[p], MSG_NOSIGNAL);
                if (w < 0 && errno != EINTR && errno != EAGAIN)
                    return STRATA_EABORTED;
                sent[p] += w > 0 ? (size_t)w : 0;
            }
        }
    }
}

static int pc_allgather(void *ctx, const void *send, size_t n, void *recv)
{
    pcomm *c = ctx;
    const char *out[PC_MAX];
    char *in[PC_MAX];
    size_t no[PC_MAX], ni[PC_MAX];
    for (int p = 0; p < c->size; p++) {
        out[p] = send;
        no[p] = ni[p] = p == c->rank ? 0 : n;
        in[p] = (char *)recv + (size_t)p * n;
    }
    memcpy((char *)recv + (size_t)c->rank * n, send, n);
    return pc_exchange(c, out, no, in, ni);
}

static int pc_alltoallv(void *ctx, const void *send, const size_t *sc, void *recv,
                        const size_t *rc)
{
    pcomm *c = ctx;
    const char *out[PC_MAX];
    char *in[PC_MAX];
    size_t no[PC_MAX], ni[PC_MAX], so = 0, ro = 0;
    for (int p = 0; p < c->size; p++) {
        out[p] = (const char *)send + so;
        in[p] = (char *)recv + ro;
        no[p] = p == c->rank ? 0 : sc[p];
        ni[p] = p == c->rank ? 0 : rc[p];
        if (p == c->rank)
            memcpy(in[p], out[p], sc[p]);
        so += sc[p];
        ro += rc[p];
    }
    return pc_exchange(c, out, no, in, ni);
}

static int pc_bcast(void *ctx, void *buf, size_t n, int root)
{
    pcomm *c = ctx;
    const char *out[PC_MAX];
    char *in[PC_MAX];
    size_t no[PC_MAX], ni[PC_MAX];
    for (int p = 0; p < c->size; p++) {
        out[p] = buf;
        in[p] = buf;
        no[p] = c->rank == root && p != root ? n : 0;
        ni[p] = c->rank != root && p == root ? n : 0;
    }
    return pc_exchange(c, out, no, in, ni);
}

static const strata_comm_ops pc_ops = {STRATA_COMM_OPS_VERSION, pc_allgather, pc_alltoallv,
                                       pc_bcast, NULL, NULL};

#endif
