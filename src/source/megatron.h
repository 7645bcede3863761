/* megatron.h - Megatron-Core torch_dist checkpoints as strata reads them: the strict reading
 * of metadata.json (the checkpoint's backends), and the mapping of a legacy N-D flattened
 * tensor (megatron-core < 0.14: a distributed-optimizer piece saved as a flat range of a
 * box, reformulated by Megatron into an (N+1)-d DCP tensor) back onto its original shape as
 * strata's flat pieces. Pure; no I/O; fuzzable (fuzz/fuzz_megatron.c). Rules: docs/FORMAT.md,
 * "Megatron torch_dist as strata reads it". */
#ifndef STRATA_MEGATRON_H
#define STRATA_MEGATRON_H
#include <stddef.h>
#include <stdint.h>

#include "../meta/meta.h"
#include "pickle.h"

#define ST_MG_CONFIG "metadata.json"
#define ST_MG_COMMON "common.pt"
#define ST_MG_MAX_CONFIG (64u << 10) /* bytes of metadata.json a reader accepts */
#define ST_MG_STRATA "strata" /* the sharded backend of a checkpoint saved through strata */
#define ST_MG_SUBDIR "strata" /* its data: the strata checkpoint dir/strata */

/* What metadata.json says (the fields strata reads; others are checked JSON and skipped). */
typedef struct st_mg_config {
    char sharded_backend[32]; /* "torch_dist", or "strata" (ST_MG_STRATA) */
    int64_t sharded_backend_version; /* -1: absent */
    char common_backend[32];  /* "" when absent */
} st_mg_config;

/* Parses metadata.json (n bytes; file names it in messages): one JSON object (strict JSON,
 * at most 64 levels deep, unique keys) holding "sharded_backend", a string. Errors:
 * STRATA_EFORMAT (not JSON, truncated, a duplicate key, no sharded_backend or one that is
 * not a string, a version that is not an integer), STRATA_ENOTSUP (a backend strata does not
 * read, named: sharded_backend other than "torch_dist" or "strata" (a checkpoint saved
 * through strata.megatron; e.g. "zarr"), its version other than 1, common_backend other
 * than "torch"). */
int st_mg_parse_config(st_mg_config *out, const unsigned char *b, size_t n, const char *file);

/* One legacy N-D flattened tensor: the DCP tensor `name` of shape (A_1..A_N, L) holds the
 * original tensor of shape orig (N dims) cut into A_1 x .. x A_N equal boxes of
 * orig[i] / A_i each (L = the product of those), a chunk at offsets (i_1..i_N, s) of
 * lengths (1..1, l) being the flat range [s, s + l) of box (i_1..i_N). */
typedef struct st_mg_reform {
    const char *name;
    int ndim;
    uint64_t orig[STRATA_MAX_DIMS];
} st_mg_reform;

/* Rewrites, in m (a foreign metadata as the DCP source built it), each tensor named in
 * r[0..n) from its reformulated shape to its original one, each shard becoming the flat
 * piece of its box. Checks that the reformulated shape is as above (N + 1 dims, each A_i
 * dividing orig[i], L the box's element count) and that every shard is a (1..1, l) chunk;
 * a name not in m is refused. STRATA_EFORMAT naming file and the tensor, STRATA_ENOMEM. The
 * result must be validated again (st_meta_encode + st_meta_decode_foreign). */
int st_mg_unflatten(st_meta *m, const st_mg_reform *r, size_t n, const char *file);

/* Parses a DCP .metadata pickle (len bytes; file names it) into doc and finds the legacy
 * N-D flattened tensors its Metadata's mcore_data records ({fqn:
 * {"nd_reformulated_orig_global_shape": shape}}; other entries are skipped; none without
 * mcore_data): *out (malloc'd, *n entries; names point into doc). Errors: those of
 * pk_parse, STRATA_EFORMAT (a malformed mcore_data, a name twice), STRATA_ENOMEM. */
int st_mg_reforms(pk_doc *doc, st_mg_reform **out, size_t *n, const unsigned char *b,
                  size_t len, const char *file);

#endif
