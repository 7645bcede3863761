/* fuzz_commit.c - libFuzzer target for the commit record decoder (st_commit_decode).
 * A record that decodes must re-encode to the very same bytes (72 for version 2, 64 for
 * version 1: the format has no slack: magic, version, reserved 0, fields, checksum), and a
 * failed decode must leave a message and return STRATA_EFORMAT. Inputs of 48+ bytes also
 * serve as field values: their record (version 1 or 2, from the input) must round-trip,
 * and with one byte of it changed (position and mask from the input) it must be refused.
 * Also replayed by tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "meta/meta.h"

#define FC_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_commit: " __VA_ARGS__);                                       \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

/* The record of six fields taken from data[0..48) round-trips (version 1 when data[48] is
 * odd: without the save id); one changed byte of it (position data[49] % size, mask
 * data[50], when present and nonzero) is refused. */
static void fc_fields(const uint8_t *data, size_t size)
{
    st_commit c, d;
    c.version = size > 48 && (data[48] & 1) ? 1 : ST_COMMIT_VERSION;
    c.step = st_get_u64(data);
    c.meta_size = st_get_u64(data + 8);
    c.meta_hash = st_get_u64(data + 16);
    c.time_ns = st_get_u64(data + 24);
    c.data_bytes = st_get_u64(data + 32);
    c.save_id = c.version == 1 ? 0 : st_get_u64(data + 40);
    unsigned char rec[ST_COMMIT_SIZE];
    size_t n = st_commit_encode(&c, rec);
    if (n != (c.version == 1 ? ST_COMMIT_V1_SIZE : ST_COMMIT_SIZE))
        FC_FAIL("version %u record encoded to %zu bytes", c.version, n);
    if (st_commit_decode(&d, rec, n) != 0 || !st_commit_same(&c, &d))
        FC_FAIL("encoded record does not decode to its fields: %s", strata_error_last());
    if (size >= 51 && data[50] != 0) {
        rec[data[49] % n] ^= data[50];
        if (st_commit_decode(&d, rec, n) != STRATA_EFORMAT)
            FC_FAIL("record with byte %zu changed was not refused", data[49] % n);
        rec[data[49] % n] ^= data[50];
    }
    /* any other length is refused, even with a valid record inside */
    size_t k = size % (ST_COMMIT_SIZE + 1);
    if (k != n && st_commit_decode(&d, rec, k) != STRATA_EFORMAT)
        FC_FAIL("record of %zu bytes was not refused", k);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= 48)
        fc_fields(data, size);
    st_commit c;
    memset(&c, 0xA5, sizeof c);
    int rc = st_commit_decode(&c, data, size);
    if (rc != 0) {
        if (rc != STRATA_EFORMAT || strata_error_last()[0] == 0)
            FC_FAIL("decode failed with %s and message '%s'", strata_error_name(rc),
                    strata_error_last());
        return 0;
    }
    if (size != (c.version == 1 ? ST_COMMIT_V1_SIZE : ST_COMMIT_SIZE))
        FC_FAIL("a version %u record of %zu bytes was accepted", c.version, size);
    unsigned char out[ST_COMMIT_SIZE];
    size_t n = st_commit_encode(&c, out);
    if (n != size || memcmp(out, data, n) != 0)
        FC_FAIL("an accepted record does not re-encode to its own bytes");
    st_commit c2;
    if (st_commit_decode(&c2, out, n) != 0 || !st_commit_same(&c, &c2))
        FC_FAIL("re-encoded record decodes to something else");
    return 0;
}
