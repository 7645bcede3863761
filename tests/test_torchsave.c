/* test_torchsave.c - the torch.save source (src/engine/src_torchsave.c) through the public
 * API, on files written by torch.save (torch 2.13; the seeds of fuzz/corpus/fuzz_torchsave,
 * made by tests/python/test_torchsave.py's writer: see FUZZ below), so that it also runs
 * under ASan, UBSan and TSan: open, the tensors and their bytes, the blob, verify (the zip
 * CRC-32s), and each refusal's code. Runs from the repository root (or $STRATA_SRC_ROOT).
 *
 * seed-valid-dtypes: {name: torch.arange(4).to(dtype)} for the 12 dtypes;
 * seed-valid-views: {"m": {"base": b, "rows": b[1:3], "row": b[2], "s": b[4, 1], "e":
 * b[2:2]}, "tied": [b, b], "p": Parameter(ones(2, 2))} with b a 5x3 float32 tensor. */
#include "testutil.h"

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

int main(void)
{
    const char *r = getenv("STRATA_SRC_ROOT");
    snprintf(root, sizeof root, "%s", r ? r : ".");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_views_and_shared_storages),
        cmocka_unit_test(test_verify_finds_a_flipped_byte),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
