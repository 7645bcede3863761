/* test_cuda.c - shards in CUDA device memory. Without a usable CUDA runtime and driver
 * (this project's usual machines) registering one is STRATA_EDEVICE with a clear message;
 * with a GPU, a save from and a load into device buffers round-trip bitwise. */
#include <dlfcn.h>

#include "io/cuda.h"
#include "testutil.h"

static char base_dir[512];
TU_TMPDIR_GROUP(base_dir, "cuda")

static const uint64_t shape[] = {1031, 67};

static void test_device_shards(void **state)
{
    (void)state;
    size_t n = 1031 * 67, bytes = n * 4;
    if (st_cuda_check() != 0) { /* no GPU: the clear error, for save and load alike */
        float host[4];
        strata_state *st;
        assert_ok(strata_state_new(&st));
        strata_shard sh = {.name = "gpu.w", .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .data = host, .device = 1};
        assert_rc(strata_state_add_shard(st, &sh), STRATA_EDEVICE);
        assert_msg_has("gpu.w");
        assert_msg_has("CUDA is not usable");
        sh.device = 0; /* the same shard in host memory is fine */
        sh.data = malloc(bytes);
        assert_ok(strata_state_add_shard(st, &sh));
        free(sh.data);
        strata_state_free(st);
        print_message("no usable CUDA device: checked the error path only\n");
        return;
    }
    /* a GPU: device buffers through the runtime the library uses */
    void *h = dlopen("libcudart.so", RTLD_NOW);
    assert_non_null(h);
    int (*cmalloc)(void **, size_t) = (int (*)(void **, size_t))dlsym(h, "cudaMalloc");
    int (*cfree)(void *) = (int (*)(void *))dlsym(h, "cudaFree");
    assert_non_null(cmalloc);
    float *src = malloc(bytes), *back = malloc(bytes);
    for (size_t i = 0; i < n; i++)
        src[i] = (float)i * 0.25f - 7.0f;
    void *dsrc, *ddst;
    assert_int_equal(cmalloc(&dsrc, bytes), 0);
    assert_int_equal(cmalloc(&ddst, bytes), 0);
    assert_ok(st_cuda_copy(dsrc, src, bytes, 0));
    char ck[700];
    snprintf(ck, sizeof ck, "%s/gpu", base_dir);
    strata_state *s, *d;
    assert_ok(strata_state_new(&s));
    assert_ok(strata_state_new(&d));
    strata_shard sh = {.name = "gpu.w", .dtype = STRATA_F32, .ndim = 2, .global_shape = shape,
                       .data = dsrc, .device = 1};
    assert_ok(strata_state_add_shard(s, &sh));
    sh.data = ddst;
    assert_ok(strata_state_add_shard(d, &sh));
    assert_ok(strata_save(ck, &s, 1, NULL, NULL));
    assert_ok(strata_load(ck, &d, 1, NULL, NULL));
    assert_ok(st_cuda_copy(back, ddst, bytes, 1));
    assert_memory_equal(src, back, bytes);
    strata_state_free(s);
    strata_state_free(d);
    cfree(dsrc);
    cfree(ddst);
    free(src);
    free(back);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_device_shards)};
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
