/* test_zero.c - the DeepSpeed ZeRO source (src/source/zero_src.c) through the public API, on
 * the files DeepSpeed 0.19.8's default engine wrote (ZeRO-2, 2 ranks: the seed
 * fuzz/corpus/fuzz_zero/seed-valid-z2-zip, made by fuzz/make_zero_seeds.py), so that it also
 * runs under ASan, UBSan and TSan: the save_dir through `latest` and the tag directory, the
 * tensors assembled from their flat pieces (checked against the pieces' bytes read from the
 * files directly), verify, and the source's refusals (a rank's file missing, a second
 * model-parallel rank, `latest` naming nothing). The values against DeepSpeed's zero_to_fp32
 * are tests/python/test_zero_source.py's. Runs from the repository root (or $STRATA_SRC_ROOT). */
#include "testutil.h"

#define SEED "fuzz/corpus/fuzz_zero/seed-valid-z2-zip"
#define TAG "step3"

static char root[2048];
static char dir[1024];
TU_TMPDIR_GROUP(dir, "zero")

static const char *const names[] = {"mp_rank_00_model_states.pt",
                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                    "zero_pp_rank_1_mp_rank_00_optim_states.pt"};

static void write_file(const char *path, const unsigned char *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    fclose(f);
}

/* save_dir sub of dir: latest and the tag's three files, from the seed. */
static void unpack(char *save, size_t cap, const char *sub)
{
    char p[4096], seed[4096];
    snprintf(save, cap, "%s/%s", dir, sub);
    snprintf(p, sizeof p, "%s/" TAG, save);
    assert_int_equal(mkdir(save, 0755), 0);
    assert_int_equal(mkdir(p, 0755), 0);
    snprintf(seed, sizeof seed, "%s/" SEED, root);
    size_t n;
    unsigned char *b = tu_read_file(seed, &n);
    assert_true(n > 3 && b[0] == 'Z' && b[1] == 1 && b[2] == 1); /* stage 2, 2 ranks */
    size_t at = 3;
    for (size_t i = 0; i < 3; i++) {
        assert_true(n - at >= 4);
        uint32_t len = (uint32_t)b[at] | (uint32_t)b[at + 1] << 8 | (uint32_t)b[at + 2] << 16 |
                       (uint32_t)b[at + 3] << 24;
        at += 4;
        assert_true(len <= n - at);
        snprintf(p, sizeof p, "%s/" TAG "/%s", save, names[i]);
        write_file(p, b + at, len);
        at += len;
    }
    free(b);
    snprintf(p, sizeof p, "%s/latest", save);
    write_file(p, (const unsigned char *)TAG "\n", strlen(TAG) + 1);
}

/* Loads tensor i of ck (f32, whole) from path and checks each element against the bytes of
 * the piece holding it, read from the tag's file directly; returns the pieces. */
static size_t check_tensor(const char *path, const char *tagdir, const strata_ckpt *ck,
                           const char *name)
{
    strata_tensor_info t;
    int i = tu_find_tensor(ck, name, &t);
    assert_true(i >= 0);
    assert_int_equal(t.dtype, STRATA_F32);
    uint64_t numel = 1;
    for (int d = 0; d < t.ndim; d++)
        numel *= t.shape[d];
    float *got = malloc(numel * 4), *want = malloc(numel * 4);
    memset(got, 0xAB, numel * 4);
    strata_state *st;
    assert_ok(strata_state_new(&st));
    strata_shard sh = {name, STRATA_F32, t.ndim, t.shape, NULL, NULL, 0, 0, 0, got, 0, 0};
    assert_ok(strata_state_add_shard(st, &sh));
    const char *uris[] = {path};
    assert_ok(strata_load(NULL, NULL, uris, 1, &st, 1, NULL));
    strata_state_free(st);
    uint64_t covered = 0;
    for (size_t k = 0; k < t.nshards; k++) {
        strata_shard_info s;
        strata_ckpt_shard(&s, ck, (size_t)i, k);
        uint64_t fs = s.flat ? s.flat_start : 0, fe = s.flat ? s.flat_end : numel;
        assert_int_equal(s.bytes, (fe - fs) * 4);
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", tagdir, s.file);
        FILE *f = fopen(p, "rb");
        assert_non_null(f);
        assert_int_equal(fseek(f, (long)s.file_offset, SEEK_SET), 0);
        assert_int_equal(fread(want + fs, 4, fe - fs, f), fe - fs);
        fclose(f);
        covered += fe - fs;
    }
    assert_int_equal(covered, numel);
    assert_memory_equal(got, want, numel * 4);
    free(got);
    free(want);
    return t.nshards;
}

static void test_open_and_load(void **state)
{
    (void)state;
    char save[2048], tagdir[4096];
    unpack(save, sizeof save, "ok");
    snprintf(tagdir, sizeof tagdir, "%s/" TAG, save);
    for (int w = 0; w < 2; w++) {
        const char *path = w ? tagdir : save;
        strata_ckpt *ck;
        assert_ok(strata_ckpt_open(&ck, path, 0));
        assert_int_equal(strata_ckpt_format(ck), STRATA_FORMAT_DEEPSPEED);
        assert_string_equal(strata_ckpt_format_name(ck), "deepspeed");
        assert_true(strata_ckpt_committed(ck));
        assert_int_equal(strata_ckpt_step(ck), 3);
        assert_int_equal(strata_ckpt_nblobs(ck), 0);
        assert_int_equal(strata_ckpt_nfiles(ck), 3);
        assert_int_equal(strata_ckpt_ntensors(ck), 46); /* 16 weights + 2 x 15 moments */
        /* the partition boundary of group 0 falls inside out_proj.weight: two pieces */
        assert_int_equal(check_tensor(path, tagdir, ck, "layer.self_attn.out_proj.weight"), 2);
        assert_int_equal(check_tensor(path, tagdir, ck,
                                      "optim.state.layer.self_attn.out_proj.weight.exp_avg"), 2);
        assert_int_equal(check_tensor(path, tagdir, ck, "head.weight"), 1); /* emb.weight's */
        assert_int_equal(check_tensor(path, tagdir, ck, "frozen.bias"), 1);
        assert_int_equal(check_tensor(path, tagdir, ck, "scale"), 1);
        assert_ok(strata_ckpt_verify(ck, NULL, NULL));
        strata_ckpt_free(ck);
    }
}

static void refused(const char *path, int code, const char *words)
{
    strata_ckpt *ck = NULL;
    assert_rc(strata_ckpt_open(&ck, path, 0), code);
    assert_null(ck);
    assert_msg_has(words);
}

static void test_refusals(void **state)
{
    (void)state;
    char save[2048], p[4096], q[4096];
    unpack(save, sizeof save, "missing");
    snprintf(p, sizeof p, "%s/" TAG "/%s", save, names[2]);
    assert_int_equal(unlink(p), 0);
    refused(save, STRATA_ENOENT, "'zero_pp_rank_1_mp_rank_00_optim_states.pt' is missing "
            "(partition_count in 'zero_pp_rank_0_mp_rank_00_optim_states.pt' says 2");

    unpack(save, sizeof save, "mp");
    snprintf(p, sizeof p, "%s/" TAG "/%s", save, names[0]);
    snprintf(q, sizeof q, "%s/" TAG "/mp_rank_01_model_states.pt", save);
    assert_int_equal(link(p, q), 0);
    refused(save, STRATA_ENOTSUP, "second model-parallel rank ('mp_rank_01_model_states.pt')");

    unpack(save, sizeof save, "extra");
    snprintf(p, sizeof p, "%s/" TAG "/%s", save, names[2]);
    snprintf(q, sizeof q, "%s/" TAG "/zero_pp_rank_2_mp_rank_00_optim_states.pt", save);
    assert_int_equal(link(p, q), 0);
    refused(save, STRATA_EFORMAT, "'zero_pp_rank_2_mp_rank_00_optim_states.pt' is there, "
            "but partition_count");

    unpack(save, sizeof save, "trunc");
    snprintf(p, sizeof p, "%s/" TAG "/%s", save, names[1]);
    assert_int_equal(truncate(p, 1000), 0);
    refused(save, STRATA_EFORMAT, "zero_pp_rank_0_mp_rank_00_optim_states.pt");
}

int main(void)
{
    const char *r = getenv("STRATA_SRC_ROOT");
    snprintf(root, sizeof root, "%s", r ? r : ".");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_and_load),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
