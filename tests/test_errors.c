/* test_errors.c - every failure has its exact code and a message naming the culprit:
 * corrupt data, truncated/garbled/hostile metadata, commit records, layout mismatches,
 * missing pieces, URI schemes, existing checkpoints, invalid registrations. */
#include <signal.h>
#include <sys/resource.h>

#include "core/checksum.h"
#include "meta/meta.h"
#include "testutil.h"

static char base_dir[512];

/* ---- a small standard checkpoint ---- */

#define W "layer0.weight" /* f32 [64, 64], rows split over 2 ranks: 2 chunks per shard */
#define B "layer0.bias"   /* f32 [64], replicated */
static const uint64_t wshape[] = {64, 64}, bshape[] = {64};

typedef struct {
    char ck[600];
    tu_set src;
} fixture;

/* The standard layout, on 2 ranks of s (not saved). */
static void std_state(tu_set *s)
{
    tu_set_init(s, 2);
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {(uint64_t)r * 32, 0}, len[] = {32, 64};
        tu_set_shard(s, r, W, STRATA_F32, 2, wshape, off, len, 0, 0, 0, 1);
        tu_set_shard(s, r, B, STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 1);
        tu_set_blob(s, r, "cfg", 0, 0, 100, 1);
        tu_set_blob(s, r, "rng", 1, 0, 40, 1);
    }
}

/* Saves the standard checkpoint to base_dir/<sub> (synced: default options). */
static void make_ckpt(fixture *f, const char *sub)
{
    snprintf(f->ck, sizeof f->ck, "%s/%s", base_dir, sub);
    tu_rmrf(f->ck);
    std_state(&f->src);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 4096;
    o.step = 42;
    assert_ok(strata_save(NULL, NULL, (const char *[]){f->ck}, 1, f->src.st, 2, &o));
}

static void drop_ckpt(fixture *f)
{
    tu_rmrf(f->ck);
    tu_set_free(&f->src);
}

/* A request for everything in the standard checkpoint, on one rank. */
static void request_all(tu_set *d)
{
    tu_set_init(d, 1);
    tu_set_shard(d, 0, W, STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(d, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_blob(d, 0, "cfg", 0, -1, 100, 0);
    tu_set_blob(d, 0, "rng", 1, 1, 40, 0);
}

/* The error message is only valid until the next strata call, so the request of a load
 * helper is freed at the next helper call (or at teardown), not right after the load. */
static tu_set last_req;

static int load_req(const char *ck, tu_set *d)
{
    int rc = strata_load(NULL, NULL, &ck, 1, d->st, d->n, NULL);
    if (rc == 0)
        assert_int_equal(tu_set_check(d), 0);
    return rc;
}

/* strata_load of everything; on success the values are checked. */
static int load_all(const char *ck)
{
    tu_set_free(&last_req);
    request_all(&last_req);
    return load_req(ck, &last_req);
}

/* Loads one shard request of W (box rows [r0, r0 + n)). */
static int load_rows(const char *ck, uint64_t r0, uint64_t n)
{
    tu_set_free(&last_req);
    tu_set_init(&last_req, 1);
    uint64_t off[] = {r0, 0}, len[] = {n, 64};
    tu_set_shard(&last_req, 0, W, STRATA_F32, 2, wshape, off, len, 0, 0, 0, 0);
    return load_req(ck, &last_req);
}

/* The data file path, file name and file offset of shard s of tensor `name`. */
static void shard_file(const char *ck, const char *name, size_t s, char *path, size_t cap,
                       char *file, size_t fcap, uint64_t *off)
{
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    for (size_t t = 0; t < strata_ckpt_ntensors(c); t++) {
        strata_tensor_info ti;
        strata_ckpt_tensor(&ti, c, t);
        if (strcmp(ti.name, name) != 0)
            continue;
        strata_shard_info si;
        strata_ckpt_shard(&si, c, t, s);
        snprintf(path, cap, "%s/%s", ck, si.file);
        snprintf(file, fcap, "%s", si.file);
        *off = si.file_offset;
        strata_ckpt_free(c);
        return;
    }
    fail_msg("tensor %s not in %s", name, ck);
}

static int open_rc(const char *ck, unsigned flags)
{
    strata_ckpt *c = NULL;
    int rc = strata_ckpt_open(&c, ck, flags);
    if (c) /* not on failure: keep the message */
        strata_ckpt_free(c);
    return rc;
}

/* ---- corrupt data ---- */

typedef struct {
    int calls;
    char object[128], file[128], message[256];
} reports;

static void on_report(void *ctx, const char *object, const char *file, const char *message)
{
    reports *r = ctx;
    r->calls++;
    snprintf(r->object, sizeof r->object, "%s", object);
    snprintf(r->file, sizeof r->file, "%s", file);
    snprintf(r->message, sizeof r->message, "%s", message);
}

static void test_bit_flip(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "flip");
    char path[700], file[64];
    uint64_t off;
    shard_file(f.ck, W, 1, path, sizeof path, file, sizeof file, &off); /* rows 32..63 */
    tu_flip_byte(path, off + 4096 + 77, 0x10); /* in its second chunk: rows 48..63 */

    assert_rc(load_all(f.ck), STRATA_ECHECKSUM);
    assert_msg_has(W);
    assert_msg_has(file);
    /* chunks not read are not checked: rows 32..47 are the good first chunk */
    assert_ok(load_rows(f.ck, 32, 16));
    assert_rc(load_rows(f.ck, 47, 2), STRATA_ECHECKSUM);

    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, f.ck, 0));
    reports r = {0};
    assert_rc(strata_ckpt_verify(c, on_report, &r), STRATA_ECHECKSUM);
    assert_int_equal(r.calls, 1);
    assert_string_equal(r.object, W);
    assert_string_equal(r.file, file);
    assert_non_null(strstr(r.message, "checksum"));
    strata_ckpt_free(c);

    /* a flipped blob byte names the blob */
    strata_ckpt *c2;
    assert_ok(strata_ckpt_open(&c2, f.ck, 0));
    strata_blob_info bi;
    for (size_t i = 0; i < strata_ckpt_nblobs(c2); i++) {
        strata_ckpt_blob(&bi, c2, i);
        if (bi.owner == -1)
            break;
    }
    assert_string_equal(bi.name, "cfg");
    snprintf(path, sizeof path, "%s/%s", f.ck, bi.file);
    snprintf(file, sizeof file, "%s", bi.file);
    tu_flip_byte(path, bi.file_offset + 99, 0x01);
    strata_ckpt_free(c2);
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_blob(&d, 0, "cfg", 0, -1, 100, 0);
    assert_rc(strata_load(NULL, NULL, (const char *[]){f.ck}, 1, d.st, 1, NULL), STRATA_ECHECKSUM);
    assert_msg_has("'cfg'");
    assert_msg_has(file);
    tu_set_free(&d);
    drop_ckpt(&f);
}

static void test_data_files(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "datafiles");
    char path[700], file[64];
    uint64_t off;
    shard_file(f.ck, W, 1, path, sizeof path, file, sizeof file, &off);

    /* truncated in the middle of the shard's second chunk */
    size_t n;
    unsigned char *keep = tu_read_file(path, &n);
    tu_truncate(path, off + 4096 + 100);
    assert_rc(load_rows(f.ck, 0, 64), STRATA_ECHECKSUM);
    assert_msg_has(W);
    assert_msg_has(file);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, f.ck, 0));
    reports r = {0};
    assert_rc(strata_ckpt_verify(c, on_report, &r), STRATA_ECHECKSUM);
    assert_true(r.calls >= 1);
    assert_string_equal(r.file, file);
    strata_ckpt_free(c);

    /* missing */
    assert_int_equal(unlink(path), 0);
    assert_rc(load_all(f.ck), STRATA_ENOENT);
    assert_msg_has(file);
    assert_ok(strata_ckpt_open(&c, f.ck, 0));
    assert_rc(strata_ckpt_verify(c, NULL, NULL), STRATA_ENOENT);
    assert_msg_has(file);
    strata_ckpt_free(c);

    /* put back: all good again */
    tu_write_file(path, keep, n);
    free(keep);
    assert_ok(load_all(f.ck));
    drop_ckpt(&f);
}

/* ---- metadata ---- */

static int decode_rc(const unsigned char *buf, size_t len, int checked);

static void test_meta_truncated(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "metatrunc");
    char mp[700], cp[700];
    tu_join(mp, f.ck, ST_META_FILE);
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    size_t len, clen;
    unsigned char *meta = tu_read_file(mp, &len), *commit = tu_read_file(cp, &clen);
    assert_true(len > 100);
    for (int committed = 1; committed >= 0; committed--) {
        if (!committed)
            assert_int_equal(unlink(cp), 0);
        for (size_t n = 0; n < len; n++) {
            tu_write_file(mp, meta, n);
            if (committed) {
                assert_rc(load_all(f.ck), STRATA_EFORMAT);
                assert_msg_has(ST_META_FILE);
                assert_rc(open_rc(f.ck, 0), STRATA_EFORMAT);
            }
            assert_rc(open_rc(f.ck, STRATA_OPEN_INCOMPLETE), STRATA_EFORMAT);
        }
    }
    print_message("metadata: %zu bytes, every shorter length refused\n", len);
    /* no metadata at all: corrupt if committed, incomplete if not */
    assert_int_equal(unlink(mp), 0);
    assert_rc(load_all(f.ck), STRATA_EINCOMPLETE);
    assert_rc(open_rc(f.ck, STRATA_OPEN_INCOMPLETE), STRATA_EINCOMPLETE);
    tu_write_file(cp, commit, clen);
    assert_rc(load_all(f.ck), STRATA_EFORMAT);
    assert_msg_has(ST_META_FILE);
    tu_write_file(mp, meta, len);
    assert_ok(load_all(f.ck));
    free(meta);
    free(commit);
    drop_ckpt(&f);
}

static void test_meta_garbled(void **state)
{
    (void)state;
    fixture f, g;
    make_ckpt(&f, "garbled");
    char mp[700];
    tu_join(mp, f.ck, ST_META_FILE);
    size_t len;
    unsigned char *meta = tu_read_file(mp, &len), *bad = malloc(len);
    tu_rng rng = {1234};
    for (int i = 0; i < 400; i++) {
        memcpy(bad, meta, len);
        int flips = (int)tu_range(&rng, 1, 4);
        for (int k = 0; k < flips; k++)
            bad[tu_below(&rng, len)] ^= (unsigned char)tu_range(&rng, 1, 255);
        tu_write_file(mp, bad, len);
        assert_rc(load_all(f.ck), STRATA_EFORMAT);
        assert_rc(open_rc(f.ck, 0), STRATA_EFORMAT);
    }
    /* valid metadata of another checkpoint does not match this commit record */
    make_ckpt(&g, "garbled2");
    char gp[700];
    tu_join(gp, g.ck, ST_META_FILE);
    size_t glen;
    unsigned char *other = tu_read_file(gp, &glen);
    other[24] ^= 1; /* another step: the metadata differs but is self-consistent */
    uint64_t h = st_hash(other, glen - 8);
    for (int i = 0; i < 8; i++)
        other[glen - 8 + (size_t)i] = (unsigned char)(h >> (8 * i));
    assert_ok(decode_rc(other, glen, 1)); /* valid on its own */
    tu_write_file(mp, other, glen);
    assert_rc(load_all(f.ck), STRATA_EFORMAT);
    assert_msg_has("commit record");
    free(other);
    drop_ckpt(&g);

    tu_write_file(mp, meta, len);
    assert_ok(load_all(f.ck));
    free(meta);
    free(bad);
    drop_ckpt(&f);
}

/* Encoded metadata with the body length and trailer hash fixed up after edits. */
static void fix_meta(unsigned char *buf, size_t len)
{
    uint64_t body = len - ST_META_HEADER - ST_META_TRAILER;
    for (int i = 0; i < 8; i++)
        buf[16 + i] = (unsigned char)(body >> (8 * i));
    uint64_t h = st_hash(buf, len - 8);
    for (int i = 0; i < 8; i++)
        buf[len - 8 + (size_t)i] = (unsigned char)(h >> (8 * i));
}

static int decode_rc(const unsigned char *buf, size_t len, int checked)
{
    st_meta *m = NULL;
    int rc = checked ? st_meta_decode(&m, buf, len) : st_meta_decode_unchecked(&m, buf, len);
    if (rc == 0)
        assert_non_null(m);
    else
        assert_null(m);
    st_meta_free(m);
    return rc;
}

static void test_decoder_corrupt(void **state)
{
    (void)state;
    /* a rich metadata: flat pieces, blobs, several files */
    tu_set s;
    tu_set_init(&s, 3);
    uint64_t shape[] = {5, 7, 9};
    for (int r = 0; r < 3; r++) {
        tu_set_shard(&s, r, "a.b", STRATA_BF16, 3, shape, NULL, NULL, 1, 315 * r / 3,
                     315 * (r + 1) / 3, 1);
        uint64_t off[] = {(uint64_t)r, 0, 0}, len[] = {r == 2 ? 3u : 1u, 7, 9};
        tu_set_shard(&s, r, "c", STRATA_I8, 3, shape, off, len, 0, 0, 0, 1);
        tu_set_shard(&s, r, "s", STRATA_F64, 0, NULL, NULL, NULL, 0, 0, 0, 1);
        tu_set_blob(&s, r, "rng", 1, 0, 5000, 1);
        tu_set_blob(&s, r, "e", 0, 0, 0, 1);
    }
    char ck[600], mp[700];
    snprintf(ck, sizeof ck, "%s/decoder", base_dir);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags |= STRATA_SAVE_NO_SYNC;
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 3, &o));
    tu_set_free(&s);
    tu_join(mp, ck, ST_META_FILE);
    size_t len;
    unsigned char *meta = tu_read_file(mp, &len);
    tu_rmrf(ck);
    assert_int_equal(decode_rc(meta, len, 1), 0);
    unsigned char *buf = malloc(len + 16);

    /* every proper prefix of the body (header and trailer fixed up) */
    size_t body = len - ST_META_HEADER - ST_META_TRAILER;
    for (size_t n = 0; n < body; n++) {
        memcpy(buf, meta, ST_META_HEADER + n);
        size_t l = ST_META_HEADER + n + ST_META_TRAILER;
        fix_meta(buf, l);
        assert_rc(decode_rc(buf, l, 1), STRATA_EFORMAT);
        assert_rc(decode_rc(buf, l, 0), STRATA_EFORMAT);
    }
    /* a byte too many after the blob table */
    memcpy(buf, meta, len - 8);
    buf[len - 8] = 0;
    fix_meta(buf, len + 1);
    assert_rc(decode_rc(buf, len + 1, 1), STRATA_EFORMAT);
    assert_msg_has("trailing");

    /* random byte changes in the body, unchecked by the trailer: a valid parse or
     * STRATA_EFORMAT, never a crash (run under ASan) */
    tu_rng rng = {42};
    int bad = 0;
    for (int i = 0; i < 20000; i++) {
        memcpy(buf, meta, len);
        int k = (int)tu_range(&rng, 1, 3);
        for (int j = 0; j < k; j++)
            buf[ST_META_HEADER + tu_below(&rng, body)] = (unsigned char)tu_next(&rng);
        int rc = decode_rc(buf, len, 0);
        if (rc != 0 && rc != STRATA_EFORMAT)
            fail_msg("mutation %d: %s", i, strata_error_name(rc));
        bad += rc == STRATA_EFORMAT;
        assert_rc(decode_rc(buf, len, 1), memcmp(buf, meta, len) ? STRATA_EFORMAT : 0);
    }
    print_message("decoder: %d of 20000 random body mutations refused\n", bad);
    assert_true(bad > 5000);

    /* header errors */
    memcpy(buf, meta, len);
    buf[0] = 'X';
    assert_rc(decode_rc(buf, len, 0), STRATA_EFORMAT);
    assert_msg_has("magic");
    memcpy(buf, meta, len);
    buf[8] = 2;
    assert_rc(decode_rc(buf, len, 0), STRATA_EFORMAT);
    assert_msg_has("version");
    memcpy(buf, meta, len);
    buf[12] = 1;
    assert_rc(decode_rc(buf, len, 0), STRATA_EFORMAT);
    memcpy(buf, meta, len);
    buf[16] ^= 1;
    assert_rc(decode_rc(buf, len, 0), STRATA_EFORMAT);
    memcpy(buf, meta, len);
    buf[40] ^= 1;
    assert_rc(decode_rc(buf, len, 1), STRATA_EFORMAT);
    assert_msg_has("checksum");
    free(buf);
    free(meta);
}

/* A hand-built metadata: file data-000000.bin of 16 KiB; tensor "w" f32 [4, 8] with
 * one whole shard at offset 0 (128 bytes); global blob "cfg" of 10 bytes at 8192. */
typedef struct {
    st_meta m;
    st_mfile files[2];
    st_mtensor t[2];
    st_mshard sh[2];
    uint64_t dims[2][4];
    uint64_t sums[4];
    st_mblob b[2];
} hmeta;

static void hmeta_init(hmeta *h)
{
    memset(h, 0, sizeof *h);
    h->files[0] = (st_mfile){(char *)"data-000000.bin", 16384};
    h->files[1] = (st_mfile){(char *)"data-000001.bin", 16384};
    h->m.chunk = 4096;
    h->m.nfiles = 1;
    h->m.files = h->files;
    for (int s = 0; s < 2; s++) {
        h->dims[s][0] = 0, h->dims[s][1] = 0, h->dims[s][2] = 4, h->dims[s][3] = 8;
        h->sh[s] = (st_mshard){.off = h->dims[s], .len = h->dims[s] + 2, .fs = 0, .fe = 32,
                               .ext = {0, 4096 * (uint64_t)s, 128, h->sums}};
    }
    h->t[0] = (st_mtensor){.name = (char *)"w", .dtype = STRATA_F32, .ndim = 2,
                           .shape = {4, 8}, .nshards = 1, .shards = h->sh};
    h->t[1] = h->t[0];
    h->t[1].shards = h->sh + 1;
    h->m.ntensors = 1;
    h->m.tensors = h->t;
    h->b[0] = (st_mblob){(char *)"cfg", -1, {0, 8192, 10, h->sums}};
    h->b[1] = h->b[0];
    h->m.nblobs = 1;
    h->m.blobs = h->b;
}

/* Encodes h and decodes it with every check; returns the decoder's code. */
static int hmeta_decode(const hmeta *h)
{
    unsigned char *buf;
    size_t len;
    assert_ok(st_meta_encode(&h->m, &buf, &len));
    int rc = decode_rc(buf, len, 1);
    free(buf);
    return rc;
}

static void test_hostile_meta(void **state)
{
    (void)state;
    hmeta h;
    hmeta_init(&h);
    assert_ok(hmeta_decode(&h)); /* the base is valid: each edit below is what fails */

    const char *names[] = {"../x", "/etc/passwd", "a/b", "..", ".", "a\\b", "x\ny"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        hmeta_init(&h);
        h.files[0].name = (char *)names[i];
        assert_rc(hmeta_decode(&h), STRATA_EFORMAT);
        assert_msg_has("file name");
    }
    /* one edit each; all must be STRATA_EFORMAT */
    for (int k = 0; k < 15; k++) {
        hmeta_init(&h);
        const char *why = "";
        switch (k) {
        case 0: h.m.chunk = 1000, why = "chunk"; break;
        case 1: h.m.chunk = 128u << 20, why = "chunk"; break;
        case 2: h.t[0].dtype = STRATA_DTYPE_COUNT, why = "dtype"; break;
        case 3: h.dims[0][3] = 9, why = "box"; break;          /* length beyond the shape */
        case 4: h.dims[0][1] = 1, why = "box"; break;          /* offset + length beyond */
        case 5: h.dims[0][2] = 0, why = "box"; break;          /* a zero length */
        case 6: h.sh[0].flat = 1, h.sh[0].fs = 10, h.sh[0].fe = 40, why = "flat"; break;
        case 7: h.sh[0].ext.offset = 16384, why = "outside"; break;
        case 8: h.sh[0].ext.file = 1, why = "file index"; break;
        case 9: h.m.ntensors = 2, why = "duplicate tensor"; break;
        case 10: h.t[0].nshards = 2, why = "overlap"; break;
        case 11: h.m.nfiles = 2, h.files[1].name = h.files[0].name, why = "duplicate file"; break;
        case 12: h.m.nblobs = 2, why = "duplicate blob"; break;
        case 13: h.b[0].owner = (int64_t)INT32_MAX + 5, why = "owner"; break;
        case 14: h.files[0].bytes = 8192, why = "outside"; break; /* the blob at 8192 */
        }
        assert_rc(hmeta_decode(&h), STRATA_EFORMAT);
        assert_msg_has(why);
    }
    /* flat pieces that do not overlap, and a second tensor of another name, are fine */
    hmeta_init(&h);
    h.t[0].nshards = 2;
    h.sh[0].flat = h.sh[1].flat = 1;
    h.sh[0].fe = 7, h.sh[1].fs = 7;
    h.sh[0].ext.bytes = 28, h.sh[1].ext.bytes = 100;
    h.m.ntensors = 2;
    h.t[1].name = (char *)"w2";
    h.t[1].shards = h.sh;
    h.t[1].nshards = 1;
    assert_ok(hmeta_decode(&h));
}

/* ---- raw metadata bytes: counts and varints the encoder would never write ---- */

static st_buf raw_begin(void)
{
    st_buf b = {0};
    st_buf_put(&b, ST_META_MAGIC, 8);
    st_buf_u32(&b, ST_META_VERSION);
    st_buf_u32(&b, 0);
    st_buf_u64(&b, 0);
    st_buf_u64(&b, 1);
    return b;
}

/* Closes the body, decodes with every check, frees; returns the code. */
static int raw_decode(st_buf *b)
{
    st_buf_u64(b, 0);
    assert_false(b->oom);
    fix_meta(b->p, b->n);
    int rc = decode_rc(b->p, b->n, 1);
    free(b->p);
    return rc;
}

static uint64_t vm_peak_kb(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    uint64_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmPeak: %" SCNu64, &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

static void test_hostile_counts(void **state)
{
    (void)state;
    /* huge counts in a tiny file: refused before allocating for them. Naive code would
     * try to allocate gigabytes (20M tensors x ~100 bytes); the peak virtual size of the
     * process must not move by more than a little. */
    uint64_t peak0 = vm_peak_kb();
    static const uint64_t counts[] = {20000000, 3000000000u, (uint64_t)1 << 40, UINT64_MAX};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        for (int where = 0; where < 4; where++) {
            st_buf b = raw_begin();
            st_buf_var(&b, 4096);
            if (where == 0) { /* files */
                st_buf_var(&b, counts[i]);
            } else if (where == 1) { /* tensors */
                st_buf_var(&b, 0);
                st_buf_var(&b, counts[i]);
            } else if (where == 2) { /* shards of a tensor */
                st_buf_var(&b, 0);
                st_buf_var(&b, 1);
                st_buf_str(&b, "w");
                st_buf_u8(&b, STRATA_U8);
                st_buf_u8(&b, 1);
                st_buf_var(&b, 1000);
                st_buf_var(&b, counts[i]);
            } else { /* blobs */
                st_buf_var(&b, 0);
                st_buf_var(&b, 0);
                st_buf_var(&b, counts[i]);
            }
            for (int k = 0; k < 32; k++)
                st_buf_u8(&b, 1);
            assert_rc(raw_decode(&b), STRATA_EFORMAT);
        }
    }
    uint64_t grew = vm_peak_kb() - peak0;
    if (grew > 256 * 1024)
        fail_msg("decoding hostile counts grew the peak virtual size by %" PRIu64 " KiB", grew);

    /* ndim 9, a varint of 11 bytes, a name length of 2^63, an unknown shard flag */
    st_buf b = raw_begin();
    st_buf_var(&b, 4096);
    st_buf_var(&b, 0);
    st_buf_var(&b, 1);
    st_buf_str(&b, "w");
    st_buf_u8(&b, STRATA_U8);
    st_buf_u8(&b, 9);
    for (int d = 0; d < 9; d++)
        st_buf_var(&b, 1);
    st_buf_var(&b, 0);
    st_buf_var(&b, 0);
    assert_rc(raw_decode(&b), STRATA_EFORMAT);
    assert_msg_has("dims");

    b = raw_begin();
    for (int k = 0; k < 11; k++)
        st_buf_u8(&b, 0xff);
    st_buf_u8(&b, 0);
    assert_rc(raw_decode(&b), STRATA_EFORMAT);
    assert_msg_has("varint");

    b = raw_begin();
    st_buf_var(&b, 4096);
    st_buf_var(&b, 1);
    st_buf_var(&b, (uint64_t)1 << 63);
    st_buf_put(&b, "data-000000.bin", 15);
    st_buf_var(&b, 4096);
    st_buf_var(&b, 0);
    st_buf_var(&b, 0);
    assert_rc(raw_decode(&b), STRATA_EFORMAT);
    assert_msg_has("name");

    b = raw_begin();
    st_buf_var(&b, 4096);
    st_buf_var(&b, 0);
    st_buf_var(&b, 1);
    st_buf_str(&b, "w");
    st_buf_u8(&b, STRATA_U8);
    st_buf_u8(&b, 0);
    st_buf_var(&b, 1);
    st_buf_u8(&b, 2); /* flags: bit 1 is unknown */
    for (int k = 0; k < 16; k++)
        st_buf_u8(&b, 0);
    assert_rc(raw_decode(&b), STRATA_EFORMAT);
    assert_msg_has("flags");
}

/* ---- commit record ---- */

static void test_commit(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "commit");
    char cp[700];
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    size_t clen;
    unsigned char *rec = tu_read_file(cp, &clen);
    assert_int_equal(clen, ST_COMMIT_SIZE);

    /* missing */
    assert_int_equal(unlink(cp), 0);
    assert_rc(load_all(f.ck), STRATA_EINCOMPLETE);
    assert_msg_has("commit record");
    assert_rc(open_rc(f.ck, 0), STRATA_EINCOMPLETE);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, f.ck, STRATA_OPEN_INCOMPLETE));
    assert_int_equal(strata_ckpt_committed(c), 0);
    assert_int_equal(strata_ckpt_step(c), 42);
    strata_ckpt_free(c);
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, f.ck));
    assert_int_equal(pi.is_ckpt, 1);
    assert_int_equal(pi.committed, 0);

    /* corrupt: every single-byte change, a short one, an empty one */
    unsigned char bad[ST_COMMIT_SIZE];
    for (size_t i = 0; i < ST_COMMIT_SIZE; i++) {
        memcpy(bad, rec, sizeof bad);
        bad[i] ^= 0x40;
        tu_write_file(cp, bad, sizeof bad);
        assert_rc(load_all(f.ck), STRATA_EINCOMPLETE);
        assert_rc(open_rc(f.ck, 0), STRATA_EINCOMPLETE);
    }
    tu_write_file(cp, rec, 10);
    assert_rc(load_all(f.ck), STRATA_EINCOMPLETE);
    tu_write_file(cp, rec, 0);
    assert_rc(load_all(f.ck), STRATA_EINCOMPLETE);
    unsigned char longer[ST_COMMIT_SIZE + 1] = {0};
    memcpy(longer, rec, ST_COMMIT_SIZE);
    tu_write_file(cp, longer, sizeof longer);
    assert_rc(load_all(f.ck), STRATA_EINCOMPLETE);

    /* a version 1 record (64 bytes, no save id), as strata wrote before: still committed */
    st_commit c1;
    assert_ok(st_commit_decode(&c1, rec, clen));
    assert_int_equal(c1.version, ST_COMMIT_VERSION);
    assert_true(c1.save_id != 0);
    c1.version = 1;
    unsigned char v1[ST_COMMIT_SIZE];
    assert_int_equal(st_commit_encode(&c1, v1), ST_COMMIT_V1_SIZE);
    tu_write_file(cp, v1, ST_COMMIT_V1_SIZE);
    assert_ok(load_all(f.ck));
    assert_ok(open_rc(f.ck, 0));
    tu_write_file(cp, v1, ST_COMMIT_SIZE); /* a version 1 record of version 2's size */
    assert_rc(load_all(f.ck), STRATA_EINCOMPLETE);

    tu_write_file(cp, rec, clen);
    assert_ok(load_all(f.ck));
    assert_ok(strata_probe(&pi, f.ck));
    assert_int_equal(pi.committed, 1);
    assert_int_equal(pi.step, 42);
    free(rec);
    drop_ckpt(&f);
}

/* ---- requests that do not fit the checkpoint ---- */

static void test_requests(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "requests");
    uint64_t other[] = {64, 65}, three[] = {64, 64, 1};
    struct {
        const char *name;
        strata_dtype dt;
        int ndim;
        const uint64_t *shape;
        int want;
    } cases[] = {
        {W, STRATA_BF16, 2, wshape, STRATA_EMISMATCH},
        {W, STRATA_I32, 2, wshape, STRATA_EMISMATCH}, /* same size, other type */
        {W, STRATA_F32, 2, other, STRATA_EMISMATCH},
        {W, STRATA_F32, 3, three, STRATA_EMISMATCH},
        {"layer9.weight", STRATA_F32, 2, wshape, STRATA_ENOTFOUND},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tu_set d;
        tu_set_init(&d, 2);
        tu_set_shard(&d, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 0);
        tu_set_shard(&d, 1, cases[i].name, cases[i].dt, cases[i].ndim, cases[i].shape, NULL,
                     NULL, 0, 0, 0, 0);
        assert_rc(strata_load(NULL, NULL, (const char *[]){f.ck}, 1, d.st, 2, NULL), cases[i].want);
        assert_msg_has(cases[i].name);
        tu_set_free(&d);
    }
    struct {
        const char *name;
        int owner;
        uint64_t size;
        int want;
    } blobs[] = {
        {"nope", -1, 100, STRATA_ENOTFOUND},
        {"cfg", 0, 100, STRATA_ENOTFOUND},   /* only a global one */
        {"rng", 2, 40, STRATA_ENOTFOUND},    /* no rank 2 saved */
        {"rng", -1, 40, STRATA_ENOTFOUND},   /* no global one */
        {"cfg", -1, 99, STRATA_EMISMATCH},
        {"rng", 1, 41, STRATA_EMISMATCH},
        {"rng", 0, 40, 0},
    };
    for (size_t i = 0; i < sizeof blobs / sizeof blobs[0]; i++) {
        tu_set d;
        tu_set_init(&d, 1);
        tu_set_blob(&d, 0, blobs[i].name, blobs[i].owner >= 0, blobs[i].owner, blobs[i].size, 0);
        assert_rc(strata_load(NULL, NULL, (const char *[]){f.ck}, 1, d.st, 1, NULL), blobs[i].want);
        if (blobs[i].want)
            assert_msg_has(blobs[i].name);
        else
            assert_int_equal(tu_set_check(&d), 0);
        tu_set_free(&d);
    }
    drop_ckpt(&f);
}

static void test_unfilled(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/unfilled", base_dir);
    tu_set s;
    tu_set_init(&s, 1);
    uint64_t off[] = {0, 0}, len[] = {32, 64};
    tu_set_shard(&s, 0, W, STRATA_F32, 2, wshape, off, len, 0, 0, 0, 1); /* half of W */
    tu_set_shard(&s, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 1, 0, 63, 1); /* all but one */
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 1, NULL));
    tu_set_free(&s);

    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, W, STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
    assert_rc(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL), STRATA_EUNFILLED);
    assert_msg_has(W);
    assert_msg_has("2048 of the 4096");
    tu_set_free(&d);
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 1, 60, 64, 0);
    assert_rc(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL), STRATA_EUNFILLED);
    assert_msg_has(B);
    tu_set_free(&d);
    /* what was saved loads */
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, W, STRATA_F32, 2, wshape, off, len, 0, 0, 0, 0);
    tu_set_shard(&d, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 1, 60, 63, 0);
    assert_ok(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_rmrf(ck);
}

/* ---- URIs and existing directories ---- */

static void test_scheme(void **state)
{
    (void)state;
    tu_set s;
    tu_set_init(&s, 1);
    tu_set_blob(&s, 0, "x", 0, 0, 8, 1);
    const char *uris[] = {"s3://bucket/x", "gs://b/ckpt", "hdfs://nn/a"};
    for (size_t i = 0; i < 3; i++) {
        assert_rc(strata_save(NULL, NULL, &uris[i], 1, s.st, 1, NULL), STRATA_ESCHEME);
        assert_msg_has(uris[i]);
        assert_rc(strata_load(NULL, NULL, &uris[i], 1, s.st, 1, NULL), STRATA_ESCHEME);
        assert_msg_has(uris[i]);
        assert_rc(open_rc(uris[i], STRATA_OPEN_INCOMPLETE), STRATA_ESCHEME);
        strata_probe_info pi;
        assert_rc(strata_probe(&pi, uris[i]), STRATA_ESCHEME);
        assert_rc(strata_remove_incomplete(uris[i]), STRATA_ESCHEME);
    }
    /* a file:// URI must be absolute; an empty one is invalid */
    assert_rc(strata_save(NULL, NULL, (const char *[]){"file://relative/x"}, 1, s.st, 1, NULL),
              STRATA_EINVAL);
    assert_rc(strata_save(NULL, NULL, (const char *[]){""}, 1, s.st, 1, NULL), STRATA_EINVAL);
    /* a missing checkpoint */
    char ck[600];
    snprintf(ck, sizeof ck, "%s/never-saved", base_dir);
    assert_rc(strata_load(NULL, NULL, (const char *[]){ck}, 1, s.st, 1, NULL), STRATA_ENOENT);
    assert_msg_has(ck);
    assert_rc(open_rc(ck, STRATA_OPEN_INCOMPLETE), STRATA_ENOENT);
    tu_set_free(&s);
}

static void test_existing(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "existing");
    char mp[700];
    tu_join(mp, f.ck, ST_META_FILE);
    size_t len0;
    unsigned char *meta0 = tu_read_file(mp, &len0);

    /* another save onto the committed checkpoint is refused; nothing changes */
    tu_set s;
    tu_set_init(&s, 1);
    uint64_t shape[] = {10};
    tu_set_shard(&s, 0, "new", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    assert_rc(strata_save(NULL, NULL, (const char *[]){f.ck}, 1, s.st, 1, NULL), STRATA_EEXIST);
    assert_msg_has(f.ck);
    size_t len1;
    unsigned char *meta1 = tu_read_file(mp, &len1);
    assert_int_equal(len0, len1);
    assert_memory_equal(meta0, meta1, len0);
    free(meta0);
    free(meta1);
    assert_ok(load_all(f.ck));

    /* without its commit record it is incomplete: a save replaces it entirely */
    char cp[700], d1[700];
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    tu_join(d1, f.ck, "data-000001.bin");
    assert_true(tu_exists(d1));
    assert_int_equal(unlink(cp), 0);
    assert_ok(strata_save(NULL, NULL, (const char *[]){f.ck}, 1, s.st, 1, NULL));
    assert_false(tu_exists(d1)); /* the old save's files are gone */
    assert_rc(load_all(f.ck), STRATA_ENOTFOUND);
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "new", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 0);
    assert_ok(strata_load(NULL, NULL, (const char *[]){f.ck}, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);

    /* an incomplete directory holding someone else's file is not cleared */
    char other[700];
    tu_join(other, f.ck, "notes.txt");
    assert_int_equal(unlink(cp), 0);
    tu_write_file(other, "mine", 4);
    assert_rc(strata_save(NULL, NULL, (const char *[]){f.ck}, 1, s.st, 1, NULL), STRATA_EEXIST);
    assert_true(tu_exists(other));
    tu_set_free(&s);
    drop_ckpt(&f);
}

/* A full disk (simulated with RLIMIT_FSIZE: writes past the limit fail with EFBIG) is
 * STRATA_ENOSPC; nothing is committed, the failed save leaves no files, the previous
 * checkpoint still loads, and a retry with space succeeds. */
static void test_full_disk(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "full_prev");
    char ck[700];
    snprintf(ck, sizeof ck, "%s/full_new", base_dir);
    tu_rmrf(ck);
    tu_set s;
    tu_set_init(&s, 2);
    uint64_t shape[] = {1 << 20}; /* 4 MiB of f32 per rank half */
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {(uint64_t)r << 19}, len[] = {1 << 19};
        tu_set_shard(&s, r, "big", STRATA_F32, 1, shape, off, len, 0, 0, 0, 1);
    }
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    lim = old;
    lim.rlim_cur = 1 << 20;
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int rc = strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 2, NULL);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    assert_rc(rc, STRATA_ENOSPC);
    assert_msg_has("data-00000");
    char cp[800];
    tu_join(cp, ck, ST_COMMIT_FILE);
    assert_false(tu_exists(cp));
    assert_false(tu_exists(ck)); /* the failed save removed what it created */
    assert_ok(load_all(f.ck));   /* the committed one is untouched */
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 2, NULL));
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "big", STRATA_F32, 1, shape, NULL, NULL, 0, 0, 0, 0);
    assert_ok(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_set_free(&s);
    tu_rmrf(ck);
    drop_ckpt(&f);
}

static void test_remove_incomplete(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "remove");
    char cp[700], mp[700];
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    tu_join(mp, f.ck, ST_META_FILE);
    assert_rc(strata_remove_incomplete(f.ck), STRATA_EEXIST);
    assert_msg_has(f.ck);
    assert_ok(load_all(f.ck)); /* untouched */

    assert_int_equal(unlink(cp), 0);
    assert_ok(strata_remove_incomplete(f.ck));
    assert_false(tu_exists(f.ck));
    assert_rc(strata_remove_incomplete(f.ck), STRATA_ENOENT);
    drop_ckpt(&f);

    /* foreign files stay (and so does the directory); a symlink with a strata name is
     * not followed: its target survives */
    make_ckpt(&f, "remove2");
    char other[700], link[700], target[700];
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    tu_join(mp, f.ck, ST_META_FILE);
    tu_join(other, f.ck, "notes.txt");
    tu_join(link, f.ck, "data-000009.bin");
    tu_join(target, base_dir, "target.bin");
    tu_write_file(other, "mine", 4);
    tu_write_file(target, "keep", 4);
    assert_int_equal(symlink(target, link), 0);
    assert_int_equal(unlink(cp), 0);
    assert_ok(strata_remove_incomplete(f.ck));
    assert_true(tu_exists(other));
    assert_true(tu_exists(target));
    assert_false(tu_exists(mp));
    unlink(target);
    drop_ckpt(&f);
}

static void test_symlinks(void **state)
{
    (void)state;
    /* a "latest" symlink to a checkpoint is read through; nothing is written or removed
     * through one; a dangling one, or one to a file, is no checkpoint */
    fixture f;
    make_ckpt(&f, "step-10");
    char latest[700], dangling[700], tofile[700], cp[700];
    tu_join(latest, base_dir, "latest");
    tu_join(dangling, base_dir, "dangling");
    tu_join(tofile, base_dir, "tofile");
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    assert_int_equal(symlink("step-10", latest), 0);
    assert_int_equal(symlink("no-such-dir", dangling), 0);
    assert_int_equal(symlink("step-10/COMMIT", tofile), 0);
    assert_ok(load_all(latest));
    assert_ok(open_rc(latest, 0));
    assert_rc(strata_save(NULL, NULL, (const char *[]){latest}, 1, f.src.st, 2, NULL),
              STRATA_EEXIST);
    assert_rc(strata_remove_incomplete(latest), STRATA_EINVAL);
    assert_rc(load_all(dangling), STRATA_ENOENT);
    assert_rc(load_all(tofile), STRATA_ENOENT);
    assert_int_equal(unlink(cp), 0); /* incomplete: still not removed through the link */
    assert_rc(strata_remove_incomplete(latest), STRATA_EINVAL);
    assert_true(tu_exists(f.ck));
    assert_rc(load_all(latest), STRATA_EINCOMPLETE);
    unlink(latest);
    unlink(dangling);
    unlink(tofile);
    drop_ckpt(&f);
}

/* ---- invalid registrations and arguments ---- */

static void test_invalid_args(void **state)
{
    (void)state;
    strata_state *st;
    assert_ok(strata_state_new(&st));
    uint64_t shape[] = {10, 20}, off[] = {5, 0}, len[] = {6, 20}, big[] = {1ull << 40, 1ull << 40};
    uint64_t okoff[] = {5, 0}, oklen[] = {5, 20};
    char data[8192], longname[STRATA_MAX_NAME + 2];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    strata_shard good = {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape,
                         .offsets = okoff, .lengths = oklen, .data = data};
    assert_ok(strata_state_add_shard(st, &good));
    assert_int_equal(strata_shard_numel(&good), 100);
    struct {
        const char *why, *msg;
        strata_shard s;
    } bad[] = {
        {"offset + length beyond the shape", "exceeds",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape, .offsets = off,
          .lengths = len, .data = data}},
        {"offset beyond the shape", "exceeds",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape,
          .offsets = (uint64_t[]){11, 0}, .lengths = (uint64_t[]){0, 20}, .data = data}},
        {"flat end beyond the box", "flat range",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape, .offsets = okoff,
          .lengths = oklen, .flat = 1, .flat_start = 0, .flat_end = 101, .data = data}},
        {"flat start after end", "flat range",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape, .flat = 1,
          .flat_start = 7, .flat_end = 6, .data = data}},
        {"ndim 9", "ndim 9",
         {.name = "t", .dtype = STRATA_U8, .ndim = 9, .global_shape = shape, .data = data}},
        {"ndim -1", "ndim -1",
         {.name = "t", .dtype = STRATA_U8, .ndim = -1, .global_shape = shape, .data = data}},
        {"NULL data", "data is NULL",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape}},
        {"NULL shape", "global_shape",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .data = data}},
        {"unknown dtype", "dtype",
         {.name = "t", .dtype = STRATA_DTYPE_COUNT, .ndim = 0, .data = data}},
        {"empty name", "name",
         {.name = "", .dtype = STRATA_U8, .ndim = 0, .data = data}},
        {"NULL name", "name", {.dtype = STRATA_U8, .ndim = 0, .data = data}},
        {"long name", "longer",
         {.name = longname, .dtype = STRATA_U8, .ndim = 0, .data = data}},
        {"overflowing size", "overflows",
         {.name = "t", .dtype = STRATA_F64, .ndim = 2, .global_shape = big, .data = data}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = strata_state_add_shard(st, &bad[i].s);
        if (rc != STRATA_EINVAL)
            fail_msg("%s: %s, want STRATA_EINVAL", bad[i].why, strata_error_name(rc));
        assert_msg_has(bad[i].msg);
        assert_int_equal(strata_shard_numel(&bad[i].s), 0);
    }
    /* a shard of no elements needs no data */
    strata_shard empty = {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape,
                          .flat = 1, .flat_start = 3, .flat_end = 3};
    assert_ok(strata_state_add_shard(st, &empty));

    assert_rc(strata_state_add_blob(st, "", 0, 0, data, 1), STRATA_EINVAL);
    assert_rc(strata_state_add_blob(st, NULL, 0, 0, data, 1), STRATA_EINVAL);
    assert_rc(strata_state_add_blob(st, "b", 0, 0, NULL, 1), STRATA_EINVAL);
    assert_msg_has("'b'");
    assert_rc(strata_state_add_blob(st, "b", 0, -2, data, 1), STRATA_EINVAL);
    assert_ok(strata_state_add_blob(st, "b", 0, 0, NULL, 0));

    /* save and load arguments */
    char ck[600];
    snprintf(ck, sizeof ck, "%s/args", base_dir);
    const char *u = ck;
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    assert_rc(strata_save(NULL, NULL, &u, 1, &st, 0, NULL), STRATA_EINVAL);
    assert_rc(strata_save(NULL, NULL, &u, 1, NULL, 1, NULL), STRATA_EINVAL);
    strata_state *none[] = {NULL};
    assert_rc(strata_save(NULL, NULL, &u, 1, none, 1, NULL), STRATA_EINVAL);
    so.chunk_bytes = 1000;
    assert_rc(strata_save(NULL, NULL, &u, 1, &st, 1, &so), STRATA_EINVAL);
    assert_msg_has("1000");
    so.chunk_bytes = 2048;
    assert_rc(strata_save(NULL, NULL, &u, 1, &st, 1, &so), STRATA_EINVAL);
    so.chunk_bytes = 128u << 20;
    assert_rc(strata_save(NULL, NULL, &u, 1, &st, 1, &so), STRATA_EINVAL);
    so.chunk_bytes = 0;
    /* options versions: 1..current are accepted (test_versions), 0 and newer ones not */
    const int bad_versions[] = {0, -1, STRATA_SAVE_OPTS_VERSION + 1, 99};
    for (size_t i = 0; i < sizeof bad_versions / sizeof bad_versions[0]; i++) {
        so.version = bad_versions[i];
        assert_rc(strata_save(NULL, NULL, &u, 1, &st, 1, &so), STRATA_EINVAL);
    }
    assert_false(tu_exists(ck)); /* nothing was created */
    assert_rc(strata_load(NULL, NULL, &u, 1, &st, 0, NULL), STRATA_EINVAL);
    const int bad_lversions[] = {0, -1, STRATA_LOAD_OPTS_VERSION + 1, 99};
    for (size_t i = 0; i < sizeof bad_lversions / sizeof bad_lversions[0]; i++) {
        lo.version = bad_lversions[i];
        assert_rc(strata_load(NULL, NULL, &u, 1, &st, 1, &lo), STRATA_EINVAL);
    }
    strata_state_free(st);

    /* error names and strings cover the table */
    assert_string_equal(strata_error_name(STRATA_ECHECKSUM), "STRATA_ECHECKSUM");
    assert_string_equal(strata_error_name(-99), "STRATA_E?");
    assert_non_null(strata_error_str(-99));
    strata_dtype dt;
    assert_ok(strata_dtype_parse(&dt, "fp8_e5m2"));
    assert_int_equal(dt, STRATA_FP8_E5M2);
    assert_rc(strata_dtype_parse(&dt, "f128"), STRATA_EINVAL);
}

/* Options structs of an older version are accepted (the fields added later take their
 * defaults); version 0 and versions newer than this header's are refused. */
static void test_versions(void **state)
{
    (void)state;
    tu_set s;
    std_state(&s);
    char ck[600];
    snprintf(ck, sizeof ck, "%s/v1", base_dir);
    const char *u = ck;

    /* a version-1 save options struct: the layout before bg_nice, exactly its size on the
     * heap (under ASan a read past it, of bg_nice, fails) */
    typedef struct {
        int version;
        unsigned flags;
        uint64_t step;
        uint32_t chunk_bytes;
        int io_threads;
    } save_opts_v1;
    save_opts_v1 *v1 = malloc(sizeof *v1);
    assert_non_null(v1);
    *v1 = (save_opts_v1){.version = 1, .flags = STRATA_SAVE_NO_SYNC, .step = 7,
                         .chunk_bytes = 8192, .io_threads = 2};
    assert_ok(strata_save(NULL, NULL, &u, 1, s.st, 2, (const strata_save_opts *)(void *)v1));
    free(v1);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    assert_int_equal(strata_ckpt_committed(c), 1);
    assert_int_equal(strata_ckpt_step(c), 7);
    assert_int_equal(strata_ckpt_chunk_bytes(c), 8192);
    strata_ckpt_free(c);
    assert_ok(load_all(ck)); /* bitwise: load_all checks every value */

    /* version 1 in a current struct is accepted too */
    tu_rmrf(ck);
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.version = 1;
    so.flags = STRATA_SAVE_NO_SYNC;
    so.step = 8;
    so.chunk_bytes = 16384;
    assert_ok(strata_save(NULL, NULL, &u, 1, s.st, 2, &so));
    assert_ok(strata_ckpt_open(&c, ck, 0));
    assert_int_equal(strata_ckpt_step(c), 8);
    assert_int_equal(strata_ckpt_chunk_bytes(c), 16384);
    strata_ckpt_free(c);

    /* load options: version 1 is the current one; 0 and 2 are refused */
    tu_set_free(&last_req);
    request_all(&last_req);
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    assert_int_equal(lo.version, 1);
    lo.version = 0;
    assert_rc(strata_load(NULL, NULL, &u, 1, last_req.st, 1, &lo), STRATA_EINVAL);
    lo.version = 2;
    assert_rc(strata_load(NULL, NULL, &u, 1, last_req.st, 1, &lo), STRATA_EINVAL);
    lo.version = 1;
    assert_ok(strata_load(NULL, NULL, &u, 1, last_req.st, 1, &lo));
    assert_int_equal(tu_set_check(&last_req), 0);

    /* a stats struct of version 0 (zero-initialised, not STRATA_STATS_INIT) is refused,
     * before anything is created */
    char ck2[700];
    tu_join(ck2, base_dir, "stats0");
    const char *u2 = ck2;
    strata_stats zero;
    memset(&zero, 0, sizeof zero);
    assert_rc(strata_save(&zero, NULL, &u2, 1, s.st, 2, NULL), STRATA_EINVAL);
    assert_msg_has("version");
    assert_false(tu_exists(ck2));
    strata_stats ok = STRATA_STATS_INIT;
    assert_ok(strata_save(&ok, NULL, &u2, 1, s.st, 2, NULL));
    assert_true(ok.data_bytes > 0);
    tu_rmrf(ck2);
    tu_rmrf(ck);
    tu_set_free(&s);
}

/* Argument errors of the save and load calls: the destinations / sources and the ranks.
 * Each is STRATA_EINVAL, and nothing is created on disk. */
static void test_call_args(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "callargs"); /* a committed source, so a load fails only on arguments */
    char paths[STRATA_MAX_TIERS + 1][700];
    const char *uris[STRATA_MAX_TIERS + 1];
    for (int i = 0; i <= STRATA_MAX_TIERS; i++) {
        snprintf(paths[i], sizeof paths[i], "%s/tier-%d", base_dir, i);
        uris[i] = paths[i];
    }
    const int bad_n[] = {0, -1, STRATA_MAX_TIERS + 1};
    for (size_t i = 0; i < sizeof bad_n / sizeof bad_n[0]; i++) {
        assert_rc(strata_save(NULL, NULL, uris, bad_n[i], f.src.st, 2, NULL), STRATA_EINVAL);
        for (int k = 0; k <= STRATA_MAX_TIERS; k++)
            assert_false(tu_exists(paths[k]));
    }
    /* NULL uris; a NULL uri inside the array (the first one valid) */
    assert_rc(strata_save(NULL, NULL, NULL, 1, f.src.st, 2, NULL), STRATA_EINVAL);
    const char *with_null[] = {paths[0], NULL, paths[2]};
    assert_rc(strata_save(NULL, NULL, with_null, 3, f.src.st, 2, NULL), STRATA_EINVAL);
    /* no states */
    assert_rc(strata_save(NULL, NULL, uris, 1, f.src.st, 0, NULL), STRATA_EINVAL);
    for (int k = 0; k <= STRATA_MAX_TIERS; k++)
        assert_false(tu_exists(paths[k]));

    /* the same for a load from the committed checkpoint */
    tu_set_free(&last_req);
    request_all(&last_req);
    const char *src[STRATA_MAX_TIERS + 1];
    for (int i = 0; i <= STRATA_MAX_TIERS; i++)
        src[i] = f.ck;
    for (size_t i = 0; i < sizeof bad_n / sizeof bad_n[0]; i++)
        assert_rc(strata_load(NULL, NULL, src, bad_n[i], last_req.st, 1, NULL), STRATA_EINVAL);
    assert_rc(strata_load(NULL, NULL, NULL, 1, last_req.st, 1, NULL), STRATA_EINVAL);
    const char *lnull[] = {f.ck, NULL};
    assert_rc(strata_load(NULL, NULL, lnull, 2, last_req.st, 1, NULL), STRATA_EINVAL);
    assert_rc(strata_load(NULL, NULL, src, 1, last_req.st, 0, NULL), STRATA_EINVAL);
    for (int k = 0; k <= STRATA_MAX_TIERS; k++)
        assert_false(tu_exists(paths[k]));
    /* and the arguments fixed, both work: every tier allowed */
    assert_ok(strata_load(NULL, NULL, src, STRATA_MAX_TIERS, last_req.st, 1, NULL));
    assert_int_equal(tu_set_check(&last_req), 0);
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags = STRATA_SAVE_NO_SYNC;
    assert_ok(strata_save(NULL, NULL, uris, STRATA_MAX_TIERS, f.src.st, 2, &so));
    for (int k = 0; k < STRATA_MAX_TIERS; k++) {
        assert_ok(load_all(paths[k]));
        tu_rmrf(paths[k]);
    }
    assert_false(tu_exists(paths[STRATA_MAX_TIERS]));
    drop_ckpt(&f);
}

static int setup(void **state)
{
    (void)state;
    tu_tmpdir(base_dir, sizeof base_dir, "err");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tu_set_free(&last_req);
    tu_rmrf(base_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hostile_counts), /* first: it watches the peak memory */
        cmocka_unit_test(test_bit_flip),
        cmocka_unit_test(test_data_files),
        cmocka_unit_test(test_meta_truncated),
        cmocka_unit_test(test_meta_garbled),
        cmocka_unit_test(test_decoder_corrupt),
        cmocka_unit_test(test_hostile_meta),
        cmocka_unit_test(test_commit),
        cmocka_unit_test(test_requests),
        cmocka_unit_test(test_unfilled),
        cmocka_unit_test(test_scheme),
        cmocka_unit_test(test_existing),
        cmocka_unit_test(test_full_disk),
        cmocka_unit_test(test_remove_incomplete),
        cmocka_unit_test(test_symlinks),
        cmocka_unit_test(test_invalid_args),
        cmocka_unit_test(test_versions),
        cmocka_unit_test(test_call_args),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
