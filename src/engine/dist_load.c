/* dist_load.c - one rank's part of a load by every rank of a communicator, from a source
 * the loader opened and agreed on (loader.c). Every function here is a collective.
 * [allgather requests] -> every rank makes the same global plan (or keeps the last one,
 * when every request repeats) and assigns each read to one rank that needs it -> rounds
 * of (read + verify my reads, [allgather status], [alltoallv the bytes others need]). */
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "dist.h"

/* Rank 0's I/O settings, every rank's: they size the reads of the one global plan, the
 * rounds (reads per rank per round) and each rank's slot in the node's segment, so ranks
 * that asked for others would go out of step. Every rank's request starts with its own;
 * rank 0's are used. */
typedef struct {
    uint32_t io_threads, max_io, shm;
    uint32_t crc; /* 1: a format's CRC-32s checked (not STRATA_LOAD_SKIP_CRC): the reads differ */
} io_settings;

/* st_walk_read callbacks that count: the bytes of a read for each destination rank
 * (ctx: uint64_t[P]); for one rank only; and the ranks that need a read. */
static void count_per_rank(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)at;
    ((uint64_t *)ctx)[run->rank] += x1 - x0;
}

typedef struct {
    int rank;
    uint64_t bytes;
} one_rank;

static void count_one_rank(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)at;
    one_rank *c = ctx;
    if (run->rank == c->rank)
        c->bytes += x1 - x0;
}

typedef struct {
    unsigned char *need; /* per rank, all 0 between reads */
    int *who, n;         /* the ranks marked in need */
} needers;

static void mark_needer(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)x0, (void)x1, (void)at;
    needers *c = ctx;
    if (!c->need[run->rank]) {
        c->need[run->rank] = 1;
        c->who[c->n++] = run->rank;
    }
}

typedef struct {
    const st_io_plan *p;
    int me;
    const st_node_shm *shm; /* ranks of my node take from the segment, not the exchange */
    const char *buf;      /* the read's buffer (sender; or the segment slot it is in) */
    unsigned char **out;  /* per destination: write cursor (sender) */
    const unsigned char *in; /* receive cursor (receiver) */
    int rc;                  /* a device copy failed */
} move_ctx;

static void pack_run(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    move_ctx *m = ctx;
    if (run->rank == m->me || st_node_shared(m->shm, m->me, run->rank))
        return; /* scattered by the read itself, or taken from the segment */
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

/* The runs of rank me in a read done by another rank of its node, from its slot. */
static void take_run(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    move_ctx *m = ctx;
    if (run->rank != m->me)
        return;
    int rc = st_deliver(m->p, run, x0, x1, m->buf + at);
    if (rc && !m->rc)
        m->rc = rc;
}

typedef struct {
    const st_node_shm *shm;
    int reader, cross; /* cross: a run goes to a rank of another node */
} cross_ctx;

static void find_cross(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)x0, (void)x1, (void)at;
    cross_ctx *c = ctx;
    if (run->rank != c->reader && !st_node_shared(c->shm, c->reader, run->rank))
        c->cross = 1;
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

/* Assigns each read to one of the ranks that need its bytes, the least loaded so far;
 * priv[i] = 1 where its reader is the only rank that needs it (nothing to send). A check
 * spread over several reads (a zip entry larger than a read) is read by one rank, which
 * combines their CRC-32s: such reads (st_io_joined) form a group, assigned as one. */
static int assign_readers(const st_io_plan *p, int P, int *reader, unsigned char *priv)
{
    const size_t n = p->nios;
    uint64_t *load = calloc((size_t)P, sizeof *load);
    needers c = {calloc((size_t)P, 1), malloc((size_t)P * sizeof *c.who), 0};
    size_t *lead = malloc((n + 1) * sizeof *lead), *start = calloc(n + 2, sizeof *start);
    size_t *memb = malloc((n + 1) * sizeof *memb);
    int rc = !load || !c.need || !c.who || !lead || !start || !memb
                 ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
    for (size_t i = 0, last = SIZE_MAX; !rc && i < n; i++) {
        lead[i] = last != SIZE_MAX && st_io_joined(p, i) ? lead[last] : i;
        if (p->ios[i].cp1 > p->ios[i].cp0)
            last = i;
        start[lead[i] + 1]++;
    }
    for (size_t i = 0; !rc && i < n; i++)
        start[i + 1] += start[i];
    for (size_t i = 0; !rc && i < n; i++) /* a group's reads, in order, from start[lead] */
        memb[start[lead[i]]++] = i;
    for (size_t i = n; !rc && i > 0; i--)
        start[i] = start[i - 1];
    if (!rc)
        start[0] = 0;
    for (size_t g = 0; !rc && g < n; g++) {
        if (lead[g] != g)
            continue;
        c.n = 0;
        for (size_t k = start[g]; k < start[g + 1]; k++)
            st_walk_read(p, memb[k], mark_needer, &c);
        int best = -1;
        for (int k = 0; k < c.n; k++) { /* the lowest rank wins ties */
            int r = c.who[k];
            if (best < 0 || load[r] < load[best] || (load[r] == load[best] && r < best))
                best = r;
            c.need[r] = 0;
        }
        for (size_t k = start[g]; k < start[g + 1]; k++) {
            size_t i = memb[k];
            reader[i] = best < 0 ? 0 : best;
            priv[i] = c.n <= 1;
            load[reader[i]] += p->ios[i].len;
        }
    }
    free(load);
    free(c.need);
    free(c.who);
    free(lead);
    free(start);
    free(memb);
    return rc;
}

typedef struct {
    const size_t *round_of;
    const int *reader;
} order_ctx;

/* Reads by (round, reader, index): the order in which receivers unpack. */
static int cmp_order(const void *a, const void *b, void *ctx)
{
    const order_ctx *c = ctx;
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    if (c->round_of[i] != c->round_of[j])
        return c->round_of[i] < c->round_of[j] ? -1 : 1;
    if (c->reader[i] != c->reader[j])
        return c->reader[i] < c->reader[j] ? -1 : 1;
    return (i > j) - (i < j);
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

/* The reads and exchanges. A read whose bytes only its reader needs (a shard that is
 * this rank's alone: most of a resharded load) is private: read, verified and scattered
 * by its reader on its I/O threads like a load in one process, with no collective, first.
 * The others are shared, in rounds of up to o->io_threads reads per rank (o holds the
 * settings every rank agreed on); shm: use a node segment where ranks share a node. At
 * least one round runs, so that a failure of a private read reaches every rank with its
 * message. */
static int exchange_rounds(strata_comm *comm, const st_dir *d, const st_io_plan *p,
                           const strata_load_opts *o, int shm_on, uint64_t *my_bytes,
                           uint64_t *my_reads, uint64_t *my_crc_bytes, uint64_t *my_checked)
{
    const int P = comm->size, me = comm->rank;
    const uint64_t max_io = o->max_io_bytes;
    int per_round = o->io_threads;
    int *reader = malloc((p->nios + 1) * sizeof *reader);
    size_t *mine = malloc((p->nios + 1) * sizeof *mine), nmine = 0;
    size_t *round_of = malloc((p->nios + 1) * sizeof *round_of);
    size_t *order = malloc((p->nios + 1) * sizeof *order);
    size_t *count = calloc((size_t)P, sizeof *count);
    size_t *sc = calloc((size_t)P, sizeof *sc), *rc_ = calloc((size_t)P, sizeof *rc_);
    uint64_t *bytes = calloc((size_t)P, sizeof *bytes);
    unsigned char **cur = calloc((size_t)P, sizeof *cur);
    size_t *jx = calloc((size_t)P, sizeof *jx);
    char **bufs = calloc((size_t)per_round, sizeof *bufs);
    st_file **files = NULL;
    int32_t *sts = malloc((size_t)P * sizeof *sts);
    unsigned char *priv = malloc(p->nios + 1);
    size_t *privs = malloc((p->nios + 1) * sizeof *privs), npriv = 0, nshared = 0;
    size_t bufsize = st_read_buf_bytes(p->meta, max_io), rounds = 0, scap = 0, rcap = 0;
    unsigned char *sbuf = NULL, *rbuf = NULL;
    int rc = 0;
    st_node_shm shm = {0};
    st_crc_run *crc = NULL; /* the CRC-32s of the checks my reads hold */
    if (!reader || !mine || !round_of || !order || !count || !sc || !rc_ || !bytes || !cur ||
        !jx || !bufs || !sts || !priv || !privs) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = assign_readers(p, P, reader, priv)) || (rc = st_crc_run_new(&crc, p, NULL)))
        goto out;
    for (size_t i = 0; i < p->nios; i++) {
        if (reader[i] == me) {
            *my_bytes += read_payload(p, i), (*my_reads)++;
            *my_crc_bytes += p->ncparts ? st_io_crc_bytes(p, i) : 0;
        }
        if (priv[i]) {
            if (reader[i] == me)
                privs[npriv++] = i;
            continue;
        }
        round_of[i] = count[reader[i]]++ / (size_t)per_round;
        rounds = ST_MAX(rounds, round_of[i] + 1);
        order[nshared++] = i;
        if (reader[i] == me)
            mine[nmine++] = i;
    }
    order_ctx oc = {round_of, reader};
    if (nshared)
        qsort_r(order, nshared, sizeof *order, cmp_order, &oc);
    size_t next = 0; /* reads of earlier rounds in `order` */
    /* ranks of one node share their reads through a segment: each rank's read buffers
     * are its slot there (the same decision on every rank: the plan is the same) */
    if (rounds && (rc = st_node_shm_open(comm, shm_on ? (size_t)per_round * bufsize : 0, &shm)))
        goto out;
    /* a local failure (opening the files, a private read) still takes part in every round */
    int local_rc = nmine || npriv
                       ? st_open_data_files(d, p, o->flags & STRATA_LOAD_NO_DIRECT, &files)
                       : 0;
    if (!local_rc && npriv)
        local_rc = st_read_some(d, p, files, privs, npriv, NULL, per_round, me, max_io, crc);
    for (int k = 0; k < per_round && !local_rc && rounds; k++)
        if (!(bufs[k] = shm.base ? (char *)st_node_slot(&shm, me) + (size_t)k * bufsize
                                 : st_scratch_get(bufsize)))
            local_rc = st_fail(STRATA_ENOMEM, "out of memory for read buffers");
    for (size_t round = 0; round < ST_MAX(rounds, 1); round++) {
        /* my reads this round: read, verify, scatter my own runs */
        size_t first = 0;
        while (first < nmine && round_of[mine[first]] < round)
            first++;
        size_t n = 0;
        while (first + n < nmine && round_of[mine[first + n]] == round)
            n++;
        if (!local_rc && n)
            local_rc =
                st_read_some(d, p, files, mine + first, n, bufs, per_round, me, max_io, crc);
        int32_t my_st = local_rc;
        if ((rc = st_allgather(comm, &my_st, sizeof my_st, sts)))
            goto out;
        int bad = -1;
        for (int r = 0; r < P && bad < 0; r++)
            if (sts[r])
                bad = r;
        if (bad >= 0) { /* every rank learns the first failure, with its message */
            st_status s;
            st_status_set(&s, sts[bad], bad);
            if ((rc = st_bcast(comm, &s, sizeof s, bad)))
                goto out;
            rc = st_status_raise(&s, me);
            goto out;
        }
        /* what I send: the bytes of my reads that other ranks need */
        memset(bytes, 0, (size_t)P * sizeof *bytes);
        for (size_t j = 0; j < n; j++)
            st_walk_read(p, mine[first + j], count_per_rank, bytes);
        size_t stot = 0, rtot = 0;
        for (int r = 0; r < P; r++) {
            sc[r] = r == me || st_node_shared(&shm, me, r) ? 0 : (size_t)bytes[r];
            stot += sc[r];
        }
        /* what I receive: from each reader, the bytes of its reads this round that I need;
         * this round's reads are order[next .. end), by reader rank */
        size_t end = next;
        while (end < nshared && round_of[order[end]] == round)
            end++;
        /* the alltoallv only where a byte of this round goes to another node (every rank
         * tells the same from the plan) */
        int cross = 0;
        for (size_t k = next; k < end && !cross; k++) {
            cross_ctx cc = {&shm, reader[order[k]], 0};
            st_walk_read(p, order[k], find_cross, &cc);
            cross = cc.cross;
        }
        memset(rc_, 0, (size_t)P * sizeof *rc_);
        for (size_t k = next; k < end; k++) {
            size_t i = order[k];
            if (reader[i] == me || st_node_shared(&shm, me, reader[i]))
                continue;
            one_rank c = {me, 0};
            st_walk_read(p, i, count_one_rank, &c);
            rc_[reader[i]] += (size_t)c.bytes;
        }
        for (int r = 0; r < P; r++)
            rtot += rc_[r];
        /* the exchange buffers are reused across rounds: fresh pages cost a first touch */
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
            move_ctx m = {p, me, &shm, bufs[j] + st_read_shift(&p->ios[mine[first + j]]), cur,
                          NULL, 0};
            st_walk_read(p, mine[first + j], pack_run, &m);
        }
        rc = cross ? st_alltoallv(comm, sbuf, sc, rbuf, rc_) : 0;
        if (!rc) {
            const unsigned char *in = rbuf; /* readers in rank order, their reads in order */
            memset(jx, 0, (size_t)P * sizeof *jx);
            for (size_t k = next; k < end; k++) {
                int r = reader[order[k]];
                size_t j = jx[r]++; /* the read's buffer among its reader's this round */
                move_ctx m = {p, me, &shm, NULL, NULL, in, 0};
                if (r == me)
                    continue;
                if (st_node_shared(&shm, me, r)) {
                    m.buf = (const char *)st_node_slot(&shm, r) + j * bufsize +
                            st_read_shift(&p->ios[order[k]]);
                    st_walk_read(p, order[k], take_run, &m);
                } else {
                    st_walk_read(p, order[k], unpack_run, &m);
                    in = m.in;
                }
                if (m.rc && !local_rc)
                    local_rc = m.rc; /* reported with the next round's status */
            }
        }
        next = end;
        if (rc)
            goto out;
        /* the slots are read by the node's ranks until here: nobody reads into them again
         * before all are done */
        int32_t done = 0;
        if (shm.base && round + 1 < rounds && (rc = st_allgather(comm, &done, sizeof done, sts)))
            goto out;
    }
    if (local_rc) /* failed after the last round's status exchange (a device copy) */
        rc = local_rc;
    *my_checked = st_crc_run_checked(crc);
out:
    st_crc_run_free(crc);
    for (int k = 0; bufs && !shm.base && k < per_round; k++)
        st_scratch_put(bufs[k], bufsize);
    st_node_shm_close(&shm);
    free(jx);
    if (sbuf)
        st_scratch_put(sbuf, scap);
    if (rbuf)
        st_scratch_put(rbuf, rcap);
    if (files)
        st_close_data_files(d, p, files);
    free(reader);
    free(mine);
    free(round_of);
    free(order);
    free(count);
    free(sc);
    free(rc_);
    free(bytes);
    free(cur);
    free(bufs);
    free(sts);
    free(priv);
    free(privs);
    return rc;
}

/* Every rank's request (its settings, then its encoded state), to every rank; rank 0's
 * settings into *set. all and counts are then each rank's encoded state alone. */
static int exchange_requests(strata_comm *comm, strata_state *local, const strata_load_opts *o,
                             st_rank_view *my, io_settings *set, unsigned char **all,
                             size_t *counts)
{
    const char *shm = getenv("STRATA_LOAD_SHM");
    io_settings mine = {(uint32_t)st_io_threads(o->io_threads), o->max_io_bytes,
                        !(shm && strcmp(shm, "0") == 0), !(o->flags & STRATA_LOAD_SKIP_CRC)};
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
    uint64_t got = 0, reads = 0, crc_bytes = 0, checked = 0;
    if ((rc = exchange_rounds(comm, d, &c->plan, &eff, (int)set.shm, &got, &reads, &crc_bytes,
                              &checked)))
        goto out;
    /* payload bytes read, not alignment padding, and the reads this rank made, as the
     * in-process load counts them */
    *stats = (strata_stats){.data_bytes = d->meta->data_bytes, .bytes = got, .io_calls = reads,
                            .plan_cached = cached, .io_threads = eff.io_threads,
                            .max_io_bytes = eff.max_io_bytes, .crc_checked = checked,
                            .crc_bytes = crc_bytes,
                            .crc_skipped = !set.crc && d->meta->nchecks};
    st_over_ranks(comm, got, &stats->all_bytes, NULL, NULL);
    stats->seconds = st_now() - t0;
out:
    free(key.p);
    free(all);
    free(counts);
    return rc;
}
