/* pool.h - a parallel for-loop over I/O tasks on a few threads, with per-worker scratch
 * buffers. Each call spawns nthreads-1 threads and joins them before returning; the
 * caller's thread is worker 0. The first failing task stops the others from starting
 * new tasks; its code and message are returned on the calling thread. */
#ifndef STRATA_POOL_H
#define STRATA_POOL_H
#include <stddef.h>
#include <stdint.h>

/* fn returns 0 or a STRATA_E* code (with its message set on the worker's thread). */
typedef int (*st_task_fn)(void *ctx, size_t task, int worker);

int st_parallel(int nthreads, size_t ntasks, st_task_fn fn, void *ctx);

/* A parallel for-loop of two-stage tasks on `lanes` double-buffered lanes: each lane is a
 * pair of threads with two buffers of bufsize bytes (st_scratch_get), the first thread
 * running `first` (e.g. a read into the buffer) on one while the second runs `second`
 * (verify and copy out) on the other, so the device is kept busy while the CPU works.
 * Tasks are taken in index order. `first` may pass a value to `second` for its task
 * through *aux. The first failure (of either stage) stops new tasks and is returned, with
 * its message, on the calling thread (which runs lane 0's first stage). */
typedef int (*st_stage_fn)(void *ctx, size_t task, void *buf, int64_t *aux);
int st_pipeline(int lanes, size_t ntasks, size_t bufsize, st_stage_fn first, st_stage_fn second,
                void *ctx);

/* Threads to use: `asked` if > 0, else $STRATA_IO_THREADS, else 4. */
int st_io_threads(int asked);

/* Large I/O buffers, shaped for the device (DESIGN.md, "The I/O path"): from ST_HUGE_BYTES
 * on, 2 MiB-aligned whole huge pages - reserved hugetlb pages (MAP_HUGETLB) while the
 * kernel has them free, else anonymous memory advised MADV_HUGEPAGE (transparent huge
 * pages; with THP "never", 4 KiB pages) -, so that an O_DIRECT request is not cut at the
 * device's segment limit (254 pages of 4 KiB on virtio-blk: ~1 MiB); smaller ones 4 KiB-
 * aligned from the heap. NULL on failure. Free with st_io_free and the same n. */
#define ST_HUGE_BYTES ((size_t)2 << 20)
void *st_io_alloc(size_t n);
void st_io_free(void *p, size_t n);
/* What backs [p, p + n) now (measured, not assumed: /proc/self/smaps for transparent huge
 * pages): ST_PAGES_HUGETLB, ST_PAGES_THP (every 2 MiB of it a huge page), ST_PAGES_MIXED
 * (some), ST_PAGES_SMALL. For reports and benchmarks; reads /proc. */
enum { ST_PAGES_SMALL, ST_PAGES_MIXED, ST_PAGES_THP, ST_PAGES_HUGETLB };
int st_io_pages(const void *p, size_t n);
const char *st_io_pages_name(int kind);
/* The largest request the block device under path takes (its queue's max_sectors_kb, in
 * bytes); 0 where there is none to read (tmpfs, a network filesystem, a URI). */
uint64_t st_dev_max_request(const char *path);

/* A load's largest read by default on the device under path: its largest request (whole
 * MiB), from 4 MiB up to 16 MiB; 4 MiB where there is no block device to ask. */
uint64_t st_read_bytes_for(const char *path);

/* The block device under a directory, measured the way strata uses it (disk.c): a scratch
 * file of `bytes` written sequentially with O_DIRECT by `threads` threads in write_block
 * requests, fsynced, then read back cold in read_block requests, through I/O buffers of
 * st_io_alloc's kind or (small) of 4 KiB pages. Rates in GB/s (1e9 bytes per second), the
 * average bytes per device request in each pass (/proc/diskstats; 0 unknown). */
typedef struct {
    double write_gbps, read_gbps, write_request, read_request;
    uint64_t max_request; /* st_dev_max_request */
    int pages;            /* ST_PAGES_*: what backed the buffers */
} st_disk_rate;
int st_disk_measure(const char *dir, uint64_t bytes, int threads, uint64_t read_block,
                    uint64_t write_block, int small, st_disk_rate *out);
/* Reads and read bytes, writes and written bytes so far of the device holding path
 * (/proc/diskstats). 0 or -errno (-ENODEV: not a listed device, as tmpfs). */
int st_disk_counters(const char *path, uint64_t c[4]);

/* Reused, pre-faulted I/O scratch buffers (st_io_alloc; first touch of fresh memory is slow):
 * get returns a buffer of at least n bytes (one of exactly n bytes if one is kept); put gives
 * it back for later calls. Up to 8 buffers and 64 MiB are kept process-wide; the rest are
 * freed. Thread-safe. */
void *st_scratch_get(size_t n);
void st_scratch_put(void *p, size_t n);

#endif
