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
#include "dist.h"

#define PEER_MAGIC "STRATAPR"
#define PEER_VERSION 1u
#define PEER_MAX_BYTES (1u << 26) /* a record: 64 MiB at most (files of 2^26 ranks) */
#define HDR 16                    /* a file on the wire: u32 file index, u32 0, u64 bytes */

typedef struct {
    strata_comm *comm;
    const st_vfs *vfs;
    char dir[PATH_MAX];
    int P, me, N;      /* ranks, this rank, nodes */
    st_node_shm ns;    /* node[r]: the node's lowest rank; lidx[r] */
    int *ix;           /* per rank: its node's index 0..N-1 (nodes by lowest rank) */
    int *lead, *nloc;  /* per node index: its lowest rank, its ranks */
    unsigned char *mbuf, *cbuf; /* metadata.bin and the commit record */
    size_t mlen, clen;
    st_meta *meta;
    st_commit cr;
} peer_ctx;

static void ctx_free(peer_ctx *c)
{
    st_node_shm_close(&c->ns);
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
    if ((rc = st_node_shm_open(comm, 0, &c->ns)))
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

/* ---- the files of this node's copy ---- */

static int path_of(const peer_ctx *c, const char *name, char *out)
{
    return st_path_join(out, c->dir, name);
}

static int read_file(const peer_ctx *c, const char *name, size_t max, unsigned char **out,
                     size_t *len)
{
    char p[PATH_MAX];
    int rc = path_of(c, name, p);
    return rc ? rc : st_vfs_read_all(c->vfs, p, max, 0, out, len);
}

/* Writes a whole file; through name.tmp and a rename when atomic (the records). */
static int write_file(const peer_ctx *c, const char *name, const void *buf, size_t n,
                      int atomic)
{
    char p[PATH_MAX], t[PATH_MAX + 8];
    int rc = path_of(c, name, p);
    if (rc)
        return rc;
    snprintf(t, sizeof t, "%s.tmp", p);
    st_file *f;
    int e = c->vfs->open(c->vfs, atomic ? t : p, ST_O_WRITE, &f);
    if (e)
        return st_fail(STRATA_EIO, "cannot create %s: %s", atomic ? t : p, strerror(-e));
    e = st_vfs_write_full(c->vfs, f, buf, n, 0);
    int ce = c->vfs->close(f);
    if (!e)
        e = ce;
    if (!e && atomic) { /* a record replaced: swapped in at once where the storage can */
        e = c->vfs->rename(c->vfs, t, p);
        if (e == -EEXIST && c->vfs->exchange && c->vfs->exchange(c->vfs, t, p) == 0)
            e = c->vfs->unlink(c->vfs, t);
        else if (e == -EEXIST && (e = c->vfs->unlink(c->vfs, p)) == 0)
            e = c->vfs->rename(c->vfs, t, p);
    }
    if (e)
        return st_fail(e == -ENOSPC ? STRATA_ENOSPC : STRATA_EIO, "cannot write %s: %s", p,
                       strerror(-e));
    return 0;
}

/* ---- the replica record (FORMAT.md, "Peer replica record") ---- */

typedef struct {
    uint64_t save_id, step;
    uint32_t nodes, replicas, nfiles, clen;
    unsigned char commit[ST_COMMIT_SIZE];
    unsigned char *held; /* nfiles bytes: 1 where the node holds the file */
} peer_rec;

static int rec_write(const peer_ctx *c, const unsigned char *held, int replicas)
{
    st_buf b = {0};
    st_buf_put(&b, PEER_MAGIC, 8);
    st_buf_u32(&b, PEER_VERSION);
    st_buf_u64(&b, c->cr.save_id);
    st_buf_u64(&b, c->cr.step);
    st_buf_u32(&b, (uint32_t)c->N);
    st_buf_u32(&b, (uint32_t)replicas);
    st_buf_u32(&b, (uint32_t)c->clen);
    st_buf_put(&b, c->cbuf, c->clen);
    st_buf_u32(&b, c->meta->nfiles);
    st_buf_put(&b, held, c->meta->nfiles);
    st_buf_u64(&b, b.oom ? 0 : st_hash(b.p, b.n));
    int rc = b.oom ? st_fail(STRATA_ENOMEM, "out of memory")
                   : write_file(c, ST_PEER_FILE, b.p, b.n, 1);
    free(b.p);
    return rc;
}

/* Decodes a record: STRATA_EFORMAT naming what is wrong. r->held points into buf. */
static int rec_decode(peer_rec *r, unsigned char *buf, size_t n)
{
    const size_t fixed = 8 + 4 + 16 + 12 + 4;
    memset(r, 0, sizeof *r);
    if (n < fixed + 4 + 8 || memcmp(buf, PEER_MAGIC, 8) != 0)
        return st_fail(STRATA_EFORMAT, "not a peer replica record (magic or size)");
    if (st_get_u64(buf + n - 8) != st_hash(buf, n - 8))
        return st_fail(STRATA_ECHECKSUM, "peer replica record fails its checksum");
    if (st_get_u32(buf + 8) != PEER_VERSION)
        return st_fail(STRATA_EFORMAT, "peer replica record of version %u",
                       st_get_u32(buf + 8));
    r->save_id = st_get_u64(buf + 12);
    r->step = st_get_u64(buf + 20);
    r->nodes = st_get_u32(buf + 28);
    r->replicas = st_get_u32(buf + 32);
    r->clen = st_get_u32(buf + 36);
    size_t p = 40;
    if (r->clen > ST_COMMIT_SIZE || p + r->clen + 4 + 8 > n)
        return st_fail(STRATA_EFORMAT, "peer replica record: bad commit record length");
    memcpy(r->commit, buf + p, r->clen);
    p += r->clen;
    r->nfiles = st_get_u32(buf + p);
    p += 4;
    if (r->nfiles != n - 8 - p)
        return st_fail(STRATA_EFORMAT, "peer replica record: %u files in %zu bytes",
                       r->nfiles, n - 8 - p);
    r->held = buf + p;
    for (uint32_t f = 0; f < r->nfiles; f++)
        if (r->held[f] > 1)
            return st_fail(STRATA_EFORMAT, "peer replica record: bad flag of file %u", f);
    st_commit cr;
    if (st_commit_decode(&cr, r->commit, r->clen) || cr.save_id != r->save_id ||
        cr.step != r->step)
        return st_fail(STRATA_EFORMAT, "peer replica record: its commit record disagrees");
    return 0;
}

/* ---- what every rank agrees on ---- */

/* Every rank's outcome agreed on: 0 where all succeeded, else the first failure's. */
static int agree(strata_comm *comm, const char *what, int rc)
{
    size_t *lens = calloc((size_t)comm->size, sizeof *lens);
    unsigned char *out = NULL;
    if (!lens)
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* still calls: the others wait */
    size_t one;
    int arc = strata_comm_agree(&out, lens ? lens : &one, comm, what, rc, NULL, 0, 0, 0);
    free(out);
    free(lens);
    return arc;
}

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
    if (c->me != root) {
        c->mlen = (size_t)len[0], c->clen = (size_t)len[1];
        c->mbuf = malloc(c->mlen + 1);
        c->cbuf = malloc(c->clen + 1);
        if (!c->mbuf || !c->cbuf)
            return st_fail(STRATA_ENOMEM, "out of memory"); /* a hang the time limit ends */
    }
    if ((rc = st_bcast(c->comm, c->mbuf, c->mlen, root)) ||
        (rc = st_bcast(c->comm, c->cbuf, c->clen, root)))
        return rc;
    return agree(c->comm, "decoding the checkpoint's metadata", take_meta(c));
}

/* The data file of rank r in the metadata, or -1. */
static int file_of(const peer_ctx *c, int r)
{
    char name[ST_DATA_FILE_BYTES];
    st_data_file_name(name, r);
    for (uint32_t f = 0; f < c->meta->nfiles; f++)
        if (strcmp(c->meta->files[f].name, name) == 0)
            return (int)f;
    return -1;
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
        unsigned char *buf = NULL;
        size_t len = 0;
        if ((*local = read_file(c, mf->name, SIZE_MAX, &buf, &len)))
            break;
        if (len != mf->bytes) {
            free(buf);
            *local = st_fail(STRATA_EINCOMPLETE, "%s/%s has %zu bytes, the metadata says %llu",
                             c->dir, mf->name, len, (unsigned long long)mf->bytes);
            break;
        }
        for (int k = 0; k < 4; k++)
            p[k] = (unsigned char)(x[i].file >> (8 * k)), p[4 + k] = 0;
        for (int k = 0; k < 8; k++)
            p[8 + k] = (unsigned char)((uint64_t)len >> (8 * k));
        memcpy(p + HDR, buf, len);
        free(buf);
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
        *local = write_file(c, c->meta->files[f].name, rb + p + HDR, (size_t)len, 0);
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

int strata_peer_replicate(strata_peer_info *out, strata_comm *comm, const char *uri,
                          int replicas)
{
    st_clear_error();
    if (out)
        memset(out, 0, sizeof *out);
    if (!comm || !uri || replicas < 1)
        return st_fail(STRATA_EINVAL, "strata_peer_replicate: a communicator, a URI and "
                                      "replicas >= 1 are needed");
    peer_ctx c = {0};
    xfer *x = NULL;
    unsigned char *held = NULL;
    int32_t *node_ok = NULL;
    uint64_t sent = 0, got = 0;
    int rc = layout(&c, comm, uri), local = 0;
    if (rc)
        goto out;
    if (replicas > c.N - 1) { /* the same on every rank */
        rc = st_fail(STRATA_EINVAL, "%d peer replicas need %d nodes; the communicator spans %d",
                     replicas, replicas + 1, c.N);
        goto out;
    }
    if (c.me == ST_ROOT && !(local = read_file(&c, ST_COMMIT_FILE, ST_COMMIT_SIZE, &c.cbuf,
                                               &c.clen)))
        local = read_file(&c, ST_META_FILE, (size_t)1 << 31, &c.mbuf, &c.mlen);
    if (local)
        local = st_wrap(local, "%s is not committed on rank 0's node", uri);
    if ((rc = agree(comm, "reading the committed checkpoint", local)) ||
        (rc = share_meta(&c, ST_ROOT)))
        goto out;
    /* the transfers: rank r's data file to the rank of its index on each of the next R
     * nodes of the ring; metadata.bin by the leaders of the nodes without it */
    x = calloc((size_t)c.P * (size_t)replicas + 1, sizeof *x);
    held = calloc((size_t)c.meta->nfiles + 1, 1);
    node_ok = calloc((size_t)c.N, sizeof *node_ok);
    if (!x || !held || !node_ok) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    size_t n = 0;
    for (int r = 0; r < c.P; r++) {
        int f = file_of(&c, r);
        if (f < 0)
            continue;
        int d = (c.ix[c.me] - c.ix[r] + c.N) % c.N; /* my node is d after r's */
        if (d <= replicas)
            held[f] = 1;
        for (int k = 1; k <= replicas; k++)
            x[n++] = (xfer){r, rank_on(&c, (c.ix[r] + k) % c.N, c.ns.lidx[r]), (uint32_t)f};
    }
    if (c.lead[c.ix[c.me]] == c.me && c.ix[c.me] != c.ix[ST_ROOT])
        local = write_file(&c, ST_META_FILE, c.mbuf, c.mlen, 1);
    if ((rc = agree(comm, "writing the metadata to every node", local)))
        goto out;
    if ((rc = exchange(&c, x, n, &sent, &got, &local)))
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
        wrc = rec_write(&c, held, replicas);
    if ((rc = agree(comm, "committing the replica sets", local ? local : wrc)))
        goto out;
    if (out) {
        *out = (strata_peer_info){.nodes = c.N, .replicas = replicas, .step = c.cr.step,
                                  .save_id = c.cr.save_id, .bytes_sent = sent,
                                  .bytes_received = got};
        for (uint32_t f = 0; f < c.meta->nfiles; f++)
            out->bytes_held += held[f] ? c.meta->files[f].bytes : 0;
        out->share_bytes = 0;
        for (int r = 0; r < c.P; r++) {
            int f = file_of(&c, r);
            if (f >= 0 && c.ix[r] == c.ix[c.me])
                out->share_bytes += c.meta->files[f].bytes;
        }
    }
out:
    free(x);
    free(held);
    free(node_ok);
    ctx_free(&c);
    return rc;
}

/* ---- restore ---- */

/* A leader's view of its node's copy: [u8 usable][u64 save id][u32 nfiles][held flags]. */
static void survey(peer_ctx *c, st_buf *b, unsigned char **rec_buf)
{
    size_t n = 0;
    peer_rec r;
    unsigned char *buf = NULL;
    int ok = read_file(c, ST_PEER_FILE, PEER_MAX_BYTES, &buf, &n) == 0 &&
             rec_decode(&r, buf, n) == 0;
    /* a held file must be there with its size (the loader checks every chunk's sum) */
    unsigned char *mb = NULL;
    size_t ml = 0;
    st_meta *m = NULL;
    st_commit cr;
    if (ok)
        ok = read_file(c, ST_META_FILE, (size_t)1 << 31, &mb, &ml) == 0 &&
             st_commit_decode(&cr, r.commit, r.clen) == 0 && cr.meta_size == ml &&
             cr.meta_hash == st_hash(mb, ml) && st_meta_decode(&m, mb, ml) == 0 &&
             m->nfiles == r.nfiles;
    for (uint32_t f = 0; ok && f < r.nfiles; f++) {
        char p[PATH_MAX];
        uint64_t size = 0;
        int kind = -1;
        if (r.held[f] && (path_of(c, m->files[f].name, p) ||
                          c->vfs->stat(c->vfs, p, &size, &kind) || kind != 0 ||
                          size != m->files[f].bytes))
            r.held[f] = 0;
    }
    st_buf_u8(b, (uint8_t)ok);
    st_buf_u64(b, ok ? r.save_id : 0);
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
    int *holder = NULL, *avail = NULL;
    xfer *x = NULL;
    uint64_t sent = 0, got = 0, id = 0;
    int rc = layout(&c, comm, uri), local = 0, src = -1;
    if (rc)
        goto out;
    /* 1. every node's leader says what its copy holds; every rank learns all */
    const int leader = c.lead[c.ix[c.me]] == c.me;
    if (leader)
        survey(&c, &b, &rec);
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
        if (counts[r] >= 13 && all[at]) {
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
    /* 3. who holds each file: the first usable node */
    holder = malloc(((size_t)c.meta->nfiles + 1) * sizeof *holder);
    held = calloc((size_t)c.N * (c.meta->nfiles + 1), 1); /* node i's: held + i * nfiles */
    if (!holder || !held) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    at = 0;
    for (int r = 0; r < c.P; r++) {
        if (avail[c.ix[r]] && c.ns.node[r] == r && counts[r] == 13 + (size_t)c.meta->nfiles)
            memcpy(held + (size_t)c.ix[r] * c.meta->nfiles, all + at + 13, c.meta->nfiles);
        at += counts[r];
    }
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
                                  : write_file(&c, ST_META_FILE, c.mbuf, c.mlen, 1);
    }
    if ((rc = agree(comm, "preparing the surviving nodes' copies", local)))
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
        (rc = agree(comm, "rebuilding the lost nodes' files", local)))
        goto out;
    /* 5. every node's copy is whole: its leader commits it (the save's own record) and
     * records that it holds every file */
    if (leader) {
        unsigned char *cur = NULL, *all1 = malloc(c.meta->nfiles + 1);
        size_t cl = 0;
        st_commit a, bb;
        if (!all1) {
            local = st_fail(STRATA_ENOMEM, "out of memory");
        } else if (read_file(&c, ST_COMMIT_FILE, ST_COMMIT_SIZE, &cur, &cl) == 0) {
            if (st_commit_decode(&a, cur, cl) || st_commit_decode(&bb, c.cbuf, c.clen) ||
                !st_commit_same(&a, &bb))
                local = st_fail(STRATA_EEXIST, "%s holds another save's commit record", c.dir);
        } else {
            local = write_file(&c, ST_COMMIT_FILE, c.cbuf, c.clen, 1);
        }
        if (!local) {
            memset(all1, 1, c.meta->nfiles);
            local = rec_write(&c, all1, 0);
        }
        free(cur);
        free(all1);
    }
    if ((rc = agree(comm, "committing the rebuilt copies", local)))
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
    free(x);
    ctx_free(&c);
    return rc;
}
