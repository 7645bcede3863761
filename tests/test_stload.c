/* test_stload.c - Hugging Face safetensors as a load source: a directory (one file, or a
 * sharded set with its index) or one .safetensors file loads through strata_load into any
 * layout - row blocks, flat pieces, in process and across a communicator - bitwise, reading
 * exactly the requested bytes; the index parser's rules; every hostile directory refused
 * with its exact code and a message naming the file. The files are written here by hand
 * (tests/python/test_stload.py loads files written by the safetensors package). */
#include <dirent.h>
#include <sys/time.h>
#include <unistd.h>

#include "testutil.h"
#include "threadcomm.h"

#include "source/safetensors.h"

static char base[512];
static int seq;

/* ---- writing safetensors files: every tensor holds the test pattern (testutil.h) ---- */

typedef struct {
    const char *name;
    strata_dtype dt;
    int ndim;
    uint64_t shape[4];
} tdesc;

static uint64_t numel_of(const tdesc *t)
{
    uint64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n;
}

/* Writes dir/file with tensors ts[0..n) (data in this order), __metadata__ included, the
 * JSON padded with spaces to a multiple of 8 as the reference writer does. */
static void write_st(const char *dir, const char *file, const tdesc *ts, int n)
{
    char json[8192];
    size_t k = (size_t)snprintf(json, sizeof json, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        uint64_t bytes = numel_of(&ts[i]) * strata_dtype_size(ts[i].dt);
        k += (size_t)snprintf(json + k, sizeof json - k, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[",
                              ts[i].name, st_st_dtype_name(ts[i].dt));
        for (int d = 0; d < ts[i].ndim; d++)
            k += (size_t)snprintf(json + k, sizeof json - k, d ? ",%llu" : "%llu",
                                  (unsigned long long)ts[i].shape[d]);
        k += (size_t)snprintf(json + k, sizeof json - k, "],\"data_offsets\":[%llu,%llu]}",
                              (unsigned long long)off, (unsigned long long)(off + bytes));
        off += bytes;
    }
    k += (size_t)snprintf(json + k, sizeof json - k, "}");
    while (k % 8)
        json[k++] = ' ';
    size_t len = 8 + k + off;
    unsigned char *b = calloc(1, len);
    assert_non_null(b);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)k >> (8 * i));
    memcpy(b + 8, json, k);
    unsigned char *p = b + 8 + k;
    for (int i = 0; i < n; i++) {
        size_t esz = strata_dtype_size(ts[i].dt);
        uint64_t ne = numel_of(&ts[i]), nh = tu_name_hash(ts[i].name);
        for (uint64_t e = 0; e < ne; e++, p += esz)
            tu_elem(p, esz, nh, e);
    }
    char path[1024];
    tu_join(path, dir, file);
    tu_write_file(path, b, len);
    free(b);
}

static void write_text(const char *dir, const char *file, const char *text)
{
    char path[1024];
    tu_join(path, dir, file);
    tu_write_file(path, text, strlen(text));
}

static void fresh_dir(char *out, size_t cap, const char *tag)
{
    snprintf(out, cap, "%s/%s-%d", base, tag, seq++);
    assert_int_equal(mkdir(out, 0755), 0);
}

/* The model: two files and an index; odd shapes, every dtype, a scalar, an empty tensor. */
static const tdesc part1[] = {
    {"embed.weight", STRATA_F32, 2, {23, 17}},
    {"layers.0.w", STRATA_BF16, 2, {10, 9}},
    {"layers.0.b", STRATA_F16, 1, {9}},
    {"step", STRATA_I64, 0, {0}},
};
static const tdesc part2[] = {
    {"layers.1.w", STRATA_F64, 3, {5, 3, 4}},
    {"layers.1.i", STRATA_I32, 1, {11}},
    {"mask", STRATA_BOOL, 1, {13}},
    {"q8", STRATA_FP8_E4M3, 2, {4, 6}},
    {"q5", STRATA_FP8_E5M2, 1, {7}},
    {"u", STRATA_U8, 1, {5}},
    {"s", STRATA_I16, 1, {3}},
    {"c", STRATA_I8, 1, {6}},
    {"empty", STRATA_F32, 2, {0, 4}},
};
#define N1 (int)(sizeof part1 / sizeof part1[0])
#define N2 (int)(sizeof part2 / sizeof part2[0])
#define F1 "model-00001-of-00002.safetensors"
#define F2 "model-00002-of-00002.safetensors"

static void write_index(const char *dir, const char *extra_entry)
{
    char json[8192];
    size_t k = (size_t)snprintf(json, sizeof json,
                                "{\n  \"metadata\": {\"total_size\": 12345},\n  \"weight_map\": {");
    for (int i = 0; i < N1 + N2; i++) {
        const tdesc *t = i < N1 ? &part1[i] : &part2[i - N1];
        k += (size_t)snprintf(json + k, sizeof json - k, "%s\n    \"%s\": \"%s\"", i ? "," : "",
                              t->name, i < N1 ? F1 : F2);
    }
    if (extra_entry)
        k += (size_t)snprintf(json + k, sizeof json - k, ",\n    %s", extra_entry);
    snprintf(json + k, sizeof json - k, "\n  }\n}\n");
    write_text(dir, ST_ST_INDEX_FILE, json);
}

static void write_model(const char *dir)
{
    write_st(dir, F1, part1, N1);
    write_st(dir, F2, part2, N2);
    write_index(dir, NULL);
}

static const tdesc *all_t(int i) { return i < N1 ? &part1[i] : &part2[i - N1]; }

static uint64_t tensor_bytes(const tdesc *t) { return numel_of(t) * strata_dtype_size(t->dt); }

/* Requests on nranks ranks: each tensor split by rows (dim 0) into nranks uneven blocks
 * (flat = 0), or its flattening cut into nranks flat pieces (flat = 1). */
static void request(tu_set *s, int nranks, int flat)
{
    tu_set_init(s, nranks);
    for (int i = 0; i < N1 + N2; i++) {
        const tdesc *t = all_t(i);
        uint64_t ne = numel_of(t);
        for (int r = 0; r < nranks; r++) {
            if (flat) {
                uint64_t a = ne * (uint64_t)r * (uint64_t)r / (uint64_t)(nranks * nranks);
                uint64_t b = ne * (uint64_t)(r + 1) * (uint64_t)(r + 1) /
                             (uint64_t)(nranks * nranks);
                tu_set_shard(s, r, t->name, t->dt, t->ndim, t->shape, NULL, NULL, 1, a, b, 0);
            } else if (t->ndim == 0) {
                tu_set_shard(s, r, t->name, t->dt, 0, t->shape, NULL, NULL, 0, 0, 0, 0);
            } else {
                uint64_t rows = t->shape[0], a = rows * (uint64_t)r / (uint64_t)nranks,
                         b = rows * (uint64_t)(r + 1) / (uint64_t)nranks;
                uint64_t off[4] = {a, 0, 0, 0}, len[4];
                for (int d = 0; d < t->ndim; d++)
                    len[d] = t->shape[d];
                len[0] = b - a;
                tu_set_shard(s, r, t->name, t->dt, t->ndim, t->shape, off, len, 0, 0, 0, 0);
            }
        }
    }
}

/* Payload bytes of the model, and of what a request set asks for (each rank's own). */
static uint64_t model_bytes(void)
{
    uint64_t n = 0;
    for (int i = 0; i < N1 + N2; i++)
        n += tensor_bytes(all_t(i));
    return n;
}

static int load_local(tu_set *s, const char *uri, strata_stats *st)
{
    const char *uris[] = {uri};
    *st = (strata_stats)STRATA_STATS_INIT;
    return strata_load(st, NULL, uris, 1, s->st, s->n, NULL);
}

/* ---- loads ---- */

static void test_rows_and_flat(void **state)
{
    (void)state;
    char dir[600];
    fresh_dir(dir, sizeof dir, "model");
    write_model(dir);
    for (int flat = 0; flat <= 1; flat++) {
        int nranks = flat ? 2 : 3;
        tu_set s;
        request(&s, nranks, flat);
        strata_stats st;
        assert_ok(load_local(&s, dir, &st));
        assert_int_equal(tu_set_check(&s), 0);
        /* every byte of every tensor is asked for once over the ranks: read exactly once */
        assert_int_equal(st.bytes, model_bytes());
        assert_int_equal(st.data_bytes, model_bytes());
        tu_set_free(&s);
    }
}

/* Only what is asked for is read: one row block of one tensor, a flat piece of another. */
static void test_reads_only_requested(void **state)
{
    (void)state;
    char dir[600];
    fresh_dir(dir, sizeof dir, "part");
    write_model(dir);
    tu_set s;
    tu_set_init(&s, 1);
    const tdesc *e = &part1[0], *w = &part2[0];
    uint64_t off[2] = {5, 0}, len[2] = {7, 17};
    tu_set_shard(&s, 0, e->name, e->dt, 2, e->shape, off, len, 0, 0, 0, 0);
    tu_set_shard(&s, 0, w->name, w->dt, 3, w->shape, NULL, NULL, 1, 13, 29, 0);
    strata_stats st;
    assert_ok(load_local(&s, dir, &st));
    assert_int_equal(tu_set_check(&s), 0);
    assert_int_equal(st.bytes, 7 * 17 * 4 + 16 * 8);
    tu_set_free(&s);
}

/* A single model.safetensors, a path to one .safetensors file, and a symlinked file (as
 * in a Hugging Face cache snapshot). */
static void test_single_file_and_links(void **state)
{
    (void)state;
    char dir[600], file[700], linkdir[600], target[800], link[800];
    fresh_dir(dir, sizeof dir, "single");
    write_st(dir, ST_ST_SINGLE_FILE, part2, N2);
    tu_join(file, dir, ST_ST_SINGLE_FILE);
    fresh_dir(linkdir, sizeof linkdir, "linked");
    snprintf(target, sizeof target, "%s/blob-1234", linkdir);
    write_st(linkdir, "blob-1234", part2, N2);
    tu_join(link, linkdir, ST_ST_SINGLE_FILE);
    assert_int_equal(symlink("blob-1234", link), 0);
    const char *uris[] = {dir, file, linkdir, link};
    for (int u = 0; u < 4; u++) {
        tu_set s;
        tu_set_init(&s, 2);
        for (int i = 0; i < N2; i++) {
            const tdesc *t = &part2[i];
            uint64_t ne = numel_of(t);
            tu_set_shard(&s, 0, t->name, t->dt, t->ndim, t->shape, NULL, NULL, 1, 0, ne / 2, 0);
            tu_set_shard(&s, 1, t->name, t->dt, t->ndim, t->shape, NULL, NULL, 1, ne / 2, ne, 0);
        }
        strata_stats st;
        int rc = load_local(&s, uris[u], &st);
        if (rc)
            fail_msg("%s: %s", uris[u], strata_error_last());
        assert_int_equal(tu_set_check(&s), 0);
        tu_set_free(&s);
    }
    (void)target;
}

/* The read-only view: format, no checksums, one shard per tensor at its file offset;
 * verify reads every byte. */
static void test_ckpt_view(void **state)
{
    (void)state;
    char dir[600];
    fresh_dir(dir, sizeof dir, "view");
    write_model(dir);
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, dir, 0));
    assert_int_equal(strata_ckpt_format(ck), STRATA_FORMAT_SAFETENSORS);
    assert_int_equal(strata_ckpt_chunk_bytes(ck), 0);
    assert_int_equal(strata_ckpt_committed(ck), 1);
    assert_int_equal(strata_ckpt_ntensors(ck), N1 + N2);
    assert_int_equal(strata_ckpt_nblobs(ck), 0);
    assert_int_equal(strata_ckpt_nfiles(ck), 2);
    assert_int_equal(strata_ckpt_data_bytes(ck), model_bytes());
    for (size_t i = 0; i < strata_ckpt_ntensors(ck); i++) {
        strata_tensor_info t;
        strata_shard_info sh;
        strata_ckpt_tensor(&t, ck, i);
        assert_int_equal(t.nshards, 1);
        strata_ckpt_shard(&sh, ck, i, 0);
        assert_int_equal(sh.flat, 0);
        assert_int_equal(sh.bytes, t.bytes);
        int found = 0;
        for (int k = 0; k < N1 + N2; k++)
            if (strcmp(all_t(k)->name, t.name) == 0) {
                found = 1;
                assert_string_equal(sh.file, k < N1 ? F1 : F2);
                assert_int_equal(t.bytes, tensor_bytes(all_t(k)));
            }
        assert_true(found);
    }
    assert_ok(strata_ckpt_verify(ck, NULL, NULL));
    strata_ckpt_free(ck);
    /* a strata checkpoint says the opposite */
    char ck2[600];
    fresh_dir(ck2, sizeof ck2, "strata");
    tu_set s;
    tu_set_init(&s, 1);
    tu_set_shard(&s, 0, "x", STRATA_F32, 1, (uint64_t[]){8}, NULL, NULL, 0, 0, 0, 1);
    const char *u[] = {ck2};
    assert_ok(strata_save(NULL, NULL, u, 1, s.st, 1, NULL));
    assert_ok(strata_ckpt_open(&ck, ck2, 0));
    assert_int_equal(strata_ckpt_format(ck), STRATA_FORMAT_STRATA);
    assert_true(strata_ckpt_chunk_bytes(ck) > 0);
    strata_ckpt_free(ck);
    tu_set_free(&s);
}

/* Requests that do not fit: unknown tensor, other dtype or shape. */
static void test_bad_requests(void **state)
{
    (void)state;
    char dir[600];
    fresh_dir(dir, sizeof dir, "req");
    write_model(dir);
    strata_stats st;
    tu_set s;
    tu_set_init(&s, 1);
    tu_set_shard(&s, 0, "nope", STRATA_F32, 1, (uint64_t[]){3}, NULL, NULL, 0, 0, 0, 0);
    assert_rc(load_local(&s, dir, &st), STRATA_ENOTFOUND);
    assert_msg_has("nope");
    tu_set_free(&s);
    tu_set_init(&s, 1);
    tu_set_shard(&s, 0, "embed.weight", STRATA_F16, 2, (uint64_t[]){23, 17}, NULL, NULL, 0, 0, 0,
                 0);
    assert_rc(load_local(&s, dir, &st), STRATA_EMISMATCH);
    assert_msg_has("embed.weight");
    tu_set_free(&s);
    tu_set_init(&s, 1);
    tu_set_shard(&s, 0, "embed.weight", STRATA_F32, 2, (uint64_t[]){17, 23}, NULL, NULL, 0, 0, 0,
                 0);
    assert_rc(load_local(&s, dir, &st), STRATA_EMISMATCH);
    tu_set_free(&s);
}

/* ---- across a communicator of threads ---- */

#define NT 3
typedef struct {
    hub *h;
    tcomm tc;
    tu_set *set;
    const char *uri;
    int rank, rc;
    strata_stats st;
    char msg[512];
} rank_job;

static void *run_rank(void *arg)
{
    rank_job *j = arg;
    strata_comm *c;
    j->rc = strata_comm_host(&c, &tops, &j->tc, j->rank, NT);
    if (!j->rc) {
        j->st = (strata_stats)STRATA_STATS_INIT;
        const char *uris[] = {j->uri};
        j->rc = strata_load(&j->st, c, uris, 1, &j->set->st[j->rank], 1, NULL);
        snprintf(j->msg, sizeof j->msg, "%s", j->rc ? strata_error_last() : "");
        strata_comm_free(c);
    }
    return NULL;
}

static void dist_load(tu_set *s, const char *uri, rank_job *jobs)
{
    hub h = {.size = NT, .send = calloc(NT, sizeof(void *)),
             .scounts = calloc(NT, sizeof(size_t *))};
    pthread_barrier_init(&h.bar, NULL, NT);
    pthread_t th[NT];
    for (int r = 0; r < NT; r++) {
        jobs[r] = (rank_job){&h, {&h, r}, s, uri, r, 0, STRATA_STATS_INIT, ""};
        assert_int_equal(pthread_create(&th[r], NULL, run_rank, &jobs[r]), 0);
    }
    for (int r = 0; r < NT; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&h.bar);
    free(h.send);
    free(h.scounts);
}

static void test_distributed(void **state)
{
    (void)state;
    char dir[600];
    fresh_dir(dir, sizeof dir, "dist");
    write_model(dir);
    for (int flat = 0; flat <= 1; flat++) {
        tu_set s;
        request(&s, NT, flat);
        rank_job jobs[NT];
        dist_load(&s, dir, jobs);
        for (int r = 0; r < NT; r++)
            if (jobs[r].rc)
                fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
        assert_int_equal(tu_set_check(&s), 0);
        /* read once over all ranks: the bytes of the model, no more */
        assert_int_equal(jobs[0].st.all_bytes, model_bytes());
        tu_set_free(&s);
    }
    /* the node's shared segment was unlinked once mapped: none of this process's is left
     * (strata-load-<uid>-<boot>-<pidns>-<pid>-<random>) */
    char seg[64];
    snprintf(seg, sizeof seg, "-%d-", (int)getpid());
    DIR *shm = opendir("/dev/shm");
    for (struct dirent *e; shm && (e = readdir(shm));)
        if (strncmp(e->d_name, "strata-load-", 12) == 0 && strstr(e->d_name, seg))
            fail_msg("/dev/shm/%s is left behind", e->d_name);
    if (shm)
        closedir(shm);
    /* a hostile source fails on every rank with the same code */
    fresh_dir(dir, sizeof dir, "dist-bad");
    write_st(dir, F1, part1, N1);
    write_index(dir, NULL); /* F2 missing */
    tu_set s;
    request(&s, NT, 0);
    rank_job jobs[NT];
    dist_load(&s, dir, jobs);
    for (int r = 0; r < NT; r++)
        assert_int_equal(jobs[r].rc, STRATA_ENOENT);
    tu_set_free(&s);
}

/* ---- hostile directories ---- */

static void refuse_dir(const char *dir, int want, const char *why)
{
    tu_set s;
    request(&s, 1, 0);
    strata_stats st;
    int rc = load_local(&s, dir, &st);
    if (rc != want)
        fail_msg("%s: got %s (%s), want %s", dir, strata_error_name(rc),
                 rc ? strata_error_last() : "accepted", strata_error_name(want));
    assert_msg_has(why);
    tu_set_free(&s);
    strata_ckpt *ck;
    assert_int_equal(strata_ckpt_open(&ck, dir, 0), want);
}

static void test_hostile_dirs(void **state)
{
    (void)state;
    char dir[600], p[800];
    /* a file the index names is missing */
    fresh_dir(dir, sizeof dir, "h");
    write_st(dir, F1, part1, N1);
    write_index(dir, NULL);
    refuse_dir(dir, STRATA_ENOENT, F2);
    /* the index maps a tensor to a file that does not hold it */
    fresh_dir(dir, sizeof dir, "h");
    write_model(dir);
    write_index(dir, "\"ghost\": \"" F1 "\"");
    refuse_dir(dir, STRATA_EFORMAT, "ghost");
    /* a tensor the index does not list */
    fresh_dir(dir, sizeof dir, "h");
    write_st(dir, F1, part1, N1);
    write_st(dir, F2, part2, N2);
    write_text(dir, ST_ST_INDEX_FILE,
               "{\"weight_map\":{\"embed.weight\":\"" F1 "\",\"layers.0.w\":\"" F1
               "\",\"layers.0.b\":\"" F1 "\",\"step\":\"" F1 "\",\"q8\":\"" F2 "\"}}");
    refuse_dir(dir, STRATA_EFORMAT, "not in the weight_map");
    /* a tensor in two files */
    fresh_dir(dir, sizeof dir, "h");
    write_st(dir, F1, part1, N1);
    write_st(dir, F2, part1, 1);
    write_text(dir, ST_ST_INDEX_FILE, "{\"weight_map\":{\"embed.weight\":\"" F1 "\",\"x\":\"" F2 "\"}}");
    refuse_dir(dir, STRATA_EFORMAT, "in both");
    /* a bad header: offsets past the data, named by file */
    fresh_dir(dir, sizeof dir, "h");
    write_model(dir);
    tu_join(p, dir, F2);
    size_t len;
    unsigned char *b = tu_read_file(p, &len);
    tu_truncate(p, len - 3);
    free(b);
    refuse_dir(dir, STRATA_EFORMAT, F2);
    /* a header length over the limit */
    fresh_dir(dir, sizeof dir, "h");
    unsigned char big[16] = {0};
    uint64_t n = ST_ST_MAX_HEADER + 1;
    for (int i = 0; i < 8; i++)
        big[i] = (unsigned char)(n >> (8 * i));
    tu_join(p, dir, ST_ST_SINGLE_FILE);
    tu_write_file(p, big, sizeof big);
    refuse_dir(dir, STRATA_EFORMAT, "over the limit");
    /* a file shorter than 8 bytes */
    fresh_dir(dir, sizeof dir, "h");
    tu_write_file(p, big, 0);
    tu_join(p, dir, ST_ST_SINGLE_FILE);
    tu_write_file(p, "abc", 3);
    refuse_dir(dir, STRATA_EFORMAT, "shorter than");
    /* the index: broken JSON, a path in a file name, no weight_map, an empty one */
    static const struct {
        const char *json, *why;
    } bad_idx[] = {
        {"{\"weight_map\":{\"a\":\"" F1 "\"", "ends early"},
        {"{\"weight_map\":{\"a\":\"../" F1 "\"}}", "not a plain file name"},
        {"{\"weight_map\":{\"a\":\"/etc/passwd\"}}", "not a plain file name"},
        {"{\"metadata\":{}}", "no weight_map"},
        {"{\"weight_map\":{}}", "empty"},
        {"{\"weight_map\":{\"a\":1}}", "not a string"},
        {"{\"weight_map\":{\"a\":\"" F1 "\",\"a\":\"" F1 "\"}}", "twice"},
        {"{\"weight_map\":{},\"weight_map\":{}}", "twice"},
        {"[]", "expected '{'"},
        {"{\"weight_map\":{\"\":\"" F1 "\"}}", "bad tensor name"},
        {"{\"weight_map\":{\"a\":\"" F1 "\"}} x", "after the index"},
    };
    for (size_t i = 0; i < sizeof bad_idx / sizeof bad_idx[0]; i++) {
        fresh_dir(dir, sizeof dir, "idx");
        write_st(dir, F1, part1, N1);
        write_text(dir, ST_ST_INDEX_FILE, bad_idx[i].json);
        refuse_dir(dir, STRATA_EFORMAT, bad_idx[i].why);
        assert_msg_has(ST_ST_INDEX_FILE);
    }
    /* a directory with strata's metadata is strata's, even with safetensors beside it */
    fresh_dir(dir, sizeof dir, "mixed");
    write_model(dir);
    write_text(dir, "metadata.bin", "junk");
    tu_set s;
    request(&s, 1, 0);
    strata_stats st;
    assert_rc(load_local(&s, dir, &st), STRATA_EINCOMPLETE);
    tu_set_free(&s);
}

/* The data file shrinks after the header was read: the load fails, never a short read
 * delivered as data. */
static void test_truncated_between(void **state)
{
    (void)state;
    char dir[600], p[800];
    fresh_dir(dir, sizeof dir, "trunc");
    write_model(dir);
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, dir, 0));
    tu_join(p, dir, F1);
    size_t len;
    free(tu_read_file(p, &len));
    tu_truncate(p, len - 100);
    /* the view was opened before: verify finds the file is not the one it described */
    assert_rc(strata_ckpt_verify(ck, NULL, NULL), STRATA_ECHANGED);
    assert_msg_has(F1);
    strata_ckpt_free(ck);
}

/* ---- a file replaced between the header read and the data read ---- */

/* The "swap" wrapper (swap+file://...): POSIX, except that the second open of a path ending
 * in swap_name (the first is the header read, the second the data read) is preceded by
 * swap_act: another process replacing the file (rename) or rewriting it in place. */
static st_vfs swap_vfs;
static pthread_mutex_t swap_mu = PTHREAD_MUTEX_INITIALIZER;
static const char *swap_name;
static char swap_from[900];
static int swap_opens, swap_in_place;

static int swap_open(const st_vfs *v, const char *path, int flags, st_file **out)
{
    (void)v;
    pthread_mutex_lock(&swap_mu);
    size_t n = strlen(path), k = swap_name ? strlen(swap_name) : 0;
    if (k && n >= k && strcmp(path + n - k, swap_name) == 0 && ++swap_opens == 2) {
        if (swap_in_place) /* a data byte of the first tensor, same size, same inode */
            tu_flip_byte(path, 8 + 104, 0x10);
        else if (rename(swap_from, path))
            fail_msg("rename %s: %s", swap_from, strerror(errno));
    }
    pthread_mutex_unlock(&swap_mu);
    return st_vfs_posix.open(&st_vfs_posix, path, flags, out);
}

static int swap_make(const st_vfs **out, const st_vfs *inner, const char *query)
{
    (void)inner, (void)query;
    *out = &swap_vfs;
    return 0;
}

/* A file of the model replaced (a new file renamed over it, or rewritten in place: same
 * size, one byte differs) after its header was read: the load loaded the new bytes with
 * STRATA_OK. Now STRATA_ECHANGED naming the file, in process and on every rank. */
static void test_replaced_between(void **state)
{
    (void)state;
    swap_vfs = st_vfs_posix;
    swap_vfs.scheme = "swap";
    swap_vfs.open = swap_open;
    assert_ok(st_vfs_register_wrapper("swap", swap_make));
    for (int mode = 0; mode < 3; mode++) { /* rename, in place, rename with NT ranks */
        char dir[600], uri[700], p[800];
        fresh_dir(dir, sizeof dir, "swap");
        write_model(dir);
        tu_join(p, dir, F1);
        size_t len;
        free(tu_read_file(p, &len));
        /* the replacement: the same header and size, one data byte differs */
        snprintf(swap_from, sizeof swap_from, "%s.new", p);
        unsigned char *b = tu_read_file(p, &len);
        tu_write_file(swap_from, b, len);
        free(b);
        tu_flip_byte(swap_from, len - 1, 0x01);
        /* an in-place rewrite keeps the inode: the file's times must tell, so the file is
         * made an hour old first (timestamps are coarse: a rewrite within the same tick as
         * the write would not show) */
        struct timeval old[2];
        gettimeofday(&old[0], NULL);
        old[0].tv_sec -= 3600;
        old[1] = old[0];
        assert_int_equal(utimes(p, old), 0);
        swap_in_place = mode == 1;
        swap_opens = 0;
        swap_name = F1;
        snprintf(uri, sizeof uri, "swap+file://%s", dir);
        tu_set s;
        if (mode < 2) {
            request(&s, 2, 0);
            strata_stats st;
            int rc = load_local(&s, uri, &st);
            if (rc != STRATA_ECHANGED)
                fail_msg("mode %d: %s (want STRATA_ECHANGED): %s; the tensors %s", mode,
                         strata_error_name(rc), strata_error_last(),
                         tu_set_check(&s) ? "differ from the first file" : "match");
            assert_msg_has(F1);
            assert_msg_has(mode ? "modified" : "another file");
        } else {
            request(&s, NT, 0);
            rank_job jobs[NT];
            dist_load(&s, uri, jobs);
            int changed = 0;
            for (int r = 0; r < NT; r++) {
                if (jobs[r].rc != STRATA_ECHANGED && jobs[r].rc != STRATA_EABORTED)
                    fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
                changed += jobs[r].rc == STRATA_ECHANGED && strstr(jobs[r].msg, F1);
            }
            assert_true(changed > 0);
        }
        assert_int_equal(swap_opens >= 2, 1); /* the swap happened */
        swap_name = NULL;
        tu_set_free(&s);
        unlink(swap_from);
    }
}

static int setup(void **state)
{
    (void)state;
    tu_tmpdir(base, sizeof base, "stload");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tu_rmrf(base);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_and_flat),    cmocka_unit_test(test_reads_only_requested),
        cmocka_unit_test(test_single_file_and_links), cmocka_unit_test(test_ckpt_view),
        cmocka_unit_test(test_bad_requests),     cmocka_unit_test(test_distributed),
        cmocka_unit_test(test_hostile_dirs),     cmocka_unit_test(test_truncated_between),
        cmocka_unit_test(test_replaced_between),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
