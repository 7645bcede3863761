/* bufpool.c - strata_pool: the bounded, reused buffers an asynchronous save copies its
 * snapshot into (async.c), handed out one at a time with back-pressure. Its buffers are
 * I/O buffers (st_io_alloc: huge pages from 2 MiB), page-locked the first time a save
 * copies from device memory. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../core/util.h"
#include "bufpool.h"
#include "cuda.h"
#include "pool.h"

#define POOL_ALIGN 4096u /* buffers hold whole data-file extents (ST_ALIGN, meta.h) */
/* Pool buffers (strata.h): half the pool up to 8 MiB (a small pool has two), then a
 * sixteenth of it (16 in flight) up to 64 MiB, the largest checksum chunk. */
#define POOL_BUF_SMALL ((uint64_t)8 << 20)
#define POOL_BUF_MAX ((uint64_t)64 << 20)

struct strata_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t nbuf, bufsize, nfree;
    /* a lazy pool's buffers are NULL until st_pool_get first hands them out, on a save's
     * own thread (set under mu; a buffer is then read by whoever holds it) */
    unsigned char **bufs;
    unsigned char *pinned_buf; /* per buffer: page-locked (under mu) */
    size_t *freelist;
    int pinned; /* 0 not tried yet, 1 page-locked for device copies, -1 could not be */
    int users;  /* saves using it now (under mu) */
};

/* The buffer size st_pool_new gives a pool of `bytes`. */
static size_t pool_buffer_rule(uint64_t bytes)
{
    uint64_t b = ST_MIN(bytes / 2, ST_MIN(ST_MAX(POOL_BUF_SMALL, bytes / 16), POOL_BUF_MAX));
    return b < POOL_ALIGN ? POOL_ALIGN : (size_t)(b / POOL_ALIGN * POOL_ALIGN);
}

/* The smallest `bytes` for which st_pool_new's buffers hold a chunk (a power of two,
 * 4 KiB..64 MiB). */
uint64_t st_pool_bytes_for_chunk(uint64_t chunk)
{
    return chunk <= POOL_BUF_SMALL ? 2 * chunk : 16 * chunk;
}

/* nbuf buffers of bufsize bytes (a multiple of POOL_ALIGN); eager: allocated and faulted in
 * now; lazy: by the save that first takes each one (st_pool_get). */
static int pool_make(strata_pool **out, size_t nbuf, size_t bufsize, int lazy)
{
    *out = NULL;
    strata_pool *p = calloc(1, sizeof *p);
    if (!p)
        return st_fail(STRATA_ENOMEM, "out of memory");
    p->bufsize = bufsize;
    p->nbuf = nbuf;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->bufs = calloc(nbuf, sizeof *p->bufs);
    p->pinned_buf = calloc(nbuf, 1);
    p->freelist = calloc(nbuf, sizeof *p->freelist);
    int rc = p->bufs && p->pinned_buf && p->freelist ? 0 : STRATA_ENOMEM;
    for (size_t i = 0; i < nbuf && !rc; i++) {
        if (!lazy) {
            if (!(p->bufs[i] = st_io_alloc(bufsize)))
                rc = STRATA_ENOMEM;
            else
                memset(p->bufs[i], 0, bufsize); /* fault it in now, not during a save */
        }
        p->freelist[p->nfree++] = i;
    }
    if (rc) {
        st_pool_free(p);
        return st_fail(STRATA_ENOMEM, "out of memory for a pool of %zu buffers of %zu bytes",
                       nbuf, bufsize);
    }
    *out = p;
    return 0;
}

int st_pool_new(strata_pool **out, uint64_t bytes)
{
    *out = NULL;
    if (bytes < POOL_ALIGN)
        return st_fail(STRATA_EINVAL, "a pool needs at least %u bytes", POOL_ALIGN);
    size_t b = pool_buffer_rule(bytes);
    uint64_t n = bytes / b;
    if (n > SIZE_MAX / sizeof(void *))
        return st_fail(STRATA_ENOMEM, "out of memory for a pool of %llu bytes",
                       (unsigned long long)bytes);
    return pool_make(out, (size_t)n, b, 0);
}

/* The pool a save makes for itself or its saver when given none: for a state of `bytes`,
 * min(1 GiB, the state) (two buffers at least) in buffers of st_pool_new's size or
 * the chunk, whichever is larger; lazy, so that nothing is allocated on the caller's
 * thread and no page is touched before a copy needs it. */
int st_pool_own(strata_pool **out, uint64_t bytes, uint32_t chunk)
{
    uint64_t want = ST_MIN((uint64_t)1 << 30, ST_ALIGN_UP(ST_MAX(bytes, 1), POOL_ALIGN));
    size_t b = ST_MAX(pool_buffer_rule(want), (size_t)chunk);
    return pool_make(out, (size_t)ST_MAX(2, want / b), b, 1);
}

void st_pool_free(strata_pool *p)
{
    if (!p)
        return;
    for (size_t i = 0; p->bufs && i < p->nbuf; i++) {
        if (p->pinned_buf && p->pinned_buf[i])
            st_cuda_unpin(p->bufs[i]);
        st_io_free(p->bufs[i], p->bufsize);
    }
    free(p->bufs);
    free(p->pinned_buf);
    free(p->freelist);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

uint64_t st_pool_bytes(const strata_pool *p) { return (uint64_t)p->nbuf * p->bufsize; }
size_t st_pool_buffer_bytes(const strata_pool *p) { return p->bufsize; }

uint64_t st_pool_allocated_bytes(strata_pool *p)
{
    pthread_mutex_lock(&p->mu);
    uint64_t n = 0;
    for (size_t i = 0; i < p->nbuf; i++)
        n += p->bufs[i] ? p->bufsize : 0;
    pthread_mutex_unlock(&p->mu);
    return n;
}

int st_pool_busy(strata_pool *p)
{
    pthread_mutex_lock(&p->mu);
    int busy = p->users > 0;
    pthread_mutex_unlock(&p->mu);
    return busy;
}

void st_pool_use(strata_pool *p, int d)
{
    pthread_mutex_lock(&p->mu);
    p->users += d;
    pthread_mutex_unlock(&p->mu);
}

/* Page-locks buffer i (under mu): cudaMemcpyAsync into pinned memory is a DMA that
 * overlaps the CPU. */
static int pin_one(strata_pool *p, size_t i)
{
    if (!p->pinned_buf[i] && st_cuda_pin(p->bufs[i], p->bufsize))
        return -1;
    p->pinned_buf[i] = 1;
    return 0;
}

/* Takes a free buffer into *out, waiting for one (back-pressure). A lazy pool's buffer is
 * allocated the first time it is taken (by the save's coordinator thread; pages are
 * faulted in by the copy), and page-locked if the pool is. */
int st_pool_get(strata_pool *p, size_t *out)
{
    pthread_mutex_lock(&p->mu);
    while (p->nfree == 0)
        pthread_cond_wait(&p->cv, &p->mu);
    size_t i = p->freelist[--p->nfree];
    int rc = 0;
    if (!p->bufs[i]) {
        if (!(p->bufs[i] = st_io_alloc(p->bufsize))) {
            p->freelist[p->nfree++] = i;
            pthread_cond_signal(&p->cv);
            rc = st_fail(STRATA_ENOMEM, "out of memory for a pool buffer of %zu bytes",
                         p->bufsize);
        } else if (p->pinned == 1) {
            pin_one(p, i); /* if it fails, the copies into this one are staged: slower */
        }
    }
    pthread_mutex_unlock(&p->mu);
    *out = i;
    return rc;
}

/* Page-locks the pool once, the first time a save copies from device memory into it (a
 * lazy pool: the buffers allocated so far, and each later one as it is allocated).
 * Without it the copies still work (staged by the driver), only slower. */
void st_pool_pin(strata_pool *p)
{
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; !p->pinned && i < p->nbuf; i++)
        if (p->bufs[i] && pin_one(p, i)) {
            for (size_t j = 0; j < p->nbuf; j++)
                if (p->pinned_buf[j]) {
                    st_cuda_unpin(p->bufs[j]);
                    p->pinned_buf[j] = 0;
                }
            p->pinned = -1;
        }
    if (!p->pinned)
        p->pinned = 1;
    pthread_mutex_unlock(&p->mu);
}

void st_pool_put(strata_pool *p, size_t i)
{
    pthread_mutex_lock(&p->mu);
    p->freelist[p->nfree++] = i;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

size_t st_pool_nbuf(const strata_pool *p) { return p->nbuf; }
unsigned char *st_pool_buf(const strata_pool *p, size_t i) { return p->bufs[i]; }
