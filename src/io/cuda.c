/* cuda.c - cudart through dlopen: device count and synchronous copies. */
#include "cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "../core/error.h"

static struct {
    int (*get_device_count)(int *);
    int (*memcpy)(void *, const void *, size_t, int);
    const char *(*error_string)(int);
    int state; /* 0 usable, else STRATA_EDEVICE */
    char why[256];
} cu;

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load(void)
{
    static const char *names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                                  "libcudart.so.11.0"};
    void *h = NULL;
    for (size_t i = 0; !h && i < sizeof names / sizeof names[0]; i++)
        h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    cu.state = STRATA_EDEVICE;
    if (!h) {
        snprintf(cu.why, sizeof cu.why, "the CUDA runtime (libcudart) cannot be loaded");
        return;
    }
    *(void **)&cu.get_device_count = dlsym(h, "cudaGetDeviceCount");
    *(void **)&cu.memcpy = dlsym(h, "cudaMemcpy");
    *(void **)&cu.error_string = dlsym(h, "cudaGetErrorString");
    if (!cu.get_device_count || !cu.memcpy || !cu.error_string) {
        snprintf(cu.why, sizeof cu.why, "libcudart lacks cudaGetDeviceCount/cudaMemcpy");
        return;
    }
    int n = 0, e = cu.get_device_count(&n);
    if (e) {
        snprintf(cu.why, sizeof cu.why, "cudaGetDeviceCount: %s", cu.error_string(e));
        return;
    }
    if (n < 1) {
        snprintf(cu.why, sizeof cu.why, "no CUDA device");
        return;
    }
    cu.state = 0;
}

int st_cuda_check(void)
{
    pthread_once(&once, load);
    return cu.state ? st_fail(cu.state, "device memory given, but CUDA is not usable: %s",
                              cu.why)
                    : 0;
}

int st_cuda_copy(void *dst, const void *src, size_t n, int to_host)
{
    int rc = st_cuda_check();
    if (rc)
        return rc;
    int e = cu.memcpy(dst, src, n, to_host ? 2 /* DeviceToHost */ : 1 /* HostToDevice */);
    return e ? st_fail(STRATA_EDEVICE, "cudaMemcpy: %s", cu.error_string(e)) : 0;
}
