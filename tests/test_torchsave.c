/* test_torchsave.c - the torch.save source (src/source/torchsave_src.c) through the public
 * API, on files written by torch.save (torch 2.13; the seeds of fuzz/corpus/fuzz_torchsave,
 * made by tests/python/test_torchsave.py's writer: see FUZZ below), so that it also runs
 * under ASan, UBSan and TSan: open, the tensors and their bytes, the blob, verify (the zip
 * CRC-32s), each refusal's code, and the zip CRC-32s every read checks (a load of a view, in
 * one read and across reads, on three threads as ranks, an export; a byte flipped where
 * the request does not reach; STRATA_LOAD_SKIP_CRC). Runs from the repository root (or $STRATA_SRC_ROOT).
 *
 * Also the restricted pickle reader's public entry (strata_pickle_*): an archive's values
 * and tensors' bytes, a bare data.pkl's, the kinds it hands out, its refusals.
 *
 * seed-valid-dtypes: {name: torch.arange(4).to(dtype)} for the 12 dtypes;
 * seed-valid-values: {"w": a float32 tensor of 2, "step": 7, "cfg": {"lr": 0.1, "big": 2**90,
 * "t": (1, "x", b"y", None, True), "od": OrderedDict(a=1), "size": torch.Size([2]),
 * "dt": torch.float16}} (seed-pkl-valid-values: its data.pkl);
 * seed-valid-views: {"m": {"base": b, "rows": b[1:3], "row": b[2], "s": b[4, 1], "e":
 * b[2:2]}, "tied": [b, b], "p": Parameter(ones(2, 2))} with b a 5x3 float32 tensor. */
#include <zlib.h>

#include "testutil.h"
#include "threadcomm.h"

#define FUZZ "fuzz/corpus/fuzz_torchsave/"

static char root[2048];

static const char *at(const char *rel)
{
    static char p[4096];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    return p;
}

/* Loads tensor `name` (whole) of the source at path into a new buffer. */
static unsigned char *load(const char *path, const char *name, strata_dtype dt, int ndim,
                           const uint64_t *shape, size_t bytes)
{
    unsigned char *buf = malloc(bytes ? bytes : 1);
    memset(buf, 0xAB, bytes);
    strata_state *st;
    assert_ok(strata_state_new(&st));
    strata_shard sh = {name, dt, ndim, shape, NULL, NULL, 0, 0, 0, buf, 0, 0};
    assert_ok(strata_state_add_shard(st, &sh));
    const char *uris[] = {path};
    assert_ok(strata_load(NULL, NULL, uris, 1, &st, 1, NULL));
    strata_state_free(st);
    return buf;
}

static void test_dtypes(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        strata_dtype dt;
        unsigned char want[32];
    } t[] = {
        {"f64", STRATA_F64, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f,
                             0, 0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0, 0, 0, 0, 0x08, 0x40}},
        {"f32", STRATA_F32, {0, 0, 0, 0, 0, 0, 0x80, 0x3f, 0, 0, 0, 0x40, 0, 0, 0x40, 0x40}},
        {"f16", STRATA_F16, {0, 0, 0, 0x3c, 0, 0x40, 0, 0x42}},
        {"bf16", STRATA_BF16, {0, 0, 0x80, 0x3f, 0, 0x40, 0x40, 0x40}},
        {"e4m3", STRATA_FP8_E4M3, {0, 0x38, 0x40, 0x44}},
        {"e5m2", STRATA_FP8_E5M2, {0, 0x3c, 0x40, 0x42}},
        {"i64", STRATA_I64, {0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
                             2, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0}},
        {"i32", STRATA_I32, {0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0}},
        {"i16", STRATA_I16, {0, 0, 1, 0, 2, 0, 3, 0}},
        {"i8", STRATA_I8, {0, 1, 2, 3}},
        {"u8", STRATA_U8, {0, 1, 2, 3}},
        {"b", STRATA_BOOL, {0, 1, 1, 1}},
    };
    const char *path = at(FUZZ "seed-valid-dtypes");
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, path, 0));
    assert_int_equal(strata_ckpt_format(ck), STRATA_FORMAT_TORCH_SAVE);
    assert_int_equal(strata_ckpt_ntensors(ck), 12);
    assert_int_equal(strata_ckpt_chunk_bytes(ck), 0);
    assert_int_equal(strata_ckpt_nblobs(ck), 1);
    strata_blob_info b;
    strata_ckpt_blob(&b, ck, 0);
    assert_string_equal(b.name, "seed-valid-dtypes/seed-valid-dtypes/data.pkl");
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        strata_tensor_info ti;
        assert_true(tu_find_tensor(ck, t[i].name, &ti) >= 0);
        assert_int_equal(ti.dtype, t[i].dt);
        assert_int_equal(ti.ndim, 1);
        assert_int_equal(ti.shape[0], 4);
        size_t n = 4 * strata_dtype_size(t[i].dt);
        uint64_t shape[1] = {4};
        unsigned char *got = load(path, t[i].name, t[i].dt, 1, shape, n);
        if (memcmp(got, t[i].want, n) != 0)
            fail_msg("tensor '%s': other bytes than torch.arange(4) as %s", t[i].name,
                     strata_dtype_name(t[i].dt));
        free(got);
    }
    assert_ok(strata_ckpt_verify(ck, NULL, NULL));
    strata_ckpt_free(ck);
}

static void test_views_and_shared_storages(void **state)
{
    (void)state;
    const char *path = at(FUZZ "seed-valid-views");
    strata_ckpt *ck;
    strata_tensor_info ti;
    assert_ok(strata_ckpt_open(&ck, path, 0));
    assert_int_equal(tu_find_tensor(ck, "m.e", &ti), -1); /* empty: not in the index */
    assert_true(tu_find_tensor(ck, "m.s", &ti) >= 0);
    assert_int_equal(ti.ndim, 0);
    uint64_t s53[2] = {5, 3}, s23[2] = {2, 3}, s3[1] = {3}, s22[2] = {2, 2};
    unsigned char *base = load(path, "m.base", STRATA_F32, 2, s53, 60);
    unsigned char *rows = load(path, "m.rows", STRATA_F32, 2, s23, 24);
    unsigned char *row = load(path, "m.row", STRATA_F32, 1, s3, 12);
    unsigned char *s = load(path, "m.s", STRATA_F32, 0, NULL, 4);
    unsigned char *t0 = load(path, "tied.0", STRATA_F32, 2, s53, 60);
    unsigned char *t1 = load(path, "tied.1", STRATA_F32, 2, s53, 60);
    unsigned char *p = load(path, "p", STRATA_F32, 2, s22, 16);
    assert_memory_equal(rows, base + 12, 24); /* b[1:3]: storage offset 3 elements */
    assert_memory_equal(row, base + 24, 12);  /* b[2] */
    assert_memory_equal(s, base + 52, 4);     /* b[4, 1] */
    assert_memory_equal(t0, base, 60);
    assert_memory_equal(t1, base, 60);
    static const float ones[4] = {1, 1, 1, 1};
    assert_memory_equal(p, ones, 16);
    free(base), free(rows), free(row), free(s), free(t0), free(t1), free(p);
    strata_ckpt_free(ck);
}

typedef struct {
    int calls;
    char object[256];
} reports;

static void on_bad(void *ctx, const char *object, const char *file, const char *msg)
{
    reports *r = ctx;
    (void)file, (void)msg;
    if (r->calls++ == 0)
        snprintf(r->object, sizeof r->object, "%s", object);
}

static void test_verify_finds_a_flipped_byte(void **state)
{
    (void)state;
    char dir[1024], path[1100];
    tu_tmpdir(dir, sizeof dir, "torchsave");
    tu_join(path, dir, "m.pt");
    size_t len;
    unsigned char *b = tu_read_file(at(FUZZ "seed-valid-dtypes"), &len);
    tu_write_file(path, b, len);
    free(b);
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, path, 0));
    strata_tensor_info ti;
    strata_shard_info si;
    int i = tu_find_tensor(ck, "f64", &ti);
    strata_ckpt_shard(&si, ck, (size_t)i, 0);
    strata_ckpt_free(ck);
    tu_flip_byte(path, si.file_offset + 9, 0x01); /* inside the f64 storage's entry */
    assert_ok(strata_ckpt_open(&ck, path, 0));
    reports r = {0};
    assert_rc(strata_ckpt_verify(ck, on_bad, &r), STRATA_ECHECKSUM);
    assert_int_equal(r.calls, 1);
    assert_non_null(strstr(r.object, "/data/"));
    strata_ckpt_free(ck);
    tu_rmrf(dir);
}

/* ---- the zip CRC-32s every read checks ---- */

static uint32_t le(const unsigned char *p, int n)
{
    uint32_t v = 0;
    for (int i = n; i-- > 0;)
        v = v << 8 | p[i];
    return v;
}

/* The stored entry whose data holds byte `off` of the zip file b (len bytes): its name into
 * name, the offset of its first data byte - from its central directory record (size at 20,
 * local header at 42) and its local header (name and extra lengths at 26 and 28: torch
 * writes data descriptors, so the sizes are in the central directory only). */
static uint64_t entry_at(const unsigned char *b, size_t len, uint64_t off, char *name,
                         size_t cap)
{
    size_t e = len - 22;
    while (e > 0 && memcmp(b + e, "PK\x05\x06", 4) != 0)
        e--;
    size_t cd = le(b + e + 16, 4), n = le(b + e + 10, 2);
    for (size_t i = 0; i < n; i++) {
        assert_memory_equal(b + cd, "PK\x01\x02", 4);
        uint32_t csize = le(b + cd + 20, 4), lh = le(b + cd + 42, 4);
        size_t nl = le(b + cd + 28, 2);
        assert_memory_equal(b + lh, "PK\x03\x04", 4);
        uint64_t data = lh + 30 + le(b + lh + 26, 2) + le(b + lh + 28, 2);
        if (off >= data && off < data + csize) {
            snprintf(name, cap, "%.*s", (int)nl, (const char *)b + cd + 46);
            return data;
        }
        cd += 46 + nl + le(b + cd + 30, 2) + le(b + cd + 32, 2);
    }
    fail_msg("no zip entry holds byte %llu", (unsigned long long)off);
    return 0;
}

typedef struct {
    char dir[1024], path[1100], entry[256];
    uint64_t base_at; /* the first byte of m.base (its storage) in the file */
} views_copy;

/* seed-valid-views copied to a new directory; m.base's storage entry found. */
static void views_copy_make(views_copy *c)
{
    tu_tmpdir(c->dir, sizeof c->dir, "tscrc");
    tu_join(c->path, c->dir, "m.pt");
    size_t len;
    unsigned char *b = tu_read_file(at(FUZZ "seed-valid-views"), &len);
    tu_write_file(c->path, b, len);
    strata_ckpt *ck;
    strata_tensor_info ti;
    strata_shard_info si;
    assert_ok(strata_ckpt_open(&ck, c->path, 0));
    strata_ckpt_shard(&si, ck, (size_t)tu_find_tensor(ck, "m.base", &ti), 0);
    strata_ckpt_free(ck);
    c->base_at = entry_at(b, len, si.file_offset, c->entry, sizeof c->entry);
    assert_int_equal(c->base_at, si.file_offset); /* b is its storage, from its start */
    free(b);
}

/* m.rows (b[1:3], 24 bytes at 12 of the 60 of b's entry) into buf with opts (may be NULL). */
static int load_rows(const char *path, float *buf, const strata_load_opts *o, strata_stats *st)
{
    strata_state *s;
    assert_ok(strata_state_new(&s));
    uint64_t shape[2] = {2, 3};
    strata_shard sh = {"m.rows", STRATA_F32, 2, shape, NULL, NULL, 0, 0, 0, buf, 0, 0};
    assert_ok(strata_state_add_shard(s, &sh));
    const char *uris[] = {path};
    int rc = strata_load(st, NULL, uris, 1, &s, 1, o);
    strata_state_free(s);
    return rc;
}

static void test_loads_check_the_crc(void **state)
{
    (void)state;
    views_copy c;
    views_copy_make(&c);
    float want[6], got[6];
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(load_rows(c.path, want, NULL, &st));
    assert_int_equal(st.crc_checked, 1);
    assert_int_equal(st.crc_bytes, 60 - 24); /* the rest of b's entry, read for its CRC-32 */
    assert_int_equal(st.crc_skipped, 0);
    assert_int_equal(st.bytes, 24);
    /* reads of 8 bytes on 4 threads: the entry's CRC-32 combined from eight reads */
    strata_load_opts o = STRATA_LOAD_OPTS_INIT;
    o.max_io_bytes = 8;
    o.io_threads = 4;
    st = (strata_stats)STRATA_STATS_INIT;
    assert_ok(load_rows(c.path, got, &o, &st));
    assert_memory_equal(got, want, 24);
    assert_int_equal(st.crc_checked, 1);
    assert_true(st.io_calls >= 8);
    /* a byte of row 4 of b, which m.rows does not hold: found, in one read and in eight */
    tu_flip_byte(c.path, c.base_at + 50, 0x01);
    assert_rc(load_rows(c.path, got, NULL, NULL), STRATA_ECHECKSUM);
    assert_msg_has("tensor 'm.base'");
    assert_msg_has(c.entry);
    assert_msg_has("'m.pt'");
    assert_rc(load_rows(c.path, got, &o, NULL), STRATA_ECHECKSUM);
    assert_msg_has(c.entry);
    /* skipped: the rows alone read, nothing checked, and the stats say so */
    o = (strata_load_opts)STRATA_LOAD_OPTS_INIT;
    o.flags = STRATA_LOAD_SKIP_CRC;
    st = (strata_stats)STRATA_STATS_INIT;
    assert_ok(load_rows(c.path, got, &o, &st));
    assert_memory_equal(got, want, 24);
    assert_int_equal(st.crc_skipped, 1);
    assert_int_equal(st.crc_checked, 0);
    assert_int_equal(st.crc_bytes, 0);
    tu_rmrf(c.dir);
}

static void test_export_checks_the_crc(void **state)
{
    (void)state;
    views_copy c;
    views_copy_make(&c);
    char out[1200];
    tu_join(out, c.dir, "out");
    strata_export_opts eo = STRATA_EXPORT_OPTS_INIT;
    const char *only[] = {"m.rows", NULL};
    eo.include = only;
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(strata_export_safetensors(&st, c.path, out, &eo));
    assert_int_equal(st.crc_checked, 1);
    assert_int_equal(st.crc_bytes, 60 - 24); /* read at the end, after the window's rows */
    tu_rmrf(out);
    tu_flip_byte(c.path, c.base_at + 50, 0x01);
    assert_rc(strata_export_safetensors(NULL, c.path, out, &eo), STRATA_ECHECKSUM);
    assert_msg_has(c.entry);
    struct stat sb;
    assert_int_equal(stat(out, &sb), -1); /* nothing published */
    eo.flags = STRATA_EXPORT_SKIP_CRC;
    st = (strata_stats)STRATA_STATS_INIT;
    assert_ok(strata_export_safetensors(&st, c.path, out, &eo));
    assert_int_equal(st.crc_skipped, 1);
    tu_rmrf(c.dir);
}

#define NR 3
typedef struct {
    hub *h;
    tcomm tc;
    const char *path;
    int rank, rc;
    float rows[2][3];
    char msg[512];
} rank_job;

/* Rank r of NR: rows [r * 5 / NR, (r + 1) * 5 / NR) of m.base (2 x... of its 5 x 3). */
static void *run_rank(void *arg)
{
    rank_job *j = arg;
    strata_comm *c;
    strata_state *s;
    j->rc = strata_comm_host(&c, &tops, &j->tc, j->rank, NR);
    if (j->rc)
        return NULL;
    assert_ok(strata_state_new(&s));
    uint64_t shape[2] = {5, 3}, off[2] = {(uint64_t)j->rank * 2, 0},
             len[2] = {j->rank == 2 ? 1 : 2, 3};
    strata_shard sh = {"m.base", STRATA_F32, 2, shape, off, len, 0, 0, 0, j->rows, 0, 0};
    assert_ok(strata_state_add_shard(s, &sh));
    const char *uris[] = {j->path};
    j->rc = strata_load(NULL, c, uris, 1, &s, 1, NULL);
    snprintf(j->msg, sizeof j->msg, "%s", j->rc ? strata_error_last() : "");
    strata_state_free(s);
    strata_comm_free(c);
    return NULL;
}

static void test_ranks_all_fail(void **state)
{
    (void)state;
    views_copy c;
    views_copy_make(&c);
    tu_flip_byte(c.path, c.base_at + 2, 0x01); /* row 0: rank 0's; ranks 1 and 2 need none */
    hub h;
    hub_init(&h, NR);
    rank_job jobs[NR];
    pthread_t th[NR];
    for (int r = 0; r < NR; r++) {
        jobs[r] = (rank_job){&h, {&h, r}, c.path, r, 0, {{0}}, ""};
        assert_int_equal(pthread_create(&th[r], NULL, run_rank, &jobs[r]), 0);
    }
    for (int r = 0; r < NR; r++)
        pthread_join(th[r], NULL);
    hub_free(&h);
    for (int r = 0; r < NR; r++) {
        if (jobs[r].rc != STRATA_ECHECKSUM || !strstr(jobs[r].msg, c.entry))
            fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
    }
    tu_rmrf(c.dir);
}

static void refused(const char *seed, int code, const char *words)
{
    strata_ckpt *ck = NULL;
    assert_rc(strata_ckpt_open(&ck, at(seed), 0), code);
    assert_null(ck);
    assert_msg_has(words);
}

static void test_refusals(void **state)
{
    (void)state;
    refused(FUZZ "seed-reject-legacy-eformat", STRATA_ENOTSUP, "legacy format");
    refused(FUZZ "seed-reject-compressed-enotsup", STRATA_ENOTSUP, "is compressed");
    refused(FUZZ "seed-reject-noncontiguous-enotsup", STRATA_ENOTSUP,
            "tensor 't' is not contiguous");
    refused(FUZZ "seed-reject-complex-enotsup", STRATA_ENOTSUP, "tensor 'c' is complex");
    refused(FUZZ "seed-reject-root-tensor-enotsup", STRATA_ENOTSUP, "root is a tensor");
    refused(FUZZ "seed-reject-lying-size-eformat", STRATA_EFORMAT, "holds 64 bytes, its "
            "storage 60");
    refused(FUZZ "seed-reject-dup-key-eformat", STRATA_EFORMAT, "holds the key 'dupA' twice");
    refused(FUZZ "seed-reject-planted-global-eformat", STRATA_EFORMAT, "io.open");
}

/* The kind of v (strata_pickle_get), checked. */
static strata_pickle_value_info kind_of(const strata_pickle_value *v, int kind)
{
    assert_non_null(v);
    strata_pickle_value_info i;
    strata_pickle_get(&i, v);
    assert_int_equal(i.kind, kind);
    return i;
}

/* The value of dict d at the key named key (by strata_pickle_key), checked to be there. */
static const strata_pickle_value *at_key(const strata_pickle_value *d, const char *key)
{
    strata_pickle_value_info i = kind_of(d, STRATA_PICKLE_DICT);
    char part[64];
    for (size_t k = 0; k < i.n; k++)
        if (strata_pickle_key(part, sizeof part, strata_pickle_item(d, 2 * k)) >= 0 &&
            strcmp(part, key) == 0)
            return strata_pickle_item(d, 2 * k + 1);
    fail_msg("no key '%s'", key);
    return NULL;
}

static void test_pickle_api(void **state)
{
    (void)state;
    size_t len;
    unsigned char *buf = tu_read_file(at(FUZZ "seed-valid-values"), &len);
    strata_pickle *pk;
    assert_ok(strata_pickle_open_archive(&pk, buf, len, "values.pt"));
    const strata_pickle_value *root = strata_pickle_root(pk), *v, *cfg, *t;
    assert_int_equal(kind_of(root, STRATA_PICKLE_DICT).n, 3);
    /* the tensor: its dtype, shape, and its bytes in the archive (their zip CRC-32) */
    v = at_key(root, "w");
    kind_of(v, STRATA_PICKLE_TENSOR);
    strata_pickle_tensor_info ti;
    assert_ok(strata_pickle_tensor(&ti, pk, v, "w"));
    assert_int_equal(ti.dtype, STRATA_F32);
    assert_int_equal(ti.ndim, 1);
    assert_int_equal(ti.shape[0], 2);
    assert_int_equal(ti.bytes, 8);
    assert_true((const unsigned char *)ti.data >= buf &&
                (const unsigned char *)ti.data + 8 <= buf + len);
    assert_int_equal(crc32(0, ti.data, 8), 3573961104u);
    assert_rc(strata_pickle_tensor(&ti, pk, root, "root"), STRATA_EINVAL);
    assert_msg_has("'root' is not a tensor");
    assert_int_equal(kind_of(at_key(root, "step"), STRATA_PICKLE_INT).i, 7);
    /* the values */
    cfg = at_key(root, "cfg");
    assert_int_equal(kind_of(cfg, STRATA_PICKLE_DICT).ordered, 0);
    assert_true(kind_of(at_key(cfg, "lr"), STRATA_PICKLE_FLOAT).f == 0.1);
    strata_pickle_value_info big = kind_of(at_key(cfg, "big"), STRATA_PICKLE_BIGINT);
    assert_int_equal(big.len, 12); /* 2**90, little-endian */
    assert_int_equal(big.bytes[11], 4);
    t = at_key(cfg, "t");
    assert_int_equal(kind_of(t, STRATA_PICKLE_TUPLE).n, 5);
    assert_int_equal(kind_of(strata_pickle_item(t, 0), STRATA_PICKLE_INT).i, 1);
    strata_pickle_value_info x = kind_of(strata_pickle_item(t, 1), STRATA_PICKLE_STR);
    assert_true(x.len == 1 && strcmp((const char *)x.bytes, "x") == 0);
    x = kind_of(strata_pickle_item(t, 2), STRATA_PICKLE_BYTES);
    assert_true(x.len == 1 && x.bytes[0] == 'y');
    kind_of(strata_pickle_item(t, 3), STRATA_PICKLE_NONE);
    assert_int_equal(kind_of(strata_pickle_item(t, 4), STRATA_PICKLE_BOOL).i, 1);
    assert_null(strata_pickle_item(t, 5));
    assert_null(strata_pickle_item(strata_pickle_item(t, 0), 0));
    v = at_key(cfg, "od");
    assert_int_equal(kind_of(v, STRATA_PICKLE_DICT).ordered, 1);
    assert_int_equal(kind_of(at_key(v, "a"), STRATA_PICKLE_INT).i, 1);
    v = at_key(cfg, "size"); /* torch.Size([2]): a tuple */
    assert_int_equal(kind_of(v, STRATA_PICKLE_TUPLE).n, 1);
    assert_int_equal(kind_of(strata_pickle_item(v, 0), STRATA_PICKLE_INT).i, 2);
    x = kind_of(at_key(cfg, "dt"), STRATA_PICKLE_GLOBAL);
    assert_string_equal(x.module, "torch");
    assert_string_equal(x.name, "float16");
    char part[2];
    assert_int_equal(strata_pickle_key(part, sizeof part, strata_pickle_item(cfg, 0)), -1);
    strata_pickle_free(pk);
    free(buf);

    /* its data.pkl alone: the same values, a tensor without bytes */
    buf = tu_read_file(at(FUZZ "seed-pkl-valid-values"), &len);
    assert_ok(strata_pickle_parse(&pk, buf, len, NULL));
    free(buf); /* copied */
    assert_ok(strata_pickle_tensor(&ti, pk, at_key(strata_pickle_root(pk), "w"), "w"));
    assert_true(ti.dtype == STRATA_F32 && ti.shape[0] == 2 && !ti.data && !ti.bytes);
    assert_int_equal(kind_of(at_key(strata_pickle_root(pk), "step"), STRATA_PICKLE_INT).i, 7);
    strata_pickle_free(pk);

    /* a call strata does not interpret (a DCP Metadata) is OTHER, named */
    buf = tu_read_file(at("fuzz/corpus/fuzz_dcp/seed-valid-single"), &len);
    assert_ok(strata_pickle_parse(&pk, buf, len, ".metadata"));
    x = kind_of(strata_pickle_root(pk), STRATA_PICKLE_OTHER);
    assert_string_equal(x.name, "Metadata");
    assert_non_null(strstr(x.why, "torch.distributed.checkpoint.metadata.Metadata"));
    strata_pickle_free(pk);
    free(buf);

    /* refusals, each naming the input */
    static const struct {
        const char *seed;
        int archive, rc;
        const char *words;
    } bad[] = {
        {"seed-reject-planted-global-eformat", 1, STRATA_EFORMAT, "io.open"},
        {"seed-pkl-reject-planted-global-eformat", 0, STRATA_EFORMAT, "io.open"},
        {"seed-reject-legacy-eformat", 1, STRATA_EFORMAT, "in.pt"},
        {"seed-reject-compressed-enotsup", 1, STRATA_ENOTSUP, "compressed"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, FUZZ "%s", bad[i].seed);
        buf = tu_read_file(at(path), &len);
        pk = (strata_pickle *)1;
        assert_rc(bad[i].archive ? strata_pickle_open_archive(&pk, buf, len, "in.pt")
                                 : strata_pickle_parse(&pk, buf, len, "in.pt"),
                  bad[i].rc);
        assert_null(pk);
        assert_msg_has(bad[i].words);
        assert_msg_has("in.pt");
        free(buf);
    }
}

int main(void)
{
    const char *r = getenv("STRATA_SRC_ROOT");
    snprintf(root, sizeof root, "%s", r ? r : ".");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_views_and_shared_storages),
        cmocka_unit_test(test_verify_finds_a_flipped_byte),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_loads_check_the_crc),
        cmocka_unit_test(test_export_checks_the_crc),
        cmocka_unit_test(test_ranks_all_fail),
        cmocka_unit_test(test_pickle_api),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
