/* fuzz_torchsave.c - libFuzzer target for the torch.save interpreter (src/source/torchsave.c):
 * the zip, data.pkl and the tensors of its pickle placed in their storages.
 *
 * The input is the archive, read through a callback that refuses reads past its end (the
 * reader never asks for one: such a read is abort()). An opened archive is held to the rules
 * of torchsave.h: tensors sorted by name, unique, names 1..STRATA_MAX_NAME bytes; each
 * tensor's bytes numel x its dtype's size, inside its storage's stored entry, which holds
 * exactly the storage; then the metadata built from it must hold a check range for each
 * stored entry a tensor or the pickle lies in (its data, size and CRC-32), sorted and
 * disjoint, and must encode and decode (the same validator as every other rank's)
 * unchanged in its tensors and checks. A refusal must be
 * STRATA_EFORMAT, STRATA_ENOTSUP or STRATA_ECHECKSUM naming the file (or STRATA_ENOMEM) and
 * leave nothing behind.
 *
 * An input that begins as a pickle (0x80) is fuzzed as a data.pkl alone, so that mutations
 * reach the interpreter without having to keep a zip's CRC-32 right: parsed (pickle.h), then
 * its tensors found (st_ts_tensors: sorted, unique, names 1..STRATA_MAX_NAME bytes, inside
 * their storages, each storage with one dtype and size), refusals as above. Also replayed by
 * tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "meta/checks.h"
#include "source/torchsave.h"
#include "strata_types.h"
#include "fuzz_mem.h"

#define FT_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_torchsave: " __VA_ARGS__);                                    \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

static void ft_check(const st_ts_archive *a, size_t size)
{
    const st_ts_doc *d = &a->doc;
    for (size_t i = 0; i < d->n; i++) {
        const st_ts_tensor *t = &d->t[i];
        size_t nl = strlen(t->name);
        if (nl < 1 || nl > STRATA_MAX_NAME)
            FT_FAIL("tensor name of %zu bytes accepted", nl);
        if (i && strcmp(d->t[i - 1].name, t->name) >= 0)
            FT_FAIL("tensors '%s' and '%s' not sorted and unique", d->t[i - 1].name, t->name);
        uint64_t numel = 1;
        for (int k = 0; k < t->ndim; k++)
            numel *= t->shape[k];
        if ((unsigned)t->dtype >= STRATA_DTYPE_COUNT ||
            numel * strata_dtype_size(t->dtype) != t->bytes)
            FT_FAIL("tensor '%s': %llu bytes for its shape", t->name,
                    (unsigned long long)t->bytes);
        st_ts_storage k = {.key = t->storage}, *s = NULL;
        for (size_t j = 0; j < d->nstorages && !s; j++)
            if (strcmp(d->s[j].key, k.key) == 0)
                s = &d->s[j];
        if (!s || !s->entry || s->entry->method != 0 || s->entry->usize != s->bytes)
            FT_FAIL("tensor '%s': its storage has no stored entry of its size", t->name);
        if (t->at < s->entry->data_off || t->at - s->entry->data_off != t->offset ||
            t->offset + t->bytes > s->bytes || t->at + t->bytes > size)
            FT_FAIL("tensor '%s' lies outside its storage", t->name);
    }
    st_ts_file f = {"fuzz.pt", size, {1, 2, 3}, a};
    st_meta *m = NULL, *back = NULL;
    unsigned char *enc = NULL;
    size_t len = 0;
    int rc = st_ts_meta(&m, &f, 1, NULL, "fuzz");
    if (rc == STRATA_ENOMEM)
        return;
    if (rc)
        FT_FAIL("metadata of an accepted archive refused: %s", strata_error_last());
    /* its check table: stored entries of the archive, each holding a tensor's or the
     * pickle's bytes, sorted and disjoint */
    for (size_t i = 0; i < m->nchecks; i++) {
        const st_mcheck *c = &m->checks[i];
        const st_zip_entry *e = st_zip_find(&a->zip, c->name);
        if (!e || e->method != 0 || e->data_off != c->offset || e->usize != c->bytes ||
            e->crc != c->crc || c->file != 0)
            FT_FAIL("check range %zu is not a stored entry of the archive", i);
        if (i && m->checks[i - 1].offset + m->checks[i - 1].bytes > c->offset)
            FT_FAIL("check ranges %zu and %zu overlap or are out of order", i - 1, i);
    }
    for (size_t i = 0; i < d->n; i++) { /* every tensor with bytes lies in a checked entry */
        const st_ts_tensor *t = &d->t[i];
        size_t k = t->bytes ? st_check_find(m, 0, t->at) : 0;
        if (t->bytes && (k == m->nchecks || m->checks[k].offset > t->at ||
                         m->checks[k].offset + m->checks[k].bytes < t->at + t->bytes))
            FT_FAIL("tensor '%s' lies in no checked entry", t->name);
    }
    if (st_meta_encode(m, &enc, &len) == 0) {
        rc = st_meta_decode_foreign(&back, enc, len);
        if (rc && rc != STRATA_ENOMEM)
            FT_FAIL("the metadata of an accepted archive does not decode: %s",
                    strata_error_last());
        if (!rc && (back->ntensors != m->ntensors || back->nchecks != m->nchecks))
            FT_FAIL("decoded metadata has %zu tensors and %zu checks, not %zu and %zu",
                    back->ntensors, back->nchecks, m->ntensors, m->nchecks);
    }
    st_meta_free(back);
    free(enc);
    st_meta_free(m);
}

static void ft_refused(int rc, const char *name)
{
    if (rc != STRATA_EFORMAT && rc != STRATA_ENOTSUP && rc != STRATA_ECHECKSUM &&
        rc != STRATA_ENOMEM)
        FT_FAIL("refused with %s (%s)", strata_error_name(rc), strata_error_last());
    if (rc != STRATA_ENOMEM && !strstr(strata_error_last(), name))
        FT_FAIL("message \"%s\" does not name the input", strata_error_last());
}

static void ft_pickle(const uint8_t *data, size_t size)
{
    st_ts_doc d = {0};
    int rc = pk_parse(&d.pk, data, size, "fuzz.pkl");
    if (!rc && !(rc = st_ts_tensors(&d, "fuzz.pkl"))) {
        for (size_t i = 0; i < d.n; i++) {
            const st_ts_tensor *t = &d.t[i];
            size_t nl = strlen(t->name);
            if (nl < 1 || nl > STRATA_MAX_NAME || (i && strcmp(d.t[i - 1].name, t->name) >= 0))
                FT_FAIL("tensor names not sorted, unique, 1..%d bytes", STRATA_MAX_NAME);
            const st_ts_storage *s = NULL;
            for (size_t j = 0; j < d.nstorages && !s; j++)
                if (strcmp(d.s[j].key, t->storage) == 0)
                    s = &d.s[j];
            if (!s || s->dtype != t->dtype || t->offset > s->bytes ||
                t->bytes > s->bytes - t->offset)
                FT_FAIL("tensor '%s' outside its storage", t->name);
        }
        for (size_t j = 1; j < d.nstorages; j++)
            if (strcmp(d.s[j - 1].key, d.s[j].key) >= 0)
                FT_FAIL("storages not sorted and unique");
    } else {
        ft_refused(rc, "fuzz.pkl");
    }
    st_ts_doc_free(&d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size && data[0] == 0x80) {
        ft_pickle(data, size);
        return 0;
    }
    fuzz_mem s = {data, size};
    st_ts_archive a;
    int rc = st_ts_open(&a, size, fuzz_mem_read, &s, "fuzz.pt");
    if (rc == 0) {
        ft_check(&a, size);
        st_ts_close(&a);
        return 0;
    }
    ft_refused(rc, "fuzz.pt");
    if (a.pkl || a.pkl_bytes || a.doc.n || a.zip.n)
        FT_FAIL("a refused open left something behind");
    return 0;
}
