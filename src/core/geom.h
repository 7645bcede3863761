/* geom.h - shard geometry: boxes, flat ranges of a box's row-major flattening, and the
 * contiguous element runs two such regions share. Pure functions, no allocation. */
#ifndef STRATA_GEOM_H
#define STRATA_GEOM_H
#include <stdint.h>

#include "strata_types.h"

/* A region of a global tensor: the box (off, len) narrowed to the element range [fs, fe)
 * of the box's row-major flattening. A whole box has fs = 0, fe = numel(box). */
typedef struct st_region {
    int ndim;
    const uint64_t *off, *len;
    uint64_t fs, fe;
} st_region;

/* a * b into *out; returns 0 on overflow. */
static inline int st_mul_ok(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* numel of a box; returns 0 and sets *overflow on overflow (overflow may be NULL). */
uint64_t st_box_numel(int ndim, const uint64_t *len, int *overflow);

/* Intersects two boxes; returns 1 and fills (io, il) if they share an element. */
int st_box_intersect(int ndim, const uint64_t *ao, const uint64_t *al, const uint64_t *bo,
                     const uint64_t *bl, uint64_t *io, uint64_t *il);

/* Called for each run: n elements at index a_idx of region a's data (0 = its first
 * element, at flat position fs) and index b_idx of region b's data. Return nonzero to stop. */
typedef int (*st_run_fn)(void *ctx, uint64_t a_idx, uint64_t b_idx, uint64_t n);

/* Enumerates the runs of elements common to a and b, in increasing order of position in
 * both. Both regions must describe the same tensor (same ndim). Runs are maximal in the
 * sense that trailing dims full in both boxes are merged. Returns the number of common
 * elements visited (stops early if fn returns nonzero). fn may be NULL to just count. */
uint64_t st_region_runs(const st_region *a, const st_region *b, st_run_fn fn, void *ctx);

/* The range [lo, hi) of dim-0 indices that a region touches (tight for flat ranges).
 * For ndim == 0, [0, 1). Returns 0 for an empty region. */
int st_region_dim0(const st_region *r, uint64_t *lo, uint64_t *hi);

#endif
