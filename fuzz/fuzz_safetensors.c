/* fuzz_safetensors.c - libFuzzer target for the safetensors header parser
 * (src/source/safetensors.c).
 *
 * Each input is parsed three times: as a whole file (8-byte length, JSON, data; file size =
 * input size), and twice "wrapped": the first 4 bytes are a little-endian data length D, the
 * rest is the JSON, and the parser sees 8 + len + D bytes of file of which the first 8 + len
 * are given (so mutations of the JSON need not keep the length field right); the second
 * time D is instead the largest decimal number in the JSON (usually the last tensor's end,
 * so mutated headers still reach the checks after the offsets). On success the index is
 * held to the rules of docs/FORMAT.md ("Reading safetensors"): known dtype, ndim <= 8, names
 * 1..1024 bytes without NUL and unique, end - begin = numel x element size, and the tensors,
 * in order, tile [8 + N, file size) exactly. Any violation is abort(); any refusal must be
 * STRATA_EFORMAT (or STRATA_ENOMEM). The input is also parsed as the index of a sharded
 * set (model.safetensors.index.json): on success the weight_map is sorted with unique
 * names of 1..1024 bytes, its files are plain names and the distinct files listed. Also
 * replayed by tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "source/safetensors.h"

#define FST_FAIL(...)                                                                        \
    do {                                                                                     \
        fprintf(stderr, "fuzz_safetensors: " __VA_ARGS__);                                  \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

static void fst_check(const st_st_index *ix, uint64_t n, uint64_t file_size)
{
    if (ix->header_len != n || ix->data_begin != 8 + n || ix->file_size != file_size)
        FST_FAIL("index header fields disagree with the input");
    uint64_t pos = 8 + n;
    for (size_t i = 0; i < ix->ntensors; i++) {
        const st_st_tensor *t = &ix->tensors[i];
        size_t len = strlen(t->name);
        if (len < 1 || len > STRATA_MAX_NAME)
            FST_FAIL("tensor %zu: bad name length %zu accepted", i, len);
        if ((unsigned)t->dtype >= STRATA_DTYPE_COUNT || !st_st_dtype_name(t->dtype))
            FST_FAIL("tensor '%s': bad dtype accepted", t->name);
        if (t->ndim < 0 || t->ndim > STRATA_MAX_DIMS)
            FST_FAIL("tensor '%s': bad ndim %d accepted", t->name, t->ndim);
        uint64_t numel = 1, bytes;
        for (int d = 0; d < t->ndim; d++)
            if (__builtin_mul_overflow(numel, t->shape[d], &numel))
                FST_FAIL("tensor '%s': shape overflow accepted", t->name);
        if (__builtin_mul_overflow(numel, (uint64_t)strata_dtype_size(t->dtype), &bytes))
            FST_FAIL("tensor '%s': size overflow accepted", t->name);
        if (t->begin != pos)
            FST_FAIL("tensor '%s' begins at %llu, the previous ended at %llu", t->name,
                     (unsigned long long)t->begin, (unsigned long long)pos);
        if (t->end < t->begin || t->end - t->begin != bytes)
            FST_FAIL("tensor '%s': offsets [%llu, %llu) disagree with its %llu bytes", t->name,
                     (unsigned long long)t->begin, (unsigned long long)t->end,
                     (unsigned long long)bytes);
        pos = t->end;
        /* unique names: quadratic, so only for modest counts */
        for (size_t k = 0; k < i && ix->ntensors <= 1024; k++)
            if (strcmp(ix->tensors[k].name, t->name) == 0)
                FST_FAIL("duplicate tensor name '%s' accepted", t->name);
    }
    if (pos != file_size)
        FST_FAIL("tensors end at %llu, the file at %llu", (unsigned long long)pos,
                 (unsigned long long)file_size);
    for (size_t i = 0; i < ix->nmeta; i++)
        if (!ix->meta[i].key || !ix->meta[i].value)
            FST_FAIL("metadata entry %zu missing", i);
}

static void fst_one(const unsigned char *head, size_t head_len, uint64_t file_size)
{
    st_st_index ix;
    int rc = st_st_parse(&ix, head, head_len, file_size, "fuzz.safetensors");
    if (rc == 0) {
        uint64_t n = 0;
        if (st_st_header_len(head, file_size, &n) != 0)
            FST_FAIL("parse accepted a header length that st_st_header_len refuses");
        fst_check(&ix, n, file_size);
        st_st_free(&ix);
        return;
    }
    if (rc != STRATA_EFORMAT && rc != STRATA_ENOMEM)
        FST_FAIL("refused with %s (%s), want STRATA_EFORMAT", strata_error_name(rc),
                 strata_error_last());
    if (rc == STRATA_EFORMAT && !strstr(strata_error_last(), "fuzz.safetensors"))
        FST_FAIL("message \"%s\" does not name the file", strata_error_last());
    if (ix.ntensors || ix.tensors || ix.arena.head)
        FST_FAIL("a refused parse left an index behind");
}

static void fst_index(const unsigned char *json, size_t len)
{
    st_st_map m;
    int rc = st_st_parse_index(&m, json, len, "fuzz.index.json");
    if (rc) {
        if (rc != STRATA_EFORMAT && rc != STRATA_ENOMEM)
            FST_FAIL("index refused with %s (%s), want STRATA_EFORMAT", strata_error_name(rc),
                     strata_error_last());
        if (rc == STRATA_EFORMAT && !strstr(strata_error_last(), "fuzz.index.json"))
            FST_FAIL("message \"%s\" does not name the index", strata_error_last());
        if (m.n || m.e || m.arena.head)
            FST_FAIL("a refused index parse left a map behind");
        return;
    }
    for (size_t i = 0; i < m.n; i++) {
        size_t n = strlen(m.e[i].name);
        if (n < 1 || n > STRATA_MAX_NAME)
            FST_FAIL("index: bad name length %zu accepted", n);
        if (i && strcmp(m.e[i - 1].name, m.e[i].name) >= 0)
            FST_FAIL("index: names not sorted and unique at %zu", i);
        if (!st_plain_name(m.e[i].file, strlen(m.e[i].file)))
            FST_FAIL("index: file '%s' is not a plain name", m.e[i].file);
    }
    if (m.nfiles > m.n || (m.n && !m.nfiles))
        FST_FAIL("index: %zu files for %zu entries", m.nfiles, m.n);
    for (size_t i = 1; i < m.nfiles; i++)
        if (strcmp(m.files[i - 1], m.files[i]) >= 0)
            FST_FAIL("index: files not sorted and distinct");
    st_st_map_free(&m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fst_one(data, size, size);
    fst_index(data, size);
    if (size >= 4) {
        uint64_t d = (uint64_t)data[0] | (uint64_t)data[1] << 8 | (uint64_t)data[2] << 16 |
                     (uint64_t)data[3] << 24;
        size_t len = size - 4;
        unsigned char *f = malloc(8 + len);
        if (!f)
            return 0;
        for (int i = 0; i < 8; i++)
            f[i] = (unsigned char)((uint64_t)len >> (8 * i));
        memcpy(f + 8, data + 4, len);
        fst_one(f, 8 + len, 8 + (uint64_t)len + d);
        uint64_t big = 0, x = 0;
        for (size_t i = 0; i <= len; i++) {
            if (i < len && f[8 + i] >= '0' && f[8 + i] <= '9') {
                x = x * 10 + (uint64_t)(f[8 + i] - '0');
                if (x >> 40)
                    x = 0; /* not a plausible data length */
                continue;
            }
            big = x > big ? x : big;
            x = 0;
        }
        if (big != d)
            fst_one(f, 8 + len, 8 + (uint64_t)len + big);
        free(f);
    }
    return 0;
}
