/* bufpool.h - the pool behind strata_pool (strata.h; async.c wraps the public calls): an
 * asynchronous save's bounded pool of reused snapshot buffers (bufpool.c). st_pool_new
 * makes an eager one (allocated and faulted in at once); st_pool_own a lazy one (each
 * buffer allocated by the save that first takes it). A buffer is held by one thread at a
 * time: st_pool_get waits for a free one. */
#ifndef STRATA_BUFPOOL_H
#define STRATA_BUFPOOL_H
#include <stddef.h>
#include <stdint.h>

typedef struct strata_pool strata_pool;

/* strata_pool_new, strata_pool_free and strata_pool_bytes (strata.h). */
int st_pool_new(strata_pool **out, uint64_t bytes);
void st_pool_free(strata_pool *p);
uint64_t st_pool_bytes(const strata_pool *p);

/* The lazy pool a save makes for itself or its saver when given none: for a state of
 * `bytes`, min(1 GiB, the state) (two buffers at least) in buffers of strata_pool_new's
 * size or the chunk, whichever is larger. */
int st_pool_own(strata_pool **out, uint64_t bytes, uint32_t chunk);
/* The smallest `bytes` for which strata_pool_new's buffers hold a chunk. */
uint64_t st_pool_bytes_for_chunk(uint64_t chunk);
size_t st_pool_nbuf(const strata_pool *p);
/* The size of each buffer of a pool. */
size_t st_pool_buffer_bytes(const strata_pool *p);
/* Buffer i (NULL in a lazy pool until st_pool_get first hands it out). */
unsigned char *st_pool_buf(const strata_pool *p, size_t i);
/* Bytes of the pool's buffers allocated so far. */
uint64_t st_pool_allocated_bytes(strata_pool *p);
/* Counts a save using the pool (d = 1) or done with it (d = -1); is one using it now? */
void st_pool_use(strata_pool *p, int d);
int st_pool_busy(strata_pool *p);
/* Takes a free buffer into *out, waiting for one (back-pressure); allocates a lazy pool's
 * buffer the first time (STRATA_ENOMEM, the buffer given back, if it cannot). */
int st_pool_get(strata_pool *p, size_t *out);
void st_pool_put(strata_pool *p, size_t i);
/* Page-locks the pool once (for copies from device memory), each later lazy buffer too. */
void st_pool_pin(strata_pool *p);

#endif
