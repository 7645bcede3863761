/* fuzz_planfile.c - libFuzzer target for the stored save plan's decoders (plan.bin,
 * src/meta/planfile.c). The whole-file decoder must refuse what it refuses with
 * STRATA_EFORMAT and a message; what it accepts must hold its promises (pieces aligned,
 * in increasing offsets inside their data file, metadata indices increasing), re-encode
 * to a file that decodes to the same plan, and agree with what a rank reading its own part
 * (header, index entries, part) gets. Inputs also serve as plans: a plan made from the
 * input's bytes must round-trip, and with one byte of its file changed (position and mask
 * from the input) be refused. Also replayed by tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "meta/meta.h"
#include "meta/planfile.h"

#define FP_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_planfile: " __VA_ARGS__);                                     \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

static int same_part(const st_ppart *a, const st_ppart *b)
{
    if (a->hash != b->hash || a->file_bytes != b->file_bytes || a->n != b->n)
        return 0;
    for (size_t i = 0; i < a->n; i++) {
        const st_ppiece *x = &a->p[i], *y = &b->p[i];
        if (x->meta_index != y->meta_index || x->local != y->local || x->src_off != y->src_off ||
            x->offset != y->offset || x->bytes != y->bytes)
            return 0;
    }
    return 1;
}

static void check_part(const st_ppart *p, uint32_t r)
{
    uint64_t end = 0;
    for (size_t i = 0; i < p->n; i++) {
        const st_ppiece *q = &p->p[i];
        if (q->offset % ST_ALIGN || q->offset < end || q->offset + q->bytes > p->file_bytes ||
            (i && q->meta_index <= p->p[i - 1].meta_index))
            FP_FAIL("rank %u's piece %zu breaks the decoder's promises", r, i);
        end = q->offset + q->bytes;
    }
}

/* What rank r reads of buf alone: its part, or an error. */
static int read_own(st_ppart *out, const uint8_t *buf, size_t len, uint32_t r)
{
    st_phead h;
    uint64_t off, n;
    int rc = st_planfile_header(&h, buf, len);
    if (rc)
        return rc;
    if (r >= h.ranks || st_planfile_index_at(r) + 16 > len)
        return STRATA_EFORMAT;
    if ((rc = st_planfile_span(&off, &n, &h, r, buf + st_planfile_index_at(r), len)))
        return rc;
    return st_planfile_part(out, buf, r, buf + off, (size_t)n);
}

/* A plan of 1..4 ranks made from data: each rank's pieces from 6 bytes each. */
static void fp_made(const uint8_t *data, size_t size)
{
    uint32_t ranks = 1 + data[0] % 4;
    st_ppart parts[4];
    st_ppiece pieces[64];
    size_t at = 1, used = 0;
    for (uint32_t r = 0; r < ranks; r++) {
        size_t n = at < size ? data[at++] % 8 : 0;
        parts[r] = (st_ppart){st_get_u32(data) * 0x9e3779b97f4a7c15ULL + r, 0, 0, pieces + used};
        uint64_t off = 0, mi = r;
        for (size_t i = 0; i < n && at + 6 <= size && used < 64; i++, at += 6, used++) {
            uint64_t bytes = data[at] | (uint64_t)data[at + 1] << 8 | (uint64_t)data[at + 2] << 16;
            pieces[used] = (st_ppiece){mi, data[at + 3], data[at + 4], off, bytes};
            mi += 1 + data[at + 5] % 3;
            off = (off + bytes + ST_ALIGN - 1) / ST_ALIGN * ST_ALIGN;
            parts[r].n++;
        }
        parts[r].file_bytes = off;
    }
    st_phead h = {ranks, 1u << (12 + data[0] % 8), st_get_u32(data) | 1ull << 40, 0}, g;
    unsigned char *buf;
    size_t len;
    if (st_planfile_encode(&h, parts, &buf, &len))
        FP_FAIL("a plan did not encode: %s", strata_error_last());
    st_ppart *back = NULL;
    if (st_planfile_decode(&g, &back, buf, len) || g.ranks != ranks || g.chunk != h.chunk ||
        g.save_id != h.save_id)
        FP_FAIL("an encoded plan does not decode: %s", strata_error_last());
    for (uint32_t r = 0; r < ranks; r++)
        if (!same_part(&back[r], &parts[r]))
            FP_FAIL("rank %u's part does not round-trip", r);
    st_planfile_free(back, g.ranks);
    if (size > 2 && data[size - 1]) { /* one byte changed: refused */
        size_t k = data[size - 2] % len;
        buf[k] ^= data[size - 1];
        if (st_planfile_decode(&g, &back, buf, len) != STRATA_EFORMAT)
            FP_FAIL("a plan with byte %zu changed was not refused", k);
    }
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= 4)
        fp_made(data, size);
    st_phead h;
    st_ppart *parts = NULL;
    int rc = st_planfile_decode(&h, &parts, data, size);
    if (rc) {
        if ((rc != STRATA_EFORMAT && rc != STRATA_ENOMEM) || strata_error_last()[0] == 0)
            FP_FAIL("decode failed with %s and message '%s'", strata_error_name(rc),
                    strata_error_last());
        for (uint32_t r = 0; r < 4; r++) { /* a rank's own part alone: no crash */
            st_ppart one;
            if (read_own(&one, data, size, r) == 0) {
                check_part(&one, r);
                st_ppart_free(&one);
            }
        }
        return 0;
    }
    for (uint32_t r = 0; r < h.ranks; r++) {
        check_part(&parts[r], r);
        st_ppart one;
        if (r < 64) {
            if (read_own(&one, data, size, r) != 0 || !same_part(&one, &parts[r]))
                FP_FAIL("rank %u reads another part alone than whole", r);
            st_ppart_free(&one);
        }
    }
    unsigned char *buf;
    size_t len;
    st_phead g;
    st_ppart *again = NULL;
    if (st_planfile_encode(&h, parts, &buf, &len) || st_planfile_decode(&g, &again, buf, len))
        FP_FAIL("an accepted plan does not re-encode: %s", strata_error_last());
    for (uint32_t r = 0; r < h.ranks; r++)
        if (!same_part(&again[r], &parts[r]))
            FP_FAIL("rank %u's part changed through a re-encode", r);
    st_planfile_free(again, g.ranks);
    st_planfile_free(parts, h.ranks);
    free(buf);
    return 0;
}
