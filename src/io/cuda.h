/* cuda.h - CUDA device memory, through cudart loaded at run time (dlopen; $STRATA_CUDART
 * overrides the library): strata builds and runs without CUDA; a device shard without a
 * usable runtime and driver is a clear STRATA_EDEVICE error. Thread-safe (loads once). */
#ifndef STRATA_CUDA_H
#define STRATA_CUDA_H
#include <stddef.h>

/* 0 if CUDA is usable (a device is present), else STRATA_EDEVICE with the reason. */
int st_cuda_check(void);
/* Copies n bytes device -> host (to_host = 1) or host -> device. 0 or STRATA_EDEVICE. */
int st_cuda_copy(void *dst, const void *src, size_t n, int to_host);
/* Enqueues a device -> host copy on the calling thread's stream; dst must not be read
 * before st_cuda_wait. Fastest into pinned memory (st_cuda_pin). */
int st_cuda_copy_async(void *dst, const void *src, size_t n);
/* Waits for the copies the calling thread enqueued. 0 or STRATA_EDEVICE. */
int st_cuda_wait(void);
/* Page-locks (cudaHostRegister) host memory for fast asynchronous copies; unpin undoes it. */
int st_cuda_pin(void *p, size_t n);
void st_cuda_unpin(void *p);

#endif
