/* dist_load.c - one rank's part of a load by every rank of a communicator, from a source
 * the loader opened and agreed on (loader.c). Every function here is a collective.
 * [allgather requests] -> every rank makes the same global plan (or keeps the last one, when
 * every request repeats) -> the ranks' nodes (one allgather) -> each rank reads the chunks
 * it needs itself, those that ranks of its node share through the page cache, with no
 * collective (plan_rank.c) -> only where ranks of several nodes need a read: rounds of (its
 * reader reads it, [allgather status], alltoallv the bytes to the other nodes) -> one
 * allgather of every rank's status and bytes read. A format's check unit (a zip entry and
 * its CRC-32) is read whole by every rank that reads any of it, and compared before its
 * bytes reach the caller (st_io_unit_end). */
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "dist.h"

/* Rank 0's I/O settings, every rank's: they size the reads of the one global plan and the
 * rounds (reads per rank per round), so ranks that asked for others would go out of step.
 * Every rank's request starts with its own; rank 0's are used. */
typedef struct {
    uint32_t io_threads, max_io;
    uint32_t crc; /* 1: a format's CRC-32s checked (not STRATA_LOAD_SKIP_CRC): the reads differ */
} io_settings;

/* st_walk_read callbacks: the bytes of a read for each destination rank (ctx: uint64_t[P]);
 * and the ranks that need a read. */
static void count_per_rank(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)at;
    ((uint64_t *)ctx)[run->rank] += x1 - x0;
}

typedef struct {
    unsigned char *need; /* per rank, all 0 between reads */
    int *who, n;         /* the ranks marked in need */
} needers;

static void mark_needer(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)x0, (void)x1, (void)at;
    needers *c = ctx;
    if (run->rank >= 0 && !c->need[run->rank]) {
        c->need[run->rank] = 1;
        c->who[c->n++] = run->rank;
    }
}

/* Moving a read's bytes to the ranks of other nodes: the reader packs the runs of each
 * destination in the walk's order, each receiver takes its own in the same order. */
typedef struct {
    const st_io_plan *p;
    int me;
    const int *node;
    const char *buf;          /* the read's buffer (sender) */
    unsigned char **out;      /* per destination: write cursor (sender) */
    const unsigned char *in;  /* receive cursor (receiver) */
    int rc;                   /* a device copy failed */
} move_ctx;

static void pack_run(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    move_ctx *m = ctx;
    if (run->rank < 0 || m->node[run->rank] == m->node[m->me])
        return; /* scattered by the read itself, or read by that rank itself */
    memcpy(m->out[run->rank], m->buf + at, x1 - x0);
    m->out[run->rank] += x1 - x0;
}

static void unpack_run(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)at;
    move_ctx *m = ctx;
    if (run->rank != m->me)
        return;
    int rc = st_deliver(m->p, run, x0, x1, m->in);
    if (rc && !m->rc)
        m->rc = rc;
    m->in += x1 - x0;
}

/* Payload bytes of read i (its chunks, without alignment padding). */
static uint64_t read_payload(const st_io_plan *p, size_t i)
{
    uint64_t n = 0, C = p->meta->chunk;
    for (size_t si = p->ios[i].seg0; si < p->ios[i].seg1; si++) {
        const st_seg *s = &p->segs[si];
        n += ST_MIN(s->c1 * C, p->ext[s->piece]->bytes) - s->c0 * C;
    }
    return n;
}

typedef struct {
    const uint64_t *size;
} by_size;

static int cmp_size_desc(const void *a, const void *b, void *ctx)
{
    const by_size *c = ctx;
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    if (c->size[i] != c->size[j])
        return c->size[i] > c->size[j] ? -1 : 1;
    return (i > j) - (i < j);
}

/* The reader of each read that ranks of more than one node need (reader[i] = -1 for the
 * others): one of its needers, balanced over the whole plan - every rank starts with the
 * bytes it reads for itself on its node, then these reads go largest first to their
 * least-loaded needer (the lowest rank on a tie). The reads of one unit (st_io_unit_end: a
 * check spread over several reads) go to one reader, which compares the check. The same on
 * every rank. */
static int assign_readers(const st_io_plan *p, int P, const int *node, int *reader)
{
    uint64_t *load = calloc((size_t)P, sizeof *load), *size = malloc((p->nios + 1) * 8);
    size_t *cross = malloc((p->nios + 1) * sizeof *cross), ncross = 0;
    size_t *end = malloc((p->nios + 1) * sizeof *end);
    needers c = {calloc((size_t)P, 1), malloc((size_t)P * sizeof *c.who), 0};
    int rc = !load || !size || !cross || !end || !c.need || !c.who
                 ? st_fail(STRATA_ENOMEM, "out of memory")
                 : 0;
    for (size_t i = 0; !rc && i < p->nios; i = end[i]) {
        end[i] = st_io_unit_end(p, i);
        c.n = 0;
        size[i] = 0;
        for (size_t k = i; k < end[i]; k++) {
            st_walk_read(p, k, mark_needer, &c);
            size[i] += read_payload(p, k);
            reader[k] = -1;
        }
        int many = 0;
        for (int k = 0; k < c.n; k++) {
            many |= node[c.who[k]] != node[c.who[0]];
            c.need[c.who[k]] = 0;
        }
        if (many)
            cross[ncross++] = i;
        else
            for (size_t k = i; k < end[i]; k++)
                st_walk_read(p, k, count_per_rank, load);
    }
    by_size bs = {size};
    if (!rc && ncross > 1)
        qsort_r(cross, ncross, sizeof *cross, cmp_size_desc, &bs);
    for (size_t k = 0; !rc && k < ncross; k++) {
        size_t i = cross[k];
        c.n = 0;
        for (size_t j = i; j < end[i]; j++)
            st_walk_read(p, j, mark_needer, &c);
        int best = -1;
        for (int j = 0; j < c.n; j++) {
            int r = c.who[j];
            if (best < 0 || load[r] < load[best] || (load[r] == load[best] && r < best))
                best = r;
            c.need[r] = 0;
        }
        for (size_t j = i; j < end[i]; j++)
            reader[j] = best;
        load[best] += size[i];
    }
    free(load);
    free(size);
    free(cross);
    free(end);
    free(c.need);
    free(c.who);
    return rc;
}

/* A scratch buffer of at least n bytes in place of buf (capacity *cap); NULL if out of
 * memory (buf is given back either way). */
static unsigned char *grow(unsigned char *buf, size_t *cap, size_t n)
{
    if (buf)
        st_scratch_put(buf, *cap);
    *cap = (size_t)1 << 20; /* powers of two: sizes that repeat, for the scratch cache */
    while (*cap < n)
        *cap *= 2;
    buf = st_scratch_get(*cap);
    if (!buf)
        *cap = 0;
    return buf;
}

/* The first failure of any rank, as every rank's error (its message from the failing rank);
 * 0 if none. */
static int first_failure(strata_comm *comm, const int32_t *sts, int P)
{
    for (int r = 0; r < P; r++)
        if (sts[r]) {
            st_status s;
            st_status_set(&s, sts[r], r);
            int rc = st_bcast(comm, &s, sizeof s, r);
            return rc ? rc : st_status_raise(&s, comm->rank);
        }
    return 0;
}

/* The reads that ranks of several nodes need, in rounds of up to o->io_threads reads per
 * reader: each reader reads its reads of the round (rp's ST_IO_SEND reads, in plan order),
 * verifies them and scatters its own runs; an allgather of status (a failure ends the load
 * on every rank, with its message); one alltoallv carrying, for each rank of another node,
 * exactly the bytes of its runs in the walk's order, so no headers are sent. *local_rc: this
 * rank's failure so far (it still takes part, without reading). */
static int cross_rounds(strata_comm *comm, const st_dir *d, const st_io_plan *p,
                        const st_io_plan *rp, st_file **files, const int *node,
                        const int *reader, const strata_load_opts *o, st_crc_run *crc,
                        int *local_rc)
{
    const int P = comm->size, me = comm->rank;
    const size_t per_round = (size_t)o->io_threads;
    size_t *round_of = malloc((p->nios + 1) * sizeof *round_of);
    size_t *count = calloc((size_t)P, sizeof *count), rounds = 0;
    size_t *sc = calloc((size_t)P, sizeof *sc), *rcv = calloc((size_t)P, sizeof *rcv);
    uint64_t *bytes = calloc((size_t)P, sizeof *bytes);
    unsigned char **cur = calloc((size_t)P, sizeof *cur);
    char **bufs = calloc(per_round, sizeof *bufs);
    size_t *mine = malloc((rp->nios + 1) * sizeof *mine), nmine = 0;
    int32_t *sts = malloc((size_t)P * sizeof *sts);
    size_t bufsize = st_read_buf_bytes(p->meta, o->max_io_bytes), scap = 0, rcap = 0;
    unsigned char *sbuf = NULL, *rbuf = NULL;
    int rc = 0;
    if (!round_of || !count || !sc || !rcv || !bytes || !cur || !bufs || !mine || !sts) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    for (size_t i = 0; i < p->nios; i++)
        if (reader[i] >= 0) {
            round_of[i] = count[reader[i]]++ / per_round;
            rounds = ST_MAX(rounds, round_of[i] + 1);
        }
    for (size_t i = 0; i < rp->nios; i++)
        if (rp->ios[i].flags & ST_IO_SEND)
            mine[nmine++] = i; /* in plan order: my reads of the rounds */
    for (size_t k = 0; k < per_round && !*local_rc && nmine; k++)
        if (!(bufs[k] = st_scratch_get(bufsize)))
            *local_rc = st_fail(STRATA_ENOMEM, "out of memory for read buffers");
    for (size_t round = 0, first = 0; round < rounds; round++) {
        size_t n = ST_MIN(per_round, nmine - first);
        if (!*local_rc && n)
            *local_rc = st_read_some(d, rp, files, mine + first, n, bufs, o->io_threads, me,
                                     o->max_io_bytes, crc);
        int32_t my_st = *local_rc;
        if ((rc = st_allgather(comm, &my_st, sizeof my_st, sts)) ||
            (rc = first_failure(comm, sts, P)))
            goto out;
        /* what I send: the bytes of my reads for ranks of other nodes */
        memset(bytes, 0, (size_t)P * sizeof *bytes);
        for (size_t j = 0; j < n; j++)
            st_walk_read(rp, mine[first + j], count_per_rank, bytes);
        size_t stot = 0, rtot = 0;
        for (int r = 0; r < P; r++) {
            sc[r] = node[r] == node[me] ? 0 : (size_t)bytes[r];
            stot += sc[r];
        }
        /* what I receive: from each reader of another node, the bytes of its reads this
         * round that I need */
        memset(rcv, 0, (size_t)P * sizeof *rcv);
        for (size_t i = 0; i < p->nios; i++) {
            if (reader[i] < 0 || round_of[i] != round || node[reader[i]] == node[me])
                continue;
            memset(bytes, 0, (size_t)P * sizeof *bytes);
            st_walk_read(p, i, count_per_rank, bytes);
            rcv[reader[i]] += (size_t)bytes[me];
        }
        for (int r = 0; r < P; r++)
            rtot += rcv[r];
        if ((stot > scap && !(sbuf = grow(sbuf, &scap, stot))) ||
            (rtot > rcap && !(rbuf = grow(rbuf, &rcap, rtot)))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto out; /* the others then time out: memory is gone anyway */
        }
        size_t at = 0;
        for (int r = 0; r < P; r++) {
            cur[r] = sbuf + at;
            at += sc[r];
        }
        for (size_t j = 0; j < n; j++) {
            move_ctx m = {rp, me, node, bufs[j] + st_read_shift(&rp->ios[mine[first + j]]), cur,
                          NULL, 0};
            st_walk_read(rp, mine[first + j], pack_run, &m);
        }
        if ((rc = st_alltoallv(comm, sbuf, sc, rbuf, rcv)))
            goto out;
        /* senders in rank order, each one's reads in plan order */
        const unsigned char *in = rbuf;
        for (int r = 0; r < P; r++)
            for (size_t i = 0; rcv[r] && i < p->nios; i++) {
                if (reader[i] != r || round_of[i] != round)
                    continue;
                move_ctx m = {p, me, node, NULL, NULL, in, 0};
                st_walk_read(p, i, unpack_run, &m);
                in = m.in;
                if (m.rc && !*local_rc)
                    *local_rc = m.rc; /* reported with the next status */
            }
        first += n;
    }
out:
    for (size_t k = 0; bufs && k < per_round; k++)
        st_scratch_put(bufs[k], bufsize);
    if (sbuf)
        st_scratch_put(sbuf, scap);
    if (rbuf)
        st_scratch_put(rbuf, rcap);
    free(round_of);
    free(count);
    free(sc);
    free(rcv);
    free(bytes);
    free(cur);
    free(bufs);
    free(mine);
    free(sts);
    return rc;
}

/* What a rank's reads count: the payload bytes it is counted as reading from storage (of
 * chunks several ranks of a node read through the page cache, one rank's), every rank's
 * sum, its reads, and of the format's checks in the reads it is counted for, the bytes read
 * only for them and the checks compared (each check once over the ranks of a node). */
typedef struct {
    uint64_t bytes, all_bytes, reads, crc_bytes, checked;
} read_counts;

/* Is read i of rank plan rp counted for this rank (not a read of shared bytes another rank
 * of its node is counted for)? */
static int counted(const st_io_plan *rp, size_t i)
{
    return !(rp->ios[i].flags & ST_IO_SHARED) || (rp->ios[i].flags & ST_IO_FIRST);
}

static void count_reads(const st_io_plan *rp, read_counts *n)
{
    for (size_t i = 0; i < rp->nios; i++) {
        if (!counted(rp, i))
            continue;
        n->bytes += read_payload(rp, i);
        if (!rp->ncparts)
            continue;
        n->crc_bytes += st_io_crc_bytes(rp, i);
        for (size_t j = rp->ios[i].cp0; j < rp->ios[i].cp1; j++) /* a check's last part */
            n->checked += j + 1 == rp->ncparts || rp->cparts[j + 1].check != rp->cparts[j].check;
    }
    n->reads = rp->nios;
}

/* This rank's reads of the plan (o: the settings every rank agreed on). The ranks' nodes
 * first (an allgather); then the reads this rank does for itself, with no collective; then
 * the rounds of reads for other nodes, if any; then one allgather of every rank's status and
 * of the bytes it counts as read from storage, so that a failure on any rank fails every
 * rank with its message. */
static int load_reads(strata_comm *comm, const st_dir *d, const st_io_plan *p,
                      const strata_load_opts *o, read_counts *n)
{
    const int P = comm->size, me = comm->rank;
    int *node = malloc(((size_t)P + 1) * sizeof *node);
    int *reader = malloc((p->nios + 1) * sizeof *reader);
    struct {
        int32_t rc, pad;
        uint64_t bytes;
    } mine = {0, 0, 0}, *every = malloc((size_t)P * sizeof *every);
    st_io_plan rp = {0};
    st_file **files = NULL;
    st_crc_run *crc = NULL; /* the CRC-32s of the checks my reads hold */
    int rc = 0, local_rc = 0, cross = 0;
    if (!node || !reader || !every) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    for (size_t i = 0; i < p->nios; i++)
        reader[i] = -1;
    if ((rc = st_nodes(comm, node)))
        goto out;
    /* the same on every rank: the plan and the nodes are */
    if ((local_rc = assign_readers(p, P, node, reader)) == 0 &&
        (local_rc = st_plan_rank_reads(&rp, p, me, node, reader, o->max_io_bytes)) == 0 &&
        (local_rc = st_crc_run_new(&crc, &rp, NULL)) == 0 && rp.nios)
        local_rc = st_open_data_files(d, &rp, o->flags & STRATA_LOAD_NO_DIRECT, &files);
    for (size_t i = 0; i < p->nios; i++)
        cross |= reader[i] >= 0;
    size_t nlocal = 0;
    while (!local_rc && nlocal < rp.nios && !(rp.ios[nlocal].flags & ST_IO_SEND))
        nlocal++;
    if (!local_rc && nlocal)
        local_rc = st_read_some(d, &rp, files, NULL, nlocal, NULL, o->io_threads, me,
                                o->max_io_bytes, crc);
    if (cross &&
        (rc = cross_rounds(comm, d, p, &rp, files, node, reader, o, crc, &local_rc)))
        goto out;
    count_reads(&rp, n);
    mine.bytes = n->bytes;
    mine.rc = local_rc;
    if ((rc = st_allgather(comm, &mine, sizeof mine, every)))
        goto out;
    int32_t *sts = (int32_t *)node; /* every rank's status: the nodes are no longer needed */
    for (int r = 0; r < P; r++) {
        sts[r] = every[r].rc;
        n->all_bytes += every[r].bytes;
    }
    rc = first_failure(comm, sts, P);
out:
    st_crc_run_free(crc);
    if (files)
        st_close_data_files(d, &rp, files);
    st_rank_reads_free(&rp);
    free(node);
    free(reader);
    free(every);
    return rc;
}

/* Every rank's request (its settings, then its encoded state), to every rank; rank 0's
 * settings into *set. all and counts are then each rank's encoded state alone. */
static int exchange_requests(strata_comm *comm, strata_state *local, const strata_load_opts *o,
                             st_rank_view *my, io_settings *set, unsigned char **all,
                             size_t *counts)
{
    io_settings mine = {(uint32_t)st_io_threads(o->io_threads), o->max_io_bytes,
                        !(o->flags & STRATA_LOAD_SKIP_CRC)};
    st_buf req = {0};
    *my = st_state_view(local);
    my->cast = st_cast_level(o->flags); /* each rank's own: it travels in its request */
    st_buf_put(&req, &mine, sizeof mine);
    st_encode_state(&req, my);
    if (req.oom)
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    int rc = st_allgatherv(comm, req.p, req.n, all, counts);
    free(req.p);
    if (rc)
        return rc;
    memcpy(set, *all, sizeof *set);
    return 0;
}

/* The key of the whole request: every rank's bytes, and where each one's begin. */
static int dist_key(const unsigned char *all, const size_t *counts, int P, st_buf *key)
{
    size_t total = 0;
    for (int r = 0; r < P; r++) {
        st_buf_u64(key, counts[r]);
        total += counts[r];
    }
    st_buf_put(key, all, total);
    return key->oom ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
}

/* Drops each rank's settings from its request in all (in place). */
static void strip_settings(unsigned char *all, size_t *counts, int P)
{
    size_t from = 0, to = 0;
    for (int r = 0; r < P; r++) {
        size_t n = counts[r] - sizeof(io_settings);
        memmove(all + to, all + from + sizeof(io_settings), n);
        from += counts[r];
        to += n;
        counts[r] = n;
    }
}

int st_load_dist(strata_comm *comm, const st_dir *d, st_load_cache *c, strata_state *local,
                 const strata_load_opts *o, strata_stats *stats)
{
    double t0 = st_now();
    const int P = comm->size, me = comm->rank;
    strata_load_opts eff = *o;
    unsigned char *all = NULL;
    size_t *counts = calloc((size_t)P, sizeof *counts);
    io_settings set;
    st_rank_view my;
    st_buf key = {0};
    int rc, cached = 0;
    if (!counts)
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    /* 1. every rank's requests, to every rank */
    if ((rc = exchange_requests(comm, local, o, &my, &set, &all, counts)))
        goto out;
    for (int r = 0; r < P; r++)
        if (counts[r] < sizeof set) { /* the same bytes everywhere: every rank fails here */
            rc = st_fail(STRATA_EFORMAT, "load: rank %d's request is truncated", r);
            goto out;
        }
    eff.io_threads = (int)set.io_threads;
    eff.max_io_bytes = set.max_io;
    if ((rc = dist_key(all, counts, P, &key)))
        goto out; /* memory is gone: the others time out */
    /* 2. the same global plan everywhere (its errors are everyone's), or the last one when
     * every rank asks for the same as last time */
    if (st_load_cache_hit(c, key.p, key.n)) {
        c->views[me] = my;
        ((st_rank_view *)c->plan.ranks)[me] = my;
        cached = 1;
    } else {
        st_load_cache_clear(c);
        strip_settings(all, counts, P);
        if (!(c->views = calloc((size_t)P, sizeof *c->views))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto out;
        }
        if ((rc = st_decode_all(&c->arena, all, counts, P, me, &my, c->views)) ||
            (rc = st_plan_load(&c->plan, d->meta, c->views, P, eff.max_io_bytes))) {
            st_load_cache_clear(c);
            goto out;
        }
        c->have = 1; /* the plan is the cache's to free from here on */
        if (set.crc && (rc = st_plan_checks(&c->plan, eff.max_io_bytes, 1))) {
            st_load_cache_clear(c);
            goto out;
        }
        c->key = key.p;
        c->keylen = key.n;
        key.p = NULL;
    }
    read_counts n = {0};
    if ((rc = load_reads(comm, d, &c->plan, &eff, &n)))
        goto out;
    /* payload bytes read from storage, not alignment padding, as the in-process load counts
     * (of chunks several ranks of a node read through the page cache, one rank's) */
    *stats = (strata_stats){.data_bytes = d->meta->data_bytes, .bytes = n.bytes,
                            .io_calls = n.reads, .all_bytes = n.all_bytes,
                            .plan_cached = cached, .io_threads = eff.io_threads,
                            .max_io_bytes = eff.max_io_bytes, .crc_checked = n.checked,
                            .crc_bytes = n.crc_bytes,
                            .crc_skipped = !set.crc && d->meta->nchecks};
    stats->seconds = st_now() - t0;
out:
    free(key.p);
    free(all);
    free(counts);
    return rc;
}
