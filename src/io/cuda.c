/* cuda.c - cudart through dlopen: the device count, copies, and pinned host memory.
 * Device -> host copies of a save are cudaMemcpyAsync on a stream of the calling thread
 * (created on first use, destroyed when the thread exits), completed by st_cuda_wait. */
#include "cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"

enum { H2D = 1, D2H = 2, STREAM_NON_BLOCKING = 1, HOST_REGISTER_PORTABLE = 1 };

static struct {
    int (*get_device_count)(int *);
    int (*memcpy)(void *, const void *, size_t, int);
    int (*memcpy_async)(void *, const void *, size_t, int, void *);
    int (*stream_create)(void **, unsigned);
    int (*stream_sync)(void *);
    int (*stream_destroy)(void *);
    int (*host_register)(void *, size_t, unsigned);
    int (*host_unregister)(void *);
    const char *(*error_string)(int);
    int state; /* 0 usable, else STRATA_EDEVICE */
    char why[256];
    pthread_key_t key; /* the calling thread's stream */
} cu;

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void stream_exit(void *s)
{
    if (s) {
        cu.stream_sync(s);
        cu.stream_destroy(s);
    }
}

#define SYM(field, name) (*(void **)&cu.field = dlsym(h, name))

static void load(void)
{
    /* $STRATA_CUDART names the runtime library to use (a path or a soname) */
    const char *env = getenv("STRATA_CUDART");
    static const char *names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                                  "libcudart.so.11.0"};
    void *h = NULL;
    if (env && *env)
        h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    for (size_t i = 0; !h && !(env && *env) && i < sizeof names / sizeof names[0]; i++)
        h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    cu.state = STRATA_EDEVICE;
    if (!h) {
        snprintf(cu.why, sizeof cu.why, "the CUDA runtime (%s) cannot be loaded",
                 env && *env ? env : "libcudart");
        return;
    }
    if (!SYM(get_device_count, "cudaGetDeviceCount") || !SYM(memcpy, "cudaMemcpy") ||
        !SYM(memcpy_async, "cudaMemcpyAsync") ||
        !SYM(stream_create, "cudaStreamCreateWithFlags") ||
        !SYM(stream_sync, "cudaStreamSynchronize") ||
        !SYM(stream_destroy, "cudaStreamDestroy") || !SYM(host_register, "cudaHostRegister") ||
        !SYM(host_unregister, "cudaHostUnregister") ||
        !SYM(error_string, "cudaGetErrorString")) {
        snprintf(cu.why, sizeof cu.why, "the CUDA runtime lacks a function strata uses: %s",
                 dlerror());
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
    if (pthread_key_create(&cu.key, stream_exit)) {
        snprintf(cu.why, sizeof cu.why, "out of thread-local keys");
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

static int cuda_err(const char *what, int e)
{
    return st_fail(STRATA_EDEVICE, "%s: %s", what, cu.error_string(e));
}

int st_cuda_copy(void *dst, const void *src, size_t n, int to_host)
{
    int rc = st_cuda_check();
    if (rc)
        return rc;
    int e = cu.memcpy(dst, src, n, to_host ? D2H : H2D);
    return e ? cuda_err("cudaMemcpy", e) : 0;
}

int st_cuda_copy_async(void *dst, const void *src, size_t n)
{
    int rc = st_cuda_check();
    if (rc)
        return rc;
    void *s = pthread_getspecific(cu.key);
    if (!s) {
        int e = cu.stream_create(&s, STREAM_NON_BLOCKING);
        if (e)
            return cuda_err("cudaStreamCreateWithFlags", e);
        pthread_setspecific(cu.key, s);
    }
    int e = cu.memcpy_async(dst, src, n, D2H, s);
    return e ? cuda_err("cudaMemcpyAsync", e) : 0;
}

int st_cuda_wait(void)
{
    if (st_cuda_check())
        return 0; /* nothing can have been enqueued */
    void *s = pthread_getspecific(cu.key);
    int e = s ? cu.stream_sync(s) : 0;
    return e ? cuda_err("cudaStreamSynchronize", e) : 0;
}

int st_cuda_pin(void *p, size_t n)
{
    int rc = st_cuda_check();
    if (rc)
        return rc;
    int e = cu.host_register(p, n, HOST_REGISTER_PORTABLE);
    return e ? cuda_err("cudaHostRegister", e) : 0;
}

void st_cuda_unpin(void *p)
{
    if (st_cuda_check() == 0)
        cu.host_unregister(p);
}
