/* fuzz_zero.c - libFuzzer target for the DeepSpeed ZeRO reader (src/source/zero.c): the files
 * of one tag directory, their pickles interpreted into named full tensors of flat pieces.
 *
 * Input: "Z", the stage (a byte, taken modulo 3, plus 1), the data-parallel ranks (a byte,
 * modulo 4, plus 1), then the files - the model-states files (1 for stage 1/2, one per rank
 * for stage 3) and one optim file per rank - each a little-endian u32 length and its bytes.
 * A file that begins as a pickle (0x80) is its data.pkl alone (so that mutations reach the
 * interpreter without keeping a zip's CRC-32 right): its tensors are placed one storage after
 * another in a file of their total size; any other is a torch.save archive read through a
 * callback that refuses reads past its end. An accepted checkpoint's metadata must encode and
 * decode (the validator every other rank runs: boxes, flat ranges and extents inside the
 * files, no overlap, the check table of the archives' entries) with every tensor's pieces
 * covering it exactly. A refusal must be
 * STRATA_EFORMAT, STRATA_ENOTSUP, STRATA_ECHECKSUM, STRATA_EUNFILLED or STRATA_EMISMATCH
 * naming the input (or STRATA_ENOMEM). Also replayed by tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "source/zero.h"
#include "strata_types.h"
#include "fuzz_mem.h"

#define ZF_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_zero: " __VA_ARGS__);                                         \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

#define ZF_MAX_FILES 8

/* A data.pkl alone as an archive: its tensors placed storage after storage; the file's size
 * into *size. */
static int zf_pickle(st_ts_archive *a, const uint8_t *b, size_t n, const char *name,
                     uint64_t *size)
{
    memset(a, 0, sizeof *a);
    int rc = pk_parse(&a->doc.pk, b, n, name);
    if (!rc)
        rc = st_ts_tensors(&a->doc, name);
    if (rc)
        return rc;
    uint64_t at = 0;
    for (size_t j = 0; j < a->doc.nstorages; j++) {
        uint64_t base = at;
        at += a->doc.s[j].bytes;
        for (size_t i = 0; i < a->doc.n; i++)
            if (strcmp(a->doc.t[i].storage, a->doc.s[j].key) == 0)
                a->doc.t[i].at = base + a->doc.t[i].offset;
    }
    *size = at;
    return 0;
}

/* Reads the input into archives and builds the metadata: 0 with *out, or the refusal. */
static int zf_zero(const uint8_t *data, size_t size, const char *name, st_meta **out)
{
    *out = NULL;
    if (size < 3 || data[0] != 'Z')
        return -1; /* not an input of this target */
    int stage = data[1] % 3 + 1;
    uint32_t ranks = data[2] % 4 + 1;
    size_t nmodel = stage == 3 ? ranks : 1, n = nmodel + ranks, at = 3;
    if (n > ZF_MAX_FILES)
        return -1;
    st_ts_archive a[ZF_MAX_FILES];
    st_ts_file f[ZF_MAX_FILES];
    static const char *const names[ZF_MAX_FILES] = {"f0", "f1", "f2", "f3",
                                                    "f4", "f5", "f6", "f7"};
    memset(a, 0, sizeof a);
    int rc = 0;
    size_t opened = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        if (size - at < 4) {
            rc = -1;
            break;
        }
        uint32_t len = (uint32_t)data[at] | (uint32_t)data[at + 1] << 8 |
                       (uint32_t)data[at + 2] << 16 | (uint32_t)data[at + 3] << 24;
        at += 4;
        if (len > size - at) {
            rc = -1;
            break;
        }
        const uint8_t *b = data + at;
        uint64_t fsize = len;
        at += len;
        if (len && b[0] == 0x80) {
            rc = zf_pickle(&a[i], b, len, name, &fsize);
        } else {
            fuzz_mem s = {b, len};
            rc = st_ts_open(&a[i], len, fuzz_mem_read, &s, name);
        }
        opened = i + 1;
        f[i] = (st_ts_file){names[i], fsize, {1, 2, 3}, &a[i]};
    }
    if (!rc)
        rc = st_zero_meta(out, f, nmodel, stage, ranks, name);
    for (size_t i = 0; i < opened; i++)
        st_ts_close(&a[i]);
    return rc;
}

static void zf_check(const st_meta *m)
{
    unsigned char *enc = NULL;
    size_t len = 0;
    st_meta *back = NULL;
    if (st_meta_encode(m, &enc, &len))
        return; /* out of memory */
    int rc = st_meta_decode_foreign(&back, enc, len);
    free(enc);
    if (rc == STRATA_ENOMEM)
        return;
    if (rc)
        ZF_FAIL("the metadata of an accepted checkpoint does not decode: %s",
                strata_error_last());
    if (back->nchecks != m->nchecks)
        ZF_FAIL("%zu check ranges decoded of %zu", back->nchecks, m->nchecks);
    for (size_t i = 0; i < m->nchecks; i++) /* each holds a byte of some piece */
        if (!m->checks[i].bytes || m->checks[i].file >= m->nfiles)
            ZF_FAIL("check range %zu is empty or of no file", i);
    for (size_t i = 0; i < back->ntensors; i++) {
        const st_mtensor *t = &back->tensors[i];
        uint64_t numel = 1, got = 0;
        for (int d = 0; d < t->ndim; d++)
            numel *= t->shape[d];
        for (size_t k = 0; k < t->nshards; k++)
            got += t->shards[k].fe - t->shards[k].fs;
        if (got != numel)
            ZF_FAIL("tensor '%s': its pieces hold %llu of its %llu elements", t->name,
                    (unsigned long long)got, (unsigned long long)numel);
    }
    st_meta_free(back);
}

static void zf_refused(int rc, const char *name)
{
    if (rc != STRATA_EFORMAT && rc != STRATA_ENOTSUP && rc != STRATA_ECHECKSUM &&
        rc != STRATA_EUNFILLED && rc != STRATA_EMISMATCH && rc != STRATA_ENOMEM)
        ZF_FAIL("refused with %s (%s)", strata_error_name(rc), strata_error_last());
    if (rc != STRATA_ENOMEM && !strstr(strata_error_last(), name))
        ZF_FAIL("message \"%s\" does not name the input", strata_error_last());
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_meta *m;
    int rc = zf_zero(data, size, "fuzz", &m);
    if (rc == 0) {
        zf_check(m);
        st_meta_free(m);
    } else if (rc != -1) {
        zf_refused(rc, "fuzz");
    }
    return 0;
}
