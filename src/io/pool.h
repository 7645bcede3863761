/* pool.h - a parallel for-loop over I/O tasks on a few threads, with per-worker scratch
 * buffers. Each call spawns nthreads-1 threads and joins them before returning; the
 * caller's thread is worker 0. The first failing task stops the others from starting
 * new tasks; its code and message are returned on the calling thread. */
#ifndef STRATA_POOL_H
#define STRATA_POOL_H
#include <stddef.h>

/* fn returns 0 or a STRATA_E* code (with its message set on the worker's thread). */
typedef int (*st_task_fn)(void *ctx, size_t task, int worker);

int st_parallel(int nthreads, size_t ntasks, st_task_fn fn, void *ctx);

/* Threads to use: `asked` if > 0, else $STRATA_IO_THREADS, else 4. */
int st_io_threads(int asked);

/* Aligned (4096) allocation; free with free(). NULL on failure. */
void *st_aligned_alloc(size_t n);

/* Reused, pre-faulted aligned scratch buffers (first touch of fresh memory is slow):
 * get returns a buffer of at least n bytes (one of exactly n bytes if one is kept); put gives
 * it back for later calls. Up to 8 buffers and 64 MiB are kept process-wide; the rest are
 * freed. Thread-safe. */
void *st_scratch_get(size_t n);
void st_scratch_put(void *p, size_t n);

#endif
