/* fuzz_dcp.c - libFuzzer target for the DCP interpreter (src/source/dcp.c): the input is a
 * .metadata pickle. On success the table is held to dcp.h's rules: items sorted by FQN and
 * unique, files plain names sorted and unique, every chunk inside its tensor and naming a
 * file of the table, the non-empty chunks' volumes summing to the tensor's elements; a
 * refusal must be STRATA_EFORMAT or STRATA_ENOTSUP naming the file (or STRATA_ENOMEM) and
 * leave nothing behind. The input is also read as an item's data.pkl (st_dcp_saved_tensor):
 * an accepted tensor lies inside its storage. Any violation is abort(). Also replayed by
 * tests/test_fuzz_replay.c (seed-valid-* must be accepted, seed-reject-* refused). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "source/dcp.h"
#include "meta/meta.h"

#define FDCP_FAIL(...)                                                                       \
    do {                                                                                     \
        fprintf(stderr, "fuzz_dcp: " __VA_ARGS__);                                          \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

static void fdcp_check(const st_dcp *d)
{
    for (size_t f = 0; f < d->nfiles; f++) {
        if (!st_plain_name(d->files[f], strlen(d->files[f])))
            FDCP_FAIL("file '%s' is not a plain name", d->files[f]);
        if (f && strcmp(d->files[f - 1], d->files[f]) >= 0)
            FDCP_FAIL("files not sorted and unique");
    }
    for (size_t i = 0; i < d->nitems; i++) {
        const st_dcp_item *it = &d->items[i];
        if (i && strcmp(d->items[i - 1].fqn, it->fqn) >= 0)
            FDCP_FAIL("items not sorted and unique at '%s'", it->fqn);
        if (!it->nchunks || it->ndim < 0 || it->ndim > STRATA_MAX_DIMS ||
            (!it->tensor && (it->nchunks != 1 || it->ndim)))
            FDCP_FAIL("item '%s': %zu chunks, %d dims", it->fqn, it->nchunks, it->ndim);
        if (it->tensor && !strata_dtype_size(it->dtype))
            FDCP_FAIL("item '%s': dtype %d", it->fqn, (int)it->dtype);
        unsigned __int128 numel = 1, sum = 0;
        for (int k = 0; k < it->ndim; k++)
            numel *= it->shape[k];
        for (size_t c = 0; c < it->nchunks; c++) {
            const st_dcp_chunk *ch = &it->chunks[c];
            unsigned __int128 v = 1;
            if (ch->file >= d->nfiles)
                FDCP_FAIL("item '%s': chunk names file %u of %zu", it->fqn, ch->file, d->nfiles);
            if (ch->offset + (unsigned __int128)ch->length > UINT64_MAX)
                FDCP_FAIL("item '%s': offset + length overflows", it->fqn);
            for (int k = 0; k < it->ndim; k++) {
                if (ch->off[k] > it->shape[k] || ch->len[k] > it->shape[k] - ch->off[k])
                    FDCP_FAIL("item '%s': a chunk outside the tensor", it->fqn);
                v *= ch->len[k];
            }
            sum += v;
        }
        if (it->tensor && sum != numel)
            FDCP_FAIL("item '%s': chunks do not cover the tensor", it->fqn);
    }
}

static void fdcp_refused(int rc, const char *what, const void *left)
{
    if (rc != STRATA_EFORMAT && rc != STRATA_ENOTSUP && rc != STRATA_ENOMEM)
        FDCP_FAIL("refused with %s (%s)", strata_error_name(rc), strata_error_last());
    if (rc != STRATA_ENOMEM && !strstr(strata_error_last(), what))
        FDCP_FAIL("message \"%s\" does not name %s", strata_error_last(), what);
    if (left)
        FDCP_FAIL("a refused parse left something behind");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_dcp d;
    int rc = st_dcp_parse(&d, data, size, "fuzz.metadata");
    if (rc == 0) {
        fdcp_check(&d);
        st_dcp_free(&d);
    } else {
        fdcp_refused(rc, "fuzz.metadata", d.arena.head ? (void *)d.arena.head : d.items);
    }
    st_dcp_saved s;
    rc = st_dcp_saved_tensor(&s, data, size, "fuzz/data.pkl");
    if (rc == 0) {
        unsigned __int128 numel = 1;
        for (int k = 0; k < s.ndim; k++)
            numel *= s.shape[k];
        if (numel && s.storage_offset + numel > s.storage_numel)
            FDCP_FAIL("a tensor past the end of its storage accepted");
        if (!st_plain_name(s.key, strlen(s.key)) || !strata_dtype_size(s.dtype))
            FDCP_FAIL("storage key '%s' or dtype %d accepted", s.key, (int)s.dtype);
    } else {
        fdcp_refused(rc, "fuzz/data.pkl", NULL);
    }
    return 0;
}
