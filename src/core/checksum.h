/* checksum.h - the data checksum: XXH3-64 from the system's libxxhash. */
#ifndef STRATA_CHECKSUM_H
#define STRATA_CHECKSUM_H
#include <stddef.h>
#include <stdint.h>
#include <xxhash.h>

static inline uint64_t st_hash(const void *p, size_t n) { return XXH3_64bits(p, n); }

#endif
