/* dcp.h - PyTorch Distributed Checkpoint (torch.distributed.checkpoint, "DCP") as strata
 * reads it: the interpretation of a .metadata pickle (the restricted reader's value graph,
 * pickle.h) into a table of items, and of one item's torch.save archive pickle (data.pkl)
 * into where its tensor's bytes lie. Pure; no I/O; fuzzable (fuzz/fuzz_dcp.c). Not
 * thread-safe per object; separate objects are independent. Rules: docs/FORMAT.md, "DCP as
 * strata reads it".
 *
 * Every refusal is STRATA_EFORMAT naming the file (and the item's FQN), except a dtype that
 * strata does not hold (complex) and an item with transform_descriptors (compressed or
 * otherwise transformed by a storage extension), which are STRATA_ENOTSUP. */
#ifndef STRATA_DCP_H
#define STRATA_DCP_H
#include <stddef.h>
#include <stdint.h>

#include "../core/util.h"
#include "pickle.h"
#include "strata_types.h"

#define ST_DCP_METADATA ".metadata"
#define ST_DCP_MAX_METADATA (256ull << 20) /* bytes of .metadata a reader accepts */
#define ST_DCP_MAX_FILES (1u << 20)

/* One stored item: a tensor's chunk (a box of the global tensor) or a non-tensor value's
 * bytes, at [offset, offset + length) of files[file]. */
typedef struct st_dcp_chunk {
    uint64_t off[STRATA_MAX_DIMS], len[STRATA_MAX_DIMS];
    uint32_t file;
    uint64_t offset, length;
} st_dcp_chunk;

typedef struct st_dcp_item {
    char *fqn;
    int tensor;               /* 0: BytesStorageMetadata (one chunk, ndim 0) */
    strata_dtype dtype;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS];
    size_t nchunks;
    st_dcp_chunk *chunks;
} st_dcp_item;

typedef struct st_dcp {
    st_arena arena; /* owns everything below */
    size_t nfiles;
    char **files;   /* relative_path of the items: plain names, each once, sorted */
    size_t nitems;
    st_dcp_item *items; /* sorted by fqn */
} st_dcp;

/* Parses a .metadata pickle of n bytes (file names it in messages) and interprets it. Checks:
 * the root is a Metadata whose state_dict_metadata maps str FQNs (unique) to
 * TensorStorageMetadata (a dtype strata holds, strided, 0..STRATA_MAX_DIMS dims, chunks that
 * lie inside the tensor, do not overlap and cover it exactly) or BytesStorageMetadata;
 * storage_data maps each chunk (MetadataIndex fqn + offset) and each bytes item (fqn) to
 * exactly one _StorageInfo (a plain relative_path: neither absolute nor with '/' or "..";
 * no transform_descriptors) and names nothing else. On failure *out is empty (st_dcp_free is
 * harmless). Errors: STRATA_EFORMAT, STRATA_ENOTSUP, STRATA_ENOMEM. */
int st_dcp_parse(st_dcp *out, const unsigned char *b, size_t n, const char *file);
void st_dcp_free(st_dcp *d);

/* What a torch.save archive of one tensor says of it (its data.pkl): a
 * torch._utils._rebuild_tensor_v2 call on a storage. */
typedef struct st_dcp_saved {
    strata_dtype dtype;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS];
    uint64_t storage_offset; /* elements */
    uint64_t storage_numel;  /* elements of the storage, as its persistent id says */
    char key[64];            /* the storage's key: its bytes are <archive>/data/<key> */
} st_dcp_saved;

/* Interprets a data.pkl (n bytes; what names it in messages) that must hold one tensor:
 * _rebuild_tensor_v2 (or _v3) of a persistent storage, contiguous (row-major strides; a dim
 * of length 1 may have any stride), storage offset + numel within the storage, dtype the
 * storage's. Errors: STRATA_EFORMAT, STRATA_ENOTSUP (not contiguous, a dtype strata does not
 * hold), STRATA_ENOMEM. */
int st_dcp_saved_tensor(st_dcp_saved *out, const unsigned char *b, size_t n, const char *what);

#endif
