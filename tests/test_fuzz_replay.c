/* test_fuzz_replay.c - replays every file of fuzz/corpus/<target>/ through the libFuzzer
 * targets of fuzz/ (the same code, with the entry point renamed), so the seeds, the
 * coverage the fuzzers found and the reproducers of fixed crashes run in every test build:
 * make test, test-asan, test-tsan, test-valgrind. A target abort()s (or a sanitizer
 * reports) on any violation; the name of the input being replayed is printed then.
 * Files named repro-reject-* must also be refused: by the metadata decoder (fuzz_meta),
 * by URI resolution (fuzz_uri) or by the safetensors header parser (fuzz_safetensors, as a
 * whole file); they reproduce bugs where bad input was accepted. For fuzz_safetensors the
 * seeds say what they are too: seed-reject-* must be refused (STRATA_EFORMAT, naming the
 * file), seed-valid-* accepted; seed-index-reject-* and seed-index-valid-* the same, as an
 * index of a sharded set. For fuzz_pickle and fuzz_zip too: seed-valid-* must be parsed
 * (a pickle) or opened with every entry read (a zip), seed-reject-* refused with
 * STRATA_EFORMAT naming the input; for fuzz_dcp (a DCP .metadata) the same, a refusal being
 * STRATA_EFORMAT or STRATA_ENOTSUP; for fuzz_megatron (a metadata.json) the same. For
 * fuzz_torchsave, seed-valid-* (torch.save files written by torch) must open, seed-reject-*
 * be refused with the code its name ends in (-eformat, -enotsup) naming the input;
 * seed-pkl-valid-* / seed-pkl-reject-* the same for a data.pkl alone (its tensors found).
 * For fuzz_zero (a DeepSpeed ZeRO tag's files, fuzz/make_zero_seeds.py): seed-valid-* must
 * be read into metadata, seed-reject-<code>-* refused with that code naming the input.
 * For fuzz_planfile (a stored save plan, plan.bin): seed-valid-* must decode, seed-reject-*
 * and repro-reject-* be refused with STRATA_EFORMAT.
 * Runs from the repository root (or $STRATA_SRC_ROOT). A corpus directory that is missing
 * or empty is a failure. */
#include <dirent.h>
#include <signal.h>

#include "testutil.h"

#define LLVMFuzzerTestOneInput fuzz_meta_one
#include "../fuzz/fuzz_meta.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_commit_one
#include "../fuzz/fuzz_commit.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_uri_one
#include "../fuzz/fuzz_uri.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_planfile_one
#include "../fuzz/fuzz_planfile.c"
#undef LLVMFuzzerTestOneInput
#undef FP_FAIL /* fuzz_peer.c has its own */
#define LLVMFuzzerTestOneInput fuzz_layout_one
#include "../fuzz/fuzz_layout.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_safetensors_one
#include "../fuzz/fuzz_safetensors.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_pickle_one
#include "../fuzz/fuzz_pickle.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_zip_one
#include "../fuzz/fuzz_zip.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_dcp_one
#include "../fuzz/fuzz_dcp.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_megatron_one
#include "../fuzz/fuzz_megatron.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_torchsave_one
#include "../fuzz/fuzz_torchsave.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_zero_one
#include "../fuzz/fuzz_zero.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_peer_one
#include "../fuzz/fuzz_peer.c"
#undef LLVMFuzzerTestOneInput
#include "../src/cli/synth.c" /* layout_parse: the CLI is not in libstrata.a */

typedef int (*target_fn)(const uint8_t *data, size_t size);

static char current[4096]; /* the input being replayed, for crash reports */

static void say_current(void)
{
    if (current[0]) {
        static const char pre[] = "\ntest_fuzz_replay: crashed while replaying ";
        ssize_t w = write(2, pre, sizeof pre - 1);
        w = write(2, current, strlen(current));
        w = write(2, "\n", 1);
        (void)w;
    }
}

static void on_abort(int sig)
{
    say_current();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Called by AddressSanitizer before it reports an error (test-asan). */
void __asan_on_error(void);
void __asan_on_error(void) { say_current(); }

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Replays every regular file of fuzz/corpus/<target>/ in name order through fn; returns
 * the count. check (may be NULL) is called after each file with its name and bytes. */
static size_t replay(const char *target, target_fn fn,
                     void (*check)(const char *name, const unsigned char *b, size_t n))
{
    const char *root = getenv("STRATA_SRC_ROOT");
    char dir[2048];
    snprintf(dir, sizeof dir, "%s/fuzz/corpus/%s", root && *root ? root : ".", target);
    DIR *d = opendir(dir);
    if (!d)
        fail_msg("corpus directory %s: %s (run the tests from the repository root)", dir,
                 strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            names = realloc(names, cap * sizeof *names);
            assert_non_null(names);
        }
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    if (n == 0)
        fail_msg("corpus directory %s is empty", dir);
    qsort(names, n, sizeof *names, cmp_names);
    for (size_t i = 0; i < n; i++) {
        snprintf(current, sizeof current, "%s/%s", dir, names[i]);
        size_t len;
        unsigned char *raw = tu_read_file(current, &len);
        /* an exact-size copy, so ASan sees any read past the end */
        unsigned char *b = malloc(len ? len : 1);
        assert_non_null(b);
        memcpy(b, raw, len);
        free(raw);
        fn(b, len);
        if (check)
            check(names[i], b, len);
        free(b);
        free(names[i]);
    }
    current[0] = 0;
    free(names);
    print_message("replayed %zu inputs of %s\n", n, dir);
    return n;
}

static void meta_rejects(const char *name, const unsigned char *b, size_t n)
{
    if (strncmp(name, "repro-reject-", 13) != 0)
        return;
    st_meta *m = NULL;
    int rc = st_meta_decode_unchecked(&m, b, n);
    if (rc == 0) {
        st_meta_free(m);
        fail_msg("%s: metadata the decoder must refuse was accepted", name);
    }
    assert_int_equal(rc, STRATA_EFORMAT);
}

/* plan.bin: seed-valid-* decode whole, seed-reject-* and repro-reject-* are refused. */
static void planfile_verdict(const char *name, const unsigned char *b, size_t n)
{
    int reject = strncmp(name, "repro-reject-", 13) == 0 || strncmp(name, "seed-reject-", 12) == 0;
    if (!reject && strncmp(name, "seed-valid-", 11) != 0)
        return;
    st_phead h;
    st_ppart *parts = NULL;
    int rc = st_planfile_decode(&h, &parts, b, n);
    if (rc == 0)
        st_planfile_free(parts, h.ranks);
    if (!reject && rc != 0)
        fail_msg("%s: a valid stored plan was refused: %s", name, strata_error_last());
    if (reject && rc != STRATA_EFORMAT)
        fail_msg("%s: a stored plan that must be refused got %s", name, strata_error_name(rc));
}

static void uri_rejects(const char *name, const unsigned char *b, size_t n)
{
    if (strncmp(name, "repro-reject-", 13) != 0)
        return;
    char uri[4096], path[4096];
    assert_true(n < sizeof uri);
    memcpy(uri, b, n);
    uri[n] = 0;
    const st_vfs *v = NULL;
    int rc = st_vfs_resolve(uri, &v, path, sizeof path);
    if (rc == 0) {
        st_vfs_release(v);
        fail_msg("%s: URI '%s' that must be refused was accepted", name, uri);
    }
    assert_int_equal(rc, STRATA_EINVAL);
}

static void safetensors_verdict(const char *name, const unsigned char *b, size_t n)
{
    if (strncmp(name, "seed-index-", 11) == 0) { /* an index of a sharded set */
        st_st_map m;
        int rc = st_st_parse_index(&m, b, n, name);
        st_st_map_free(&m);
        if (strncmp(name, "seed-index-valid-", 17) == 0 && rc != 0)
            fail_msg("%s: a valid index was refused: %s", name, strata_error_last());
        if (strncmp(name, "seed-index-reject-", 18) == 0) {
            if (rc == 0)
                fail_msg("%s: an index the parser must refuse was accepted", name);
            assert_int_equal(rc, STRATA_EFORMAT);
            assert_msg_has(name);
        }
        return;
    }
    int reject = strncmp(name, "repro-reject-", 13) == 0 || strncmp(name, "seed-reject-", 12) == 0;
    int valid = strncmp(name, "seed-valid-", 11) == 0;
    if (!reject && !valid)
        return;
    st_st_index ix;
    int rc = st_st_parse(&ix, b, n, n, name);
    st_st_free(&ix);
    if (valid && rc != 0)
        fail_msg("%s: a valid safetensors file was refused: %s", name, strata_error_last());
    if (reject && rc == 0)
        fail_msg("%s: a safetensors file the parser must refuse was accepted", name);
    if (reject) {
        assert_int_equal(rc, STRATA_EFORMAT);
        assert_msg_has(name);
    }
}

static void pickle_verdict(const char *name, const unsigned char *b, size_t n)
{
    int valid = strncmp(name, "seed-valid-", 11) == 0;
    if (!valid && strncmp(name, "seed-reject-", 12) != 0)
        return;
    pk_doc d;
    int rc = pk_parse(&d, b, n, name);
    pk_free(&d);
    if (valid && rc != 0)
        fail_msg("%s: a valid pickle was refused: %s", name, strata_error_last());
    if (!valid) {
        if (rc == 0)
            fail_msg("%s: a pickle the reader must refuse was accepted", name);
        assert_int_equal(rc, STRATA_EFORMAT);
        assert_msg_has(name);
    }
}

static void zip_verdict(const char *name, const unsigned char *b, size_t n)
{
    int valid = strncmp(name, "seed-valid-", 11) == 0;
    if (!valid && strncmp(name, "seed-reject-", 12) != 0)
        return;
    fuzz_mem s = {b, n};
    st_zip z;
    int rc = st_zip_open(&z, n, fuzz_mem_read, &s, name);
    for (size_t i = 0; rc == 0 && i < z.n; i++) {
        unsigned char *buf = malloc(z.e[i].method == 0 && z.e[i].usize ? z.e[i].usize : 1);
        rc = st_zip_read(&z, &z.e[i], buf, fuzz_mem_read, &s, name);
        free(buf);
    }
    st_zip_free(&z);
    if (valid && rc != 0)
        fail_msg("%s: a valid archive was refused: %s", name, strata_error_last());
    if (!valid) {
        if (rc == 0)
            fail_msg("%s: an archive the reader must refuse was accepted", name);
        assert_int_equal(rc, STRATA_EFORMAT);
        assert_msg_has(name);
    }
}

/* fuzz_dcp: seed-valid-* are real .metadata files (interpreted), seed-reject-* refused with
 * STRATA_EFORMAT or STRATA_ENOTSUP naming the input. */
static void dcp_verdict(const char *name, const unsigned char *b, size_t n)
{
    int valid = strncmp(name, "seed-valid-", 11) == 0;
    if (!valid && strncmp(name, "seed-reject-", 12) != 0)
        return;
    st_dcp d;
    int rc = st_dcp_parse(&d, b, n, name);
    st_dcp_free(&d);
    if (valid && rc != 0)
        fail_msg("%s: a valid .metadata was refused: %s", name, strata_error_last());
    if (!valid) {
        if (rc == 0)
            fail_msg("%s: a .metadata the reader must refuse was accepted", name);
        if (rc != STRATA_EFORMAT && rc != STRATA_ENOTSUP)
            fail_msg("%s: refused with %s", name, strata_error_name(rc));
        assert_msg_has(name);
    }
}

static void torchsave_verdict(const char *name, const unsigned char *b, size_t n)
{
    int pkl = strncmp(name, "seed-pkl-", 9) == 0; /* a data.pkl alone */
    const char *kind = pkl ? name + 9 : strncmp(name, "seed-", 5) == 0 ? name + 5 : "";
    int valid = strncmp(kind, "valid-", 6) == 0, rc;
    if (!valid && strncmp(kind, "reject-", 7) != 0)
        return;
    if (pkl) {
        st_ts_doc d = {0};
        if (!(rc = pk_parse(&d.pk, b, n, name)))
            rc = st_ts_tensors(&d, name);
        st_ts_doc_free(&d);
    } else {
        fuzz_mem s = {b, n};
        st_ts_archive a;
        rc = st_ts_open(&a, n, fuzz_mem_read, &s, name);
        st_ts_close(&a);
    }
    if (valid && rc != 0)
        fail_msg("%s: a torch.save file was refused: %s", name, strata_error_last());
    if (!valid) {
        if (rc == 0)
            fail_msg("%s: an archive the reader must refuse was accepted", name);
        assert_int_equal(rc, strstr(name, "-enotsup") ? STRATA_ENOTSUP : STRATA_EFORMAT);
        assert_msg_has(name);
    }
}

static void test_replay_torchsave(void **state)
{
    (void)state;
    replay("fuzz_torchsave", fuzz_torchsave_one, torchsave_verdict);
}

static void zero_verdict(const char *name, const unsigned char *b, size_t n)
{
    static const struct {
        const char *tag;
        int code;
    } codes[] = {{"eformat-", STRATA_EFORMAT},     {"enotsup-", STRATA_ENOTSUP},
                 {"eunfilled-", STRATA_EUNFILLED}, {"emismatch-", STRATA_EMISMATCH}};
    int valid = strncmp(name, "seed-valid-", 11) == 0, want = 0;
    for (size_t i = 0; !valid && strncmp(name, "seed-reject-", 12) == 0 && i < 4; i++)
        if (strncmp(name + 12, codes[i].tag, strlen(codes[i].tag)) == 0)
            want = codes[i].code;
    if (!valid && !want)
        return;
    st_meta *m = NULL;
    int rc = zf_zero(b, n, name, &m);
    if (m)
        st_meta_free(m);
    if (valid && rc != 0)
        fail_msg("%s: a ZeRO checkpoint was refused: %s", name, strata_error_last());
    if (!valid) {
        if (rc != want)
            fail_msg("%s: refused with %d (%s), not %s", name, rc, strata_error_last(),
                     strata_error_name(want));
        assert_msg_has(name);
    }
}

static void test_replay_zero(void **state)
{
    (void)state;
    replay("fuzz_zero", fuzz_zero_one, zero_verdict);
}

static void test_replay_dcp(void **state)
{
    (void)state;
    replay("fuzz_dcp", fuzz_dcp_one, dcp_verdict);
}

/* fuzz_megatron: seed-valid-* are metadata.json files strata reads, seed-reject-* refused
 * with STRATA_EFORMAT or STRATA_ENOTSUP naming the input (seed-pickle-* are .metadata
 * files, fuzzed for their mcore_data). */
static void megatron_verdict(const char *name, const unsigned char *b, size_t n)
{
    int valid = strncmp(name, "seed-valid-", 11) == 0;
    if (!valid && strncmp(name, "seed-reject-", 12) != 0)
        return;
    st_mg_config c;
    int rc = st_mg_parse_config(&c, b, n, name);
    if (valid && rc != 0)
        fail_msg("%s: a valid metadata.json was refused: %s", name, strata_error_last());
    if (!valid) {
        if (rc == 0)
            fail_msg("%s: a metadata.json the reader must refuse was accepted", name);
        if (rc != STRATA_EFORMAT && rc != STRATA_ENOTSUP)
            fail_msg("%s: refused with %s", name, strata_error_name(rc));
        assert_msg_has(name);
    }
}

static void test_replay_megatron(void **state)
{
    (void)state;
    replay("fuzz_megatron", fuzz_megatron_one, megatron_verdict);
}

static void test_replay_pickle(void **state)
{
    (void)state;
    replay("fuzz_pickle", fuzz_pickle_one, pickle_verdict);
}

static void test_replay_zip(void **state)
{
    (void)state;
    replay("fuzz_zip", fuzz_zip_one, zip_verdict);
}

static void test_replay_meta(void **state)
{
    (void)state;
    replay("fuzz_meta", fuzz_meta_one, meta_rejects);
}

static void test_replay_commit(void **state)
{
    (void)state;
    replay("fuzz_commit", fuzz_commit_one, NULL);
}

/* The peer replica record: seed-valid-* (written by strata_peer_replicate and
 * strata_peer_encode) decode, seed-reject-* are refused. */
static void peer_verdict(const char *name, const unsigned char *b, size_t n)
{
    st_peer_rec r;
    int rc = st_peer_rec_decode(&r, b, n);
    if (!strncmp(name, "seed-valid-", 11) && rc)
        fail_msg("fuzz_peer/%s: refused: %s", name, strata_error_last());
    if (!strncmp(name, "seed-reject-", 12) && !rc)
        fail_msg("fuzz_peer/%s: decoded", name);
}

static void test_replay_peer(void **state)
{
    (void)state;
    replay("fuzz_peer", fuzz_peer_one, peer_verdict);
}

static void test_replay_planfile(void **state)
{
    (void)state;
    replay("fuzz_planfile", fuzz_planfile_one, planfile_verdict);
}

static void test_replay_uri(void **state)
{
    (void)state;
    replay("fuzz_uri", fuzz_uri_one, uri_rejects);
}

static void test_replay_layout(void **state)
{
    (void)state;
    replay("fuzz_layout", fuzz_layout_one, NULL);
}

static void test_replay_safetensors(void **state)
{
    (void)state;
    replay("fuzz_safetensors", fuzz_safetensors_one, safetensors_verdict);
}

int main(void)
{
    signal(SIGABRT, on_abort);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_replay_meta),
        cmocka_unit_test(test_replay_commit),
        cmocka_unit_test(test_replay_peer),
        cmocka_unit_test(test_replay_planfile),
        cmocka_unit_test(test_replay_uri),
        cmocka_unit_test(test_replay_layout),
        cmocka_unit_test(test_replay_safetensors),
        cmocka_unit_test(test_replay_pickle),
        cmocka_unit_test(test_replay_zip),
        cmocka_unit_test(test_replay_megatron),
        cmocka_unit_test(test_replay_dcp),
        cmocka_unit_test(test_replay_torchsave),
        cmocka_unit_test(test_replay_zero),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
