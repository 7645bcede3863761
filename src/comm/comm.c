/* comm.c - communicators: the single-process one, host callbacks, and the collectives
 * the engine uses, built on allgather / alltoallv / bcast. */
#include "comm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"

/* ---- single process ---- */

static int self_allgather(void *ctx, const void *send, size_t n, void *recv)
{
    (void)ctx;
    if (n)
        memmove(recv, send, n);
    return 0;
}

static int self_alltoallv(void *ctx, const void *send, const size_t *sc, void *recv,
                          const size_t *rc)
{
    (void)ctx;
    if (sc[0] != rc[0])
        return STRATA_EINVAL;
    if (sc[0])
        memmove(recv, send, sc[0]);
    return 0;
}

static int self_bcast(void *ctx, void *buf, size_t n, int root)
{
    (void)ctx, (void)buf, (void)n, (void)root;
    return 0;
}

static int self_dup(void *ctx, strata_comm **out)
{
    (void)ctx;
    return strata_comm_self(out);
}

static const strata_comm_ops self_ops = {STRATA_COMM_OPS_VERSION, self_allgather,
                                         self_alltoallv, self_bcast, NULL, self_dup};

int strata_comm_self(strata_comm **out)
{
    return strata_comm_host(out, &self_ops, NULL, 0, 1);
}

int strata_comm_host(strata_comm **out, const strata_comm_ops *ops, void *ctx, int rank,
                     int size)
{
    *out = NULL;
    if (!ops || ops->version < 1 || ops->version > STRATA_COMM_OPS_VERSION || !ops->allgather ||
        !ops->alltoallv || !ops->bcast)
        return st_fail(STRATA_EINVAL, "communicator ops are missing, or their version is not "
                       "1..%d", STRATA_COMM_OPS_VERSION);
    if (size < 1 || rank < 0 || rank >= size)
        return st_fail(STRATA_EINVAL, "rank %d of %d is not a rank", rank, size);
    strata_comm *c = calloc(1, sizeof *c);
    if (!c)
        return st_fail(STRATA_ENOMEM, "out of memory");
    /* an older struct ends before the later fields: read only those of its version */
    c->ops = (strata_comm_ops){STRATA_COMM_OPS_VERSION, ops->allgather, ops->alltoallv,
                               ops->bcast, ops->version >= 2 ? ops->destroy : NULL,
                               ops->version >= 3 ? ops->dup : NULL};
    c->ctx = ctx;
    c->rank = rank;
    c->size = size;
    c->timeout_ms = 300000;
    *out = c;
    return 0;
}

void strata_comm_free(strata_comm *c)
{
    if (!c)
        return;
    if (c->ops.destroy)
        c->ops.destroy(c->ctx);
    free(c);
}

int strata_comm_rank(const strata_comm *c) { return c->rank; }
int strata_comm_size(const strata_comm *c) { return c->size; }
void strata_comm_set_timeout(strata_comm *c, int ms) { c->timeout_ms = ms < 0 ? 0 : ms; }
int strata_comm_timeout(const strata_comm *c) { return c->timeout_ms; }

/* ---- collectives ---- */

/* A host op's outcome. The op may set a message of its own (strata_error_set), so it runs
 * with none; on success the caller's pending message (a local failure about to travel in
 * this very collective) is put back. */
static int check(strata_comm *c, int rc, const char *what, const char *saved)
{
    if (rc == 0) {
        st_err_restore(0, saved);
        return 0;
    }
    c->broken = 1;
    const char *m = strata_error_last();
    if (m && *m)
        return st_wrap(STRATA_EABORTED, "%s failed on rank %d", what, c->rank);
    return st_fail(STRATA_EABORTED, "%s failed on rank %d (%s)", what, c->rank,
                   strata_error_name(rc));
}

/* Keeps this thread's message in `saved` and clears it, for check(). */
static void stash(char saved[ST_ERR_BYTES])
{
    st_err_keep(saved, ST_ERR_ALWAYS);
    st_clear_error();
}

static int usable(strata_comm *c)
{
    return c->broken ? st_fail(STRATA_EABORTED, "the communicator failed earlier (rank %d)",
                               c->rank)
                     : 0;
}

int st_allgather(strata_comm *c, const void *send, size_t n, void *recv)
{
    int rc = usable(c);
    if (rc)
        return rc;
    char saved[ST_ERR_BYTES];
    stash(saved);
    return check(c, c->ops.allgather(c->ctx, send, n, recv), "allgather", saved);
}

int st_alltoallv(strata_comm *c, const void *send, const size_t *scounts, void *recv,
                 const size_t *rcounts)
{
    int rc = usable(c);
    if (rc)
        return rc;
    char saved[ST_ERR_BYTES];
    stash(saved);
    return check(c, c->ops.alltoallv(c->ctx, send, scounts, recv, rcounts), "alltoallv", saved);
}

int st_bcast(strata_comm *c, void *buf, size_t n, int root)
{
    int rc = usable(c);
    if (rc)
        return rc;
    char saved[ST_ERR_BYTES];
    stash(saved);
    return check(c, c->ops.bcast(c->ctx, buf, n, root), "bcast", saved);
}

int st_comm_dup(strata_comm *c, strata_comm **out)
{
    *out = NULL;
    int rc = usable(c);
    if (rc)
        return rc;
    if (!c->ops.dup)
        return st_fail(STRATA_EINVAL, "the communicator has no dup operation (strata_comm_ops "
                       "version 3): asynchronous saves commit on the caller's thread, in "
                       "strata_wait_durable");
    st_clear_error();
    strata_comm *d = NULL;
    rc = c->ops.dup(c->ctx, &d);
    if (rc || !d) {
        strata_comm_free(d);
        return st_wrap(rc ? rc : STRATA_EINVAL, "the communicator could not be duplicated "
                       "(asynchronous saves commit on the caller's thread)");
    }
    if (d->rank != c->rank || d->size != c->size) {
        strata_comm_free(d);
        return st_fail(STRATA_EINVAL, "the communicator's duplicate is rank %d of %d, not %d of "
                       "%d (asynchronous saves commit on the caller's thread)", d->rank,
                       d->size, c->rank, c->size);
    }
    d->timeout_ms = c->timeout_ms;
    *out = d;
    return 0;
}

int st_all_true(strata_comm *c, int flag, int *all)
{
    unsigned char mine = flag != 0, *v = malloc((size_t)c->size);
    if (!v)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = st_allgather(c, &mine, 1, v);
    *all = 1;
    for (int r = 0; !rc && r < c->size; r++)
        *all &= v[r];
    free(v);
    return rc;
}

static int gather_sizes(strata_comm *c, size_t n, size_t *counts)
{
    uint64_t mine = n, *all = malloc((size_t)c->size * 8);
    if (!all)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = st_allgather(c, &mine, 8, all);
    for (int r = 0; !rc && r < c->size; r++)
        counts[r] = (size_t)all[r];
    free(all);
    return rc;
}

/* alltoallv where this rank sends the same n bytes to rank only_to (to all if -1). */
static int exchange(strata_comm *c, const void *send, size_t n, int only_to, const size_t *rcounts,
                    unsigned char **recv)
{
    size_t *sc = calloc((size_t)c->size, sizeof *sc), total = 0;
    if (!sc)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (int r = 0; r < c->size; r++)
        total += rcounts[r];
    unsigned char *sbuf = NULL, *rbuf = malloc(total ? total : 1);
    int rc = 0;
    /* one destination: the caller's bytes as they are; all: a copy for each */
    size_t nsend = only_to >= 0 ? 1 : (size_t)c->size;
    if (!rbuf || (nsend > 1 && !(sbuf = malloc(n * nsend + 1)))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    } else {
        for (int r = 0; r < c->size; r++)
            if (only_to < 0 || r == only_to)
                sc[r] = n;
        for (size_t i = 0; sbuf && i < nsend; i++)
            if (n)
                memcpy(sbuf + i * n, send, n);
        rc = st_alltoallv(c, sbuf ? sbuf : send, sc, rbuf, rcounts);
    }
    free(sc);
    free(sbuf);
    if (rc) {
        free(rbuf);
        return rc;
    }
    *recv = rbuf;
    return 0;
}

int st_allgatherv(strata_comm *c, const void *send, size_t n, unsigned char **recv,
                  size_t *counts)
{
    *recv = NULL;
    int rc = gather_sizes(c, n, counts);
    return rc ? rc : exchange(c, send, n, -1, counts, recv);
}

int st_gatherv(strata_comm *c, const void *send, size_t n, int root, unsigned char **recv,
               size_t *counts)
{
    *recv = NULL;
    int rc = gather_sizes(c, n, counts);
    if (rc)
        return rc;
    size_t *rcounts = calloc((size_t)c->size, sizeof *rcounts);
    if (!rcounts)
        return st_fail(STRATA_ENOMEM, "out of memory");
    if (c->rank == root)
        memcpy(rcounts, counts, (size_t)c->size * sizeof *counts);
    unsigned char *buf = NULL;
    rc = exchange(c, send, n, root, rcounts, &buf);
    free(rcounts);
    if (rc)
        return rc;
    if (c->rank == root)
        *recv = buf;
    else
        free(buf);
    return 0;
}

int st_scatterv(strata_comm *c, const void *send, const size_t *counts, int root,
                unsigned char **recv, size_t *n)
{
    *recv = NULL;
    size_t P = (size_t)c->size;
    size_t *sc = calloc(P, sizeof *sc), *rcv = calloc(P, sizeof *rcv);
    uint64_t *sizes = malloc(P * 8), mine = 0;
    unsigned char *buf = NULL;
    int rc = 0;
    if (!sc || !rcv || !sizes) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    /* 1: the sizes, 8 bytes from root to each rank */
    if (c->rank == root)
        for (size_t r = 0; r < P; r++) {
            sizes[r] = counts[r];
            sc[r] = 8;
        }
    rcv[root] = 8;
    if ((rc = st_alltoallv(c, sizes, sc, &mine, rcv)))
        goto out;
    /* 2: the bytes */
    if (c->rank == root)
        for (size_t r = 0; r < P; r++)
            sc[r] = counts[r];
    rcv[root] = (size_t)mine;
    if (!(buf = malloc(mine ? mine : 1))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = st_alltoallv(c, send, sc, buf, rcv)))
        goto out;
    *recv = buf;
    *n = (size_t)mine;
    buf = NULL;
out:
    free(sc);
    free(rcv);
    free(sizes);
    free(buf);
    return rc;
}

/* ---- agreement ---- */

/* A rank's record in the agreement's allgather: its code, the length and hash of its
 * payload (its message where it failed), then inline bytes: the payload where it fits. */
#define AGREE_HEAD 24

typedef struct {
    int64_t code;
    uint64_t len, hash;
} agree_head;

static agree_head head_of(const unsigned char *rec)
{
    agree_head h;
    memcpy(&h.code, rec, 8);
    memcpy(&h.len, rec + 8, 8);
    memcpy(&h.hash, rec + 16, 8);
    return h;
}

void strata_free(void *p) { free(p); }

/* Every rank's payload, in rank order, from the records (those that fit) and extra (the
 * others, want[r] bytes of rank r's, packed in rank order) into *out. */
static int join_payloads(unsigned char **out, const unsigned char *recs, size_t rec,
                         const unsigned char *extra, const size_t *want, const size_t *lens,
                         size_t P)
{
    size_t total = 0;
    for (size_t r = 0; r < P; r++)
        total += lens[r];
    if (!total)
        return 0;
    unsigned char *all = malloc(total);
    if (!all)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t r = 0, at = 0, ex = 0; r < P; r++) {
        if (lens[r])
            memcpy(all + at, want[r] ? extra + ex : recs + r * rec + AGREE_HEAD, lens[r]);
        at += lens[r];
        ex += want[r];
    }
    *out = all;
    return 0;
}

int strata_comm_agree(unsigned char **out, size_t *lens, strata_comm *c, const char *what,
                      int rc, const void *payload, size_t n, size_t inline_bytes,
                      unsigned flags)
{
    char msg[ST_ERR_BYTES]; /* this rank's message where it failed: sent, kept for its return */
    st_err_keep(msg, rc);
    if (out)
        *out = NULL;
    if (!out || !lens || !c || rc > 0 || (n && !payload && !rc) || (flags & ~STRATA_AGREE_SAME))
        return st_fail(STRATA_EINVAL, "strata_comm_agree: out, lens and c are needed, rc is 0 "
                       "or a STRATA_E* code, payload holds n bytes, flags are STRATA_AGREE_*");
    size_t P = (size_t)c->size, rec = AGREE_HEAD + inline_bytes;
    if (inline_bytes > ((size_t)1 << 30))
        return st_fail(STRATA_EINVAL, "strata_comm_agree: inline_bytes %zu is too large",
                       inline_bytes);
    const unsigned char *mine = rc ? (const unsigned char *)msg : payload;
    size_t mlen = rc ? strlen(msg) : n;
    unsigned char *recs = calloc(P + 1, rec), *extra = NULL;
    size_t *want = calloc(P, sizeof *want);
    int first = -1, same = 1, any = 0, crc;
    if (!recs || !want) {
        crc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    /* 1. every rank's record (this rank's put after the P received) */
    unsigned char *me = recs + P * rec;
    agree_head h = {rc, mlen, st_hash(mine, mlen)};
    memcpy(me, &h.code, 8);
    memcpy(me + 8, &h.len, 8);
    memcpy(me + 16, &h.hash, 8);
    if (mlen && mlen <= inline_bytes)
        memcpy(me + AGREE_HEAD, mine, mlen);
    if ((crc = st_allgather(c, me, rec, recs)))
        goto out;
    agree_head h0 = head_of(recs);
    for (size_t r = 0; r < P; r++) {
        h = head_of(recs + r * rec);
        if (h.len > ((size_t)1 << 40)) {
            crc = st_fail(STRATA_EABORTED, "strata_comm_agree: rank %zu sent a length of %llu",
                          r, (unsigned long long)h.len);
            goto out;
        }
        if (h.code && first < 0)
            first = (int)r;
        lens[r] = (size_t)h.len;
        same &= h.len == h0.len && h.hash == h0.hash;
    }
    int none = first < 0 && same && (flags & STRATA_AGREE_SAME); /* no payload wanted */
    /* 2. the payloads that did not fit - where a rank failed, only the failing ranks'
     * messages - in one alltoallv; every rank knows which from the records */
    for (size_t r = 0; r < P; r++) {
        int needed = first >= 0 ? head_of(recs + r * rec).code != 0 : !none;
        want[r] = needed && lens[r] > inline_bytes ? lens[r] : 0;
        any |= want[r] != 0;
    }
    if (any && (crc = exchange(c, mine, want[c->rank], -1, want, &extra)))
        goto out;
    if (first >= 0) {
        if (rc) /* this rank's own error, below */
            goto out;
        size_t at = 0;
        for (int r = 0; r < first; r++)
            at += want[r];
        const unsigned char *m = want[first] ? extra + at : recs + (size_t)first * rec + AGREE_HEAD;
        int64_t code = head_of(recs + (size_t)first * rec).code;
        int mn = lens[first] > 900 ? 900 : (int)lens[first];
        crc = st_fail(code < 0 && code >= INT32_MIN ? (int)code : STRATA_EABORTED,
                      "%s failed on rank %d: %.*s", what ? what : "a step", first, mn,
                      (const char *)m);
        goto out;
    }
    if (!none)
        crc = join_payloads(out, recs, rec, extra, want, lens, P);
out:
    free(recs);
    free(want);
    free(extra);
    return rc ? st_err_restore(rc, msg) : crc;
}
