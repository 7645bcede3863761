/* test_export_select.c - which tensors strata_export_safetensors writes: include / exclude
 * globs on the checkpoint's names (exclude wins), model_only (a model's state_dict under
 * "P." of a state saved by strata.torch: P. stripped, per-rank "@rank<r>" tensors and
 * optimizer state left out), a version-1 options struct (every tensor), a selection that
 * keeps nothing (STRATA_ENOTFOUND, nothing written) and the options' checks. The files are
 * read back: the index's weight_map names exactly the selected tensors, each file's header
 * names them and their bytes are the saved ones. Also strata_remove_export_staging (what
 * `strata gc` does with the staging directories of killed exports). */
#include <fcntl.h>

#include "testutil.h"

static char dir[512];
TU_TMPDIR_GROUP(dir, "exsel")

/* The names a strata.torch save of {"model": m, "optim": o, "step": 7, "rng": per_rank}
 * flattens to, and a few near misses. Tensor i is f32 [3] holding i*10, i*10+1, i*10+2. */
static const char *const NAMES[] = {
    "model.layers.0.w",      "model.layers.1.w", "model.buf@rank0", "model.buf@rank1",
    "model.x@rankish",       "modelx.w",         "optim.state.0.exp_avg",
    "optim.state.0.exp_avg_sq", "rng.cpu@rank0", "step",
};
enum { N = sizeof NAMES / sizeof NAMES[0] };
static float vals[N][3];

static void save_names(char *ck, size_t cap)
{
    snprintf(ck, cap, "%s/ck", dir);
    for (int i = 0; i < N; i++)
        for (int k = 0; k < 3; k++)
            vals[i][k] = (float)(i * 10 + k);
    if (tu_exists(ck))
        return;
    uint64_t len = 3;
    strata_state *st;
    assert_ok(strata_state_new(&st));
    for (int i = 0; i < N; i++) {
        assert_ok(strata_state_add_shard(st, &(strata_shard){NAMES[i], STRATA_F32, 1, &len,
                                                             .data = vals[i]}));
    }
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags = STRATA_SAVE_NO_SYNC;
    const char *u = ck;
    assert_ok(strata_save(NULL, NULL, &u, 1, &st, 1, &so));
    strata_state_free(st);
}

/* The export in out holds exactly the tensors want[i] (from the checkpoint's src[i]), with
 * their saved bytes: one file, model.safetensors (no index), whose header names each once,
 * and no other. */
static void assert_exported(const char *out, int n, const char *const *want,
                            const char *const *src)
{
    char p[1024];
    size_t len;
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", out);
    assert_false(tu_exists(p));
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    unsigned char *file = tu_read_file(p, &len);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)file[i] << (8 * i);
    char *hdr = strndup((const char *)file + 8, hlen);
    int entries = 0;
    for (const char *c = hdr; (c = strstr(c, "\"dtype\"")); c++)
        entries++;
    assert_int_equal(entries, n);
    for (int i = 0; i < n; i++) {
        char key[256];
        snprintf(key, sizeof key, "\"%s\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[",
                 want[i]);
        const char *at = strstr(hdr, key);
        if (!at)
            fail_msg("%s is not in the header %s", key, hdr);
        unsigned long long b, e;
        assert_int_equal(sscanf(at + strlen(key), "%llu,%llu]", &b, &e), 2);
        assert_int_equal(e - b, 12);
        int s = 0;
        while (strcmp(NAMES[s], src[i]) != 0)
            s++;
        assert_memory_equal(file + 8 + hlen + b, vals[s], 12);
    }
    free(hdr);
    free(file);
}

static void test_model_only(void **state)
{
    (void)state;
    char ck[600], out[700];
    save_names(ck, sizeof ck);
    snprintf(out, sizeof out, "%s/model", dir);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.model_only = "model";
    strata_stats s = STRATA_STATS_INIT;
    assert_ok(strata_export_safetensors(&s, ck, out, &o));
    const char *want[] = {"layers.0.w", "layers.1.w", "x@rankish"};
    const char *src[] = {"model.layers.0.w", "model.layers.1.w", "model.x@rankish"};
    assert_exported(out, 3, want, src);
    assert_int_equal(s.data_bytes, 3 * 12); /* only the selected ones were read */
    assert_int_equal(s.bytes, 3 * 12);
    /* another key: the optimizer's state as a "model" (its own per-rank rule applies) */
    snprintf(out, sizeof out, "%s/optim", dir);
    o.model_only = "optim.state.0";
    assert_ok(strata_export_safetensors(NULL, ck, out, &o));
    const char *want2[] = {"exp_avg", "exp_avg_sq"};
    const char *src2[] = {"optim.state.0.exp_avg", "optim.state.0.exp_avg_sq"};
    assert_exported(out, 2, want2, src2);
    /* with include / exclude, on the checkpoint's names */
    snprintf(out, sizeof out, "%s/model1", dir);
    o.model_only = "model";
    const char *const inc[] = {"*.layers.*", "model.x*", NULL}, *const exc[] = {"*.1.*", NULL};
    o.include = inc;
    o.exclude = exc;
    assert_ok(strata_export_safetensors(NULL, ck, out, &o));
    const char *want3[] = {"layers.0.w", "x@rankish"};
    const char *src3[] = {"model.layers.0.w", "model.x@rankish"};
    assert_exported(out, 2, want3, src3);
}

static void test_include_exclude(void **state)
{
    (void)state;
    char ck[600], out[700];
    save_names(ck, sizeof ck);
    snprintf(out, sizeof out, "%s/inc", dir);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    const char *const inc[] = {"optim.*", "step", NULL}, *const exc[] = {"*_sq", NULL};
    o.include = inc;
    o.exclude = exc;
    assert_ok(strata_export_safetensors(NULL, ck, out, &o));
    const char *want[] = {"optim.state.0.exp_avg", "step"};
    assert_exported(out, 2, want, want);
    /* exclude alone: everything but per-rank tensors; exclude wins over include */
    snprintf(out, sizeof out, "%s/exc", dir);
    const char *const pr[] = {"*@rank[0-9]*", NULL}, *const all[] = {"*", NULL};
    o.include = all;
    o.exclude = pr;
    assert_ok(strata_export_safetensors(NULL, ck, out, &o));
    const char *want2[] = {"model.layers.0.w", "model.layers.1.w", "model.x@rankish", "modelx.w",
                           "optim.state.0.exp_avg", "optim.state.0.exp_avg_sq", "step"};
    assert_exported(out, 7, want2, want2);
    /* a version-1 struct knows no selection: every tensor, whatever follows in memory */
    snprintf(out, sizeof out, "%s/v1", dir);
    o.version = 1;
    o.include = inc;
    o.model_only = "nothing-like-this";
    assert_ok(strata_export_safetensors(NULL, ck, out, &o));
    assert_exported(out, N, NAMES, NAMES);
}

static void test_selection_errors(void **state)
{
    (void)state;
    char ck[600], out[700];
    save_names(ck, sizeof ck);
    snprintf(out, sizeof out, "%s/none", dir);
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    const char *const none[] = {"decoder.*", NULL};
    o.include = none;
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_ENOTFOUND);
    assert_msg_has("no tensor of the checkpoint's 10 is selected by include \"decoder.*\"");
    assert_false(tu_exists(out));
    o.include = NULL;
    o.model_only = "decoder";
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_ENOTFOUND);
    assert_msg_has("model_only \"decoder\" (tensors named decoder.<name>, not per-rank)");
    assert_false(tu_exists(out));
    o.model_only = "rng"; /* only per-rank tensors under it */
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_ENOTFOUND);
    o.model_only = "model";
    const char *const all[] = {"*", NULL};
    o.exclude = all;
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_ENOTFOUND);
    assert_false(tu_exists(out));
    o.exclude = NULL;
    o.prefix = "model.";
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EINVAL);
    assert_msg_has("prefix \"model.\" cannot be given with it");
    o.prefix = NULL;
    o.model_only = "";
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EINVAL);
    assert_msg_has("model_only is empty");
    o.model_only = NULL;
    const char *const bad[] = {"ok", "x\xc3", NULL};
    o.exclude = bad;
    assert_rc(strata_export_safetensors(NULL, ck, out, &o), STRATA_EINVAL);
    assert_msg_has("strata_export_opts.exclude[1] is not valid UTF-8");
    assert_false(tu_exists(out));
}

/* A staging directory as a killed export leaves it: set/ with a partial file, EXPORT.LOCK. */
static void fake_stage(const char *stage, const char *sub)
{
    char p[1100], q[1200];
    assert_int_equal(mkdir(stage, 0755), 0);
    tu_join(p, stage, sub);
    assert_int_equal(mkdir(p, 0755), 0);
    tu_join(q, p, "model-00001-of-00001.safetensors");
    tu_write_file(q, "partial", 7);
    tu_join(p, stage, "EXPORT.LOCK");
    tu_write_file(p, "", 0);
}

/* strata_remove_export_staging (strata gc): the staging directories of killed exports under a
 * directory go, a live export's (its lock held) stays, other directories are not touched,
 * and an OUT that a kill between the two renames left missing gets its files back. */
static void test_remove_staging(void **state)
{
    (void)state;
    char ck[600], top[600], out[700], stale[800], live[800], odd[800], moved[900], p[1000];
    save_names(ck, sizeof ck);
    snprintf(top, sizeof top, "%s/runs", dir);
    assert_int_equal(mkdir(top, 0755), 0);
    snprintf(out, sizeof out, "%s/hf", top);
    assert_ok(strata_export_safetensors(NULL, ck, out, NULL));
    snprintf(stale, sizeof stale, "%s.strata-export-11-0000dead", out);
    snprintf(live, sizeof live, "%s/other.strata-export-12-0000beef", top);
    snprintf(odd, sizeof odd, "%s/.strata-export-13-00000bad", top); /* names no OUT */
    fake_stage(stale, "set");
    fake_stage(live, "set");
    fake_stage(odd, "set");
    tu_join(p, live, "EXPORT.LOCK");
    int fd = open(p, O_RDWR);
    assert_true(fd >= 0);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    assert_int_equal(fcntl(fd, F_OFD_SETLK, &fl), 0);
    int n = -1;
    assert_ok(strata_remove_export_staging(&n, top));
    assert_int_equal(n, 1);
    assert_false(tu_exists(stale));
    assert_true(tu_exists(live));
    assert_true(tu_exists(odd));
    assert_exported(out, N, NAMES, NAMES); /* OUT untouched */
    close(fd); /* that export is gone: its directory goes next time */
    assert_ok(strata_remove_export_staging(&n, top));
    assert_int_equal(n, 1);
    assert_false(tu_exists(live));
    /* killed between the two renames: OUT missing, its files in old/; a foreign file keeps
     * a directory (not counted) */
    fake_stage(stale, "set");
    tu_join(moved, stale, "old");
    assert_int_equal(rename(out, moved), 0);
    tu_join(p, stale, "set/notes.txt");
    tu_write_file(p, "mine", 4);
    assert_ok(strata_remove_export_staging(&n, top));
    assert_int_equal(n, 0);
    assert_exported(out, N, NAMES, NAMES);
    assert_true(tu_exists(p));
    assert_rc(strata_remove_export_staging(NULL, "/nonexistent/strata-dir"), STRATA_ENOENT);
    assert_rc(strata_remove_export_staging(NULL, NULL), STRATA_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_only),
        cmocka_unit_test(test_include_exclude),
        cmocka_unit_test(test_selection_errors),
        cmocka_unit_test(test_remove_staging),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
