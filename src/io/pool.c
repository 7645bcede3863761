/* pool.c - parallel for-loop: workers pull task indices from an atomic counter. */
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"

typedef struct {
    st_task_fn fn;
    void *ctx;
    size_t ntasks;
    atomic_size_t next;
    atomic_int failed;
    pthread_mutex_t mu;
    int rc;
    char msg[ST_ERR_BYTES];
} pool_run;

typedef struct {
    pool_run *run;
    int worker;
} worker_arg;

static void *worker_main(void *p)
{
    worker_arg *a = p;
    pool_run *r = a->run;
    while (!atomic_load(&r->failed)) {
        size_t t = atomic_fetch_add(&r->next, 1);
        if (t >= r->ntasks)
            break;
        int rc = r->fn(r->ctx, t, a->worker);
        if (rc) {
            pthread_mutex_lock(&r->mu);
            if (!r->rc) {
                r->rc = rc;
                st_err_keep(r->msg, rc);
            }
            pthread_mutex_unlock(&r->mu);
            atomic_store(&r->failed, 1);
        }
    }
    return NULL;
}

int st_parallel(int nthreads, size_t ntasks, st_task_fn fn, void *ctx)
{
    if (ntasks == 0)
        return 0;
    if (nthreads < 1)
        nthreads = 1;
    if ((size_t)nthreads > ntasks)
        nthreads = (int)ntasks;
    pool_run r = {.fn = fn, .ctx = ctx, .ntasks = ntasks};
    atomic_init(&r.next, 0);
    atomic_init(&r.failed, 0);
    pthread_mutex_init(&r.mu, NULL);
    pthread_t th[64];
    worker_arg args[64];
    if (nthreads > 64)
        nthreads = 64;
    int started = 1;
    for (int i = 1; i < nthreads; i++) {
        args[i] = (worker_arg){&r, i};
        if (pthread_create(&th[i], NULL, worker_main, &args[i]) != 0)
            break; /* run with the threads we have */
        started++;
    }
    args[0] = (worker_arg){&r, 0};
    worker_main(&args[0]);
    for (int i = 1; i < started; i++)
        pthread_join(th[i], NULL);
    pthread_mutex_destroy(&r.mu);
    if (r.rc)
        return st_fail(r.rc, "%s", r.msg);
    return 0;
}

int st_io_threads(int asked)
{
    if (asked > 0)
        return asked > 64 ? 64 : asked;
    const char *e = getenv("STRATA_IO_THREADS");
    if (e) {
        int n = atoi(e);
        if (n > 0)
            return n > 64 ? 64 : n;
    }
    return 4;
}

void *st_aligned_alloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, n ? n : 4096))
        return NULL;
    return p;
}

/* ---- scratch buffer cache ---- */

#define SCRATCH_KEEP 8
#define SCRATCH_BYTES ((size_t)64 << 20) /* kept between calls, at most */
static pthread_mutex_t scratch_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    void *p;
    size_t n;
} scratch[SCRATCH_KEEP];
static size_t scratch_bytes; /* held in scratch[] */

void *st_scratch_get(size_t n)
{
    pthread_mutex_lock(&scratch_mu);
    for (int i = 0; i < SCRATCH_KEEP; i++)
        if (scratch[i].p && scratch[i].n == n) {
            void *p = scratch[i].p;
            scratch[i].p = NULL;
            scratch_bytes -= n;
            pthread_mutex_unlock(&scratch_mu);
            return p;
        }
    pthread_mutex_unlock(&scratch_mu);
    return st_aligned_alloc(n);
}

void st_scratch_put(void *p, size_t n)
{
    if (!p)
        return;
    pthread_mutex_lock(&scratch_mu);
    for (int i = 0; i < SCRATCH_KEEP && scratch_bytes + n <= SCRATCH_BYTES; i++)
        if (!scratch[i].p) {
            scratch[i].p = p;
            scratch[i].n = n;
            scratch_bytes += n;
            p = NULL;
            break;
        }
    pthread_mutex_unlock(&scratch_mu);
    free(p);
}
