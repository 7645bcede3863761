/* test_pool.c - the buffers of asynchronous saves. Every documented chunk_bytes (up to
 * 64 MiB) works with no pool, a saver's own pool, or a caller's pool large enough by the
 * rule of strata.h; a caller's pool too small is STRATA_EINVAL with advice that works. A
 * pool a save makes for itself or its saver is allocated by the save's background thread,
 * never on the caller's: strata_save_start allocates none of it (checked with the
 * coordinator held at a test hook, so nothing races the measurement). With a device
 * (the fake CUDA runtime beside this binary, used unless STRATA_CUDART names a runtime,
 * or a real GPU), such a pool is pinned buffer by buffer as it is allocated. */
#include <dlfcn.h>
#include <libgen.h>
#include <pthread.h>
#include <stdatomic.h>

#include "core/error.h"
#include "engine/engine.h"
#include "io/bufpool.h"
#include "io/cuda.h"
#include "io/pool.h"
#include "testutil.h"

static char base_dir[512];
TU_TMPDIR_GROUP(base_dir, "pool")

#define MiB ((uint64_t)1 << 20)

/* ~130 MiB over two ranks, odd sizes: rows of an f32 matrix split unevenly, a bf16 vector
 * flat-sharded, a global blob. */
static const uint64_t wshape[] = {8191, 4099}, zshape[] = {1000003};

static void big_state(tu_set *s, int fill)
{
    tu_set_init(s, fill ? 2 : 1);
    if (!fill) { /* one rank asking for everything */
        tu_set_shard(s, 0, "w", STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
        tu_set_shard(s, 0, "z", STRATA_BF16, 1, zshape, NULL, NULL, 0, 0, 0, 0);
        tu_set_blob(s, 0, "cfg", 0, -1, 77, 0);
        return;
    }
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {r ? 4000 : 0, 0}, len[] = {r ? 8191 - 4000 : 4000, 4099};
        tu_set_shard(s, r, "w", STRATA_F32, 2, wshape, off, len, 0, 0, 0, 1);
        tu_set_shard(s, r, "z", STRATA_BF16, 1, zshape, NULL, NULL, 1, r ? 444444 : 0,
                     r ? 1000003 : 444444, 1);
        tu_set_blob(s, r, "cfg", 0, -1, 77, 1);
    }
}

/* Loads ck and compares it bitwise with the saved state src (its two ranks' buffers are
 * the loaded tensors' halves, in order). */
static void check_big(const char *ck, const tu_set *src)
{
    tu_set d;
    big_state(&d, 0);
    assert_ok(strata_load(NULL, NULL, &ck, 1, d.st, 1, NULL));
    for (int t = 0; t < 2; t++) { /* w, then z: rank 0's records, then rank 1's */
        const unsigned char *got = d.sh[t].sh.data;
        for (size_t i = 0; i < src->nsh; i++)
            if (strcmp(src->sh[i].name, d.sh[t].name) == 0) {
                size_t n = tu_shard_numel(&src->sh[i].sh) * strata_dtype_size(src->sh[i].sh.dtype);
                assert_memory_equal(got, src->sh[i].sh.data, n);
                got += n;
            }
        assert_true(got == (const unsigned char *)d.sh[t].sh.data +
                               tu_shard_numel(&d.sh[t].sh) * strata_dtype_size(d.sh[t].sh.dtype));
    }
    assert_memory_equal(d.bl[0].data, src->bl[0].data, 77);
    tu_set_free(&d);
}

static strata_save_opts opts(uint32_t chunk)
{
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = chunk;
    o.flags |= STRATA_SAVE_NO_SYNC;
    return o;
}

/* An async save of src to dir/name through sv (NULL: none); its outcome. */
static int save_async(strata_saver *sv, const char *name, const tu_set *src, uint32_t chunk,
                      char *ck, size_t cap)
{
    snprintf(ck, cap, "%s/%s", base_dir, name);
    strata_save_opts o = opts(chunk);
    strata_handle *h;
    const char *u = ck;
    int rc = strata_save_start(&h, sv, &u, 1, src->st, src->n, &o);
    if (rc)
        return rc;
    strata_stats st = STRATA_STATS_INIT;
    rc = strata_wait_durable(&st, h);
    strata_handle_free(h);
    if (!rc) {
        strata_ckpt *c;
        assert_ok(strata_ckpt_open(&c, ck, 0));
        assert_int_equal(strata_ckpt_chunk_bytes(c), chunk);
        strata_ckpt_free(c);
    }
    return rc;
}

/* The pool size the EINVAL message advises ("a pool of at least N bytes"). */
static uint64_t advised_bytes(void)
{
    const char *m = strstr(strata_error_last(), "a pool of at least ");
    if (!m)
        fail_msg("no advice on the pool size in \"%s\"", strata_error_last());
    return strtoull(m + strlen("a pool of at least "), NULL, 10);
}

/* The documented rule: buffers of min(bytes/2, max(8 MiB, bytes/16), 64 MiB). */
static void test_buffer_rule(void **state)
{
    (void)state;
    static const struct {
        uint64_t bytes, buf;
    } cases[] = {
        {4096, 4096},           {8192, 4096},         {4 * 8192, 16384},
        {64 << 10, 32 << 10},   {1 * MiB, 512 << 10}, {16 * MiB, 8 * MiB},
        {64 * MiB, 8 * MiB},    {128 * MiB, 8 * MiB}, {256 * MiB, 16 * MiB},
        {100 * MiB + 4096, 8 * MiB},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        strata_pool *p;
        assert_ok(strata_pool_new(&p, cases[i].bytes));
        if (st_pool_buffer_bytes(p) != cases[i].buf)
            fail_msg("a pool of %llu bytes has buffers of %zu, want %llu",
                     (unsigned long long)cases[i].bytes, st_pool_buffer_bytes(p),
                     (unsigned long long)cases[i].buf);
        uint64_t n = ST_MAX(1, cases[i].bytes / cases[i].buf);
        assert_int_equal(strata_pool_bytes(p), n * cases[i].buf);
        assert_int_equal(st_pool_allocated_bytes(p), strata_pool_bytes(p)); /* eager */
        strata_pool_free(p);
    }
}

/* chunk_bytes 16, 32 and 64 MiB: with no saver, a saver's own pool, a caller's pool of
 * the advised size; a caller's pool too small is STRATA_EINVAL naming that size. */
static void test_large_chunks(void **state)
{
    (void)state;
    tu_set src;
    big_state(&src, 1);
    char ck[700];
    for (uint32_t chunk = 16u << 20; chunk && chunk <= 64u << 20; chunk <<= 1) {
        print_message("chunk_bytes %u MiB\n", chunk >> 20);
        assert_ok(save_async(NULL, "nosaver", &src, chunk, ck, sizeof ck));
        check_big(ck, &src);
        tu_rmrf(ck);
        strata_saver *sv;
        assert_ok(strata_saver_new(&sv, NULL, NULL));
        assert_ok(save_async(sv, "own", &src, chunk, ck, sizeof ck));
        check_big(ck, &src);
        tu_rmrf(ck);
        strata_saver_free(sv);
        /* a caller's pool of 64 MiB has buffers of 8 MiB: refused, with the size needed */
        strata_pool *pool;
        assert_ok(strata_pool_new(&pool, 64 * MiB));
        assert_ok(strata_saver_new(&sv, NULL, pool));
        assert_rc(save_async(sv, "small", &src, chunk, ck, sizeof ck), STRATA_EINVAL);
        assert_msg_has("chunk_bytes of at most 8388608");
        uint64_t want = advised_bytes();
        assert_int_equal(want, 16 * (uint64_t)chunk); /* as strata.h says */
        assert_false(tu_exists(ck));
        strata_saver_free(sv);
        strata_pool_free(pool);
        if (chunk == 16u << 20) { /* the advice is the least that works */
            assert_ok(strata_pool_new(&pool, want - 4096));
            assert_ok(strata_saver_new(&sv, NULL, pool));
            assert_rc(save_async(sv, "small", &src, chunk, ck, sizeof ck), STRATA_EINVAL);
            assert_int_equal(advised_bytes(), want);
            strata_saver_free(sv);
            strata_pool_free(pool);
        }
        assert_ok(strata_pool_new(&pool, want));
        assert_true(st_pool_buffer_bytes(pool) >= chunk);
        assert_ok(strata_saver_new(&sv, NULL, pool));
        assert_ok(save_async(sv, "advised", &src, chunk, ck, sizeof ck));
        check_big(ck, &src);
        tu_rmrf(ck);
        strata_saver_free(sv);
        strata_pool_free(pool);
    }
    tu_set_free(&src);
}

/* For chunks up to 8 MiB the advice is twice the chunk. */
static void test_small_chunk_advice(void **state)
{
    (void)state;
    tu_set src;
    tu_set_init(&src, 1);
    static const uint64_t shape[] = {300007};
    tu_set_shard(&src, 0, "v", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    strata_pool *pool;
    assert_ok(strata_pool_new(&pool, 8192)); /* two 4 KiB buffers */
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, pool));
    char ck[700];
    assert_rc(save_async(sv, "tiny", &src, 1 << 16, ck, sizeof ck), STRATA_EINVAL);
    assert_msg_has("chunk_bytes of at most 4096");
    uint64_t want = advised_bytes();
    assert_int_equal(want, 2 << 16);
    strata_saver_free(sv);
    strata_pool_free(pool);
    assert_ok(strata_pool_new(&pool, want));
    assert_ok(strata_saver_new(&sv, NULL, pool));
    assert_ok(save_async(sv, "tiny", &src, 1 << 16, ck, sizeof ck));
    strata_saver_free(sv);
    strata_pool_free(pool);
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "v", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 0);
    const char *u = ck;
    assert_ok(strata_load(NULL, NULL, &u, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_set_free(&src);
}

/* ---- the test hook: records the pool of each save's coordinator (in the order they
 * start), and holds them there while hook_hold is set ---- */

#define MAXHOOK 8
static pthread_mutex_t hook_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hook_cv = PTHREAD_COND_INITIALIZER;
static int hook_hold, nhook;
static strata_pool *hook_pool[MAXHOOK];
static size_t hook_buf[MAXHOOK]; /* its buffer size */

static void the_hook(strata_pool *pool)
{
    pthread_mutex_lock(&hook_mu);
    if (nhook < MAXHOOK) {
        hook_buf[nhook] = st_pool_buffer_bytes(pool);
        hook_pool[nhook++] = pool;
    }
    pthread_cond_broadcast(&hook_cv);
    while (hook_hold)
        pthread_cond_wait(&hook_cv, &hook_mu);
    pthread_mutex_unlock(&hook_mu);
}

static void hook_start(int hold)
{
    pthread_mutex_lock(&hook_mu);
    hook_hold = hold;
    nhook = 0;
    pthread_mutex_unlock(&hook_mu);
    st_async_test_hook = the_hook;
}

/* The pool of the i-th coordinator to start, once it has reached the hook. */
static strata_pool *hook_wait(int i)
{
    pthread_mutex_lock(&hook_mu);
    while (nhook <= i)
        pthread_cond_wait(&hook_cv, &hook_mu);
    strata_pool *p = hook_pool[i];
    pthread_mutex_unlock(&hook_mu);
    return p;
}

static void hook_release(void)
{
    pthread_mutex_lock(&hook_mu);
    hook_hold = 0;
    pthread_cond_broadcast(&hook_cv);
    pthread_mutex_unlock(&hook_mu);
}

/* After each test, passed or failed: no coordinator stays held, so that a failure fails
 * its test instead of hanging the next one. Only then is the hook unset (no save runs). */
static int hook_teardown(void **state)
{
    (void)state;
    hook_release();
    st_async_test_hook = NULL;
    return 0;
}

/* Resident bytes of this process (/proc/self/statm). */
static uint64_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    assert_non_null(f);
    unsigned long long size, res;
    assert_int_equal(fscanf(f, "%llu %llu", &size, &res), 2);
    fclose(f);
    return res * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* strata_save_start with no pool (a saver without one, or no saver) returns having
 * allocated none of the pool: with the coordinator held before it starts, the pool it
 * will use holds no buffer and the process grew by far less than the pool (512 MiB here).
 * Released, the save allocates the buffers on its own thread and loads bitwise. */
static void test_start_allocates_no_pool(void **state)
{
    (void)state;
    size_t n = (size_t)512 * MiB + 12345;
    unsigned char *x = malloc(n), *back = malloc(n);
    assert_non_null(x);
    assert_non_null(back);
    for (size_t i = 0; i < n; i++)
        x[i] = (unsigned char)(i * 131 + (i >> 16));
    uint64_t shape[1] = {n};
    strata_state *st;
    assert_ok(strata_state_new(&st));
    strata_shard sh = {.name = "x", .dtype = STRATA_U8, .ndim = 1, .global_shape = shape, .data = x};
    assert_ok(strata_state_add_shard(st, &sh));
    strata_state *ld;
    assert_ok(strata_state_new(&ld));
    sh.data = back;
    assert_ok(strata_state_add_shard(ld, &sh));
    for (int with_saver = 0; with_saver <= 1; with_saver++) {
        char ck[700];
        snprintf(ck, sizeof ck, "%s/start%d", base_dir, with_saver);
        strata_saver *sv = NULL;
        if (with_saver)
            assert_ok(strata_saver_new(&sv, NULL, NULL));
        hook_start(1);
        strata_save_opts o = opts(0);
        strata_handle *h;
        const char *u = ck;
        uint64_t rss0 = rss_bytes();
        assert_ok(strata_save_start(&h, sv, &u, 1, &st, 1, &o));
        uint64_t rss1 = rss_bytes();
        strata_pool *pool = hook_wait(0);
        assert_non_null(pool);
        uint64_t pool_bytes = strata_pool_bytes(pool), got = st_pool_allocated_bytes(pool);
        print_message("%s: pool of %llu MiB, %llu bytes of it allocated and RSS +%lld KiB "
                      "when strata_save_start returned\n",
                      with_saver ? "saver without a pool" : "no saver",
                      (unsigned long long)(pool_bytes >> 20), (unsigned long long)got,
                      ((long long)rss1 - (long long)rss0) / 1024);
        assert_true(pool_bytes >= 256 * MiB); /* min(1 GiB, the state) */
        assert_int_equal(got, 0);
        assert_true(rss1 < rss0 + 64 * MiB);
        assert_int_equal(strata_handle_status(NULL, h), 0);
        hook_release();
        assert_ok(strata_wait_durable(NULL, h));
        assert_true(st_pool_allocated_bytes(pool) > 0); /* by the save's thread */
        strata_handle_free(h);
        if (sv) { /* the saver keeps it for its next save */
            char ck2[700];
            snprintf(ck2, sizeof ck2, "%s/start-again", base_dir);
            const char *u2 = ck2;
            assert_ok(strata_save_start(&h, sv, &u2, 1, &st, 1, &o));
            assert_ok(strata_wait_durable(NULL, h));
            strata_handle_free(h);
            assert_ptr_equal(hook_wait(1), pool);
            tu_rmrf(ck2);
        }
        strata_saver_free(sv);
        memset(back, 0, n);
        assert_ok(strata_load(NULL, NULL, &u, 1, &ld, 1, NULL));
        assert_memory_equal(x, back, n);
        tu_rmrf(ck);
    }
    strata_state_free(st);
    strata_state_free(ld);
    free(x);
    free(back);
}

/* A saver's own pool made for small chunks is made again for larger ones when no save
 * uses it; while one does, the larger-chunk save gets a pool of its own. All load. */
static void test_own_pool_larger_chunks(void **state)
{
    (void)state;
    tu_set a, b;
    tu_set_init(&a, 1);
    tu_set_init(&b, 1);
    static const uint64_t shape[] = {3 * 1048576 + 17};
    tu_set_shard(&a, 0, "v", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    tu_set_shard(&b, 0, "v", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, NULL));
    char ck[4][700];
    const char *u[4];
    for (int i = 0; i < 4; i++) {
        snprintf(ck[i], sizeof ck[i], "%s/grow%d", base_dir, i);
        u[i] = ck[i];
    }
    strata_save_opts o4 = opts(4096), o32 = opts(32u << 20), o64 = opts(64u << 20);
    strata_handle *h, *h2;
    hook_start(0);
    assert_ok(strata_save_start(&h, sv, &u[0], 1, a.st, 1, &o4));
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    hook_wait(0);
    assert_true(hook_buf[0] < 32u << 20);
    /* idle: made again, for 32 MiB chunks (held, so that it is in use below) */
    hook_start(1);
    assert_ok(strata_save_start(&h, sv, &u[1], 1, a.st, 1, &o32));
    strata_pool *p1 = hook_wait(0);
    /* in use (h not freed): a 64 MiB chunk gets a pool of its own */
    assert_ok(strata_save_start(&h2, sv, &u[2], 1, b.st, 1, &o64));
    strata_pool *p2 = hook_wait(1);
    hook_release();
    assert_true(p1 != p2);
    assert_true(hook_buf[0] >= 32u << 20 && hook_buf[0] < 64u << 20);
    assert_true(hook_buf[1] >= 64u << 20);
    assert_ok(strata_wait_durable(NULL, h2));
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h2);
    strata_handle_free(h);
    /* the saver kept the one made for 32 MiB chunks: buffers already allocated when the
     * next save starts (a new pool has none) */
    hook_start(1);
    assert_ok(strata_save_start(&h, sv, &u[3], 1, b.st, 1, &o32));
    strata_pool *p3 = hook_wait(0);
    assert_ptr_equal(p3, p1);
    assert_true(st_pool_allocated_bytes(p3) > 0);
    hook_release();
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    strata_saver_free(sv);
    static const uint32_t want_chunk[4] = {4096, 32u << 20, 64u << 20, 32u << 20};
    for (int i = 0; i < 4; i++) {
        strata_ckpt *c;
        assert_ok(strata_ckpt_open(&c, ck[i], 0));
        assert_int_equal(strata_ckpt_chunk_bytes(c), want_chunk[i]);
        strata_ckpt_free(c);
        tu_set d;
        tu_set_init(&d, 1);
        tu_set_shard(&d, 0, "v", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 0);
        assert_ok(strata_load(NULL, NULL, &u[i], 1, d.st, 1, NULL));
        assert_int_equal(tu_set_check(&d), 0);
        tu_set_free(&d);
    }
    tu_set_free(&a);
    tu_set_free(&b);
}

/* Two saves at once through a saver without a pool share the one it makes: both start
 * before either coordinator runs (held), then allocate its buffers side by side (the race
 * ThreadSanitizer watches); both load bitwise. */
static void test_shared_lazy_pool(void **state)
{
    (void)state;
    static const uint64_t shape[] = {24 * 1048576 + 3};
    tu_set a, b;
    tu_set_init(&a, 1);
    tu_set_init(&b, 1);
    tu_set_shard(&a, 0, "v", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    tu_set_shard(&b, 0, "v", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, NULL));
    char ck[2][700];
    const char *u[2];
    for (int i = 0; i < 2; i++) {
        snprintf(ck[i], sizeof ck[i], "%s/shared%d", base_dir, i);
        u[i] = ck[i];
    }
    strata_save_opts o = opts(1 << 20);
    strata_handle *h[2];
    hook_start(1);
    assert_ok(strata_save_start(&h[0], sv, &u[0], 1, a.st, 1, &o));
    assert_ok(strata_save_start(&h[1], sv, &u[1], 1, b.st, 1, &o));
    strata_pool *p = hook_wait(0);
    assert_ptr_equal(hook_wait(1), p);
    assert_int_equal(st_pool_allocated_bytes(p), 0);
    hook_release();
    for (int i = 0; i < 2; i++) {
        assert_ok(strata_wait_durable(NULL, h[i]));
        strata_handle_free(h[i]);
    }
    assert_true(st_pool_allocated_bytes(p) > 0);
    assert_true(st_pool_allocated_bytes(p) <= strata_pool_bytes(p));
    strata_saver_free(sv);
    for (int i = 0; i < 2; i++) {
        tu_set d;
        tu_set_init(&d, 1);
        tu_set_shard(&d, 0, "v", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 0);
        assert_ok(strata_load(NULL, NULL, &u[i], 1, d.st, 1, NULL));
        assert_int_equal(tu_set_check(&d), 0);
        tu_set_free(&d);
    }
    tu_set_free(&a);
    tu_set_free(&b);
}

/* ---- device memory: a lazy pool pinned as it is allocated (fake runtime) ---- */

typedef struct {
    uint64_t async_copies, async_bytes, async_pinned_bytes, sync_copies, streams_created,
        streams_destroyed, pending_at_destroy, registered_bytes, bad_calls;
} fake_counters;

static void test_lazy_pool_pinned(void **state)
{
    (void)state;
    if (st_cuda_check() != 0) {
        const char *gpu = getenv("STRATA_TEST_GPU"); /* make test-gpu: a device is required */
        if (gpu && *gpu)
            fail_msg("STRATA_TEST_GPU is set, but %s", strata_error_last());
        print_message("no CUDA runtime (and no fake one beside this test): skipped\n");
        skip();
    }
    const char *lib = getenv("STRATA_CUDART");
    void *rt = dlopen(lib && *lib ? lib : "libcudart.so", RTLD_NOW);
    assert_non_null(rt);
    int (*dmalloc)(void **, size_t), (*dfree)(void *);
    void (*counters)(fake_counters *);
    *(void **)&dmalloc = dlsym(rt, "cudaMalloc");
    *(void **)&dfree = dlsym(rt, "cudaFree");
    *(void **)&counters = dlsym(rt, "fake_cuda_counters"); /* the fake runtime only */
    assert_true(dmalloc && dfree);
    size_t n = 3 * MiB + 4 * 1000; /* f32 elements */
    float *host = malloc(n * 4), *back = malloc(n * 4);
    for (size_t i = 0; i < n; i++)
        host[i] = (float)i * 0.5f - 3.0f;
    void *dev;
    assert_int_equal(dmalloc(&dev, n * 4), 0);
    assert_ok(st_cuda_copy(dev, host, n * 4, 0));
    uint64_t shape[1] = {n};
    strata_state *st;
    assert_ok(strata_state_new(&st));
    strata_shard sh = {.name = "g", .dtype = STRATA_F32, .ndim = 1, .global_shape = shape,
                       .data = dev, .device = 1};
    assert_ok(strata_state_add_shard(st, &sh));
    fake_counters c0 = {0}, c1 = {0};
    if (counters)
        counters(&c0);
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, NULL));
    char ck[700];
    snprintf(ck, sizeof ck, "%s/device", base_dir);
    const char *u = ck;
    strata_save_opts o = opts(1 << 20);
    hook_start(0);
    strata_handle *h;
    assert_ok(strata_save_start(&h, sv, &u, 1, &st, 1, &o));
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    strata_pool *pool = hook_wait(0);
    assert_true(st_pool_allocated_bytes(pool) > 0);
    if (counters) {
        counters(&c1);
        /* every device byte was copied into pinned memory, and what is pinned is exactly
         * the buffers allocated */
        assert_int_equal(c1.async_bytes - c0.async_bytes, n * 4);
        assert_int_equal(c1.async_pinned_bytes - c0.async_pinned_bytes, n * 4);
        assert_int_equal(c1.registered_bytes - c0.registered_bytes,
                         st_pool_allocated_bytes(pool));
        assert_int_equal(c1.bad_calls, 0);
    }
    strata_saver_free(sv);
    if (counters) {
        counters(&c1);
        assert_int_equal(c1.registered_bytes, c0.registered_bytes); /* unpinned with it */
    }
    strata_state *ld;
    assert_ok(strata_state_new(&ld));
    sh.data = back;
    sh.device = 0;
    assert_ok(strata_state_add_shard(ld, &sh));
    assert_ok(strata_load(NULL, NULL, &u, 1, &ld, 1, NULL));
    assert_memory_equal(host, back, n * 4);
    strata_state_free(ld);
    strata_state_free(st);
    dfree(dev);
    free(host);
    free(back);
}

/* ---- the I/O buffers and the double-buffered lanes (src/io/pool.c) ---- */

/* The kernel's transparent huge page mode: "always", "madvise" or "never". */
static void thp_mode(char *out, size_t cap)
{
    snprintf(out, cap, "never");
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    char line[128];
    if (f && fgets(line, sizeof line, f)) {
        char *a = strchr(line, '['), *b = a ? strchr(a, ']') : NULL;
        if (a && b)
            snprintf(out, cap, "%.*s", (int)(b - a - 1), a + 1);
    }
    if (f)
        fclose(f);
}

/* A large I/O buffer starts at a 2 MiB boundary and, where the kernel has transparent huge
 * pages (or free hugetlb pages), is backed by huge pages once touched - as /proc/self/smaps
 * shows, not as assumed; a small one is page-aligned heap memory. */
static void test_io_buffers(void **state)
{
    (void)state;
    char mode[32];
    thp_mode(mode, sizeof mode);
    size_t n = ((size_t)4 << 20) + 8192; /* a read buffer: 4 MiB and the foreign shift */
    unsigned char *p = st_io_alloc(n);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % ((uintptr_t)2 << 20), 0);
    memset(p, 0x5a, n);
    int kind = st_io_pages(p, n);
    printf("io buffer of %zu bytes: %s (THP %s)\n", n, st_io_pages_name(kind), mode);
    if (strcmp(mode, "never") == 0)
        assert_true(kind == ST_PAGES_SMALL || kind == ST_PAGES_HUGETLB);
    else
        assert_true(kind != ST_PAGES_SMALL); /* at least one of its two huge pages */
    st_io_free(p, n);
    unsigned char *q = st_io_alloc(100000); /* under 2 MiB: the heap */
    assert_non_null(q);
    assert_int_equal((uintptr_t)q % 4096, 0);
    memset(q, 1, 100000);
    st_io_free(q, 100000);
}

typedef struct {
    atomic_int firsts, seconds;
    atomic_uint_fast64_t sum;
    size_t fail_at; /* the second stage fails at this task (SIZE_MAX: never) */
    int *seen;      /* per task: stages done, 1 + 2 */
} pipe_t;

static int stage1(void *ctx, size_t task, void *buf, int64_t *aux)
{
    pipe_t *c = ctx;
    memset(buf, (int)(task & 0xff), 4096);
    *aux = (int64_t)task * 3;
    c->seen[task] += 1;
    atomic_fetch_add(&c->firsts, 1);
    return 0;
}

static int stage2(void *ctx, size_t task, void *buf, int64_t *aux)
{
    pipe_t *c = ctx;
    const unsigned char *b = buf;
    for (size_t i = 0; i < 4096; i++)
        if (b[i] != (unsigned char)(task & 0xff))
            return st_fail(STRATA_EIO, "task %zu: the buffer holds another task's bytes", task);
    if (*aux != (int64_t)task * 3)
        return st_fail(STRATA_EIO, "task %zu: aux %lld", task, (long long)*aux);
    c->seen[task] += 2;
    atomic_fetch_add(&c->seconds, 1);
    atomic_fetch_add(&c->sum, task);
    if (task == c->fail_at)
        return st_fail(STRATA_ECHECKSUM, "task %zu is bad", task);
    return 0;
}

/* Each task passes the first stage, then the second with the buffer and value the first left
 * for it, exactly once, on every number of lanes; a failure in the second stage comes back
 * with its code and message. */
static void test_pipeline(void **state)
{
    (void)state;
    const size_t N = 2000;
    for (int lanes = 1; lanes <= 5; lanes += 2) {
        pipe_t c = {.fail_at = SIZE_MAX, .seen = calloc(N, sizeof(int))};
        assert_int_equal(st_pipeline(lanes, N, 4096, stage1, stage2, &c), 0);
        assert_int_equal(atomic_load(&c.firsts), (int)N);
        assert_int_equal(atomic_load(&c.seconds), (int)N);
        assert_int_equal(atomic_load(&c.sum), N * (N - 1) / 2);
        for (size_t t = 0; t < N; t++)
            assert_int_equal(c.seen[t], 3);
        free(c.seen);
        pipe_t f = {.fail_at = 700, .seen = calloc(N, sizeof(int))};
        assert_int_equal(st_pipeline(lanes, N, 4096, stage1, stage2, &f), STRATA_ECHECKSUM);
        assert_non_null(strstr(strata_error_last(), "task 700 is bad"));
        for (size_t t = 0; t < N; t++) /* never the second stage without the first */
            assert_true(f.seen[t] == 0 || f.seen[t] == 1 || f.seen[t] == 3);
        assert_int_equal(f.seen[700], 3);
        free(f.seen);
    }
}

int main(int argc, char **argv)
{
    (void)argc;
    /* the fake CUDA runtime, when built beside this binary (make test builds it) */
    char self[4096];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 64);
    if (k > 0 && !getenv("STRATA_CUDART")) {
        self[k] = 0;
        char lib[4200];
        snprintf(lib, sizeof lib, "%s/libfakecudart.so", dirname(self));
        if (tu_exists(lib))
            setenv("STRATA_CUDART", lib, 1);
    }
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_io_buffers),
        cmocka_unit_test(test_pipeline),
        cmocka_unit_test(test_buffer_rule),
        cmocka_unit_test(test_small_chunk_advice),
        cmocka_unit_test(test_large_chunks),
        cmocka_unit_test_teardown(test_start_allocates_no_pool, hook_teardown),
        cmocka_unit_test_teardown(test_own_pool_larger_chunks, hook_teardown),
        cmocka_unit_test_teardown(test_shared_lazy_pool, hook_teardown),
        cmocka_unit_test_teardown(test_lazy_pool_pinned, hook_teardown),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
