/* peer_rs.c - Reed-Solomon parity of peer copies (issue 34), with ISA-L's erasure codes:
 * instead of R whole copies of each node's files, groups of n = k + m consecutive nodes
 * hold m/k of a share of parity each, and any m nodes of a group may be lost.
 *
 * A node's data is its ranks' data files, concatenated in the metadata's file order and
 * zero padded to k blocks of `block` bytes (the same block for every node: the largest
 * share / k, rounded up to 64). Group g's codeword j (0 <= j < n) has data block t (t < k)
 * = block t of the node at position (j + t) mod n of the group, and parity block p (p < m)
 * at position (j + k + p) mod n: each node is a data member of k codewords (one per block
 * of its data) and holds the parity of m, so it keeps (1 + m/k) x its share, and each
 * codeword has its n blocks on n distinct nodes. Codeword j is encoded at the node at
 * position j (its block 0): it receives blocks 1..k-1 from their nodes, computes the m
 * parity blocks (ec_encode_data over gf_gen_cauchy1_matrix's rows k..n-1) and sends each
 * to its node, which keeps it as PEER-<g * n + j>.par. A node sends (k - 1 + m) blocks:
 * (k - 1 + m) / k of its share. All on the node leaders; the other ranks join the
 * collectives with nothing to send. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "peer.h"

#ifdef ST_HAVE_ISAL
#include <isa-l/erasure_code.h>

/* Old node `who`'s files (owner[f] == who) from this node's copy, concatenated into buf
 * (cap bytes, zero padded). */
static int node_data(const peer_ctx *c, const uint32_t *owner, uint32_t who, unsigned char *buf,
                     uint64_t cap)
{
    uint64_t at = 0;
    memset(buf, 0, cap);
    for (uint32_t f = 0; f < c->meta->nfiles; f++) {
        if (owner[f] != who)
            continue;
        uint64_t n = c->meta->files[f].bytes;
        int rc = at + n > cap ? st_fail(STRATA_EINVAL, "a share over its blocks")
                              : st_peer_read_into(c, c->meta->files[f].name, buf + at, n);
        if (rc)
            return rc;
        at += n;
    }
    return 0;
}

/* The block size for nodes of n_old nodes: the largest share / k, rounded up to 64. */
static uint64_t block_of(const peer_ctx *c, const uint32_t *owner, uint32_t nodes, int k)
{
    uint64_t most = 0;
    for (uint32_t i = 0; i < nodes; i++) {
        uint64_t s = 0;
        for (uint32_t f = 0; f < c->meta->nfiles; f++)
            s += owner[f] == i ? c->meta->files[f].bytes : 0;
        most = s > most ? s : most;
    }
    uint64_t b = (most + (uint64_t)k - 1) / (uint64_t)k;
    return b ? (b + 63) / 64 * 64 : 64;
}

/* One transfer of a block between two ranks, the same list on every rank. */
typedef struct {
    int from, to;
} hop;

/* Runs the hops (each `block` bytes; sends[i] this rank's bytes for hop i where from ==
 * me), one alltoallv; *recv gets the hops to me in list order, one block each. */
static int run_hops(peer_ctx *c, const hop *h, size_t n, unsigned char *const *sends,
                    uint64_t block, unsigned char **recv, uint64_t *sent)
{
    const int P = c->P, me = c->me;
    size_t *sc = calloc((size_t)P, sizeof *sc), *rcn = calloc((size_t)P, sizeof *rcn);
    size_t *sat = calloc((size_t)P + 1, sizeof *sat), *rat = calloc((size_t)P + 1, sizeof *rat);
    unsigned char *sb = NULL, *rb = NULL;
    int rc = 0;
    *recv = NULL;
    if (!sc || !rcn || !sat || !rat) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if (h[i].from == me)
            sc[h[i].to] += block;
        if (h[i].to == me)
            rcn[h[i].from] += block;
    }
    for (int r = 0; r < P; r++)
        sat[r + 1] = sat[r] + sc[r], rat[r + 1] = rat[r] + rcn[r];
    sb = malloc(sat[P] + 1);
    rb = malloc(rat[P] + 1);
    if (!sb || !rb) {
        rc = st_fail(STRATA_ENOMEM, "out of memory for %zu + %zu bytes", sat[P], rat[P]);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        if (h[i].from == me) {
            memcpy(sb + sat[h[i].to], sends[i], block);
            sat[h[i].to] += block;
            *sent += block;
        }
    if ((rc = st_alltoallv(c->comm, sb, sc, rb, rcn)))
        goto out;
    /* the hops to me, in list order (a sender's blocks come in its list order) */
    unsigned char *out = malloc(rat[P] + 1);
    if (!out) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (h[i].to == me) {
            memcpy(out + k * block, rb + rat[h[i].from], block);
            rat[h[i].from] += block;
            k++;
        }
    *recv = out;
out:
    free(sc), free(rcn), free(sat), free(rat), free(sb), free(rb);
    return rc;
}

int st_peer_rs_encode(peer_ctx *c, int k, int m, const uint32_t *owner, uint64_t *block,
                      uint64_t *sent, int *local)
{
    const int n = k + m, N = c->N, me = c->me, q = c->ix[me] % n, g = c->ix[me] / n;
    const int leader = c->lead[c->ix[me]] == me;
    const uint64_t b = *block = block_of(c, owner, (uint32_t)N, k);
    unsigned char *data = leader ? malloc(k * b + 1) : NULL, *got = NULL, *par = NULL;
    unsigned char **sends = calloc((size_t)N * (size_t)(k + m) + 1, sizeof *sends);
    hop *h = calloc((size_t)N * (size_t)(k + m) + 1, sizeof *h);
    int rc = 0;
    *local = 0;
    if ((leader && !data) || !sends || !h)
        *local = st_fail(STRATA_ENOMEM, "out of memory");
    else if (leader)
        *local = node_data(c, owner, (uint32_t)c->ix[me], data, k * b);
    if ((rc = st_peer_agree(c->comm, "reading the nodes' shares", *local)))
        goto out;
    /* 1. block t of each node to the encoder of its codeword (position - t) */
    size_t nh = 0;
    for (int x = 0; x < N; x++)
        for (int t = 1; t < k; t++) {
            int gx = x / n, qx = x % n, enc = gx * n + (qx - t + n) % n;
            if (c->lead[x] == me)
                sends[nh] = data + (size_t)t * b;
            h[nh++] = (hop){c->lead[x], c->lead[enc]};
        }
    if ((rc = run_hops(c, h, nh, sends, b, &got, sent)))
        goto out;
    /* 2. the encoders: codeword q of group g from its k blocks (its own block 0, then
     * blocks 1..k-1 in list order: from positions q + 1, ..., q + k - 1) */
    if (leader) {
        unsigned char a[255 * 255], *tbl = malloc(32 * (size_t)k * (size_t)m);
        unsigned char *src[255], *dst[255];
        par = malloc((size_t)m * b + 1);
        if (!par || !tbl) {
            *local = st_fail(STRATA_ENOMEM, "out of memory");
        } else {
            gf_gen_cauchy1_matrix(a, n, k);
            ec_init_tables(k, m, a + k * k, tbl);
            src[0] = data;
            /* the blocks to me, in list order (x ascending), placed by their t */
            size_t i = 0;
            for (int x = 0; x < N; x++)
                for (int t = 1; t < k; t++) {
                    int gx = x / n, qx = x % n;
                    if (gx == g && (qx - t + n) % n == q)
                        src[t] = got + i++ * b;
                }
            for (int p = 0; p < m; p++)
                dst[p] = par + (size_t)p * b;
            ec_encode_data((int)b, k, m, tbl, src, dst);
        }
        free(tbl);
    }
    if ((rc = st_peer_agree(c->comm, "encoding the parity", *local)))
        goto out;
    /* 3. parity p of codeword j to position j + k + p */
    nh = 0;
    for (int x = 0; x < N; x++)
        for (int p = 0; p < m; p++) {
            int gx = x / n, qx = x % n, to = gx * n + (qx + k + p) % n;
            if (c->lead[x] == me)
                sends[nh] = par + (size_t)p * b;
            h[nh++] = (hop){c->lead[x], c->lead[to]};
        }
    free(got);
    got = NULL;
    if ((rc = run_hops(c, h, nh, sends, b, &got, sent)))
        goto out;
    size_t i = 0;
    for (int x = 0; x < N && !*local; x++)
        for (int p = 0; p < m && !*local; p++) {
            int gx = x / n, qx = x % n;
            if (c->lead[gx * n + (qx + k + p) % n] != me || !leader)
                continue;
            char name[40];
            st_peer_parity_name(name, (uint32_t)x); /* codeword g * n + j is node x's */
            *local = st_peer_write(c, name, got + i++ * b, b, 0);
        }
out:
    free(data);
    free(got);
    free(par);
    free(sends);
    free(h);
    return rc;
}

/* A rebuild's state, shared by its steps (in the order st_peer_rs_rebuild runs them). */
typedef struct {
    peer_ctx *c;
    const peer_rec *r;
    const int *old;        /* per old node: the new node holding its copy, or -1 */
    unsigned char *holds;  /* the caller's: new node i's files, holds + i * nfiles */
    uint64_t *sent, *got;
    int k, m, n, N0;       /* the code, the group, the old node count */
    uint32_t F;
    uint64_t b;            /* the block */
    uint32_t *owner;       /* per file: its old node */
    int *dec;              /* per lost old node: the old node (a survivor) decoding it */
    hop *h;                /* the blocks the decoders take, row[i]: hop i's codeword row */
    int *row;
    unsigned char **sends; /* this rank's block for each hop it sends */
    size_t nh;
    unsigned char *mine;   /* this rank's old node's data, where it leads a copy */
    unsigned char *in;     /* the blocks to me, in hop order */
} rebuild;

static int rebuild_init(rebuild *s, peer_ctx *c, const peer_rec *r, const int *old,
                        unsigned char *holds, uint64_t *sent, uint64_t *got)
{
    *s = (rebuild){.c = c, .r = r, .old = old, .holds = holds, .sent = sent, .got = got,
                   .k = (int)r->k, .m = (int)r->m, .n = (int)(r->k + r->m),
                   .N0 = (int)r->nodes, .F = r->nfiles, .b = r->block};
    const size_t most = (size_t)s->N0 * (size_t)s->k * (size_t)s->k + 1;
    s->owner = malloc((size_t)s->F * sizeof *s->owner + 1);
    s->dec = calloc((size_t)s->N0, sizeof *s->dec);
    s->h = calloc(most, sizeof *s->h);
    s->row = calloc(most, sizeof *s->row);
    s->sends = calloc(most, sizeof *s->sends);
    if (!s->owner || !s->dec || !s->h || !s->row || !s->sends)
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    for (uint32_t f = 0; f < s->F; f++)
        s->owner[f] = st_get_u32(r->owner + 4 * (size_t)f);
    return 0;
}

static void rebuild_free(rebuild *s)
{
    for (size_t i = 0; s->sends && i < s->nh; i++) /* the parity blocks read */
        if (s->h[i].from == s->c->me && s->row[i] >= s->k)
            free(s->sends[i]);
    free(s->owner);
    free(s->dec);
    free(s->h);
    free(s->row);
    free(s->sends);
    free(s->mine);
    free(s->in);
}

/* Each lost node's decoder: the first survivor of its group; STRATA_ENOREPLICA where a
 * group lost more than m (the same on every rank). */
static int find_decoders(void *p, int *local)
{
    rebuild *s = p;
    const int n = s->n;
    (void)local;
    for (int x = 0; x < s->N0; x++) {
        s->dec[x] = -1;
        if (s->old[x] >= 0)
            continue;
        int g = x / n, lost = 0;
        for (int y = g * n; y < g * n + n; y++) {
            lost += s->old[y] < 0;
            if (s->old[y] >= 0 && s->dec[x] < 0)
                s->dec[x] = y;
        }
        if (lost > s->m)
            return st_fail(STRATA_ENOREPLICA, "step %llu of %s cannot be rebuilt: nodes "
                           "%d..%d (parity group %d of %d + %d) lost %d, more than %d",
                           (unsigned long long)s->r->step, s->c->dir, g * n, g * n + n - 1,
                           g, s->k, s->m, lost, s->m);
    }
    return 0;
}

/* The leader of a surviving copy: its old node's data (its k blocks). */
static int read_share(void *p, int *local)
{
    rebuild *s = p;
    int mold = -1; /* the old node whose copy this rank leads, if any */
    for (int y = 0; y < s->N0; y++)
        if (s->old[y] >= 0 && s->c->lead[s->old[y]] == s->c->me)
            mold = y;
    if (mold >= 0) {
        s->mine = malloc((size_t)s->k * s->b + 1);
        if (!s->mine || node_data(s->c, s->owner, (uint32_t)mold, s->mine, (uint64_t)s->k * s->b))
            *local = s->mine ? STRATA_EIO : st_fail(STRATA_ENOMEM, "out of memory");
    }
    return 0;
}

/* This rank's part of hop i, the block of row s of codeword j of group g: a data block
 * of its share, or a parity file read (freed by rebuild_free). */
static void send_block(rebuild *s, size_t i, int g, int j, int row, int *local)
{
    if (row < s->k) {
        s->sends[i] = s->mine + (size_t)row * s->b;
        return;
    }
    char name[40];
    unsigned char *p = NULL;
    size_t len = 0;
    st_peer_parity_name(name, (uint32_t)(g * s->n + j));
    if (!*local && (*local = st_peer_read(s->c, name, s->b, &p, &len)) == 0 && len != s->b)
        *local = st_fail(STRATA_EINCOMPLETE, "%s/%s is short", s->c->dir, name);
    s->sends[i] = p;
}

/* Every block a decoder takes (the same list on every rank): of each codeword j of a lost
 * node's group that holds one of its blocks, the first k present; this rank's read. */
static int plan_blocks(void *p, int *local)
{
    rebuild *s = p;
    const int n = s->n, me = s->c->me;
    for (int x = 0; x < s->N0; x++) {
        if (s->old[x] >= 0)
            continue;
        int g = x / n, qx = x % n;
        for (int t = 0; t < s->k; t++) {
            int j = (qx - t + n) % n, took = 0;
            for (int r = 0; r < n && took < s->k; r++) { /* rows 0..k-1 data, k.. parity */
                int y = g * n + (j + r) % n; /* data r, or parity r - k */
                if (s->old[y] < 0)
                    continue;
                int from = s->c->lead[s->old[y]];
                if (from == me)
                    send_block(s, s->nh, g, j, r, local);
                s->row[s->nh] = r;
                s->h[s->nh++] = (hop){from, s->c->lead[s->old[s->dec[x]]]};
                took++;
            }
        }
    }
    return 0;
}

/* The blocks to their decoders, one alltoallv. */
static int send_blocks(void *p, int *local)
{
    rebuild *s = p;
    (void)local;
    return run_hops(s->c, s->h, s->nh, s->sends, s->b, &s->in, s->sent);
}

/* At its decoder (to == me), lost node x's k blocks, each from the k blocks of its
 * codeword received (in[*at..], hops from *i, whose rows pick the generator's rows; the
 * hop index advances on every rank), into whole (k blocks). */
static int decode_node(rebuild *s, int x, int to, const unsigned char *a, size_t *i,
                       size_t *at, unsigned char *whole)
{
    const int k = s->k;
    unsigned char sub[255 * 255], inv[255 * 255], tbl[32 * 255];
    for (int t = 0; t < k; t++) {
        unsigned char *src[255];
        for (int r = 0; r < k; r++, (*i)++) {
            memcpy(sub + r * k, a + s->row[*i] * k, (size_t)k);
            src[r] = to == s->c->me ? s->in + ((*at)++) * s->b : NULL;
        }
        if (to != s->c->me)
            continue;
        if (!whole || gf_invert_matrix(sub, inv, k) < 0)
            return st_fail(whole ? STRATA_EIO : STRATA_ENOMEM,
                           "cannot decode node %d's block %d", x, t);
        unsigned char *o = whole + (size_t)t * s->b;
        ec_init_tables(k, 1, inv + t * k, tbl); /* data row t of the inverse */
        ec_encode_data((int)s->b, k, 1, tbl, src, &o);
    }
    return 0;
}

/* Lost node x's files, from its data (whole), into this node's copy. */
static int write_node(rebuild *s, int x, const unsigned char *whole)
{
    const st_meta *meta = s->c->meta;
    uint64_t off = 0;
    for (uint32_t f = 0; f < s->F; f++)
        if (s->owner[f] == (uint32_t)x) {
            int rc = st_peer_write(s->c, meta->files[f].name, whole + off,
                                   meta->files[f].bytes, 0);
            if (rc)
                return rc;
            off += meta->files[f].bytes;
            *s->got += meta->files[f].bytes;
        }
    return 0;
}

/* Each lost node's blocks decoded at its decoder, its files written there; every rank:
 * the decoders' copies now hold the lost nodes' files. */
static int decode_all(void *p, int *local)
{
    rebuild *s = p;
    unsigned char a[255 * 255], *whole = malloc((size_t)s->k * s->b + 1);
    size_t at = 0, i = 0; /* i walks the hop list, at the blocks to me */
    gf_gen_cauchy1_matrix(a, s->n, s->k);
    for (int x = 0; x < s->N0 && !*local; x++) {
        if (s->old[x] >= 0)
            continue;
        int to = s->c->lead[s->old[s->dec[x]]];
        if (!(*local = decode_node(s, x, to, a, &i, &at, whole)) && to == s->c->me)
            *local = write_node(s, x, whole);
    }
    free(whole);
    for (int x = 0; x < s->N0; x++)
        for (uint32_t f = 0; s->dec[x] >= 0 && f < s->F; f++)
            if (s->owner[f] == (uint32_t)x)
                s->holds[(size_t)s->old[s->dec[x]] * s->F + f] = 1;
    return 0;
}

int st_peer_rs_rebuild(peer_ctx *c, const peer_rec *r, const int *old, unsigned char *holds,
                       uint64_t *sent, uint64_t *got, int *local)
{
    static const st_peer_step steps[] = {
        {find_decoders, NULL, NULL},
        {read_share, "reading the survivors' shares", NULL},
        {plan_blocks, "reading the survivors' blocks", NULL},
        {send_blocks, NULL, NULL},
        {decode_all, NULL, NULL}, /* its outcome is the caller's to agree on */
    };
    rebuild s;
    int rc = rebuild_init(&s, c, r, old, holds, sent, got);
    *local = 0;
    if (!rc)
        rc = st_peer_steps(c->comm, steps, sizeof steps / sizeof *steps, &s, local);
    rebuild_free(&s);
    return rc;
}

#else /* without ISA-L */

int st_peer_rs_encode(peer_ctx *c, int k, int m, const uint32_t *owner, uint64_t *block,
                      uint64_t *sent, int *local)
{
    (void)c, (void)k, (void)m, (void)owner, (void)block, (void)sent;
    return *local = st_fail(STRATA_ENOTSUP, "Reed-Solomon parity needs ISA-L (this "
                                            "libstrata was built without it)");
}

int st_peer_rs_rebuild(peer_ctx *c, const peer_rec *r, const int *old, unsigned char *holds,
                       uint64_t *sent, uint64_t *got, int *local)
{
    (void)c, (void)r, (void)old, (void)holds, (void)sent, (void)got;
    return *local = st_fail(STRATA_ENOTSUP, "these peer copies hold Reed-Solomon parity, "
                                            "which needs ISA-L (this libstrata was built "
                                            "without it)");
}

#endif
