/* pool.c - parallel for-loop: workers pull task indices from an atomic counter. */
#include "pool.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "../core/error.h"
#include "../core/util.h"

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
        return st_err_restore(r.rc, r.msg);
    return 0;
}

/* ---- double-buffered pipeline ---- */

typedef struct {
    st_stage_fn first, second;
    void *ctx;
    size_t ntasks, bufsize;
    atomic_size_t next;
    atomic_int failed;
    pthread_mutex_t mu; /* guards rc, msg */
    int rc;
    char msg[ST_ERR_BYTES];
} pipe_run;

typedef struct {
    pipe_run *run;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    void *buf[2];
    int full[2];       /* buffer holds a task for the second stage */
    size_t task[2];
    int64_t aux[2];
    int closed;        /* the first stage takes no more tasks */
} pipe_lane;

static void pipe_fail(pipe_run *r, int rc)
{
    pthread_mutex_lock(&r->mu);
    if (!r->rc) {
        r->rc = st_err_keep(r->msg, rc);
    }
    pthread_mutex_unlock(&r->mu);
    atomic_store(&r->failed, 1);
}

static void *pipe_second(void *p)
{
    pipe_lane *l = p;
    pipe_run *r = l->run;
    for (int b = 0;; b ^= 1) { /* buffers are filled and taken in turn */
        pthread_mutex_lock(&l->mu);
        while (!l->full[b] && !l->closed)
            pthread_cond_wait(&l->cv, &l->mu);
        if (!l->full[b]) {
            pthread_mutex_unlock(&l->mu);
            return NULL;
        }
        size_t t = l->task[b];
        int64_t aux = l->aux[b];
        pthread_mutex_unlock(&l->mu);
        int rc = atomic_load(&r->failed) ? 0 : r->second(r->ctx, t, l->buf[b], &aux);
        if (rc)
            pipe_fail(r, rc);
        pthread_mutex_lock(&l->mu);
        l->full[b] = 0;
        pthread_cond_broadcast(&l->cv);
        pthread_mutex_unlock(&l->mu);
    }
}

static void pipe_close(pipe_lane *l)
{
    pthread_mutex_lock(&l->mu);
    l->closed = 1;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

static void pipe_first(pipe_lane *l)
{
    pipe_run *r = l->run;
    for (int b = 0; !atomic_load(&r->failed); b ^= 1) {
        size_t t = atomic_fetch_add(&r->next, 1);
        if (t >= r->ntasks)
            break;
        pthread_mutex_lock(&l->mu);
        while (l->full[b])
            pthread_cond_wait(&l->cv, &l->mu);
        pthread_mutex_unlock(&l->mu);
        if (atomic_load(&r->failed)) /* while this lane waited */
            break;
        if (!l->buf[b] && !(l->buf[b] = st_scratch_get(r->bufsize))) {
            pipe_fail(r, st_fail(STRATA_ENOMEM, "out of memory for an I/O buffer of %zu bytes",
                                 r->bufsize));
            break;
        }
        int64_t aux = 0;
        int rc = r->first(r->ctx, t, l->buf[b], &aux);
        if (rc) {
            pipe_fail(r, rc);
            break;
        }
        pthread_mutex_lock(&l->mu);
        l->task[b] = t;
        l->aux[b] = aux;
        l->full[b] = 1;
        pthread_cond_broadcast(&l->cv);
        pthread_mutex_unlock(&l->mu);
    }
    pipe_close(l);
}

static void *pipe_first_main(void *p)
{
    pipe_first(p);
    return NULL;
}

int st_pipeline(int lanes, size_t ntasks, size_t bufsize, st_stage_fn first, st_stage_fn second,
                void *ctx)
{
    if (ntasks == 0)
        return 0;
    lanes = lanes < 1 ? 1 : lanes > 32 ? 32 : lanes;
    if ((size_t)lanes > ntasks)
        lanes = (int)ntasks;
    pipe_run r = {.first = first, .second = second, .ctx = ctx, .ntasks = ntasks,
                  .bufsize = bufsize};
    atomic_init(&r.next, 0);
    atomic_init(&r.failed, 0);
    pthread_mutex_init(&r.mu, NULL);
    pipe_lane ln[32];
    pthread_t th1[32], th2[32];
    int have2[32] = {0}, have1[32] = {0};
    for (int i = 0; i < lanes; i++) {
        ln[i] = (pipe_lane){.run = &r};
        pthread_mutex_init(&ln[i].mu, NULL);
        pthread_cond_init(&ln[i].cv, NULL);
    }
    for (int i = 0; i < lanes; i++) {
        have2[i] = pthread_create(&th2[i], NULL, pipe_second, &ln[i]) == 0;
        if (!have2[i]) { /* no second thread: this lane is not used */
            ln[i].closed = 1;
            continue;
        }
        if (i > 0 && !(have1[i] = pthread_create(&th1[i], NULL, pipe_first_main, &ln[i]) == 0))
            pipe_close(&ln[i]); /* run with the lanes we have */
    }
    if (have2[0])
        pipe_first(&ln[0]);
    else /* not even one thread: both stages here, one buffer */
        for (size_t t; !atomic_load(&r.failed) && (t = atomic_fetch_add(&r.next, 1)) < ntasks;) {
            int64_t aux = 0;
            int rc = !ln[0].buf[0] && !(ln[0].buf[0] = st_scratch_get(bufsize))
                         ? st_fail(STRATA_ENOMEM, "out of memory for an I/O buffer")
                         : first(ctx, t, ln[0].buf[0], &aux);
            if (!rc)
                rc = second(ctx, t, ln[0].buf[0], &aux);
            if (rc)
                pipe_fail(&r, rc);
        }
    for (int i = 0; i < lanes; i++) {
        if (have1[i])
            pthread_join(th1[i], NULL);
        if (have2[i])
            pthread_join(th2[i], NULL);
        for (int b = 0; b < 2; b++)
            st_scratch_put(ln[i].buf[b], bufsize);
        pthread_mutex_destroy(&ln[i].mu);
        pthread_cond_destroy(&ln[i].cv);
    }
    pthread_mutex_destroy(&r.mu);
    if (r.rc)
        return st_err_restore(r.rc, r.msg);
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

/* ---- I/O buffers ---- */

/* Free hugetlb pages of the default size, from /proc/meminfo (0 if none or unknown). */
static uint64_t hugetlb_free_bytes(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[128];
    uint64_t free_pages = 0, kb = 0;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long long v;
        if (sscanf(line, "HugePages_Free: %llu", &v) == 1)
            free_pages = v;
        else if (sscanf(line, "Hugepagesize: %llu kB", &v) == 1)
            kb = v;
    }
    if (f)
        fclose(f);
    return kb == ST_HUGE_BYTES / 1024 ? free_pages * kb * 1024 : 0;
}

/* Mapped bytes of a buffer of n bytes: whole 4 KiB pages (a hugetlb buffer is a whole number
 * of huge pages already). */
#define MAP_LEN(n) ((size_t)ST_ALIGN_UP((n), 4096))

void *st_io_alloc(size_t n)
{
    if (n < ST_HUGE_BYTES) {
        void *p = NULL;
        return posix_memalign(&p, 4096, n ? n : 4096) ? NULL : p;
    }
    size_t len = MAP_LEN(n), huge = n / ST_HUGE_BYTES * ST_HUGE_BYTES;
    if (len < n)
        return NULL;
    /* reserved huge pages first, while some are free, for whole huge pages (the mapping
     * takes them now, or fails: no SIGBUS later) */
    if (huge == n && hugetlb_free_bytes() >= len) {
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
        if (p != MAP_FAILED)
            return p;
    }
    /* 2 MiB-aligned anonymous memory: map a huge page more and trim both ends; its whole
     * huge pages advised (a tail of under 2 MiB stays in 4 KiB pages: no memory beyond n) */
    size_t over = len + ST_HUGE_BYTES;
    unsigned char *m = mmap(NULL, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                            -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    uintptr_t a = ((uintptr_t)m + ST_HUGE_BYTES - 1) & ~(uintptr_t)(ST_HUGE_BYTES - 1);
    unsigned char *p = (unsigned char *)a;
    if (p > m)
        munmap(m, (size_t)(p - m));
    if (m + over > p + len)
        munmap(p + len, (size_t)(m + over - (p + len)));
    madvise(p, huge, MADV_HUGEPAGE); /* refused (THP off): 4 KiB pages, as st_io_pages sees */
    return p;
}

void st_io_free(void *p, size_t n)
{
    if (!p)
        return;
    if (n < ST_HUGE_BYTES)
        free(p);
    else
        munmap(p, MAP_LEN(n));
}

const char *st_io_pages_name(int kind)
{
    static const char *names[] = {"4 KiB pages", "partly huge pages", "transparent huge pages",
                                  "hugetlb pages"};
    return kind >= 0 && kind <= ST_PAGES_HUGETLB ? names[kind] : "?";
}

int st_io_pages(const void *p, size_t n)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[256];
    uintptr_t a = (uintptr_t)p;
    uint64_t huge = 0, size = 0, page_kb = 4;
    int in = 0;
    while (f && fgets(line, sizeof line, f)) {
        uintptr_t lo, hi;
        unsigned long long v;
        if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " ", &lo, &hi) == 2) { /* a mapping's line */
            if (in)
                break; /* the next mapping */
            in = lo <= a && a < hi;
            size = in ? hi - lo : 0;
        } else if (in && sscanf(line, "AnonHugePages: %llu kB", &v) == 1) {
            huge = v * 1024;
        } else if (in && sscanf(line, "KernelPageSize: %llu kB", &v) == 1) {
            page_kb = v;
        }
    }
    if (f)
        fclose(f);
    if (page_kb * 1024 >= ST_HUGE_BYTES)
        return ST_PAGES_HUGETLB;
    uint64_t want = ST_MIN((uint64_t)n, size) / ST_HUGE_BYTES * ST_HUGE_BYTES;
    return huge == 0 || want == 0 ? ST_PAGES_SMALL
           : huge >= want         ? ST_PAGES_THP
                                  : ST_PAGES_MIXED;
}

uint64_t st_dev_max_request(const char *path)
{
    struct stat st;
    if (stat(path, &st) || major(st.st_dev) == 0) /* tmpfs, overlay, NFS: no queue */
        return 0;
    char q[128];
    unsigned long long kb = 0;
    for (int up = 0; up < 2 && !kb; up++) { /* the device's queue, or its disk's (a partition) */
        snprintf(q, sizeof q, "/sys/dev/block/%u:%u/%squeue/max_sectors_kb", major(st.st_dev),
                 minor(st.st_dev), up ? "../" : "");
        FILE *f = fopen(q, "r");
        if (f) {
            if (fscanf(f, "%llu", &kb) != 1)
                kb = 0;
            fclose(f);
        }
    }
    return (uint64_t)kb * 1024;
}

uint64_t st_read_bytes_for(const char *path)
{
    uint64_t dev = st_dev_max_request(path) >> 20 << 20; /* whole MiB */
    return ST_MIN(ST_MAX(dev, (uint64_t)4 << 20), (uint64_t)16 << 20);
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
    return st_io_alloc(n);
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
    st_io_free(p, n);
}
