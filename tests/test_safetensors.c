/* test_safetensors.c - the safetensors header parser (src/source/safetensors.c): a valid
 * header parses with the right fields; every hostile case is STRATA_EFORMAT with a message
 * naming the file and the problem. */
#include "testutil.h"

#include "meta/meta.h"
#include "source/safetensors.h"

#define FILE_NAME "model-00001-of-00002.safetensors"

/* A file: 8-byte length of json, json, then data_len bytes (zeros). *len gets its size. */
static unsigned char *mkfile(const char *json, uint64_t data_len, size_t *len)
{
    size_t n = strlen(json);
    *len = 8 + n + data_len;
    unsigned char *b = calloc(1, *len);
    assert_non_null(b);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(b + 8, json, n);
    return b;
}

static int parse(st_st_index *ix, const char *json, uint64_t data_len)
{
    size_t len;
    unsigned char *b = mkfile(json, data_len, &len);
    int rc = st_st_parse(ix, b, len, len, FILE_NAME);
    free(b);
    return rc;
}

/* json (with data_len bytes of data) must be refused, the message naming the file and
 * holding `why`. */
static void refuse(const char *json, uint64_t data_len, const char *why)
{
    st_st_index ix;
    int rc = parse(&ix, json, data_len);
    if (rc != STRATA_EFORMAT)
        fail_msg("%s: got %s (%s), want STRATA_EFORMAT", json, strata_error_name(rc),
                 rc ? strata_error_last() : "accepted");
    assert_msg_has(FILE_NAME);
    assert_msg_has(why);
    assert_int_equal(ix.ntensors, 0);
    assert_null(ix.tensors);
    st_st_free(&ix);
}

static const st_st_tensor *find(const st_st_index *ix, const char *name)
{
    for (size_t i = 0; i < ix->ntensors; i++)
        if (strcmp(ix->tensors[i].name, name) == 0)
            return &ix->tensors[i];
    fail_msg("tensor %s not found", name);
    return NULL;
}

static void test_valid(void **state)
{
    (void)state;
    const char *json =
        "{\"__metadata__\": {\"format\": \"pt\", \"note\": \"caf\\u00e9 \\ud83d\\ude00\"},\n"
        " \"layer.0.w\": {\"dtype\": \"BF16\", \"shape\": [2, 3], \"data_offsets\": [16, 28]},\n"
        " \"step\": {\"dtype\": \"I64\", \"shape\": [], \"data_offsets\": [0, 8]},\n"
        " \"empty\": {\"dtype\": \"F32\", \"shape\": [0, 4], \"data_offsets\": [8, 8]},\n"
        " \"mask\": {\"dtype\": \"BOOL\", \"shape\": [4], \"data_offsets\": [8, 12],"
        " \"extra\": {\"a\": [1, -2.5e3, true, false, null]}},\n"
        " \"q\": {\"data_offsets\": [12, 16], \"shape\": [1, 1, 1, 1, 1, 1, 1, 4],"
        " \"dtype\": \"F8_E4M3\"},\n"
        " \"\\u00e9\\t\": {\"dtype\": \"F64\", \"shape\": [1], \"data_offsets\": [28, 36]}}"
        "        ";
    st_st_index ix;
    size_t len;
    unsigned char *b = mkfile(json, 36, &len);
    uint64_t n;
    assert_ok(st_st_header_len(b, len, &n));
    assert_int_equal(n, strlen(json));
    assert_ok(st_st_parse(&ix, b, len, len, FILE_NAME));
    free(b);
    uint64_t d = 8 + n;
    assert_int_equal(ix.header_len, n);
    assert_int_equal(ix.data_begin, d);
    assert_int_equal(ix.file_size, len);
    assert_int_equal(ix.ntensors, 6);
    /* sorted by offset; the empty tensor (8, 8) before mask (8, 12) */
    const char *order[] = {"step", "empty", "mask", "q", "layer.0.w", "\xc3\xa9\t"};
    for (int i = 0; i < 6; i++)
        assert_string_equal(ix.tensors[i].name, order[i]);
    const st_st_tensor *t = find(&ix, "layer.0.w");
    assert_int_equal(t->dtype, STRATA_BF16);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    assert_int_equal(t->begin, d + 16);
    assert_int_equal(t->end, d + 28);
    t = find(&ix, "step");
    assert_int_equal(t->dtype, STRATA_I64);
    assert_int_equal(t->ndim, 0);
    assert_int_equal(t->begin, d);
    assert_int_equal(t->end, d + 8);
    t = find(&ix, "empty");
    assert_int_equal(t->dtype, STRATA_F32);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 0);
    assert_int_equal(t->begin, t->end);
    t = find(&ix, "mask");
    assert_int_equal(t->dtype, STRATA_BOOL);
    t = find(&ix, "q");
    assert_int_equal(t->dtype, STRATA_FP8_E4M3);
    assert_int_equal(t->ndim, 8);
    assert_int_equal(t->shape[7], 4);
    t = find(&ix, "\xc3\xa9\t");
    assert_int_equal(t->dtype, STRATA_F64);
    assert_int_equal(t->end, len);
    assert_int_equal(ix.nmeta, 2);
    assert_string_equal(ix.meta[0].key, "format");
    assert_string_equal(ix.meta[0].value, "pt");
    assert_string_equal(ix.meta[1].key, "note");
    assert_string_equal(ix.meta[1].value, "caf\xc3\xa9 \xf0\x9f\x98\x80");
    st_st_free(&ix);
    st_st_free(&ix); /* harmless twice */

    /* every dtype, by name and size */
    static const char *names[] = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2",
                                  "I64", "I32", "I16", "I8",   "U8",      "BOOL"};
    for (int i = 0; i < 12; i++) {
        strata_dtype dt;
        assert_ok(st_st_dtype_parse(&dt, names[i], strlen(names[i])));
        assert_string_equal(st_st_dtype_name(dt), names[i]);
        char js[256];
        size_t sz = strata_dtype_size(dt);
        snprintf(js, sizeof js, "{\"t\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[0,%zu]}}",
                 names[i], 3 * sz);
        assert_ok(parse(&ix, js, 3 * sz));
        assert_int_equal(ix.tensors[0].dtype, dt);
        st_st_free(&ix);
    }
    /* no tensors, no data */
    assert_ok(parse(&ix, "{}", 0));
    assert_int_equal(ix.ntensors, 0);
    st_st_free(&ix);
    assert_ok(parse(&ix, " { \"__metadata__\" : { } } ", 0));
    st_st_free(&ix);
}

#define T1(dt, shape, off) "{\"a\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":" off "}}"
#define A4 "\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}"

static void test_header_length(void **state)
{
    (void)state;
    unsigned char b[16] = {0};
    uint64_t n;
    /* over 100 MB: refused from the first 8 bytes, whatever the file size */
    uint64_t big = ST_ST_MAX_HEADER + 1;
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(big >> (8 * i));
    assert_rc(st_st_header_len(b, UINT64_MAX, &n), STRATA_EFORMAT);
    assert_msg_has("over the limit");
    st_st_index ix;
    assert_rc(st_st_parse(&ix, b, sizeof b, 1ull << 40, FILE_NAME), STRATA_EFORMAT);
    assert_msg_has(FILE_NAME);
    assert_msg_has("over the limit");
    /* past the file */
    memset(b, 0, 8);
    b[0] = 9;
    assert_rc(st_st_header_len(b, 16, &n), STRATA_EFORMAT);
    assert_msg_has("past the end of the file");
    assert_rc(st_st_parse(&ix, b, sizeof b, sizeof b, FILE_NAME), STRATA_EFORMAT);
    assert_msg_has(FILE_NAME);
    assert_msg_has("past the end of the file");
    b[0] = 8;
    assert_ok(st_st_header_len(b, 16, &n));
    assert_int_equal(n, 8);
    /* shorter than 8 bytes */
    assert_rc(st_st_parse(&ix, b, 5, 5, FILE_NAME), STRATA_EFORMAT);
    assert_msg_has(FILE_NAME);
    assert_msg_has("shorter than");
    /* the caller passed too few bytes of a file that has them: its bug, not the file's */
    b[0] = 2;
    memcpy(b + 8, "{}", 2);
    assert_rc(st_st_parse(&ix, b, 9, 10, FILE_NAME), STRATA_EINVAL);
    assert_ok(st_st_parse(&ix, b, 10, 10, FILE_NAME));
    st_st_free(&ix);
}

static void test_bad_json(void **state)
{
    (void)state;
    refuse("", 0, "ends early");
    refuse("[]", 0, "expected '{'");
    refuse("{", 0, "ends early");
    refuse("{\"a\"}", 0, "expected ':'");
    refuse("{" A4 ",}", 4, "expected a string");
    refuse("{" A4 "} x", 4, "bytes after");
    refuse("{" A4 "}{}", 4, "bytes after");
    refuse("{'a':1}", 0, "expected a string");
    refuse("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]", 4, "ends early");
    refuse("{\"a\x01\":{}}", 0, "control character");
    refuse("{\"a\xff\":{}}", 0, "invalid UTF-8");
    refuse("{\"a\xc0\xaf\":{}}", 0, "invalid UTF-8");             /* overlong '/' */
    refuse("{\"a\xed\xa0\x80\":{}}", 0, "invalid UTF-8");         /* encoded surrogate */
    refuse("{\"a\xf4\x90\x80\x80\":{}}", 0, "invalid UTF-8");     /* above U+10FFFF */
    refuse("{\"a\xe2\x82\":{}}", 0, "invalid UTF-8");             /* truncated */
    refuse("{\"a\\x\":{}}", 0, "bad escape");
    refuse("{\"a\\u12G4\":{}}", 0, "bad \\u escape");
    refuse("{\"a\\u12", 0, "bad \\u escape");
    refuse("{\"\\ud800\":{}}", 0, "not followed by a low one");
    refuse("{\"\\ud800\\u0041\":{}}", 0, "not followed by a low one");
    refuse("{\"\\udc00\":{}}", 0, "lone low surrogate");
    refuse("{\"unterminated", 0, "unterminated string");
    refuse("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4],\"x\":tru}}", 4,
           "expected a JSON value");
    refuse("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4],\"x\":1.}}", 4,
           "bad number");
    refuse("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4],\"x\":[1,]}}", 4,
           "expected a JSON value");
    /* nesting bound: 200 levels in a skipped field */
    char deep[600];
    int k = snprintf(deep, sizeof deep, "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],"
                                        "\"data_offsets\":[0,4],\"x\":");
    for (int i = 0; i < 200; i++)
        deep[k++] = '[';
    deep[k] = 0;
    refuse(deep, 4, "nested deeper than");
    /* numbers where safetensors reads them */
    refuse(T1("U8", "[-1]", "[0,1]"), 1, "negative number");
    refuse(T1("U8", "[1]", "[0,-1]"), 1, "negative number");
    refuse(T1("U8", "[1.0]", "[0,1]"), 1, "non-integer");
    refuse(T1("U8", "[1e0]", "[0,1]"), 1, "non-integer");
    refuse(T1("U8", "[01]", "[0,1]"), 1, "leading zero");
    refuse(T1("U8", "[18446744073709551616]", "[0,1]"), 1, "too large");
    refuse(T1("U8", "[\"1\"]", "[0,1]"), 1, "expected a number");
    refuse(T1("U8", "1", "[0,1]"), 1, "expected '['");
    refuse("{\"__metadata__\":{\"k\":1}}", 0, "not a string");
    refuse("{\"__metadata__\":{\"k\":\"v\",\"k\":\"w\"}}", 0, "twice");
    refuse("{\"__metadata__\":{},\"__metadata__\":{}}", 0, "twice");
}

static void test_bad_tensors(void **state)
{
    (void)state;
    refuse(T1("F128", "[1]", "[0,16]"), 16, "unknown dtype 'F128'");
    refuse(T1("f32", "[1]", "[0,4]"), 4, "unknown dtype");
    refuse(T1("U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]"), 1, "more than 8 entries");
    refuse(T1("U8", "[1]", "[0]"), 1, "not 2");
    refuse(T1("U8", "[1]", "[0,1,2]"), 1, "more than 2 entries");
    refuse("{\"a\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "has no dtype");
    refuse("{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1, "has no shape");
    refuse("{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, "has no data_offsets");
    refuse("{\"a\":{}}", 0, "has no dtype");
    refuse("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
           "dtype given twice");
    refuse("{\"a\":[]}", 0, "expected '{'");
    refuse("{\"\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "empty name");
    refuse("{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "NUL");
    /* element count x size overflows */
    refuse(T1("F64", "[4294967296,4294967296]", "[0,0]"), 0, "element count");
    refuse(T1("F64", "[4611686018427387904]", "[0,0]"), 0, "byte size");
    refuse(T1("U8", "[4294967296,4294967296,4294967296]", "[0,0]"), 0, "overflows");
    /* sizes disagree with offsets */
    refuse(T1("F32", "[2]", "[0,4]"), 4, "need 8");
    refuse(T1("U8", "[0]", "[0,1]"), 1, "need 0");
    /* offsets */
    refuse(T1("U8", "[4]", "[0,4]"), 3, "past the end of the data");
    refuse(T1("U8", "[4]", "[0,18446744073709551615]"), 4, "past the end of the data");
    refuse(T1("U8", "[0]", "[4,0]"), 4, "is after end");
    refuse("{" A4 ",\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}", 6, "overlap");
    refuse("{" A4 ",\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4, "overlap");
    refuse("{" A4 ",\"b\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[2,2]}}", 4, "overlap");
    refuse("{" A4 ",\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[6,10]}}", 10,
           "gap: bytes [4, 6)");
    refuse("{\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}", 6, "gap: bytes [0, 2)");
    refuse("{" A4 "}", 5, "at the end");
    refuse("{}", 1, "at the end");
    /* duplicate names, also when spelled differently */
    refuse("{" A4 ",\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}", 8,
           "names tensor 'a' twice");
    refuse("{" A4 ",\"\\u0061\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}", 8,
           "twice");
    /* name length */
    char *js = malloc(STRATA_MAX_NAME + 128);
    assert_non_null(js);
    memset(js, 'n', STRATA_MAX_NAME + 128);
    js[0] = '{', js[1] = '"';
    strcpy(js + 2 + STRATA_MAX_NAME + 1, "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}");
    refuse(js, 1, "longer than");
    strcpy(js + 2 + STRATA_MAX_NAME, "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}");
    st_st_index ix;
    assert_ok(parse(&ix, js, 1));
    st_st_free(&ix);
    free(js);
}

/* Many tensors: linear-ish time, and the result tiles (a shuffled order in the header). */
static void test_many(void **state)
{
    (void)state;
    size_t nt = 20000;
    size_t cap = nt * 96 + 16, k = 0;
    char *js = malloc(cap);
    assert_non_null(js);
    tu_rng r = {7};
    size_t *perm = malloc(nt * sizeof *perm);
    assert_non_null(perm);
    for (size_t i = 0; i < nt; i++)
        perm[i] = i;
    for (size_t i = nt - 1; i > 0; i--) {
        size_t j = tu_below(&r, i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    js[k++] = '{';
    for (size_t i = 0; i < nt; i++) {
        size_t p = perm[i]; /* tensor p: 2 x I16 at [4p, 4p + 4) */
        k += (size_t)snprintf(js + k, cap - k,
                              "%s\"t%zu\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[%zu,%zu]}",
                              i ? "," : "", p, 4 * p, 4 * p + 4);
    }
    js[k++] = '}';
    js[k] = 0;
    st_st_index ix;
    double t0 = st_now();
    assert_ok(parse(&ix, js, 4 * nt));
    double dt = st_now() - t0;
    assert_int_equal(ix.ntensors, nt);
    for (size_t i = 0; i < nt; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%zu", i);
        assert_string_equal(ix.tensors[i].name, name);
        assert_int_equal(ix.tensors[i].begin, ix.data_begin + 4 * i);
    }
    st_st_free(&ix);
    print_message("parsed %zu tensors (%zu bytes of JSON) in %.3f s\n", nt, k, dt);
    free(js);
    free(perm);
}


/* A foreign index (the metadata a source builds from another format's headers) travels to
 * the other ranks as st_meta_encode with the ST_META_FOREIGN flag: it decodes to the same
 * metadata, only through st_meta_decode_foreign, and a flipped byte is refused. */
static void test_foreign_index(void **state)
{
    (void)state;
    const char *json = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                       "\"b\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[24,32]}}";
    size_t len;
    unsigned char *f = mkfile(json, 32, &len);
    st_buf src = {0};
    st_st_src_begin(&src, 1);
    st_st_src_put(&src, FILE_NAME, len, &(st_mident){11, 22, 33}, f, len - 32);
    st_meta *m = NULL, *back = NULL, *bad = NULL;
    assert_int_equal(st_st_meta(&m, src.p, src.n, NULL, "dir"), 0);
    assert_int_equal(m->foreign, 1);
    unsigned char *enc;
    size_t n;
    assert_int_equal(st_meta_encode(m, &enc, &n), 0);
    if (st_meta_decode_foreign(&back, enc, n))
        fail_msg("%s", strata_error_last());
    assert_int_equal(back->foreign, 1);
    assert_int_equal(back->chunk, 1);
    assert_int_equal(back->nfiles, 1);
    assert_string_equal(back->files[0].name, FILE_NAME);
    assert_int_equal(back->files[0].bytes, len);
    assert_non_null(back->idents);
    assert_int_equal(back->idents[0].ino, 11);
    assert_int_equal(back->idents[0].mtime_ns, 22);
    assert_int_equal(back->idents[0].ctime_ns, 33);
    assert_int_equal(back->ntensors, 2);
    for (size_t i = 0; i < 2; i++) {
        const st_mtensor *a = &m->tensors[i], *b = &back->tensors[i];
        assert_string_equal(a->name, b->name);
        assert_int_equal(a->dtype, b->dtype);
        assert_int_equal(a->ndim, b->ndim);
        assert_int_equal(b->nshards, 1);
        assert_int_equal(a->shards[0].ext.offset, b->shards[0].ext.offset);
        assert_int_equal(a->shards[0].ext.bytes, b->shards[0].ext.bytes);
        assert_null(b->shards[0].ext.sums);
    }
    /* an odd byte offset (not a multiple of 4096) survives: it is the point of the form */
    assert_int_equal(back->tensors[1].shards[0].ext.offset, len - 32 + 24);
    /* never read as a metadata.bin */
    assert_int_equal(st_meta_decode(&bad, enc, n), STRATA_EFORMAT);
    assert_msg_has("another format");
    assert_null(bad);
    enc[n / 2] ^= 1;
    assert_int_equal(st_meta_decode_foreign(&bad, enc, n), STRATA_EFORMAT);
    assert_null(bad);
    free(enc);
    /* strata's own metadata is not a foreign index */
    back->foreign = 0;
    back->chunk = 4096;
    st_meta_free(back);
    free(src.p);
    free(f);
    st_meta_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),        cmocka_unit_test(test_header_length),
        cmocka_unit_test(test_bad_json),     cmocka_unit_test(test_bad_tensors),
        cmocka_unit_test(test_many),         cmocka_unit_test(test_foreign_index),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
