/* fake_cudart.c - a stand-in for the CUDA runtime, for testing strata's device paths on
 * machines without a GPU (load it with STRATA_CUDART=.../libfakecudart.so). "Device"
 * memory is host memory it tracks; it checks every copy's direction against those
 * allocations. cudaMemcpyAsync behaves like a real GPU can: the destination holds garbage
 * until the stream is synchronized, when the copy happens - so a reader that skips the
 * wait sees garbage, and a source changed before the wait is what lands. Counters
 * (fake_cuda_counters) let tests see what strata did.
 * Environment: FAKE_CUDA_DEVICES (default 1), FAKE_CUDA_FAIL_ASYNC_AFTER=N (the N+1th
 * and later cudaMemcpyAsync fail). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { OK = 0, INVALID_VALUE = 1, MEMORY_ALLOCATION = 2, INVALID_HANDLE = 400 };
enum { H2D = 1, D2H = 2 };

typedef struct {
    uint64_t async_copies, async_bytes, async_pinned_bytes, sync_copies, streams_created,
        streams_destroyed, pending_at_destroy, registered_bytes, bad_calls;
} fake_counters;

typedef struct op {
    void *dst;
    const void *src;
    size_t n;
    struct op *next;
} op;

typedef struct stream {
    op *head, *tail;
    struct stream *next;
} stream;

typedef struct range {
    uintptr_t lo, hi;
    struct range *next;
} range;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static range *device, *pinned;
static stream *streams;
static fake_counters k;
static long async_calls;

static int in(const range *r, const void *p, size_t n)
{
    for (; r; r = r->next)
        if ((uintptr_t)p >= r->lo && (uintptr_t)p + n <= r->hi)
            return 1;
    return 0;
}

static int add(range **list, void *p, size_t n)
{
    range *r = malloc(sizeof *r);
    if (!r)
        return MEMORY_ALLOCATION;
    *r = (range){(uintptr_t)p, (uintptr_t)p + n, *list};
    *list = r;
    return OK;
}

static int drop(range **list, void *p, size_t *n)
{
    for (range **r = list; *r; r = &(*r)->next)
        if ((*r)->lo == (uintptr_t)p) {
            range *d = *r;
            *r = d->next;
            if (n)
                *n = d->hi - d->lo;
            free(d);
            return OK;
        }
    return INVALID_VALUE;
}

/* Is a copy of n bytes from src to dst of this kind legal? (call with mu held) */
static int legal(void *dst, const void *src, size_t n, int kind)
{
    if (kind == D2H && in(device, src, n) && !in(device, dst, n))
        return 1;
    if (kind == H2D && in(device, dst, n) && !in(device, src, n))
        return 1;
    k.bad_calls++;
    return 0;
}

static int known(stream *s)
{
    for (stream *t = streams; t; t = t->next)
        if (t == s)
            return 1;
    return 0;
}

static void drain(stream *s) /* mu held */
{
    while (s->head) {
        op *o = s->head;
        s->head = o->next;
        memcpy(o->dst, o->src, o->n);
        free(o);
    }
    s->tail = NULL;
}

int cudaGetDeviceCount(int *n)
{
    const char *e = getenv("FAKE_CUDA_DEVICES");
    *n = e ? atoi(e) : 1;
    return OK;
}

const char *cudaGetErrorString(int e)
{
    switch (e) {
    case OK: return "no error";
    case INVALID_VALUE: return "invalid argument (fake runtime)";
    case MEMORY_ALLOCATION: return "out of memory (fake runtime)";
    default: return "invalid resource handle (fake runtime)";
    }
}

int cudaMalloc(void **p, size_t n)
{
    *p = malloc(n ? n : 1);
    pthread_mutex_lock(&mu);
    int e = *p ? add(&device, *p, n) : MEMORY_ALLOCATION;
    pthread_mutex_unlock(&mu);
    return e;
}

int cudaFree(void *p)
{
    pthread_mutex_lock(&mu);
    int e = drop(&device, p, NULL);
    pthread_mutex_unlock(&mu);
    if (!e)
        free(p);
    return e;
}

int cudaMemcpy(void *dst, const void *src, size_t n, int kind)
{
    pthread_mutex_lock(&mu);
    int ok = legal(dst, src, n, kind);
    k.sync_copies += ok;
    pthread_mutex_unlock(&mu);
    if (!ok)
        return INVALID_VALUE;
    memcpy(dst, src, n);
    return OK;
}

int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *sp)
{
    stream *s = sp;
    const char *fail = getenv("FAKE_CUDA_FAIL_ASYNC_AFTER");
    pthread_mutex_lock(&mu);
    int e = !known(s) ? INVALID_HANDLE : !legal(dst, src, n, kind) ? INVALID_VALUE : OK;
    if (!e && fail && async_calls >= atol(fail))
        e = INVALID_VALUE;
    async_calls++;
    op *o = e ? NULL : malloc(sizeof *o);
    if (!e && !o)
        e = MEMORY_ALLOCATION;
    if (!e) {
        *o = (op){dst, src, n, NULL};
        if (s->tail)
            s->tail->next = o;
        else
            s->head = o;
        s->tail = o;
        k.async_copies++;
        k.async_bytes += n;
        if (in(pinned, dst, n))
            k.async_pinned_bytes += n;
        memset(dst, 0xA5, n); /* not there yet */
    }
    pthread_mutex_unlock(&mu);
    return e;
}

int cudaStreamCreateWithFlags(void **out, unsigned flags)
{
    (void)flags;
    stream *s = calloc(1, sizeof *s);
    if (!s)
        return MEMORY_ALLOCATION;
    pthread_mutex_lock(&mu);
    s->next = streams;
    streams = s;
    k.streams_created++;
    pthread_mutex_unlock(&mu);
    *out = s;
    return OK;
}

int cudaStreamSynchronize(void *sp)
{
    pthread_mutex_lock(&mu);
    int e = known(sp) ? OK : INVALID_HANDLE;
    if (!e)
        drain(sp);
    pthread_mutex_unlock(&mu);
    return e;
}

int cudaStreamDestroy(void *sp)
{
    pthread_mutex_lock(&mu);
    int e = INVALID_HANDLE;
    for (stream **t = &streams; *t; t = &(*t)->next)
        if (*t == sp) {
            stream *s = *t;
            *t = s->next;
            k.pending_at_destroy += s->head != NULL;
            drain(s);
            free(s);
            k.streams_destroyed++;
            e = OK;
            break;
        }
    pthread_mutex_unlock(&mu);
    return e;
}

int cudaHostRegister(void *p, size_t n, unsigned flags)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    int e = in(pinned, p, 1) ? INVALID_VALUE : add(&pinned, p, n);
    if (!e)
        k.registered_bytes += n;
    pthread_mutex_unlock(&mu);
    return e;
}

int cudaHostUnregister(void *p)
{
    size_t n = 0;
    pthread_mutex_lock(&mu);
    int e = drop(&pinned, p, &n);
    k.registered_bytes -= n;
    pthread_mutex_unlock(&mu);
    return e;
}

void fake_cuda_counters(fake_counters *out)
{
    pthread_mutex_lock(&mu);
    *out = k;
    pthread_mutex_unlock(&mu);
}
