/* peer_rec.c - a node's peer replica record (docs/FORMAT.md, "Peer replica record"): its
 * encoding and its validating decode, which every input may reach (fuzz/fuzz_peer.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "peer_rec.h"

void st_peer_parity_name(char out[40], uint32_t j)
{
    snprintf(out, 40, "PEER-%06u.par", j);
}

void st_peer_rec_encode(st_buf *b, const st_peer_rec *r, const uint32_t *owner)
{
    st_buf_put(b, PEER_MAGIC, 8);
    st_buf_u32(b, PEER_VERSION);
    st_buf_u64(b, r->save_id);
    st_buf_u64(b, r->step);
    st_buf_u32(b, r->nodes);
    st_buf_u32(b, r->replicas);
    st_buf_u32(b, r->k);
    st_buf_u32(b, r->m);
    st_buf_u64(b, r->block);
    st_buf_u32(b, r->node);
    st_buf_u32(b, r->clen);
    st_buf_put(b, r->commit, r->clen);
    st_buf_u32(b, r->nfiles);
    st_buf_put(b, r->held, r->nfiles);
    for (uint32_t f = 0; f < r->nfiles; f++)
        st_buf_u32(b, owner[f]);
    st_buf_u64(b, b->oom ? 0 : st_hash(b->p, b->n));
}

/* Decodes a record: STRATA_EFORMAT naming what is wrong. r->held points into buf. */
int st_peer_rec_decode(st_peer_rec *r, const unsigned char *buf, size_t n)
{
    const size_t fixed = 60; /* up to the commit record */
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
    r->k = st_get_u32(buf + 36);
    r->m = st_get_u32(buf + 40);
    r->block = st_get_u64(buf + 44);
    r->node = st_get_u32(buf + 52);
    r->clen = st_get_u32(buf + 56);
    size_t p = fixed;
    if (r->clen > ST_COMMIT_SIZE || p + r->clen + 4 + 8 > n)
        return st_fail(STRATA_EFORMAT, "peer replica record: bad commit record length");
    memcpy(r->commit, buf + p, r->clen);
    p += r->clen;
    r->nfiles = st_get_u32(buf + p);
    p += 4;
    if ((uint64_t)r->nfiles * 5 != n - 8 - p)
        return st_fail(STRATA_EFORMAT, "peer replica record: %u files in %zu bytes",
                       r->nfiles, n - 8 - p);
    r->held = (unsigned char *)buf + p;
    r->owner = buf + p + r->nfiles;
    if (r->nodes < 1 || r->node >= r->nodes || (r->k && (r->k + r->m > r->nodes || !r->m ||
                                                         !r->block || r->replicas)))
        return st_fail(STRATA_EFORMAT, "peer replica record: bad layout (node %u of %u, "
                       "k %u, m %u)", r->node, r->nodes, r->k, r->m);
    for (uint32_t f = 0; f < r->nfiles; f++)
        if (r->held[f] > 1 || st_get_u32(r->owner + 4 * (size_t)f) >= r->nodes)
            return st_fail(STRATA_EFORMAT, "peer replica record: bad entry of file %u", f);
    st_commit cr;
    if (st_commit_decode(&cr, r->commit, r->clen) || cr.save_id != r->save_id ||
        cr.step != r->step)
        return st_fail(STRATA_EFORMAT, "peer replica record: its commit record disagrees");
    return 0;
}

