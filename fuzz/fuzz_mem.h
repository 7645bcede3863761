/* fuzz_mem.h - the in-memory read callback (st_zip_read_fn) of the fuzz targets that read a
 * zip archive: the input is the file. A read past its end is a bug of the reader (it must
 * check every offset against the size it was given), so it aborts. */
#ifndef STRATA_FUZZ_MEM_H
#define STRATA_FUZZ_MEM_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint8_t *b;
    size_t n;
} fuzz_mem;

static inline int fuzz_mem_read(void *ctx, void *buf, size_t len, uint64_t off)
{
    const fuzz_mem *s = ctx;
    if (off > s->n || len > s->n - off) {
        fprintf(stderr, "fuzz: read of %zu bytes at %llu past the end (%zu bytes)\n", len,
                (unsigned long long)off, s->n);
        abort();
    }
    memcpy(buf, s->b + off, len);
    return 0;
}

#endif
