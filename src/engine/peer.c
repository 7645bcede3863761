/* peer.c - peer-memory replicas (issue 34): a committed checkpoint's data files, held in the
 * node-local tier (mem://) of the node that wrote them, copied to the same tier of the R
 * next nodes on a ring of nodes over the job's own communicator (strata_peer_replicate),
 * and, after nodes are lost, rebuilt on the survivors into a complete checkpoint in every
 * node's tier (strata_peer_restore), which the ordinary loader then reads into any layout.
 *
 * Every rank names its own node's copy of the checkpoint directory (the same mem:// URI
 * resolves on each node to its own memory). A node's copy is trusted only through its
 * replica record, PEER (docs/FORMAT.md), written by the node's lowest rank after every rank
 * of the node holds its part: it names the save (its commit record) and the data files
 * the node holds. Nodes are the load's grouping (dist_node.c: host name and boot id;
 * STRATA_LOAD_NODES=k for tests). Every function taking a strata_comm is a collective. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/vfs.h"
#include "../meta/meta.h"
#include "peer.h"

static void ctx_free(peer_ctx *c)
{
    st_node_map_close(&c->ns);
    free(c->ix);
    free(c->lead);
    free(c->nloc);
    free(c->mbuf);
    free(c->cbuf);
    st_meta_free(c->meta);
}

/* The rank of node i whose index on its node is l (modulo the node's ranks). */
static int rank_on(const peer_ctx *c, int i, int l)
{
    l %= c->nloc[i];
    for (int r = 0; r < c->P; r++)
        if (c->ix[r] == i && c->ns.lidx[r] == l)
            return r;
    return -1;
}

static int layout(peer_ctx *c, strata_comm *comm, const char *uri)
{
    c->comm = comm;
    c->P = comm->size;
    c->me = comm->rank;
    int rc = st_vfs_resolve(uri, &c->vfs, c->dir, sizeof c->dir);
    if (rc)
        return rc; /* the same URI scheme on every rank: every rank fails here */
    if ((rc = st_node_map_open(comm, &c->ns)))
        return rc;
    c->ix = calloc((size_t)c->P, sizeof *c->ix);
    c->lead = calloc((size_t)c->P, sizeof *c->lead);
    c->nloc = calloc((size_t)c->P, sizeof *c->nloc);
    if (!c->ix || !c->lead || !c->nloc)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (int r = 0; r < c->P; r++) {
        if (c->ns.node[r] == r)
            c->lead[c->N++] = r;
        int i = 0;
        while (c->lead[i] != c->ns.node[r])
            i++;
        c->ix[r] = i;
        c->nloc[i]++;
    }
    return 0;
}

/* ---- the replica record (FORMAT.md, "Peer replica record") ---- */

/* Writes this node's record: the files it holds (held), its owners' nodes (owner). */
static int rec_write(const peer_ctx *c, const unsigned char *held, const uint32_t *owner,
                     int replicas, int k, int m, uint64_t block)
{
    st_peer_rec r = {.save_id = c->cr.save_id, .step = c->cr.step, .block = block,
                     .nodes = (uint32_t)c->N, .replicas = (uint32_t)replicas,
                     .k = (uint32_t)k, .m = (uint32_t)m, .node = (uint32_t)c->ix[c->me],
                     .nfiles = c->meta->nfiles, .clen = (uint32_t)c->clen,
                     .held = (unsigned char *)held};
    memcpy(r.commit, c->cbuf, c->clen);
    st_buf b = {0};
    st_peer_rec_encode(&b, &r, owner);
    int rc = b.oom ? st_fail(STRATA_ENOMEM, "out of memory")
                   : st_peer_write(c, ST_PEER_FILE, b.p, b.n, 1);
    free(b.p);
    return rc;
}

/* ---- what every rank agrees on ---- */

/* Decodes the metadata and commit record c holds; a checkpoint that refers to a base
 * (incremental) is refused: its linked files are the base's. */
static int take_meta(peer_ctx *c)
{
    int rc = st_commit_decode(&c->cr, c->cbuf, c->clen);
    if (!rc && (c->cr.meta_size != c->mlen || c->cr.meta_hash != st_hash(c->mbuf, c->mlen)))
        rc = st_fail(STRATA_ECHECKSUM, "%s: metadata.bin is not the one its commit record names",
                     c->dir);
    if (!rc)
        rc = st_meta_decode(&c->meta, c->mbuf, c->mlen);
    if (!rc && c->meta->base)
        rc = st_fail(STRATA_ENOTSUP, "%s refers to a base checkpoint (incremental): peer "
                                     "replicas hold whole checkpoints only", c->dir);
    return rc;
}

/* Root's metadata and commit record to every rank (lengths, then bytes); *local: their
 * decoding (take_meta), for the caller to agree on. */
static int share_meta(peer_ctx *c, int root, int *local)
{
    uint64_t len[2] = {c->mlen, c->clen};
    int rc = st_bcast(c->comm, len, sizeof len, root);
    if (rc)
        return rc;
    if (c->me != root) { /* a restore's survey may have read this node's: root's count */
        free(c->mbuf);
        free(c->cbuf);
        c->mlen = (size_t)len[0], c->clen = (size_t)len[1];
        c->mbuf = malloc(c->mlen + 1);
        c->cbuf = malloc(c->clen + 1);
        if (!c->mbuf || !c->cbuf)
            return st_fail(STRATA_ENOMEM, "out of memory"); /* a hang the time limit ends */
    }
    if (!(rc = st_bcast(c->comm, c->mbuf, c->mlen, root)) &&
        !(rc = st_bcast(c->comm, c->cbuf, c->clen, root)))
        *local = take_meta(c);
    return rc;
}

/* ---- the exchange: files to ranks, one alltoallv ---- */

typedef struct {
    int from, to;
    uint32_t file;
} xfer;

/* Runs the transfers x[0..n) (the same list on every rank): each sender reads its files
 * from its node's copy, each receiver writes them into its node's. Returns the local
 * outcome (agreed on by the caller); a failed collective. */
static int exchange(peer_ctx *c, const xfer *x, size_t n, uint64_t *sent, uint64_t *got,
                    int *local)
{
    const int P = c->P, me = c->me;
    size_t *sc = calloc((size_t)P, sizeof *sc), *rcn = calloc((size_t)P, sizeof *rcn);
    size_t *at = calloc((size_t)P, sizeof *at);
    unsigned char *sb = NULL, *rb = NULL;
    int rc = 0;
    *local = 0;
    if (!sc || !rcn || !at) {
        free(sc), free(rcn), free(at);
        return *local = st_fail(STRATA_ENOMEM, "out of memory");
    }
    size_t stot = 0, rtot = 0;
    for (size_t i = 0; i < n; i++) {
        size_t b = HDR + (size_t)c->meta->files[x[i].file].bytes;
        if (x[i].from == me)
            sc[x[i].to] += b, stot += b;
        if (x[i].to == me)
            rcn[x[i].from] += b, rtot += b;
    }
    sb = malloc(stot + 1);
    rb = malloc(rtot + 1);
    if (!sb || !rb)
        *local = st_fail(STRATA_ENOMEM, "out of memory for %zu + %zu bytes", stot, rtot);
    for (int r = 1; r < P; r++)
        at[r] = at[r - 1] + sc[r - 1];
    for (size_t i = 0; i < n && !*local; i++) {
        if (x[i].from != me)
            continue;
        const st_mfile *mf = &c->meta->files[x[i].file];
        unsigned char *p = sb + at[x[i].to];
        size_t len = (size_t)mf->bytes;
        if ((*local = st_peer_read_into(c, mf->name, p + HDR, len)))
            break;
        for (int k = 0; k < 4; k++)
            p[k] = (unsigned char)(x[i].file >> (8 * k)), p[4 + k] = 0;
        for (int k = 0; k < 8; k++)
            p[8 + k] = (unsigned char)((uint64_t)len >> (8 * k));
        at[x[i].to] += HDR + len;
        *sent += HDR + len;
    }
    if (*local) /* the bytes that were to go still go (garbage): the collective stays */
        memset(sb, 0, sb ? stot : 0);
    /* a failed allocation sends nothing sensible: every rank learns it in the agreement
     * after; the collective itself still runs with the planned counts */
    if (!sb || !rb) {
        free(sb), free(rb);
        sb = calloc(stot + 1, 1), rb = calloc(rtot + 1, 1);
        if (!sb || !rb) {
            free(sc), free(rcn), free(at), free(sb), free(rb);
            return STRATA_ENOMEM; /* nothing left to run the collective with */
        }
    }
    rc = st_alltoallv(c->comm, sb, sc, rb, rcn);
    for (size_t p = 0; !rc && !*local && p + HDR <= rtot;) {
        uint32_t f = st_get_u32(rb + p);
        uint64_t len = st_get_u64(rb + p + 8);
        if (f >= c->meta->nfiles || len != c->meta->files[f].bytes || p + HDR + len > rtot) {
            *local = st_fail(STRATA_EIO, "a peer sent a malformed file");
            break;
        }
        *local = st_peer_write(c, c->meta->files[f].name, rb + p + HDR, (size_t)len, 0);
        *got += len;
        p += HDR + (size_t)len;
    }
    free(sc), free(rcn), free(at), free(sb), free(rb);
    return rc;
}

/* 1 for the test hook STRATA_PEER_FAULT=<what>:<rank>[,<rank>...]. */
static int fault(const char *what, int rank)
{
    const char *e = getenv("STRATA_PEER_FAULT");
    size_t n = strlen(what);
    if (!e || strncmp(e, what, n) != 0 || e[n] != ':')
        return 0;
    for (const char *p = e + n + 1; *p; p += *p == ',') {
        char *end;
        long r = strtol(p, &end, 10);
        if (end == p)
            return 0;
        if (r == rank)
            return 1;
        p = end;
    }
    return 0;
}

/* Leaders: every node's outcome (the ranks of a node all succeeded), from each rank's. */
static int node_outcomes(peer_ctx *c, int local, int32_t *node_ok)
{
    int32_t *all = malloc((size_t)c->P * sizeof *all), mine = local;
    if (!all)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = st_allgather(c->comm, &mine, sizeof mine, all);
    for (int i = 0; i < c->N; i++)
        node_ok[i] = 1;
    for (int r = 0; !rc && r < c->P; r++)
        if (all[r])
            node_ok[c->ix[r]] = 0;
    free(all);
    return rc;
}

/* Replicas (replicas > 0) or Reed-Solomon parity (k, m) of the committed checkpoint at
 * uri: the body of strata_peer_replicate and strata_peer_encode. */
static int protect(strata_peer_info *out, strata_comm *comm, const char *uri, int replicas,
                   int k, int m)
{
    peer_ctx c = {0};
    xfer *x = NULL;
    unsigned char *held = NULL;
    uint32_t *owner = NULL;
    int32_t *node_ok = NULL;
    uint64_t sent = 0, got = 0, block = 0;
    int rc = layout(&c, comm, uri), local = 0;
    if (rc)
        goto out;
    if (replicas > c.N - 1 || k + m > c.N || (k && c.N % (k + m))) { /* the same everywhere */
        rc = replicas ? st_fail(STRATA_EINVAL, "%d peer replicas need %d nodes; the "
                                "communicator spans %d", replicas, replicas + 1, c.N)
                      : st_fail(STRATA_EINVAL, "parity groups of %d + %d nodes need a "
                                "multiple of %d nodes; the communicator spans %d", k, m,
                                k + m, c.N);
        goto out;
    }
    if (c.me == ST_ROOT && !(local = st_peer_read(&c, ST_COMMIT_FILE, ST_COMMIT_SIZE, &c.cbuf,
                                                  &c.clen)))
        local = st_peer_read(&c, ST_META_FILE, (size_t)1 << 31, &c.mbuf, &c.mlen);
    if (local)
        local = st_wrap(local, "%s is not committed on rank 0's node", uri);
    if ((rc = st_peer_agree(comm, "reading the committed checkpoint", local)) ||
        (rc = share_meta(&c, ST_ROOT, &local)) ||
        (rc = st_peer_agree(comm, "decoding the checkpoint's metadata", local)))
        goto out;
    const uint32_t F = c.meta->nfiles;
    x = calloc((size_t)c.P * (size_t)(replicas + 1), sizeof *x);
    held = calloc((size_t)F + 1, 1);
    owner = calloc((size_t)F + 1, sizeof *owner);
    node_ok = calloc((size_t)c.N, sizeof *node_ok);
    if (!x || !held || !owner || !node_ok) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    for (uint32_t f = 0; f < F && !rc; f++) { /* the same files on every rank */
        long r = st_data_file_rank(c.meta->files[f].name);
        if (r < 0 || r >= c.P)
            rc = st_fail(STRATA_EINVAL, "%s: %s was not written by a rank of this "
                         "communicator", uri, c.meta->files[f].name);
        else
            owner[f] = (uint32_t)c.ix[r];
    }
    if (rc)
        goto out;
    /* replicas: rank r's data file to the rank of its index on each of the next R nodes
     * of the ring; metadata.bin by the leaders of the nodes without it */
    size_t n = 0;
    for (uint32_t f = 0; f < F; f++) {
        int r = (int)st_data_file_rank(c.meta->files[f].name);
        int d = (c.ix[c.me] - c.ix[r] + c.N) % c.N; /* my node is d after r's */
        if (d <= replicas)
            held[f] = 1;
        for (int i = 1; i <= replicas; i++)
            x[n++] = (xfer){r, rank_on(&c, (c.ix[r] + i) % c.N, c.ns.lidx[r]), f};
    }
    if (c.lead[c.ix[c.me]] == c.me && c.ix[c.me] != c.ix[ST_ROOT])
        local = st_peer_write(&c, ST_META_FILE, c.mbuf, c.mlen, 1);
    if ((rc = st_peer_agree(comm, "writing the metadata to every node", local)))
        goto out;
    rc = k ? st_peer_rs_encode(&c, k, m, owner, &block, &sent, &local)
           : exchange(&c, x, n, &sent, &got, &local);
    if (rc)
        goto out;
    if (!local && fault("replicate", c.me)) /* a rank killed while its node takes its part */
        local = st_fail(STRATA_EABORTED, "fault injected: rank %d stopped during replication",
                        c.me);
    if (fault("kill", c.me)) /* the same, as a kill: the process dies here */
        raise(SIGKILL);
    /* a node's replica set is committed once all its ranks hold their part */
    if ((rc = node_outcomes(&c, local, node_ok)))
        goto out;
    int wrc = 0;
    if (c.lead[c.ix[c.me]] == c.me && node_ok[c.ix[c.me]])
        wrc = rec_write(&c, held, owner, replicas, k, m, block);
    if ((rc = st_peer_agree(comm, "committing the replica sets", local ? local : wrc)))
        goto out;
    if (out) {
        *out = (strata_peer_info){.nodes = c.N, .replicas = replicas, .step = c.cr.step,
                                  .save_id = c.cr.save_id, .bytes_sent = sent,
                                  .bytes_received = got};
        for (uint32_t f = 0; f < F; f++) {
            out->bytes_held += held[f] ? c.meta->files[f].bytes : 0;
            out->share_bytes += owner[f] == (uint32_t)c.ix[c.me] ? c.meta->files[f].bytes : 0;
        }
        out->bytes_held += k ? (uint64_t)m * block : 0; /* its parity blocks */
    }
out:
    free(x);
    free(held);
    free(owner);
    free(node_ok);
    ctx_free(&c);
    return rc;
}

int strata_peer_replicate(strata_peer_info *out, strata_comm *comm, const char *uri,
                          int replicas)
{
    st_clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!comm || !uri || replicas < 1)
        return st_fail(STRATA_EINVAL, "strata_peer_replicate: a communicator, a URI and "
                                      "replicas >= 1 are needed");
    return protect(out, comm, uri, replicas, 0, 0);
}

int strata_peer_encode(strata_peer_info *out, strata_comm *comm, const char *uri, int k, int m)
{
    st_clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!comm || !uri || k < 1 || m < 1 || k + m > 255)
        return st_fail(STRATA_EINVAL, "strata_peer_encode: a communicator, a URI, k >= 1 and "
                                      "m >= 1 (k + m <= 255) are needed");
#ifndef ST_HAVE_ISAL
    return st_fail(STRATA_ENOTSUP, "strata_peer_encode: this libstrata was built without "
                                   "ISA-L (ISAL=0, or libisal-dev missing)");
#endif
    return protect(out, comm, uri, 0, k, m);
}

/* ---- restore ---- */

/* A leader's view of its node's copy: [u8 usable][u64 save id][u32 the node it was]
 * [u32 nfiles][held flags]. */
#define SURVEY 17
static void survey(peer_ctx *c, st_buf *b, unsigned char **rec_buf, size_t *rec_len)
{
    size_t n = 0;
    peer_rec r;
    unsigned char *buf = NULL;
    int ok = st_peer_read(c, ST_PEER_FILE, PEER_MAX_BYTES, &buf, &n) == 0 &&
             st_peer_rec_decode(&r, buf, n) == 0;
    /* a held file must be there with its size (the loader checks every chunk's sum) */
    unsigned char *mb = NULL;
    size_t ml = 0;
    st_meta *m = NULL;
    st_commit cr;
    if (ok)
        ok = st_peer_read(c, ST_META_FILE, (size_t)1 << 31, &mb, &ml) == 0 &&
             st_commit_decode(&cr, r.commit, r.clen) == 0 && cr.meta_size == ml &&
             cr.meta_hash == st_hash(mb, ml) && st_meta_decode(&m, mb, ml) == 0 &&
             m->nfiles == r.nfiles;
    for (uint32_t f = 0; ok && f < r.nfiles; f++) {
        char p[PATH_MAX];
        uint64_t size = 0;
        int kind = -1;
        if (r.held[f] && (st_peer_path(c, m->files[f].name, p) ||
                          c->vfs->stat(c->vfs, p, &size, &kind) || kind != 0 ||
                          size != m->files[f].bytes))
            r.held[f] = 0;
    }
    /* with parity, the node's parity blocks too (else the copy is not used at all) */
    const uint32_t gn = ok ? r.k + r.m : 0, q = gn ? r.node % gn : 0, g = gn ? r.node / gn : 0;
    for (uint32_t p = 0; ok && r.k && p < r.m; p++) {
        char name[40], path[PATH_MAX];
        uint64_t size = 0;
        int kind = -1;
        st_peer_parity_name(name, g * gn + (q + 2 * gn - r.k - p) % gn);
        ok = st_peer_path(c, name, path) == 0 && c->vfs->stat(c->vfs, path, &size, &kind) == 0 &&
             kind == 0 && size == r.block;
    }
    st_buf_u8(b, (uint8_t)ok);
    st_buf_u64(b, ok ? r.save_id : 0);
    st_buf_u32(b, ok ? r.node : 0);
    st_buf_u32(b, ok ? r.nfiles : 0);
    if (ok)
        st_buf_put(b, r.held, r.nfiles);
    st_meta_free(m);
    if (ok) {
        free(c->mbuf); /* kept for share_meta if this node is the source */
        c->mbuf = mb, c->mlen = ml;
        c->cbuf = malloc(ST_COMMIT_SIZE);
        if (c->cbuf)
            memcpy(c->cbuf, r.commit, r.clen), c->clen = r.clen;
        *rec_buf = buf;
        *rec_len = n;
    } else {
        free(mb);
        free(buf);
    }
}

/* Names the files no surviving node holds into a message (the first few). */
static int lost(const peer_ctx *c, const char *uri, const int *holder)
{
    char names[512] = "";
    size_t len = 0;
    int k = 0;
    for (uint32_t f = 0; f < c->meta->nfiles; f++)
        if (holder[f] < 0 && k++ < 6)
            len += (size_t)snprintf(names + len, len < sizeof names ? sizeof names - len : 0,
                                    "%s%s", k > 1 ? ", " : "", c->meta->files[f].name);
    return st_fail(STRATA_ENOREPLICA, "step %llu of %s cannot be rebuilt from the surviving "
                   "nodes' replicas: %d data file%s held by none (%s%s)",
                   (unsigned long long)c->cr.step, uri, k, k == 1 ? "" : "s", names,
                   k > 6 ? ", ..." : "");
}

/* A restore's state, shared by its steps (in the order strata_peer_restore runs them). */
typedef struct {
    peer_ctx c;
    const char *uri;
    int leader;            /* this rank leads its node */
    st_buf b;              /* this leader's survey */
    unsigned char *all;    /* every rank's survey (counts[r] bytes each, in rank order) */
    size_t *counts;
    unsigned char *rec;    /* the source's replica record (n_rec bytes), decoded into R */
    size_t n_rec;
    peer_rec R;
    int src;               /* the source: the first rank whose node holds a usable copy */
    uint64_t id;           /* its save */
    int *avail;            /* per node: its copy holds the save */
    int *old;              /* per old node: the new node holding its copy, or -1 */
    unsigned char *held;   /* node i's files: held + i * nfiles */
    int *holder;           /* per file: the first node holding it */
    xfer *x;
    uint64_t sent, got;
} restore;

static void restore_free(restore *s)
{
    free(s->b.p);
    free(s->all);
    free(s->rec);
    free(s->counts);
    free(s->avail);
    free(s->holder);
    free(s->held);
    free(s->old);
    free(s->x);
    ctx_free(&s->c);
}

/* 1. every node's leader says what its copy holds; every rank learns all (allgatherv). */
static int survey_all(void *p, int *local)
{
    restore *s = p;
    (void)local;
    if (s->leader)
        survey(&s->c, &s->b, &s->rec, &s->n_rec);
    s->counts = calloc((size_t)s->c.P, sizeof *s->counts);
    s->avail = calloc((size_t)s->c.N, sizeof *s->avail);
    if (s->b.oom || !s->counts || !s->avail)
        return st_fail(STRATA_ENOMEM, "out of memory");
    return st_allgatherv(s->c.comm, s->b.p, s->b.n, &s->all, s->counts);
}

/* 2. the save: the first usable node's; nodes holding another save's count as empty. */
static int pick_save(void *p, int *local)
{
    restore *s = p;
    (void)local;
    size_t at = 0;
    s->src = -1;
    for (int r = 0; r < s->c.P; r++) {
        if (s->counts[r] >= SURVEY && s->all[at]) {
            uint64_t sid = st_get_u64(s->all + at + 1);
            if (s->src < 0)
                s->src = r, s->id = sid;
            s->avail[s->c.ix[r]] = sid == s->id;
        }
        at += s->counts[r];
    }
    if (s->src < 0)
        return st_fail(STRATA_ENOREPLICA, "no surviving node holds committed peer replicas "
                       "of %s", s->uri);
    return 0;
}

/* The source's metadata and commit record to every rank; *local: their decoding. */
static int share_save(void *p, int *local)
{
    restore *s = p;
    return share_meta(&s->c, s->src, local);
}

/* The source's record to every rank (length, then bytes); *local: its decoding (how the
 * save was protected: replicas, or parity groups). */
static int share_record(void *p, int *local)
{
    restore *s = p;
    uint64_t rlen = s->rec ? s->n_rec : 0;
    int rc = st_bcast(s->c.comm, &rlen, sizeof rlen, s->src);
    if (rc)
        return rc;
    if (s->c.me != s->src && rlen <= PEER_MAX_BYTES) {
        free(s->rec);
        s->rec = malloc(rlen + 1);
    }
    if (!s->rec || rlen > PEER_MAX_BYTES)
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    if (!(rc = st_bcast(s->c.comm, s->rec, rlen, s->src)))
        *local = st_peer_rec_decode(&s->R, s->rec, rlen);
    return rc;
}

/* 3. what each usable node holds, and which new node holds each old node's copy. */
static int find_copies(void *p, int *local)
{
    restore *s = p;
    (void)local;
    const uint32_t F = s->c.meta->nfiles;
    s->holder = malloc(((size_t)F + 1) * sizeof *s->holder);
    s->held = calloc((size_t)s->c.N * (F + 1), 1);
    if (!s->holder || !s->held)
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    s->old = malloc(((size_t)s->R.nodes + 1) * sizeof *s->old);
    if (!s->old)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < s->R.nodes; i++)
        s->old[i] = -1;
    size_t at = 0;
    for (int r = 0; r < s->c.P; r++) {
        int i = s->c.ix[r];
        if (s->avail[i] && s->c.ns.node[r] == r && s->counts[r] == SURVEY + (size_t)F) {
            memcpy(s->held + (size_t)i * F, s->all + at + SURVEY, F);
            uint32_t was = st_get_u32(s->all + at + 9);
            if (was < s->R.nodes && s->old[was] < 0)
                s->old[was] = i;
        }
        at += s->counts[r];
    }
    return 0;
}

/* With parity: the lost nodes' files decoded, each at a survivor of its group. */
static int decode_lost(void *p, int *local)
{
    restore *s = p;
    return st_peer_rs_rebuild(&s->c, &s->R, s->old, s->held, &s->sent, &s->got, local);
}

/* Who holds each file: the first node holding it; STRATA_ENOREPLICA where none does. */
static int find_holders(void *p, int *local)
{
    restore *s = p;
    (void)local;
    const uint32_t F = s->c.meta->nfiles;
    for (uint32_t f = 0; f < F; f++) {
        s->holder[f] = -1;
        for (int i = 0; i < s->c.N && s->holder[f] < 0; i++)
            if (s->held[(size_t)i * F + f])
                s->holder[f] = i;
    }
    for (uint32_t f = 0; f < F; f++)
        if (s->holder[f] < 0)
            return lost(&s->c, s->uri, s->holder);
    return 0;
}

/* 4. a node without the save: its leader makes the directory and writes the metadata. */
static int prepare_copy(void *p, int *local)
{
    restore *s = p;
    peer_ctx *c = &s->c;
    if (!s->leader || s->avail[c->ix[c->me]])
        return 0;
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", c->dir);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = 0;
        c->vfs->mkdir(c->vfs, parent);
    }
    int e = c->vfs->mkdir(c->vfs, c->dir);
    *local = e && e != -EEXIST ? st_fail(STRATA_EIO, "cannot make %s: %s", c->dir, strerror(-e))
                               : st_peer_write(c, ST_META_FILE, c->mbuf, c->mlen, 1);
    return 0;
}

/* Each node gets the files it lacks (senders spread over the holder's ranks, receivers
 * over the node's), one alltoallv. */
static int send_missing(void *p, int *local)
{
    restore *s = p;
    peer_ctx *c = &s->c;
    const uint32_t F = c->meta->nfiles;
    s->x = calloc((size_t)c->N * F + 1, sizeof *s->x);
    if (!s->x)
        return st_fail(STRATA_ENOMEM, "out of memory");
    size_t n = 0;
    for (int i = 0; i < c->N; i++)
        for (uint32_t f = 0; f < F; f++)
            if (!s->held[(size_t)i * F + f])
                s->x[n++] = (xfer){rank_on(c, s->holder[f], (int)(f + (uint32_t)i)),
                                   rank_on(c, i, (int)f), f};
    return exchange(c, s->x, n, &s->sent, &s->got, local);
}

/* 5. every node's copy is whole: its leader commits it (the save's own record; a copy
 * committed by another save is STRATA_EEXIST) and records that it holds every file. */
static int commit_copy(void *p, int *out)
{
    restore *s = p;
    peer_ctx *c = &s->c;
    if (!s->leader)
        return 0;
    unsigned char *cur = NULL, *all1 = malloc(c->meta->nfiles + 1);
    uint32_t *owner0 = NULL;
    size_t cl = 0;
    st_commit a, bb;
    int local = 0;
    if (!all1) {
        local = st_fail(STRATA_ENOMEM, "out of memory");
    } else if (st_peer_read(c, ST_COMMIT_FILE, ST_COMMIT_SIZE, &cur, &cl) == 0) {
        if (st_commit_decode(&a, cur, cl) || st_commit_decode(&bb, c->cbuf, c->clen) ||
            !st_commit_same(&a, &bb))
            local = st_fail(STRATA_EEXIST, "%s holds another save's commit record", c->dir);
    } else {
        local = st_peer_write(c, ST_COMMIT_FILE, c->cbuf, c->clen, 1);
    }
    owner0 = calloc((size_t)c->meta->nfiles + 1, sizeof *owner0);
    if (!local && !owner0)
        local = st_fail(STRATA_ENOMEM, "out of memory");
    if (!local) { /* a whole copy: the owners no longer matter */
        memset(all1, 1, c->meta->nfiles);
        local = rec_write(c, all1, owner0, 0, 0, 0, 0);
    }
    free(cur);
    free(all1);
    free(owner0);
    *out = local;
    return 0;
}

static int parity(const void *s) { return ((const restore *)s)->R.k != 0; }

/* The restore's steps, in order, the same on every rank. */
static const st_peer_step steps[] = {
    {survey_all, NULL, NULL},
    {pick_save, NULL, NULL},
    {share_save, "decoding the checkpoint's metadata", NULL},
    {share_record, "reading the replica record", NULL},
    {find_copies, NULL, NULL},
    {decode_lost, "decoding the lost nodes' files", parity},
    {find_holders, NULL, NULL},
    {prepare_copy, "preparing the surviving nodes' copies", NULL},
    {send_missing, "rebuilding the lost nodes' files", NULL},
    {commit_copy, "committing the rebuilt copies", NULL},
};

int strata_peer_restore(strata_peer_info *out, strata_comm *comm, const char *uri)
{
    st_clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!comm || !uri)
        return st_fail(STRATA_EINVAL, "strata_peer_restore: a communicator and a URI are "
                                      "needed");
    restore s = {.uri = uri, .src = -1};
    int rc = layout(&s.c, comm, uri);
    if (!rc) {
        s.leader = s.c.lead[s.c.ix[s.c.me]] == s.c.me;
        int local = 0; /* every step that can fail on one rank is agreed on */
        rc = st_peer_steps(comm, steps, sizeof steps / sizeof *steps, &s, &local);
    }
    if (!rc && out) {
        peer_ctx *c = &s.c;
        *out = (strata_peer_info){.nodes = c->N, .step = c->cr.step, .save_id = c->cr.save_id,
                                  .bytes_sent = s.sent, .bytes_received = s.got};
        for (uint32_t f = 0; f < c->meta->nfiles; f++)
            out->bytes_held += c->meta->files[f].bytes;
    }
    restore_free(&s);
    return rc;
}
