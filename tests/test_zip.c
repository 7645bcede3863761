/* test_zip.c - the bounded zip reader (src/source/zip.c) on archives built here byte by byte:
 * stored entries read back bitwise with their CRC-32 checked, ZIP64 records, and each
 * refusal's exact code and message (truncation, offsets past the end, compressed entries,
 * sizes that lie, overlaps, bad and duplicate names, local headers that disagree, a CRC that
 * differs, a failing read). Real torch.save archives: tests/python/test_pickle_reader.py. */
#include "testutil.h"

#include <zlib.h>

#include "core/error.h"
#include "source/zip.h"

#define ZF "t.zip"

typedef struct {
    unsigned char b[1 << 16];
    size_t n;
} zb;

static void w8(zb *z, unsigned v) { z->b[z->n++] = (unsigned char)v; }
static void w16(zb *z, unsigned v) { w8(z, v & 0xff); w8(z, (v >> 8) & 0xff); }
static void w32(zb *z, uint32_t v) { w16(z, v & 0xffff); w16(z, v >> 16); }
static void w64(zb *z, uint64_t v) { w32(z, (uint32_t)v); w32(z, (uint32_t)(v >> 32)); }
static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static void wb(zb *z, const void *s, size_t n) { memcpy(z->b + z->n, s, n); z->n += n; }

typedef struct {
    const char *name;
    const char *data;
    unsigned method;
    size_t off; /* where its local header went */
} ent;

/* An archive of the entries (stored, 8 bytes of local extra as torch's padding); zip64 puts
 * the sizes and offsets in ZIP64 extra fields and adds the ZIP64 end records. Returns the
 * offset of the central directory. */
static size_t build(zb *z, ent *e, int n, int zip64)
{
    z->n = 0;
    for (int i = 0; i < n; i++) {
        size_t dl = strlen(e[i].data), nl = strlen(e[i].name);
        uint32_t crc = (uint32_t)crc32(0L, (const Bytef *)e[i].data, (uInt)dl);
        e[i].off = z->n;
        w32(z, 0x04034b50); w16(z, 20); w16(z, 0); w16(z, e[i].method); w32(z, 0);
        w32(z, crc); w32(z, (uint32_t)dl); w32(z, (uint32_t)dl); w16(z, (unsigned)nl); w16(z, 8);
        wb(z, e[i].name, nl);
        w16(z, 0x4246); w16(z, 4); w32(z, 0); /* padding extra */
        wb(z, e[i].data, dl);
    }
    size_t cd = z->n;
    for (int i = 0; i < n; i++) {
        size_t dl = strlen(e[i].data), nl = strlen(e[i].name);
        uint32_t crc = (uint32_t)crc32(0L, (const Bytef *)e[i].data, (uInt)dl);
        w32(z, 0x02014b50); w16(z, 20); w16(z, 20); w16(z, 0); w16(z, e[i].method); w32(z, 0);
        w32(z, crc);
        w32(z, zip64 ? UINT32_MAX : (uint32_t)dl); w32(z, zip64 ? UINT32_MAX : (uint32_t)dl);
        w16(z, (unsigned)nl); w16(z, zip64 ? 28 : 0); w16(z, 0); w16(z, 0); w16(z, 0); w32(z, 0);
        w32(z, zip64 ? UINT32_MAX : (uint32_t)e[i].off);
        wb(z, e[i].name, nl);
        if (zip64) {
            w16(z, 1); w16(z, 24); w64(z, dl); w64(z, dl); w64(z, e[i].off);
        }
    }
    size_t cd_size = z->n - cd;
    if (zip64) {
        size_t rec = z->n;
        w32(z, 0x06064b50); w64(z, 44); w16(z, 45); w16(z, 45); w32(z, 0); w32(z, 0);
        w64(z, (uint64_t)n); w64(z, (uint64_t)n); w64(z, cd_size); w64(z, cd);
        w32(z, 0x07064b50); w32(z, 0); w64(z, rec); w32(z, 1);
    }
    w32(z, 0x06054b50); w16(z, 0); w16(z, 0);
    w16(z, zip64 ? 0xffff : (unsigned)n); w16(z, zip64 ? 0xffff : (unsigned)n);
    w32(z, zip64 ? UINT32_MAX : (uint32_t)cd_size); w32(z, zip64 ? UINT32_MAX : (uint32_t)cd);
    w16(z, 0);
    return cd;
}

typedef struct {
    const zb *z;
    int fail_after; /* reads that succeed before one fails with STRATA_EIO; -1: never */
} src;

static int rd(void *ctx, void *buf, size_t len, uint64_t off)
{
    src *s = ctx;
    if (s->fail_after == 0)
        return st_fail(STRATA_EIO, "test read failed");
    if (s->fail_after > 0)
        s->fail_after--;
    if (off > s->z->n || len > s->z->n - off)
        return st_fail(STRATA_EIO, "read past the end of the test archive");
    memcpy(buf, s->z->b + off, len);
    return 0;
}

static int open_zb(st_zip *out, const zb *z)
{
    src s = {z, -1};
    return st_zip_open(out, z->n, rd, &s, ZF);
}

static void refused(const zb *z, int code, const char *msg)
{
    st_zip out;
    int rc = open_zb(&out, z);
    if (rc == 0) {
        st_zip_free(&out);
        fail_msg("an archive that must be refused (%s) was opened", msg);
    }
    assert_int_equal(rc, code);
    assert_msg_has(msg);
    assert_msg_has(ZF);
    assert_int_equal(out.n, 0);
    assert_null(out.arena.head);
}

static void read_back(int zip64)
{
    zb z;
    ent e[] = {{"archive/data.pkl", "\x80\x02}q\0.", 0, 0}, {"archive/data/0", "0123456789", 0, 0},
               {"archive/version", "3\n", 0, 0}};
    size_t cd = build(&z, e, 3, zip64);
    st_zip a;
    src s = {&z, -1};
    assert_ok(st_zip_open(&a, z.n, rd, &s, ZF));
    assert_int_equal(a.n, 3);
    assert_int_equal(a.zip64, zip64);
    assert_int_equal(a.cd_off, cd);
    for (int i = 0; i < 3; i++) {
        const st_zip_entry *x = st_zip_find(&a, e[i].name);
        assert_non_null(x);
        assert_int_equal(x->method, 0);
        assert_int_equal(x->header_off, e[i].off);
        assert_int_equal(x->data_off, e[i].off + 30 + strlen(e[i].name) + 8);
        assert_int_equal(x->usize, strlen(e[i].data));
        char buf[64];
        assert_ok(st_zip_read(&a, x, buf, rd, &s, ZF));
        assert_memory_equal(buf, e[i].data, x->usize);
    }
    assert_null(st_zip_find(&a, "archive/data/1"));
    st_zip_free(&a);
}

static void test_read_back(void **state)
{
    (void)state;
    read_back(0);
    read_back(1);
}

static void test_truncated_and_past_end(void **state)
{
    (void)state;
    zb z;
    ent e[] = {{"a/data.pkl", "hello", 0, 0}, {"a/data/0", "world!", 0, 0}};
    build(&z, e, 2, 0);
    zb t = z;
    t.n = 10;
    refused(&t, STRATA_EFORMAT, "shorter than an end of central directory record");
    t = z;
    t.n -= 5; /* the end record cut */
    refused(&t, STRATA_EFORMAT, "no end of central directory record");
    t = z;
    memset(t.b + t.n - 22, 0, 4); /* the end record's signature gone */
    refused(&t, STRATA_EFORMAT, "no end of central directory record");
    t = z;
    t.b[t.n - 6 + 3] = 0x40; /* central directory offset far past the end */
    refused(&t, STRATA_EFORMAT, "runs past its end record");
    t = z;
    t.b[t.n - 22 + 10] = 200; /* 200 entries */
    t.b[t.n - 22 + 8] = 200;
    refused(&t, STRATA_EFORMAT, "200 entries cannot fit");
    /* a comment that does not run to the end */
    t = z;
    t.b[t.n - 2] = 5;
    refused(&t, STRATA_EFORMAT, "no end of central directory record");
    /* ZIP64: the locator points past itself */
    build(&z, e, 2, 1);
    t = z;
    memset(t.b + t.n - 22 - 20 + 8, 0x7f, 4);
    refused(&t, STRATA_EFORMAT, "ZIP64 end record offset");
    /* a failing read: its own code */
    st_zip a;
    src s = {&z, 1};
    assert_rc(st_zip_open(&a, z.n, rd, &s, ZF), STRATA_EIO);
    assert_msg_has("test read failed");
}

/* the central directory entry of entry i (build with zip64 0) */
static unsigned char *cdh(zb *z, size_t cd, int i)
{
    unsigned char *p = z->b + cd;
    for (int k = 0; k < i; k++)
        p += 46 + (p[28] | p[29] << 8) + (p[30] | p[31] << 8) + (p[32] | p[33] << 8);
    return p;
}

static void test_entries_that_lie(void **state)
{
    (void)state;
    zb z, t;
    ent e[] = {{"a/data.pkl", "hello", 0, 0}, {"a/data/0", "world!", 0, 0}};
    size_t cd = build(&z, e, 2, 0);
    /* a compressed entry is listed with its method, refused when read */
    ent c[] = {{"a/data.pkl", "hello", 8, 0}};
    build(&t, c, 1, 0);
    st_zip a;
    src s = {&t, -1};
    assert_ok(st_zip_open(&a, t.n, rd, &s, ZF));
    assert_int_equal(a.e[0].method, 8);
    char buf[16];
    assert_rc(st_zip_read(&a, &a.e[0], buf, rd, &s, ZF), STRATA_EFORMAT);
    assert_msg_has("entry 'a/data.pkl' is compressed (method 8, deflate)");
    st_zip_free(&a);
    /* a size past the central directory, in both headers */
    t = z;
    put32(cdh(&t, cd, 1) + 20, 5000);
    put32(cdh(&t, cd, 1) + 24, 5000);
    put32(t.b + e[1].off + 18, 5000);
    put32(t.b + e[1].off + 22, 5000);
    refused(&t, STRATA_EFORMAT, "entry 'a/data/0': 5000 bytes at");
    /* stored, but the two sizes differ */
    t = z;
    put32(cdh(&t, cd, 0) + 24, 4);
    refused(&t, STRATA_EFORMAT, "stored entry 'a/data.pkl' says 5 bytes stored but 4");
    /* the first entry's data runs over the second's header */
    t = z;
    put32(cdh(&t, cd, 0) + 20, 40);
    put32(cdh(&t, cd, 0) + 24, 40);
    put32(t.b + e[0].off + 18, 40);
    put32(t.b + e[0].off + 22, 40);
    refused(&t, STRATA_EFORMAT, "entries 'a/data.pkl' and 'a/data/0' overlap");
    /* local header disagrees */
    t = z;
    t.b[e[1].off + 30] = 'b';
    refused(&t, STRATA_EFORMAT, "entry 'a/data/0' has another name in its local header");
    t = z;
    t.b[e[1].off + 14] ^= 1;
    refused(&t, STRATA_EFORMAT, "entry 'a/data/0' has another CRC-32 in its local header");
    t = z;
    t.b[e[1].off] = 'X';
    refused(&t, STRATA_EFORMAT, "entry 'a/data/0' has no local header signature");
    t = z;
    put32(cdh(&t, cd, 1) + 42, (uint32_t)cd);
    refused(&t, STRATA_EFORMAT, "local header offset");
    t = z;
    cdh(&t, cd, 1)[8] |= 1;
    refused(&t, STRATA_EFORMAT, "entry 'a/data/0' is encrypted");
    t = z;
    cdh(&t, cd, 0)[0] = 'Y';
    refused(&t, STRATA_EFORMAT, "central directory entry 0 is truncated or has a bad signature");
    /* the data changed: the CRC catches it when the entry is read */
    t = z;
    t.b[e[1].off + 30 + 8 + 8] ^= 0x20;
    s.z = &t;
    assert_ok(st_zip_open(&a, t.n, rd, &s, ZF));
    assert_rc(st_zip_read(&a, st_zip_find(&a, "a/data/0"), buf, rd, &s, ZF), STRATA_ECHECKSUM);
    assert_msg_has("entry 'a/data/0': CRC-32");
    assert_msg_has(ZF);
    st_zip_free(&a);
}

static void test_names(void **state)
{
    (void)state;
    static const struct {
        const char *name, *msg;
    } bad[] = {
        {"../etc", "a '.' or '..' component"}, {"a/../../x", "a '.' or '..' component"},
        {"a/./x", "a '.' or '..' component"},  {"/abs", "an absolute name"},
        {"a\\b", "a backslash"},
    };
    zb z;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ent e[] = {{"ok", "1", 0, 0}, {bad[i].name, "2", 0, 0}};
        build(&z, e, 2, 0);
        refused(&z, STRATA_EFORMAT, bad[i].msg);
        assert_msg_has("central directory entry 1");
    }
    ent e[] = {{"a/x", "1", 0, 0}, {"a/y", "2", 0, 0}};
    size_t cd = build(&z, e, 2, 0);
    zb t = z;
    cdh(&t, cd, 1)[46 + 1] = 0; /* "a\0y" */
    refused(&t, STRATA_EFORMAT, "a name holding a NUL byte");
    t = z;
    cdh(&t, cd, 1)[46 + 2] = 'x'; /* two entries "a/x" */
    t.b[e[1].off + 30 + 2] = 'x';
    refused(&t, STRATA_EFORMAT, "entry 'a/x' appears twice");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_back),
        cmocka_unit_test(test_truncated_and_past_end),
        cmocka_unit_test(test_entries_that_lie),
        cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
