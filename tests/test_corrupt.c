/* test_corrupt.c - every damage to a checkpoint on disk fails with its exact code and a
 * message naming the culprit: corrupt data, missing or short data files, truncated,
 * garbled and hostile metadata (and counts and varints the encoder would never write), and
 * commit records. Requests, URIs, existing directories and arguments: test_errors.c. */
#include "core/checksum.h"
#include "meta/meta.h"
#include "stdckpt.h"

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
    buf[8] = 3; /* a version after this reader's (2: incremental checkpoints) */
    assert_rc(decode_rc(buf, len, 0), STRATA_EFORMAT);
    assert_msg_has("version 3 is not supported");
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
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
