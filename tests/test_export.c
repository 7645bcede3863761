/* test_export.c - strata_export_safetensors from C: the files' bytes (length prefix, header
 * padded to 8, each tensor's data at its data_offsets, merged from row blocks, flat pieces
 * and replicas), the index, stats; bf16 rounding on bits; O_DIRECT and buffered writes give
 * the same bytes; the options' checks, each with its code and nothing written; a progress
 * callback that stops the export; names refused before anything is written. The output
 * directory is replaced all at once: links planted in it are never written through, what is
 * not an export's is refused, staging directories of killed exports are removed, and every
 * storage call of an export, failed in turn (fault+file://), leaves the previous set whole;
 * a filesystem that refuses O_DIRECT writes, or cannot exchange, still gets the same bytes.
 * The Python tests (tests/python/test_export.py) read the output back with the safetensors
 * package; tests/kill_export_test.sh SIGKILLs exports. With --make-names DIR NAME... this
 * program writes a checkpoint of those names (for tests/cli_test.sh). */
#include <dirent.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include "testutil.h"

static char dir[512];
TU_TMPDIR_GROUP(dir, "export")

enum { ROWS = 5, COLS = 7, NV = 9 };
static float w[ROWS * COLS];
static uint16_t v[NV];
static int64_t step = 1234567;

/* Saves "model.w" (f32 [5,7], two ranks: rows 0-2 and 3-4), "model.v" (f16 [9], flat pieces
 * [0,4) and [4,9) of the whole box) and "step" (an i64 scalar on both ranks) to name. */
static void save_small(char *out, size_t cap, const char *name, const char *wname)
{
    snprintf(out, cap, "%s/%s", dir, name);
    for (int i = 0; i < ROWS * COLS; i++)
        w[i] = (float)i * 0.25f - 3.0f;
    w[0] = 1.00390625f; /* ties in bf16: to even */
    w[1] = 1.01171875f;
    uint32_t nan = 0x7fc00001u;
    memcpy(&w[2], &nan, 4);
    for (int i = 0; i < NV; i++)
        v[i] = (uint16_t)(0x3c00 + 37 * i); /* f16 values from 1.0 up */
    uint64_t shape[2] = {ROWS, COLS}, top[2] = {0, 0}, bot[2] = {3, 0}, lt[2] = {3, COLS},
             lb[2] = {2, COLS}, nv = NV;
    strata_state *st[2];
    assert_ok(strata_state_new(&st[0]));
    assert_ok(strata_state_new(&st[1]));
    assert_ok(strata_state_add_shard(st[0], &(strata_shard){wname, STRATA_F32, 2, shape, top, lt,
                                                            .data = w}));
    assert_ok(strata_state_add_shard(st[1], &(strata_shard){wname, STRATA_F32, 2, shape, bot, lb,
                                                            .data = w + 3 * COLS}));
    assert_ok(strata_state_add_shard(st[0], &(strata_shard){"model.v", STRATA_F16, 1, &nv,
                                                            .flat = 1, .flat_start = 0,
                                                            .flat_end = 4, .data = v}));
    assert_ok(strata_state_add_shard(st[1], &(strata_shard){"model.v", STRATA_F16, 1, &nv,
                                                            .flat = 1, .flat_start = 4,
                                                            .flat_end = NV, .data = v + 4}));
    for (int r = 0; r < 2; r++)
        assert_ok(strata_state_add_shard(st[r], &(strata_shard){"step", STRATA_I64, 0, NULL,
                                                                .data = &step}));
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags = STRATA_SAVE_NO_SYNC;
    const char *uri = out;
    assert_ok(strata_save(NULL, NULL, &uri, 1, st, 2, &so));
    strata_state_free(st[0]);
    strata_state_free(st[1]);
}

/* The data of tensor name in a safetensors file: checks the dtype and shape strings and
 * returns a pointer into buf (the whole file) with *n its bytes. */
static const unsigned char *tensor_in(const unsigned char *buf, size_t len, const char *name,
                                      const char *dtype, const char *shape, size_t *n)
{
    assert_true(len >= 8);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)buf[i] << (8 * i);
    assert_true(hlen % 8 == 0 && 8 + hlen <= len);
    char *hdr = strndup((const char *)buf + 8, hlen);
    assert_non_null(hdr);
    assert_true(strncmp(hdr, "{\"__metadata__\":{\"format\":\"pt\"}", 31) == 0);
    char want[256];
    snprintf(want, sizeof want, "\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[", name,
             dtype, shape);
    const char *at = strstr(hdr, want);
    if (!at)
        fail_msg("no %s in the header %s", want, hdr);
    unsigned long long b, e;
    assert_int_equal(sscanf(at + strlen(want), "%llu,%llu]", &b, &e), 2);
    free(hdr);
    assert_true(b <= e && 8 + hlen + e <= len);
    *n = (size_t)(e - b);
    return buf + 8 + hlen + b;
}

static unsigned char *read_out(const char *out, const char *name, size_t *len)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", out, name);
    return tu_read_file(p, len);
}

/* The names in directory d, sorted, each followed by '\n' (malloc'd). */
static char *entries(const char *d)
{
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | LC_ALL=C sort", d);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    char *out = calloc(1, 65536);
    assert_non_null(out);
    size_t n = fread(out, 1, 65535, f);
    out[n] = 0;
    pclose(f);
    return out;
}

/* Directory d holds exactly the regular files of ref, byte for byte. */
static void assert_same_dir(const char *d, const char *ref)
{
    char *a = entries(d), *b = entries(ref);
    if (strcmp(a, b) != 0)
        fail_msg("%s holds\n%s\nbut %s holds\n%s", d, a, ref, b);
    for (char *name = b, *nl; *name; name = nl + 1) {
        nl = strchr(name, '\n');
        *nl = 0;
        char pa[1200], pb[1200];
        tu_join(pa, d, name);
        tu_join(pb, ref, name);
        struct stat st;
        assert_int_equal(lstat(pa, &st), 0);
        if (!S_ISREG(st.st_mode))
            fail_msg("%s is not a regular file", pa);
        size_t la, lb;
        unsigned char *x = tu_read_file(pa, &la), *y = tu_read_file(pb, &lb);
        if (la != lb || memcmp(x, y, la) != 0)
            fail_msg("%s differs from %s", pa, pb);
        free(x);
        free(y);
    }
    free(a);
    free(b);
}

/* The entries beside out named out.strata-export-* (staging directories). */
static int staged(const char *out)
{
    char parent[600];
    snprintf(parent, sizeof parent, "%s", out);
    char *slash = strrchr(parent, '/');
    assert_non_null(slash);
    *slash = 0;
    size_t bl = strlen(slash + 1);
    DIR *d = opendir(parent);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += strncmp(e->d_name, slash + 1, bl) == 0 &&
             strncmp(e->d_name + bl, ".strata-export-", 15) == 0;
    closedir(d);
    return n;
}

static int count_entries(const char *d)
{
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | wc -l", d);
    FILE *f = popen(cmd, "r");
    int n = -1;
    assert_non_null(f);
    assert_int_equal(fscanf(f, "%d", &n), 1);
    pclose(f);
    return n;
}

static void test_roundtrip(void **state)
{
    (void)state;
    char ck[600], out[600];
    save_small(ck, sizeof ck, "ck", "model.w");
    snprintf(out, sizeof out, "%s/out", dir);
    strata_stats s = STRATA_STATS_INIT;
    assert_ok(strata_export_safetensors(&s, ck, out, NULL));
    uint64_t want = ROWS * COLS * 4 + NV * 2 + 8;
    assert_int_equal(s.bytes, want);
    assert_int_equal(s.data_bytes, want);
    assert_int_equal(s.all_bytes, want);
    assert_true(s.seconds > 0 && s.io_calls > 0);
    /* one file: model.safetensors alone, no index (as Hugging Face writes it); no .partial */
    assert_int_equal(count_entries(out), 1);
    size_t len, n;
    unsigned char *f = read_out(out, "model.safetensors", &len);
    const unsigned char *p = tensor_in(f, len, "model.w", "F32", "[5,7]", &n);
    assert_int_equal(n, sizeof w);
    assert_memory_equal(p, w, sizeof w);
    p = tensor_in(f, len, "model.v", "F16", "[9]", &n);
    assert_int_equal(n, sizeof v);
    assert_memory_equal(p, v, sizeof v);
    p = tensor_in(f, len, "step", "I64", "[]", &n);
    assert_int_equal(n, 8);
    assert_memory_equal(p, &step, 8);
    free(f);

    /* prefix, a split per tensor (max_file_bytes 1), bf16, buffered writes */
    char out2[600];
    snprintf(out2, sizeof out2, "%s/out2", dir);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.prefix = "model.";
    o.max_file_bytes = 1;
    o.flags = STRATA_EXPORT_BF16 | STRATA_EXPORT_NO_DIRECT;
    assert_ok(strata_export_safetensors(&s, ck, out2, &o));
    assert_int_equal(s.bytes, ROWS * COLS * 2 + NV * 2 + 8);
    assert_int_equal(s.data_bytes, want);
    assert_int_equal(count_entries(out2), 4);
    f = read_out(out2, "model-00002-of-00003.safetensors", &len); /* "model.w" -> "w" */
    p = tensor_in(f, len, "w", "BF16", "[5,7]", &n);
    assert_int_equal(n, ROWS * COLS * 2);
    uint16_t b[ROWS * COLS];
    memcpy(b, p, n);
    assert_int_equal(b[0], 0x3f80); /* 1.00390625: the tie rounds to even, down */
    assert_int_equal(b[1], 0x3f82); /* 1.01171875: the tie rounds to even, up */
    assert_int_equal(b[2], 0x7fc0); /* NaN stays a quiet NaN */
    for (int i = 3; i < ROWS * COLS; i++) { /* exact in bf16 */
        uint32_t u;
        memcpy(&u, &w[i], 4);
        assert_int_equal(b[i], u >> 16);
    }
    free(f);
    f = read_out(out2, "model-00003-of-00003.safetensors", &len); /* "step" */
    p = tensor_in(f, len, "step", "I64", "[]", &n);
    assert_memory_equal(p, &step, 8);
    free(f);
    f = read_out(out2, "model-00001-of-00003.safetensors", &len); /* "v" -> bf16 */
    p = tensor_in(f, len, "v", "BF16", "[9]", &n);
    assert_int_equal(n, NV * 2);
    free(f);

    /* the same bytes with O_DIRECT (the default) and without */
    char out3[600];
    snprintf(out3, sizeof out3, "%s/out3", dir);
    o.flags = STRATA_EXPORT_BF16;
    assert_ok(strata_export_safetensors(NULL, ck, out3, &o));
    for (int i = 1; i <= 3; i++) {
        char fn[64];
        size_t l2, l3;
        snprintf(fn, sizeof fn, "model-%05d-of-00003.safetensors", i);
        unsigned char *a = read_out(out2, fn, &l2), *c = read_out(out3, fn, &l3);
        assert_int_equal(l2, l3);
        assert_memory_equal(a, c, l2);
        free(a);
        free(c);
    }
}

static int stop_at;  /* the call that returns nonzero */
static int calls;
static int custom;   /* set a message of its own */
static uint64_t last_done, last_total;

static int on_progress(void *ctx, uint64_t done, uint64_t total)
{
    assert_ptr_equal(ctx, &calls);
    assert_true(done >= last_done && done <= total);
    last_done = done, last_total = total;
    if (++calls != stop_at)
        return 0;
    if (custom)
        strata_error_set(STRATA_EABORTED, "the user said stop");
    return 1;
}

static void test_progress(void **state)
{
    (void)state;
    char ck[600], out[600];
    save_small(ck, sizeof ck, "ckp", "model.w");
    snprintf(out, sizeof out, "%s/outp", dir);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.max_file_bytes = 1;
    o.progress = on_progress;
    o.progress_ctx = &calls;
    calls = 0, stop_at = -1, last_done = 0;
    assert_ok(strata_export_safetensors(NULL, ck, out, &o));
    assert_int_equal(calls, 4); /* before, then one window per file */
    assert_int_equal(last_done, 166);
    assert_int_equal(last_total, 166);
    /* stopped at the 2nd or 4th call (after the last file, before the index): nothing
     * of this export is left; an earlier export's files in OUT stay, byte for byte */
    char ref[700];
    snprintf(ref, sizeof ref, "%s/stopref", dir);
    strata_export_opts earlier = STRATA_EXPORT_OPTS_INIT;
    earlier.flags = STRATA_EXPORT_BF16;
    assert_ok(strata_export_safetensors(NULL, ck, ref, &earlier));
    for (int k = 0; k < 4; k++) {
        char o2[700];
        snprintf(o2, sizeof o2, "%s/stop%d", dir, k);
        calls = 0, last_done = 0, stop_at = k < 2 ? 2 : 4, custom = k % 2;
        if (k >= 2) /* an earlier export there */
            assert_ok(strata_export_safetensors(NULL, ck, o2, &earlier));
        assert_rc(strata_export_safetensors(NULL, ck, o2, &o), STRATA_EABORTED);
        assert_msg_has(custom ? "the user said stop" : "stopped by the progress callback");
        if (k < 2)
            assert_false(tu_exists(o2));
        else
            assert_same_dir(o2, ref);
        assert_int_equal(staged(o2), 0);
    }
}

static void test_bad_options(void **state)
{
    (void)state;
    char ck[600], out[600], file[600];
    save_small(ck, sizeof ck, "cko", "model.w");
    snprintf(out, sizeof out, "%s/outo", dir);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.version = 0;
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EINVAL);
    assert_msg_has("strata_export_opts.version 0");
    o.version = STRATA_EXPORT_OPTS_VERSION + 1;
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EINVAL);
    o = (strata_export_opts)STRATA_EXPORT_OPTS_INIT;
    o.flags = 1u << 9;
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EINVAL);
    assert_msg_has("unknown bits");
    o.flags = 0, o.io_threads = -1;
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EINVAL);
    assert_msg_has("io_threads");
    o.io_threads = 0, o.prefix = "mo\xff";
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EINVAL);
    assert_msg_has("prefix is not valid UTF-8");
    strata_stats s = STRATA_STATS_INIT;
    s.version = 0;
    assert_rc(strata_export_safetensors(&s, ck, out, NULL), STRATA_EINVAL);
    assert_msg_has("strata_stats.version");
    assert_rc(strata_export_safetensors(NULL, NULL, out, NULL), STRATA_EINVAL);
    assert_rc(strata_export_safetensors(NULL, ck, NULL, NULL), STRATA_EINVAL);
    assert_rc(strata_export_safetensors(NULL, ck, "gs://bucket/x", NULL), STRATA_ESCHEME);
    snprintf(file, sizeof file, "%s/a-file", dir);
    tu_write_file(file, "x", 1);
    assert_rc(strata_export_safetensors(NULL, ck, file, NULL), STRATA_EEXIST);
    assert_msg_has("not a directory");
    char deep[700];
    snprintf(deep, sizeof deep, "%s/no/such/parent", dir);
    assert_rc(strata_export_safetensors(NULL, ck, deep, NULL), STRATA_ENOENT);
    assert_msg_has("does not exist (export makes its output directory, not its parents)");
    char missing[700];
    snprintf(missing, sizeof missing, "%s/absent", dir);
    assert_rc(strata_export_safetensors(NULL, missing, out, NULL), STRATA_ENOENT);
    assert_false(tu_exists(out));
    /* a committed checkpoint with a corrupt byte: STRATA_ECHECKSUM, nothing left */
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    strata_shard_info si;
    strata_ckpt_shard(&si, c, 0, 0);
    char data[800];
    tu_join(data, ck, si.file);
    tu_flip_byte(data, si.file_offset, 0x10);
    strata_ckpt_free(c);
    assert_rc(strata_export_safetensors(NULL, ck, out, NULL), STRATA_ECHECKSUM);
    assert_false(tu_exists(out));
}

static void test_names(void **state)
{
    (void)state;
    char ck[600], out[600];
    /* "__metadata__" is the key of the file's metadata: a checkpoint's tensor of that name
     * is data safetensors cannot hold (STRATA_EMISMATCH, not a bad request); one the
     * prefix makes is a bad prefix (STRATA_EINVAL) */
    save_small(ck, sizeof ck, "ckm", "__metadata__");
    snprintf(out, sizeof out, "%s/outm", dir);
    assert_rc(strata_export_safetensors(NULL, ck, out, NULL), STRATA_EMISMATCH);
    assert_msg_has("tensor '__metadata__' cannot be exported: safetensors keeps that key");
    assert_false(tu_exists(out));
    assert_int_equal(staged(out), 0);
    save_small(ck, sizeof ck, "ckm2", "x.__metadata__");
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    assert_ok(strata_export_safetensors(NULL, ck, out, &o));
    o.prefix = "x.";
    char out2[700];
    snprintf(out2, sizeof out2, "%s/outm2", dir);
    assert_rc(strata_export_safetensors(NULL, ck, out2, &o), STRATA_EINVAL);
    assert_msg_has("would be named __metadata__ once the prefix is stripped");
    assert_false(tu_exists(out2));
    /* two names equal once the prefix is stripped */
    save_small(ck, sizeof ck, "ckd", "v");
    o.prefix = "model.";
    assert_rc(strata_export_safetensors(NULL, ck, out2, &o), STRATA_EINVAL);
    assert_msg_has("same name 'v'");
    assert_false(tu_exists(out2));
    /* a name equal to the prefix is kept whole */
    o.prefix = "step";
    assert_ok(strata_export_safetensors(NULL, ck, out2, &o));
}

/* The exporter never holds a whole tensor: a 320 MiB f32 tensor, saved as two row halves,
 * exports with a peak RSS under 256 MiB. The save and the export each run in a child
 * process of their own, so the figure (ru_maxrss from wait4) is the exporter's alone; it is
 * not held to the bound under the sanitizers or valgrind, whose own memory counts there. */
static void test_bounded_memory(void **state)
{
    (void)state;
    enum { R = 20480, C = 4096 }; /* 320 MiB of f32 */
    char ck[600], out[600];
    snprintf(ck, sizeof ck, "%s/big", dir);
    snprintf(out, sizeof out, "%s/big-out", dir);
    pid_t pid = fork();
    if (pid == 0) {
        uint64_t shape[2] = {R, C}, off[2] = {R / 2, 0}, len[2] = {R / 2, C};
        float *half[2];
        strata_state *st[2];
        for (int r = 0; r < 2; r++) {
            half[r] = malloc((size_t)R / 2 * C * 4);
            if (!half[r] || strata_state_new(&st[r]))
                _exit(2);
            for (size_t i = 0; i < (size_t)R / 2 * C; i++)
                half[r][i] = (float)((i + (size_t)r * R / 2 * C) % 1000003);
            strata_shard sh = {"big", STRATA_F32, 2, shape, r ? off : NULL, len, .data = half[r]};
            if (strata_state_add_shard(st[r], &sh))
                _exit(3);
        }
        const char *u[] = {ck};
        _exit(strata_save(NULL, NULL, u, 1, st, 2, NULL) ? 4 : 0);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    pid = fork();
    if (pid == 0)
        _exit(strata_export_safetensors(NULL, ck, out, NULL) ? 1 : 0);
    struct rusage ru;
    assert_int_equal(wait4(pid, &status, 0, &ru), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    const char *san = getenv("SANITIZED"), *pre = getenv("LD_PRELOAD");
    int measured = !(san && *san) && !(pre && strstr(pre, "vgpreload"));
    print_message("export of a 320 MiB tensor: peak RSS %ld MiB%s\n", ru.ru_maxrss / 1024,
                  measured ? "" : " (not held to the bound here)");
    if (measured)
        assert_true(ru.ru_maxrss < 256 * 1024);
    /* the bytes: a few elements of each half, at their data_offsets */
    char f[700];
    snprintf(f, sizeof f, "%s/model.safetensors", out);
    int fd = open(f, O_RDONLY);
    assert_true(fd >= 0);
    uint64_t n;
    assert_int_equal(pread(fd, &n, 8, 0), 8);
    static const size_t at[] = {0, 1, 12345, (size_t)R / 2 * C - 1, (size_t)R / 2 * C,
                                (size_t)R * C - 1};
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
        float x;
        assert_int_equal(pread(fd, &x, 4, (off_t)(8 + n + at[k] * 4)), 4);
        assert_true(x == (float)(at[k] % 1000003));
    }
    close(fd);
    tu_rmrf(ck);
    tu_rmrf(out);
}

/* Links planted in the output directory are never written through: a hard link into a
 * committed checkpoint's data file, under a name an export writes, is replaced (the
 * checkpoint still verifies, byte for byte); a symlink there is refused, naming it, and its
 * target is left alone. */
static void test_planted_links(void **state)
{
    (void)state;
    char ck[600], victim_ck[600], out[600], ref[600], p[800], victim[600];
    save_small(ck, sizeof ck, "ckl", "model.w");
    save_small(victim_ck, sizeof victim_ck, "ckvictim", "model.w");
    snprintf(out, sizeof out, "%s/outl", dir);
    snprintf(ref, sizeof ref, "%s/outl-ref", dir);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.max_file_bytes = 1; /* three files and the index */
    assert_ok(strata_export_safetensors(NULL, ck, ref, &o));
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, victim_ck, 0));
    strata_file_info fi;
    strata_ckpt_file(&fi, c, 0);
    char data[800];
    tu_join(data, victim_ck, fi.name);
    strata_ckpt_free(c);
    size_t dlen, dlen2;
    unsigned char *before = tu_read_file(data, &dlen);
    assert_int_equal(mkdir(out, 0755), 0);
    static const char *const names[] = {"model-00001-of-00003.safetensors.partial",
                                        "model-00002-of-00003.safetensors",
                                        "model.safetensors.index.json.partial"};
    for (int i = 0; i < 3; i++) {
        tu_join(p, out, names[i]);
        assert_int_equal(link(data, p), 0);
    }
    assert_ok(strata_export_safetensors(NULL, ck, out, &o));
    unsigned char *after = tu_read_file(data, &dlen2);
    assert_int_equal(dlen, dlen2);
    assert_memory_equal(before, after, dlen);
    free(after);
    assert_ok(strata_ckpt_open(&c, victim_ck, 0));
    assert_ok(strata_ckpt_verify(c, NULL, NULL));
    strata_ckpt_free(c);
    assert_same_dir(out, ref);
    assert_int_equal(staged(out), 0);

    /* a symlink under an export's name, to a file the user can write */
    snprintf(victim, sizeof victim, "%s/precious", dir);
    tu_write_file(victim, "precious", 8);
    tu_join(p, out, "model-00001-of-00003.safetensors.partial");
    assert_int_equal(symlink(victim, p), 0);
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EEXIST);
    assert_msg_has("holds 'model-00001-of-00003.safetensors.partial', which is not a file an "
                   "export writes");
    size_t vl;
    unsigned char *v8 = tu_read_file(victim, &vl);
    assert_int_equal(vl, 8);
    assert_memory_equal(v8, "precious", 8);
    free(v8);
    assert_true(tu_exists(p)); /* left for a person to see */
    assert_int_equal(staged(out), 0);
    free(before);
}

/* What OUT may be: missing (under an existing parent), empty, or an earlier export's
 * output; everything else is refused with its own message and nothing is touched. */
static void test_out_dir(void **state)
{
    (void)state;
    char ck[600], out[600], p[800];
    save_small(ck, sizeof ck, "ckd2", "model.w");
    /* a dangling symlink: named as such, not "File exists" */
    snprintf(out, sizeof out, "%s/dangling", dir);
    assert_int_equal(symlink("/nonexistent/strata-target", out), 0);
    assert_rc(strata_export_safetensors(NULL, ck, out, NULL), STRATA_EEXIST);
    assert_msg_has("is a symbolic link (dangling or not)");
    assert_false(tu_exists("/nonexistent/strata-target"));
    assert_int_equal(staged(out), 0);
    /* a symlink to a directory */
    char real[600];
    snprintf(real, sizeof real, "%s/realdir", dir);
    assert_int_equal(mkdir(real, 0755), 0);
    snprintf(out, sizeof out, "%s/dirlink", dir);
    assert_int_equal(symlink(real, out), 0);
    assert_rc(strata_export_safetensors(NULL, ck, out, NULL), STRATA_EEXIST);
    assert_int_equal(count_entries(real), 0);
    /* a directory with a file no export writes, and with a subdirectory */
    snprintf(out, sizeof out, "%s/shared", dir);
    assert_int_equal(mkdir(out, 0755), 0);
    tu_join(p, out, "config.json");
    tu_write_file(p, "{}", 2);
    assert_rc(strata_export_safetensors(NULL, ck, out, NULL), STRATA_EEXIST);
    assert_msg_has("holds 'config.json', which is not a file an export writes");
    assert_int_equal(count_entries(out), 1);
    assert_int_equal(unlink(p), 0);
    tu_join(p, out, "sub");
    assert_int_equal(mkdir(p, 0755), 0);
    assert_rc(strata_export_safetensors(NULL, ck, out, NULL), STRATA_EEXIST);
    assert_msg_has("holds 'sub/'");
    assert_int_equal(rmdir(p), 0);
    /* empty: filled (one file: model.safetensors) */
    assert_ok(strata_export_safetensors(NULL, ck, out, NULL));
    assert_int_equal(count_entries(out), 1);
    assert_int_equal(staged(out), 0);
    /* "." names no directory of its own */
    assert_rc(strata_export_safetensors(NULL, ck, ".", NULL), STRATA_EINVAL);
}

/* Staging directories of killed exports beside OUT are removed by the next export to OUT,
 * unless their export is alive (its lock held); a decoy of another OUT stays. An export
 * killed between the two renames of a filesystem without exchange (OUT moved to old/, the
 * new set not yet in place) is undone: old/ goes back to OUT. */
static void test_stale_staging(void **state)
{
    (void)state;
    char ck[600], out[600], ref[600], p[900], stale[700], live[700], decoy[700], q[1000];
    save_small(ck, sizeof ck, "cks", "model.w");
    snprintf(out, sizeof out, "%s/outs", dir);
    snprintf(ref, sizeof ref, "%s/outs-ref", dir);
    assert_ok(strata_export_safetensors(NULL, ck, ref, NULL));
    snprintf(stale, sizeof stale, "%s.strata-export-1-0000dead", out);
    snprintf(live, sizeof live, "%s.strata-export-2-0000beef", out);
    snprintf(decoy, sizeof decoy, "%s2.strata-export-3-00000bad", out);
    const char *dirs[] = {stale, live, decoy};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(mkdir(dirs[i], 0755), 0);
        tu_join(p, dirs[i], "set");
        assert_int_equal(mkdir(p, 0755), 0);
        tu_join(q, p, "model-00001-of-00001.safetensors");
        tu_write_file(q, "partial", 7);
        tu_join(p, dirs[i], "EXPORT.LOCK");
        tu_write_file(p, "", 0);
    }
    tu_join(p, live, "EXPORT.LOCK");
    int fd = open(p, O_RDWR);
    assert_true(fd >= 0);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    assert_int_equal(fcntl(fd, F_OFD_SETLK, &fl), 0);
    assert_int_equal(staged(out), 2);
    assert_ok(strata_export_safetensors(NULL, ck, out, NULL));
    assert_same_dir(out, ref);
    assert_false(tu_exists(stale));
    assert_true(tu_exists(live));
    assert_true(tu_exists(decoy));
    close(fd); /* its export ended: the next one removes it */
    assert_ok(strata_export_safetensors(NULL, ck, out, NULL));
    assert_false(tu_exists(live));
    assert_true(tu_exists(decoy));
    tu_rmrf(decoy);

    /* killed between the two renames: OUT missing, the previous set in old/ */
    assert_int_equal(mkdir(stale, 0755), 0);
    tu_join(p, stale, "old");
    assert_int_equal(rename(out, p), 0);
    tu_join(p, stale, "EXPORT.LOCK");
    tu_write_file(p, "", 0);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.progress = on_progress;
    o.progress_ctx = &calls;
    calls = 0, last_done = 0, stop_at = 1, custom = 0;
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EABORTED);
    assert_same_dir(out, ref);
    assert_int_equal(staged(out), 0);
}

/* Every storage call of an export, failed in turn through fault+file://OUT for each op and
 * errno: a failed export returns the mapped code and leaves OUT as it was (an earlier
 * export's files byte for byte, or no OUT) with no staging directory; a fault after the
 * swap (removing the previous files) leaves the new set in OUT and a staging directory that
 * the next export removes. The number of calls of each op is that of the protocol: open and
 * write once per file (3 and the index), fsync per file, the set's directory and OUT's
 * parent, one exchange (or rename), two mkdirs, one lock, and unlinks of the previous 4
 * files and the lock after the swap. */
static void test_export_faults(void **state)
{
    (void)state;
    char cka[600], ckb[600], out[600], refa[600], refb[600];
    save_small(cka, sizeof cka, "ckfa", "model.w");
    save_small(ckb, sizeof ckb, "ckfb", "model.w2");
    snprintf(out, sizeof out, "%s/outf", dir);
    snprintf(refa, sizeof refa, "%s/outf-a", dir);
    snprintf(refb, sizeof refb, "%s/outf-b", dir);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.max_file_bytes = 1;
    assert_ok(strata_export_safetensors(NULL, cka, refa, &o));
    assert_ok(strata_export_safetensors(NULL, ckb, refb, &o));
    static const struct {
        const char *op;
        int calls, calls_fresh; /* OUT holding an earlier export / missing */
    } ops[] = {{"open", 4, 4},  {"write", 4, 4}, {"fsync", 6, 6}, {"rename", 1, 1},
               {"mkdir", 2, 2}, {"lock", 1, 1},  {"unlink", 5, 1}};
    static const char *const errs[] = {"EIO", "ENOSPC"};
    int points = 0;
    for (int fresh = 0; fresh < 2; fresh++)
        for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++)
            for (int e = 0; e < 2; e++) {
                int n = 1;
                for (;; n++) {
                    tu_rmrf(out);
                    if (!fresh)
                        assert_ok(strata_export_safetensors(NULL, cka, out, &o));
                    char uri[900];
                    snprintf(uri, sizeof uri, "fault+file://%s?op=%s&n=%d&errno=%s", out,
                             ops[k].op, n, errs[e]);
                    int rc = strata_export_safetensors(NULL, ckb, uri, &o);
                    int left = staged(out);
                    if (rc == 0) {
                        assert_same_dir(out, refb);
                        if (!left)
                            break; /* past the last call */
                        /* failed while removing what the swap replaced: the next export
                         * removes it */
                        if (strcmp(ops[k].op, "unlink") != 0)
                            fail_msg("%s: succeeded but left a staging directory", uri);
                        assert_ok(strata_export_safetensors(NULL, ckb, out, &o));
                        assert_int_equal(staged(out), 0);
                        assert_same_dir(out, refb);
                    } else {
                        int want = strcmp(errs[e], "ENOSPC") == 0 ? STRATA_ENOSPC : STRATA_EIO;
                        if (rc != want)
                            fail_msg("%s: %s (%s), want %s", uri, strata_error_name(rc),
                                     strata_error_last(), strata_error_name(want));
                        if (left)
                            fail_msg("%s failed (%s) and left a staging directory", uri,
                                     strata_error_last());
                        if (fresh)
                            assert_false(tu_exists(out));
                        else
                            assert_same_dir(out, refa);
                    }
                    points++;
                    if (n > 100)
                        fail_msg("%s: the export never stops failing", uri);
                }
                int want = fresh ? ops[k].calls_fresh : ops[k].calls;
                if (n - 1 != want)
                    fail_msg("op %s (OUT %s): %d calls, want %d", ops[k].op,
                             fresh ? "missing" : "an earlier export", n - 1, want);
            }
    print_message("export fault points tried: %d\n", points);
}

/* A filesystem that grants O_DIRECT at open but refuses the writes (EINVAL, as some FUSE and
 * network filesystems do): the export drops O_DIRECT on the file (the storage layer's
 * undirect) and writes it buffered, to the same bytes. Without O_DIRECT the same EINVAL is
 * an I/O error. */
static void test_direct_refused(void **state)
{
    (void)state;
    char ck[600], out[600], ref[600], probe[700], uri[900];
    save_small(ck, sizeof ck, "ckdr", "model.w");
    snprintf(out, sizeof out, "%s/outdr", dir);
    snprintf(ref, sizeof ref, "%s/outdr-ref", dir);
    assert_ok(strata_export_safetensors(NULL, ck, ref, NULL));
    snprintf(probe, sizeof probe, "%s/direct-probe", dir);
    int fd = open(probe, O_WRONLY | O_CREAT | O_DIRECT, 0644);
    if (fd < 0) { /* tmpfs: nothing here is written with O_DIRECT */
        unlink(probe);
        skip();
    }
    close(fd);
    unlink(probe);
    snprintf(uri, sizeof uri, "fault+file://%s?op=write&n=1&errno=EINVAL", out);
    assert_ok(strata_export_safetensors(NULL, ck, uri, NULL));
    assert_same_dir(out, ref);
    tu_rmrf(out);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.flags = STRATA_EXPORT_NO_DIRECT;
    assert_rc(strata_export_safetensors(NULL, ck, uri, &o), STRATA_EIO);
    assert_false(tu_exists(out));
    assert_int_equal(staged(out), 0);
}

/* A filesystem without RENAME_EXCHANGE (NFS: EINVAL): OUT is moved to the staging
 * directory's old/ and the new set renamed to OUT, and the export ends as usual; when those
 * renames fail too, OUT is put back and the export fails. */
static void test_no_exchange(void **state)
{
    (void)state;
    char cka[600], ckb[600], out[600], refa[600], refb[600], uri[900];
    save_small(cka, sizeof cka, "ckna", "model.w");
    save_small(ckb, sizeof ckb, "cknb", "model.w2");
    snprintf(out, sizeof out, "%s/outn", dir);
    snprintf(refa, sizeof refa, "%s/outn-a", dir);
    snprintf(refb, sizeof refb, "%s/outn-b", dir);
    assert_ok(strata_export_safetensors(NULL, cka, refa, NULL));
    assert_ok(strata_export_safetensors(NULL, ckb, refb, NULL));
    assert_ok(strata_export_safetensors(NULL, cka, out, NULL));
    snprintf(uri, sizeof uri, "fault+file://%s?op=rename&n=1&errno=EINVAL", out);
    assert_ok(strata_export_safetensors(NULL, ckb, uri, NULL));
    assert_same_dir(out, refb);
    assert_int_equal(staged(out), 0);
    snprintf(uri, sizeof uri, "fault+file://%s?op=rename&n=1&errno=EINVAL&sticky=1", out);
    assert_rc(strata_export_safetensors(NULL, cka, uri, NULL), STRATA_EIO);
    assert_same_dir(out, refb);
    assert_int_equal(staged(out), 0);
}

/* --make-names DIR NAME...: a checkpoint with one f32 [4] tensor per NAME and a blob named
 * after the first (for tests/cli_test.sh: names holding terminal control sequences, which
 * are valid UTF-8 and so taken by strata; a tensor named __metadata__). */
static int make_names(const char *ck, int n, char **names)
{
    static float x[4] = {1, 2, 3, 4};
    static char blob[3] = "abc";
    uint64_t len = 4;
    strata_state *st;
    int rc = strata_state_new(&st);
    for (int i = 0; i < n && !rc; i++)
        rc = strata_state_add_shard(st, &(strata_shard){names[i], STRATA_F32, 1, &len, .data = x});
    if (!rc)
        rc = strata_state_add_blob(st, names[0], 0, -1, blob, 3);
    const char *u = ck;
    if (!rc)
        rc = strata_save(NULL, NULL, &u, 1, &st, 1, NULL);
    if (rc)
        fprintf(stderr, "%s\n", strata_error_last());
    strata_state_free(st);
    return rc ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc >= 4 && strcmp(argv[1], "--make-names") == 0)
        return make_names(argv[2], argc - 3, argv + 3);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_progress),
        cmocka_unit_test(test_bad_options),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_planted_links),
        cmocka_unit_test(test_out_dir),
        cmocka_unit_test(test_stale_staging),
        cmocka_unit_test(test_export_faults),
        cmocka_unit_test(test_direct_refused),
        cmocka_unit_test(test_no_exchange),
        cmocka_unit_test(test_bounded_memory),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
