/* fuzz_zip.c - libFuzzer target for the bounded zip reader (src/source/zip.c).
 *
 * The input is the archive (read through a callback that refuses reads past its end: the
 * reader must never ask for one on an archive it accepts or is still checking, so such a
 * read is abort()). An opened archive is held to the rules of zip.h: names 1..ST_ZIP_MAX_NAME
 * bytes, relative, without NUL, backslash, "." or ".." components, unique; every entry's
 * local header and data before the central directory, in order without overlap; stored
 * sizes equal. Every entry is then read: a stored one succeeds or fails its CRC
 * (STRATA_ECHECKSUM), a compressed one is STRATA_EFORMAT. A refusal must be STRATA_EFORMAT
 * naming the file (or STRATA_ENOMEM) and leave nothing behind. Also replayed by
 * tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "source/zip.h"
#include "strata_types.h"
#include "fuzz_mem.h"

#define FZ_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_zip: " __VA_ARGS__);                                          \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

/* relative, no NUL/backslash, no "." or ".." component */
static int fz_name_ok(const char *s)
{
    if (!*s || *s == '/' || strchr(s, '\\'))
        return 0;
    for (const char *p = s;;) {
        const char *q = strchr(p, '/');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        if ((n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.'))
            return 0;
        if (!q)
            return 1;
        p = q + 1;
    }
}

static int fz_cmp(const void *a, const void *b)
{
    const st_zip_entry *x = *(st_zip_entry *const *)a, *y = *(st_zip_entry *const *)b;
    return x->header_off < y->header_off ? -1 : x->header_off > y->header_off;
}

static void fz_check(const st_zip *z, fuzz_mem *s)
{
    if (z->cd_off > z->file_size)
        FZ_FAIL("central directory past the end");
    const st_zip_entry **v = malloc((z->n ? z->n : 1) * sizeof *v);
    for (size_t i = 0; i < z->n; i++) {
        const st_zip_entry *e = &z->e[i];
        size_t nl = strlen(e->name);
        if (nl < 1 || nl > ST_ZIP_MAX_NAME || !fz_name_ok(e->name))
            FZ_FAIL("bad name '%s' accepted", e->name);
        if (e->data_off < e->header_off + 30 + nl || e->data_off > z->cd_off ||
            e->csize > z->cd_off - e->data_off)
            FZ_FAIL("entry '%s' runs past the central directory", e->name);
        if (e->method == 0 && e->csize != e->usize)
            FZ_FAIL("stored entry '%s' with two sizes accepted", e->name);
        for (size_t k = 0; k < i && z->n <= 256; k++)
            if (strcmp(z->e[k].name, e->name) == 0)
                FZ_FAIL("duplicate name '%s' accepted", e->name);
        v[i] = e;
    }
    qsort(v, z->n, sizeof *v, fz_cmp);
    for (size_t i = 1; i < z->n; i++)
        if (v[i - 1]->data_off + v[i - 1]->csize > v[i]->header_off)
            FZ_FAIL("entries '%s' and '%s' overlap", v[i - 1]->name, v[i]->name);
    free(v);
    for (size_t i = 0; i < z->n; i++) {
        const st_zip_entry *e = &z->e[i];
        /* a compressed entry's usize is any number: it is refused before any read */
        unsigned char *buf = malloc(e->method == 0 && e->usize ? (size_t)e->usize : 1);
        int rc = st_zip_read(z, e, buf, fuzz_mem_read, s, "fuzz.zip");
        free(buf);
        if (e->method != 0 ? rc != STRATA_EFORMAT : rc != 0 && rc != STRATA_ECHECKSUM)
            FZ_FAIL("reading entry '%s' (method %u) gave %s", e->name, e->method,
                    strata_error_name(rc));
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_mem s = {data, size};
    st_zip z;
    int rc = st_zip_open(&z, size, fuzz_mem_read, &s, "fuzz.zip");
    if (rc == 0) {
        fz_check(&z, &s);
        st_zip_free(&z);
        return 0;
    }
    if (rc != STRATA_EFORMAT && rc != STRATA_ENOMEM)
        FZ_FAIL("refused with %s (%s), want STRATA_EFORMAT", strata_error_name(rc),
                strata_error_last());
    if (rc == STRATA_EFORMAT && !strstr(strata_error_last(), "fuzz.zip"))
        FZ_FAIL("message \"%s\" does not name the file", strata_error_last());
    if (z.n || z.e || z.arena.head)
        FZ_FAIL("a refused open left entries behind");
    return 0;
}
