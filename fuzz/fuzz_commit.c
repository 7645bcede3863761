/* fuzz_commit.c - libFuzzer target for the commit record decoder (st_commit_decode).
 * A record that decodes must re-encode to the very same 64 bytes (the format has no
 * slack: magic, version, reserved 0, fields, checksum), and a failed decode must leave a
 * message and return STRATA_EFORMAT. Inputs of 40+ bytes also serve as field values: their
 * record must round-trip, and with one byte of it changed (position and mask from the
 * input) it must be refused. Also replayed by tests/test_fuzz_replay.c. */
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

/* The record of five fields taken from data[0..40) round-trips; one changed byte of it
 * (position data[40] % 64, mask data[41], when present and nonzero) is refused. */
static void fc_fields(const uint8_t *data, size_t size)
{
    st_commit c, d;
    c.step = st_get_u64(data);
    c.meta_size = st_get_u64(data + 8);
    c.meta_hash = st_get_u64(data + 16);
    c.time_ns = st_get_u64(data + 24);
    c.data_bytes = st_get_u64(data + 32);
    unsigned char rec[ST_COMMIT_SIZE];
    st_commit_encode(&c, rec);
    if (st_commit_decode(&d, rec, sizeof rec) != 0 || memcmp(&c, &d, sizeof c) != 0)
        FC_FAIL("encoded record does not decode to its fields: %s", strata_error_last());
    if (size >= 42 && data[41] != 0) {
        rec[data[40] % ST_COMMIT_SIZE] ^= data[41];
        if (st_commit_decode(&d, rec, sizeof rec) != STRATA_EFORMAT)
            FC_FAIL("record with byte %d changed was not refused", data[40] % ST_COMMIT_SIZE);
    }
    /* any other length is refused, even with a valid record inside */
    if (st_commit_decode(&d, rec, size % ST_COMMIT_SIZE) != STRATA_EFORMAT)
        FC_FAIL("record of %zu bytes was not refused", size % ST_COMMIT_SIZE);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= 40)
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
    if (size != ST_COMMIT_SIZE)
        FC_FAIL("a record of %zu bytes was accepted", size);
    unsigned char out[ST_COMMIT_SIZE];
    st_commit_encode(&c, out);
    if (memcmp(out, data, ST_COMMIT_SIZE) != 0)
        FC_FAIL("an accepted record does not re-encode to its own bytes");
    st_commit c2;
    if (st_commit_decode(&c2, out, sizeof out) != 0 || memcmp(&c, &c2, sizeof c) != 0)
        FC_FAIL("re-encoded record decodes to something else");
    return 0;
}
