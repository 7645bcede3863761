/* fuzz_peer.c - libFuzzer target for the peer replica record decoder (st_peer_rec_decode,
 * src/meta/peer_rec.c): any input decodes or is refused with STRATA_EFORMAT or
 * STRATA_ECHECKSUM and a message, and a record that decodes encodes back to the very same
 * bytes. Inputs of 64+ bytes also serve as field values: the record built from them (its
 * checksum computed) must decode to them. Also replayed by tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "meta/peer_rec.h"

#define FP_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_peer: " __VA_ARGS__);                                         \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

/* Encodes r (owners from the record's bytes) and compares with the n bytes at p. */
static void fp_same(const st_peer_rec *r, const uint8_t *p, size_t n)
{
    uint32_t *owner = malloc((size_t)r->nfiles * 4 + 4);
    for (uint32_t f = 0; f < r->nfiles; f++)
        owner[f] = st_get_u32(r->owner + 4 * (size_t)f);
    st_buf b = {0};
    st_peer_rec_encode(&b, r, owner);
    if (b.oom || b.n != n || memcmp(b.p, p, n) != 0)
        FP_FAIL("a decoded record of %zu bytes encodes to %zu other bytes", n, b.n);
    free(b.p);
    free(owner);
}

/* A record of 2 files from the input's first 64 bytes, with a real commit record. */
static void fp_fields(const uint8_t *d)
{
    st_commit c = {.version = ST_COMMIT_VERSION, .step = st_get_u64(d),
                   .meta_size = st_get_u64(d + 8), .meta_hash = st_get_u64(d + 16),
                   .save_id = st_get_u64(d + 24) | 1};
    st_peer_rec r = {.save_id = c.save_id, .step = c.step, .nodes = 2 + d[32] % 8};
    r.node = d[33] % r.nodes;
    if (d[34] & 1) { /* parity */
        r.k = 1 + d[35] % (r.nodes - 1);
        r.m = 1 + d[36] % (r.nodes - r.k);
        r.block = 64 * (1 + d[37]);
    } else {
        r.replicas = d[35] % r.nodes;
    }
    r.clen = (uint32_t)st_commit_encode(&c, r.commit);
    r.nfiles = 2;
    unsigned char held[2] = {d[38] & 1, d[39] & 1};
    uint32_t owner[2] = {d[40] % r.nodes, d[41] % r.nodes};
    r.held = held;
    st_buf b = {0};
    st_peer_rec_encode(&b, &r, owner);
    st_peer_rec back;
    if (b.oom || st_peer_rec_decode(&back, b.p, b.n) != 0)
        FP_FAIL("a record built from fields does not decode: %s", strata_error_last());
    if (back.save_id != r.save_id || back.step != r.step || back.nodes != r.nodes ||
        back.node != r.node || back.k != r.k || back.m != r.m || back.block != r.block ||
        back.replicas != r.replicas || back.nfiles != 2 || memcmp(back.held, held, 2) ||
        st_get_u32(back.owner) != owner[0] || st_get_u32(back.owner + 4) != owner[1])
        FP_FAIL("a record built from fields decodes to other fields");
    free(b.p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_peer_rec r;
    int rc = st_peer_rec_decode(&r, data, size);
    if (rc == 0)
        fp_same(&r, data, size);
    else if ((rc != STRATA_EFORMAT && rc != STRATA_ECHECKSUM) || !strata_error_last()[0])
        FP_FAIL("refused with %d and message '%s'", rc, strata_error_last());
    if (size >= 64)
        fp_fields(data);
    return 0;
}
