/* overlap.h - do any two of a tensor's regions (its shards: boxes, each narrowed to a flat
 * range of its row-major flattening, geom.h) share an element? The check behind every save
 * plan and every decoded index (st_meta_check_overlap, meta.h). Pure; allocates scratch of
 * a small multiple of n. Thread-safe (the work counter is per thread).
 *
 * Exact, and near-linear on every input (docs/DESIGN.md, Save): the regions are split
 * recursively, dim by dim, into clusters whose spans along that dim connect; a cluster no
 * dim splits is checked exactly - by sorted flat ranges where it holds one box, else by
 * cutting each region into at most 2 ndim - 1 whole boxes and searching those for a pair
 * that meets (a segment-tree divide and conquer over the dims that vary). */
#ifndef STRATA_OVERLAP_H
#define STRATA_OVERLAP_H
#include <stddef.h>
#include <stdint.h>

#include "geom.h"

/* Regions r[0, n), all of r[0].ndim dims: 1 when two share an element (*a < *b: the first
 * pair found), 0 when none do (empty regions overlap nothing), -1 when out of memory. */
int st_overlap_find(const st_region *r, size_t n, size_t *a, size_t *b);
/* Work units (boxes visited) of this thread's last st_overlap_find: for tests and fuzzing,
 * which hold it to a near-linear bound. */
uint64_t st_overlap_work(void);

#endif
