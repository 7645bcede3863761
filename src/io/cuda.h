/* cuda.h - CUDA device memory, through cudart loaded at run time (dlopen): strata builds
 * and runs without CUDA; a device shard without a usable runtime and driver is a clear
 * STRATA_EDEVICE error. Thread-safe (loads once). */
#ifndef STRATA_CUDA_H
#define STRATA_CUDA_H
#include <stddef.h>

/* 0 if CUDA is usable (a device is present), else STRATA_EDEVICE with the reason. */
int st_cuda_check(void);
/* Copies n bytes device -> host (to_host = 1) or host -> device. 0 or STRATA_EDEVICE. */
int st_cuda_copy(void *dst, const void *src, size_t n, int to_host);

#endif
