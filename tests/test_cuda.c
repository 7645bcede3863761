/* test_cuda.c - shards in CUDA device memory. Without a usable CUDA runtime and driver
 * (this project's usual machines) registering one is STRATA_EDEVICE with a clear message.
 * With a device - a real GPU, or the fake runtime (tests/fake_cudart.c, loaded through
 * STRATA_CUDART; tests/run.sh runs this file against it too) - saves from device buffers
 * (synchronous, and asynchronous through a saver with a pinned pool, with the
 * lazy-consistency poison test) load back into device buffers bitwise, and a failing
 * device copy fails the save with STRATA_EDEVICE and commits nothing. With STRATA_TEST_GPU set
 * (make test-gpu), no usable device is a failure rather than a skip. */
#include <dlfcn.h>

#include "io/cuda.h"
#include "testutil.h"

static char base_dir[512];
TU_TMPDIR_GROUP(base_dir, "cuda")

#define ROWS 1031
#define COLS 67
static const uint64_t shape[] = {ROWS, COLS};
static const size_t N = (size_t)ROWS * COLS, BYTES = (size_t)ROWS * COLS * 4;

/* The runtime strata loaded: the same library, so that buffers are its device memory. */
static struct {
    int (*malloc)(void **, size_t);
    int (*free)(void *);
    int (*memcpy)(void *, const void *, size_t, int);
    void (*counters)(void *); /* the fake runtime only */
} rt;

typedef struct {
    uint64_t async_copies, async_bytes, async_pinned_bytes, sync_copies, streams_created,
        streams_destroyed, pending_at_destroy, registered_bytes, bad_calls;
} fake_counters;

static void open_runtime(void)
{
    const char *env = getenv("STRATA_CUDART");
    void *h = dlopen(env && *env ? env : "libcudart.so", RTLD_NOW);
    assert_non_null(h);
    *(void **)&rt.malloc = dlsym(h, "cudaMalloc");
    *(void **)&rt.free = dlsym(h, "cudaFree");
    *(void **)&rt.memcpy = dlsym(h, "cudaMemcpy");
    *(void **)&rt.counters = dlsym(h, "fake_cuda_counters");
    assert_true(rt.malloc && rt.free && rt.memcpy);
}

static void counters(fake_counters *c)
{
    memset(c, 0, sizeof *c);
    if (rt.counters)
        rt.counters(c);
}

/* A device buffer holding pattern `seed`. */
static void *device_pattern(uint32_t seed, float *host)
{
    for (size_t i = 0; i < N; i++)
        host[i] = (float)(i ^ seed) * 0.25f - 7.0f;
    void *d;
    assert_int_equal(rt.malloc(&d, BYTES), 0);
    assert_ok(st_cuda_copy(d, host, BYTES, 0));
    return d;
}

/* A state of two ranks, each holding half of the rows of gpu.w on the device, plus a
 * host blob. */
static void two_rank_state(strata_state *st[2], void *dev, uint64_t offs[2][2],
                           uint64_t lens[2][2], char *blob)
{
    for (int r = 0; r < 2; r++) {
        assert_ok(strata_state_new(&st[r]));
        offs[r][0] = r ? ROWS / 2 : 0;
        offs[r][1] = 0;
        lens[r][0] = r ? ROWS - ROWS / 2 : ROWS / 2;
        lens[r][1] = COLS;
        strata_shard sh = {.name = "gpu.w", .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .offsets = offs[r], .lengths = lens[r],
                           .data = (char *)dev + offs[r][0] * COLS * 4, .device = 1};
        assert_ok(strata_state_add_shard(st[r], &sh));
        assert_ok(strata_state_add_blob(st[r], "step", 0, 0, blob, strlen(blob)));
    }
}

/* Loads ck into fresh device memory (one rank, whole tensor) and compares with want. */
static void load_and_compare(const char *ck, const float *want)
{
    void *d;
    assert_int_equal(rt.malloc(&d, BYTES), 0);
    strata_state *s;
    assert_ok(strata_state_new(&s));
    strata_shard sh = {.name = "gpu.w", .dtype = STRATA_F32, .ndim = 2, .global_shape = shape,
                       .data = d, .device = 1};
    assert_ok(strata_state_add_shard(s, &sh));
    assert_ok(strata_load(NULL, NULL, &ck, 1, &s, 1, NULL));
    float *back = malloc(BYTES);
    assert_ok(st_cuda_copy(back, d, BYTES, 1));
    assert_memory_equal(want, back, BYTES);
    free(back);
    strata_state_free(s);
    rt.free(d);
}

/* STRATA_LOAD_CAST into device memory: an f32 tensor of 6 MiB (reads of up to 4 MiB, so
 * runs whose converted bytes exceed the 1 MiB host stage) loaded as bf16 and as f64 into
 * device buffers equals the same cast into host memory (test_cast checks that one against
 * a reference), bitwise. */
static void test_cast_to_device(void **state)
{
    (void)state;
    if (st_cuda_check() != 0)
        skip();
    open_runtime();
    enum { M = 3 << 19 }; /* elements */
    static const uint64_t vshape[] = {M / 512, 512};
    float *src = malloc((size_t)M * 4);
    tu_rng rng = {11};
    for (size_t i = 0; i < M; i++) {
        uint32_t u = (uint32_t)tu_next(&rng);
        memcpy(&src[i], &u, 4);
    }
    char ck[700];
    snprintf(ck, sizeof ck, "%s/cast", base_dir);
    strata_state *s;
    assert_ok(strata_state_new(&s));
    strata_shard sh = {.name = "v", .dtype = STRATA_F32, .ndim = 2, .global_shape = vshape,
                       .data = src};
    assert_ok(strata_state_add_shard(s, &sh));
    const char *u = ck;
    assert_ok(strata_save(NULL, NULL, &u, 1, &s, 1, NULL));
    strata_state_free(s);
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.flags = STRATA_LOAD_CAST;
    static const strata_dtype to[] = {STRATA_BF16, STRATA_F64};
    for (int k = 0; k < 2; k++) {
        size_t bytes = (size_t)M * strata_dtype_size(to[k]);
        void *host = malloc(bytes), *back = malloc(bytes), *dev;
        assert_int_equal(rt.malloc(&dev, bytes), 0);
        strata_state *sd[2];
        for (int r = 0; r < 2; r++) {
            assert_ok(strata_state_new(&sd[r]));
            sh = (strata_shard){.name = "v", .dtype = to[k], .ndim = 2, .global_shape = vshape,
                                .data = r ? dev : host, .device = r};
            assert_ok(strata_state_add_shard(sd[r], &sh));
        }
        fake_counters a, b;
        counters(&a);
        assert_ok(strata_load(NULL, NULL, &u, 1, sd, 2, &lo));
        counters(&b);
        assert_ok(st_cuda_copy(back, dev, bytes, 1));
        assert_memory_equal(host, back, bytes);
        if (rt.counters) /* staged 1 MiB at a time: at least that many copies */
            assert_true(b.sync_copies - a.sync_copies >= bytes >> 20);
        for (int r = 0; r < 2; r++)
            strata_state_free(sd[r]);
        rt.free(dev);
        free(host);
        free(back);
    }
    free(src);
}

static void test_no_device(void **state)
{
    (void)state;
    if (st_cuda_check() == 0)
        skip();
    float host[4];
    strata_state *st;
    assert_ok(strata_state_new(&st));
    strata_shard sh = {.name = "gpu.w", .dtype = STRATA_F32, .ndim = 2, .global_shape = shape,
                       .data = host, .device = 1};
    assert_rc(strata_state_add_shard(st, &sh), STRATA_EDEVICE);
    assert_msg_has("gpu.w");
    assert_msg_has("CUDA is not usable");
    print_message("no usable CUDA device: %s\n", strata_error_last());
    sh.device = 0; /* the same shard in host memory is fine */
    sh.data = malloc(BYTES);
    assert_ok(strata_state_add_shard(st, &sh));
    free(sh.data);
    strata_state_free(st);
}

static void test_sync_roundtrip(void **state)
{
    (void)state;
    if (st_cuda_check() != 0)
        skip();
    open_runtime();
    float *host = malloc(BYTES);
    void *dev = device_pattern(1, host);
    strata_state *st[2];
    uint64_t offs[2][2], lens[2][2];
    two_rank_state(st, dev, offs, lens, (char[]){"step 7"});
    char ck[700];
    snprintf(ck, sizeof ck, "%s/sync", base_dir);
    fake_counters a, b;
    counters(&a);
    const char *u = ck;
    assert_ok(strata_save(NULL, NULL, &u, 1, st, 2, NULL));
    counters(&b);
    if (rt.counters) { /* every device byte went through the streams, none was missed */
        assert_int_equal(b.async_bytes - a.async_bytes, BYTES);
        assert_int_equal(b.bad_calls, 0);
        assert_int_equal(b.pending_at_destroy, 0);
    }
    load_and_compare(ck, host);
    for (int r = 0; r < 2; r++)
        strata_state_free(st[r]);
    rt.free(dev);
    free(host);
}

/* The lazy-consistency test on device memory: poison the device buffers right after the
 * snapshot; the checkpoint holds the values from before. The pool (256 KiB, two 128 KiB
 * buffers) is smaller than one shard, and is registered as pinned for the copies. */
static void test_async_pinned(void **state)
{
    (void)state;
    if (st_cuda_check() != 0)
        skip();
    open_runtime();
    float *host = malloc(BYTES), *poison = malloc(BYTES);
    void *dev = device_pattern(2, host);
    strata_state *st[2];
    uint64_t offs[2][2], lens[2][2];
    two_rank_state(st, dev, offs, lens, (char[]){"step 8"});
    strata_pool *pool;
    assert_ok(strata_pool_new(&pool, 256 << 10));
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 64 << 10;
    char ck[700];
    snprintf(ck, sizeof ck, "%s/async", base_dir);
    fake_counters a, b;
    counters(&a);
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, pool));
    strata_handle *h;
    const char *u = ck;
    assert_ok(strata_save_start(&h, sv, &u, 1, st, 2, &o));
    assert_ok(strata_wait_snapshot(h));
    memset(poison, 0xEE, BYTES);
    assert_ok(st_cuda_copy(dev, poison, BYTES, 0));
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    strata_saver_free(sv);
    counters(&b);
    if (rt.counters) {
        assert_int_equal(b.async_bytes - a.async_bytes, BYTES);
        assert_int_equal(b.async_pinned_bytes - a.async_pinned_bytes, BYTES);
        assert_int_equal(b.registered_bytes, strata_pool_bytes(pool));
        assert_int_equal(b.bad_calls, 0);
    }
    load_and_compare(ck, host);
    strata_pool_free(pool);
    counters(&b);
    if (rt.counters)
        assert_int_equal(b.registered_bytes, 0); /* unpinned with the pool */
    for (int r = 0; r < 2; r++)
        strata_state_free(st[r]);
    rt.free(dev);
    free(host);
    free(poison);
}

/* A device copy that fails mid-save (fake runtime only): STRATA_EDEVICE on the handle,
 * nothing committed, nothing left behind. */
static void test_async_copy_fails(void **state)
{
    (void)state;
    if (st_cuda_check() != 0 || !getenv("STRATA_CUDART"))
        skip();
    open_runtime();
    if (!rt.counters)
        skip();
    float *host = malloc(BYTES);
    void *dev = device_pattern(3, host);
    strata_state *st[2];
    uint64_t offs[2][2], lens[2][2];
    two_rank_state(st, dev, offs, lens, (char[]){"step 9"});
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 64 << 10;
    strata_pool *pool;
    assert_ok(strata_pool_new(&pool, 256 << 10));
    char ck[700];
    snprintf(ck, sizeof ck, "%s/fails", base_dir);
    setenv("FAKE_CUDA_FAIL_ASYNC_AFTER", "0", 1);
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, pool));
    strata_handle *h;
    const char *u = ck;
    assert_ok(strata_save_start(&h, sv, &u, 1, st, 2, &o));
    assert_rc(strata_wait_durable(NULL, h), STRATA_EDEVICE);
    assert_msg_has("cudaMemcpyAsync");
    assert_msg_has("gpu.w");
    strata_handle_free(h);
    strata_saver_free(sv);
    assert_rc(strata_save(NULL, NULL, &u, 1, st, 2, NULL), STRATA_EDEVICE);
    unsetenv("FAKE_CUDA_FAIL_ASYNC_AFTER");
    assert_false(tu_exists(ck));
    assert_ok(strata_save(NULL, NULL, &u, 1, st, 2, NULL)); /* and then it works */
    load_and_compare(ck, host);
    strata_pool_free(pool);
    for (int r = 0; r < 2; r++)
        strata_state_free(st[r]);
    rt.free(dev);
    free(host);
}

/* STRATA_SHARD_UNCHANGED on device memory: a frozen device weight that the base holds is
 * referred to with no device copy at all (the counters), sync and async, and the
 * checkpoint loads the base's values - even once the device bytes changed (a broken
 * promise, which shows they were not read). Without the mark the same save copies and
 * writes the changed bytes. */
static void test_marked_not_copied(void **state)
{
    (void)state;
    if (st_cuda_check() != 0)
        skip();
    open_runtime();
    float *host = malloc(BYTES), *other = malloc(BYTES);
    void *dev = device_pattern(5, host);
    char dir[700], ck[4][720], blob[] = "step 1";
    snprintf(dir, sizeof dir, "%s/marked", base_dir);
    const char *names[4] = {"s0", "s1", "s2", "s3"};
    for (int i = 0; i < 4; i++)
        snprintf(ck[i], sizeof ck[i], "%s/%s", dir, names[i]);
    strata_state *st[2]; /* [0] marked, [1] not */
    for (int m = 0; m < 2; m++) {
        assert_ok(strata_state_new(&st[m]));
        strata_shard sh = {.name = "gpu.w", .dtype = STRATA_F32, .ndim = 2, .global_shape = shape,
                           .data = dev, .device = 1, .flags = m ? 0 : STRATA_SHARD_UNCHANGED};
        assert_ok(strata_state_add_shard(st[m], &sh));
        assert_ok(strata_state_add_blob(st[m], "step", 0, 0, blob, strlen(blob)));
    }
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = STRATA_SAVE_INCREMENTAL | STRATA_SAVE_NO_SYNC;
    const char *u = ck[0];
    assert_ok(strata_save(NULL, NULL, &u, 1, &st[0], 1, &o)); /* no base: read and written */
    for (size_t i = 0; i < N; i++) /* the device bytes change: the promise is broken */
        other[i] = -host[i];
    assert_ok(st_cuda_copy(dev, other, BYTES, 0));
    for (int k = 1; k < 4; k++) {
        o.base = names[k - 1];
        u = ck[k];
        fake_counters a, b;
        counters(&a);
        strata_stats stats = STRATA_STATS_INIT;
        strata_state *s = st[k == 3];
        if (k == 2) { /* asynchronously */
            strata_handle *h;
            assert_ok(strata_save_start(&h, NULL, &u, 1, &s, 1, &o));
            assert_ok(strata_wait_durable(&stats, h));
            strata_handle_free(h);
        } else {
            assert_ok(strata_save(&stats, NULL, &u, 1, &s, 1, &o));
        }
        counters(&b);
        if (k < 3) {
            assert_int_equal(stats.bytes, strlen(blob));
            if (rt.counters)
                assert_int_equal(b.async_copies + b.sync_copies, a.async_copies + a.sync_copies);
            load_and_compare(ck[k], host);
        } else { /* unmarked: a device shard is written (never hashed against the base) */
            assert_int_equal(stats.bytes, BYTES + strlen(blob));
            load_and_compare(ck[k], other);
        }
    }
    for (int m = 0; m < 2; m++)
        strata_state_free(st[m]);
    rt.free(dev);
    free(host);
    free(other);
}

int main(void)
{
    const char *gpu = getenv("STRATA_TEST_GPU");
    if (gpu && *gpu && st_cuda_check() != 0) {
        fprintf(stderr, "test_cuda: STRATA_TEST_GPU is set, but %s\n", strata_error_last());
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_device),
        cmocka_unit_test(test_sync_roundtrip),
        cmocka_unit_test(test_cast_to_device),
        cmocka_unit_test(test_async_pinned),
        cmocka_unit_test(test_async_copy_fails),
        cmocka_unit_test(test_marked_not_copied),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
