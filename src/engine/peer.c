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

/* Root's metadata and commit record to every rank (lengths, then bytes), decoded. */
static int share_meta(peer_ctx *c, int root)
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
    if ((rc = st_bcast(c->comm, c->mbuf, c->mlen, root)) ||
        (rc = st_bcast(c->comm, c->cbuf, c->clen, root)))
        return rc;
    return st_peer_agree(c->comm, "decoding the checkpoint's metadata", take_meta(c));
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
        (rc = share_meta(&c, ST_ROOT)))
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

int strata_peer_restore(strata_peer_info *out, strata_comm *comm, const char *uri)
{
    st_clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!comm || !uri)
        return st_fail(STRATA_EINVAL, "strata_peer_restore: a communicator and a URI are "
                                      "needed");
    peer_ctx c = {0};
    st_buf b = {0};
    unsigned char *all = NULL, *rec = NULL, *held = NULL;
    size_t *counts = NULL;
    int *holder = NULL, *avail = NULL, *old = NULL;
    uint32_t *owner0 = NULL;
    xfer *x = NULL;
    uint64_t sent = 0, got = 0, id = 0;
    size_t n_rec = 0;
    int rc = layout(&c, comm, uri), local = 0, src = -1;
    if (rc)
        goto out;
    /* 1. every node's leader says what its copy holds; every rank learns all */
    const int leader = c.lead[c.ix[c.me]] == c.me;
    if (leader)
        survey(&c, &b, &rec, &n_rec);
    counts = calloc((size_t)c.P, sizeof *counts);
    avail = calloc((size_t)c.N, sizeof *avail);
    if (b.oom || !counts || !avail) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = st_allgatherv(comm, b.p, b.n, &all, counts)))
        goto out;
    /* 2. the save: the first usable node's; nodes holding another save's count as empty */
    size_t at = 0;
    for (int r = 0; r < c.P; r++) {
        if (counts[r] >= SURVEY && all[at]) {
            uint64_t sid = st_get_u64(all + at + 1);
            if (src < 0)
                src = r, id = sid;
            avail[c.ix[r]] = sid == id;
        }
        at += counts[r];
    }
    if (src < 0) {
        rc = st_fail(STRATA_ENOREPLICA, "no surviving node holds committed peer replicas of %s",
                     uri);
        goto out;
    }
    if ((rc = share_meta(&c, src)))
        goto out;
    /* the source's record: how the save was protected (replicas, or parity groups) */
    uint64_t rlen = rec ? n_rec : 0;
    peer_rec R;
    if ((rc = st_bcast(comm, &rlen, sizeof rlen, src)))
        goto out;
    if (c.me != src && rlen <= PEER_MAX_BYTES) {
        free(rec);
        rec = malloc(rlen + 1);
    }
    if (!rec || rlen > PEER_MAX_BYTES) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    if ((rc = st_bcast(comm, rec, rlen, src)) ||
        (rc = st_peer_agree(comm, "reading the replica record",
                            st_peer_rec_decode(&R, rec, rlen))))
        goto out;
    /* 3. who holds each file: the first usable node */
    holder = malloc(((size_t)c.meta->nfiles + 1) * sizeof *holder);
    held = calloc((size_t)c.N * (c.meta->nfiles + 1), 1); /* node i's: held + i * nfiles */
    if (!holder || !held) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    old = malloc(((size_t)R.nodes + 1) * sizeof *old);
    if (!old) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < R.nodes; i++)
        old[i] = -1;
    at = 0;
    for (int r = 0; r < c.P; r++) {
        if (avail[c.ix[r]] && c.ns.node[r] == r &&
            counts[r] == SURVEY + (size_t)c.meta->nfiles) {
            memcpy(held + (size_t)c.ix[r] * c.meta->nfiles, all + at + SURVEY, c.meta->nfiles);
            uint32_t was = st_get_u32(all + at + 9);
            if (was < R.nodes && old[was] < 0)
                old[was] = c.ix[r];
        }
        at += counts[r];
    }
    /* with parity: the lost nodes' files decoded, each at a survivor of its group */
    if (R.k && ((rc = st_peer_rs_rebuild(&c, &R, old, held, &sent, &got, &local)) ||
                (rc = st_peer_agree(comm, "decoding the lost nodes' files", local))))
        goto out;
    for (uint32_t f = 0; f < c.meta->nfiles; f++) {
        holder[f] = -1;
        for (int i = 0; i < c.N && holder[f] < 0; i++)
            if (held[(size_t)i * c.meta->nfiles + f])
                holder[f] = i;
    }
    for (uint32_t f = 0; f < c.meta->nfiles; f++)
        if (holder[f] < 0) {
            rc = lost(&c, uri, holder);
            goto out;
        }
    /* 4. each node gets what it lacks: the directory and metadata by its leader first */
    if (leader && !avail[c.ix[c.me]]) {
        char parent[PATH_MAX];
        snprintf(parent, sizeof parent, "%s", c.dir);
        char *slash = strrchr(parent, '/');
        if (slash && slash != parent) {
            *slash = 0;
            c.vfs->mkdir(c.vfs, parent);
        }
        int e = c.vfs->mkdir(c.vfs, c.dir);
        local = e && e != -EEXIST ? st_fail(STRATA_EIO, "cannot make %s: %s", c.dir,
                                            strerror(-e))
                                  : st_peer_write(&c, ST_META_FILE, c.mbuf, c.mlen, 1);
    }
    if ((rc = st_peer_agree(comm, "preparing the surviving nodes' copies", local)))
        goto out;
    x = calloc((size_t)c.N * c.meta->nfiles + 1, sizeof *x);
    if (!x) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    size_t n = 0;
    for (int i = 0; i < c.N; i++)
        for (uint32_t f = 0; f < c.meta->nfiles; f++)
            if (!held[(size_t)i * c.meta->nfiles + f])
                x[n++] = (xfer){rank_on(&c, holder[f], (int)(f + (uint32_t)i)),
                                rank_on(&c, i, (int)f), f};
    if ((rc = exchange(&c, x, n, &sent, &got, &local)) ||
        (rc = st_peer_agree(comm, "rebuilding the lost nodes' files", local)))
        goto out;
    /* 5. every node's copy is whole: its leader commits it (the save's own record) and
     * records that it holds every file */
    if (leader) {
        unsigned char *cur = NULL, *all1 = malloc(c.meta->nfiles + 1);
        size_t cl = 0;
        st_commit a, bb;
        if (!all1) {
            local = st_fail(STRATA_ENOMEM, "out of memory");
        } else if (st_peer_read(&c, ST_COMMIT_FILE, ST_COMMIT_SIZE, &cur, &cl) == 0) {
            if (st_commit_decode(&a, cur, cl) || st_commit_decode(&bb, c.cbuf, c.clen) ||
                !st_commit_same(&a, &bb))
                local = st_fail(STRATA_EEXIST, "%s holds another save's commit record", c.dir);
        } else {
            local = st_peer_write(&c, ST_COMMIT_FILE, c.cbuf, c.clen, 1);
        }
        owner0 = calloc((size_t)c.meta->nfiles + 1, sizeof *owner0);
        if (!local && !owner0)
            local = st_fail(STRATA_ENOMEM, "out of memory");
        if (!local) { /* a whole copy: the owners no longer matter */
            memset(all1, 1, c.meta->nfiles);
            local = rec_write(&c, all1, owner0, 0, 0, 0, 0);
        }
        free(cur);
        free(all1);
    }
    if ((rc = st_peer_agree(comm, "committing the rebuilt copies", local)))
        goto out;
    if (out) {
        *out = (strata_peer_info){.nodes = c.N, .step = c.cr.step, .save_id = c.cr.save_id,
                                  .bytes_sent = sent, .bytes_received = got};
        for (uint32_t f = 0; f < c.meta->nfiles; f++)
            out->bytes_held += c.meta->files[f].bytes;
    }
out:
    free(b.p);
    free(all);
    free(rec);
    free(counts);
    free(avail);
    free(holder);
    free(held);
    free(old);
    free(owner0);
    free(x);
    ctx_free(&c);
    return rc;
}
