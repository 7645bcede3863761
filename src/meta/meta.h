/* meta.h - the checkpoint's metadata (global tensor index) and commit record: in-memory
 * form, binary encoding and validating decoder. Format: docs/FORMAT.md. Pure; no I/O. */
#ifndef STRATA_META_H
#define STRATA_META_H
#include <stddef.h>
#include <stdint.h>

#include "../core/util.h"
#include "strata_types.h"

#define ST_META_MAGIC "STRATAMD"
#define ST_META_VERSION 1u     /* a full save's */
#define ST_META_VERSION_INCR 2u /* a save that can be a base, or has one (FORMAT.md) */
#define ST_META_HEADER 32u
#define ST_META_TRAILER 8u
/* Header flag of a foreign index (st_meta_decode_foreign): never stored, only sent from
 * the rank that read another format's files to the others. */
#define ST_META_FOREIGN 1u
#define ST_COMMIT_MAGIC "STRATACR"
#define ST_COMMIT_VERSION 2u
#define ST_COMMIT_SIZE 72u    /* version 2 (written); version 1 records have 64 bytes */
#define ST_COMMIT_V1_SIZE 64u
#define ST_ALIGN 4096u            /* extents in data files start at multiples of this */
#define ST_META_FILE "metadata.bin"
#define ST_COMMIT_FILE "COMMIT"
#define ST_PEER_FILE "PEER" /* a node's peer replica record (peer.c) */
#define ST_LOCK_FILE "LOCK" /* held by the directory's owner: a save, or a collector */
#define ST_PLAN_FILE "plan.bin" /* a distributed save's plan (planfile.h) */
/* A replacing save writes into ".<name>" ST_REPLACE_SUFFIX beside <name> (strata.h's
 * STRATA_REPLACE_SUFFIX). */
#define ST_REPLACE_SUFFIX ".strata-replace"
/* A data file's name: data-<writing rank, six or more digits>.bin. */
#define ST_DATA_FILE_BYTES 32
void st_data_file_name(char out[ST_DATA_FILE_BYTES], int rank);
/* The rank of a data file's name, or -1 if name is not one. */
long st_data_file_rank(const char *name);
/* A base's data file linked into an incremental checkpoint: ref-<16 hex digits: the id of
 * the save that wrote it>-<rank, six or more digits>.bin. */
#define ST_REF_FILE_BYTES 48
void st_ref_file_name(char out[ST_REF_FILE_BYTES], uint64_t save_id, long rank);
/* Is name one of those? */
int st_is_ref_file(const char *name);
/* Is name one of the files strata writes into a checkpoint directory (commit record,
 * metadata, the stored plan, their temporary names, the lock file, data and ref files)? */
int st_is_strata_file(const char *name);

/* Bytes of a data file holding [offset, offset + bytes), checksummed per chunk: chunk i
 * covers [i*chunk, min((i+1)*chunk, bytes)) and sums[i] is its XXH3-64. */
typedef struct st_extent {
    uint32_t file;
    uint64_t offset, bytes;
    uint64_t *sums; /* version 2 shards with has2: 2 x nchunks, the XXH64s after the XXH3s
                       (st_sums2) */
} st_extent;

typedef struct st_mshard {
    uint64_t *off, *len; /* ndim each */
    uint64_t fs, fe;     /* flat range of the box; whole box: 0, numel */
    int flat;
    st_extent ext;
    int has2; /* version 2: ext.sums holds the second checksums too (shard flag bit 1) */
} st_mshard;

typedef struct st_mtensor {
    char *name;
    strata_dtype dtype;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS];
    size_t nshards;
    st_mshard *shards;
    uint64_t bytes;
} st_mtensor;

typedef struct st_mblob {
    char *name;
    int64_t owner; /* -1: global */
    st_extent ext;
} st_mblob;

typedef struct st_mfile {
    char *name;
    uint64_t bytes;
} st_mfile;

/* A foreign file's identity when its header was read (inode, modification and change
 * times): its data must be read from that file, unchanged. */
typedef struct st_mident {
    uint64_t ino, mtime_ns, ctime_ns;
} st_mident;

/* A byte range of a foreign file that its format checks as a whole: a stored zip entry's
 * bytes and their CRC-32 (DCP items, torch.save, DeepSpeed, Megatron's common.pt). A load
 * that delivers any byte of it reads and checks all of it (DESIGN.md, "Load"). */
typedef struct st_mcheck {
    uint32_t file;
    uint32_t crc;         /* CRC-32 (zlib's) of the bytes */
    uint64_t offset, bytes; /* bytes > 0 */
    const char *name;     /* the entry's name, for messages */
} st_mcheck;

typedef struct st_meta {
    st_arena arena; /* owns everything below */
    uint64_t step;
    uint32_t chunk;  /* checksum chunk; foreign: 1, the unit of planned reads */
    /* 0: strata's own. 1: built from another format's headers (safetensors.h): extents
     * start anywhere (not at ST_ALIGN), and have no checksums (sums NULL). */
    int foreign;
    uint32_t nfiles;
    st_mfile *files;
    st_mident *idents; /* foreign: per file; NULL otherwise */
    /* foreign: the ranges its format checks (checks.h), sorted by (file, offset), disjoint;
     * none for a format without checksums (safetensors) and for strata's own */
    size_t nchecks;
    st_mcheck *checks;
    size_t ntensors;
    st_mtensor *tensors;
    size_t nblobs;
    st_mblob *blobs;
    uint64_t data_bytes;
    /* version 2 (ST_META_VERSION_INCR; 1 otherwise): shards carry sums2; base names the
     * checkpoint this one refers to (a plain name beside it in the same parent directory)
     * and base_id its save id; NULL and 0 for a save without a base */
    uint32_t version;
    char *base;
    uint64_t base_id;
    uint8_t *linked; /* version 2, per file: 1 if a hard link of a base's data file (not
                        written by this save); NULL otherwise */
    int write2; /* a save's, in memory: its writes compute the second checksums */
} st_meta;

/* The alignment of extent starts in data files (reads round to it). */
static inline uint64_t st_meta_align(const st_meta *m)
{
    return m->foreign ? 1 : ST_ALIGN;
}

static inline uint64_t st_nchunks(uint64_t bytes, uint32_t chunk)
{
    return bytes / chunk + (bytes % chunk != 0);
}

/* The second checksums (XXH64, seed 0) of a shard's chunks, the check that a chunk equals
 * its base's: in version 2 metadata, where the shard has them (has2); NULL otherwise. */
static inline uint64_t *st_sums2(const st_meta *m, const st_mshard *s)
{
    return m->version == ST_META_VERSION_INCR && s->has2
               ? s->ext.sums + st_nchunks(s->ext.bytes, m->chunk) : NULL;
}

/* Is file f of m a link to a base's data file? */
static inline int st_file_linked(const st_meta *m, uint32_t f)
{
    return m->linked && m->linked[f];
}

/* Encodes m into a new malloc'd buffer (*out, *len). STRATA_ENOMEM on failure. A foreign
 * m (m->foreign) is encoded with the ST_META_FOREIGN header flag, its files' identities (if
 * any), its check ranges, extents at byte offsets and no checksums: the form in which a source of another
 * format hands its index to the other ranks and to itself (st_meta_decode_foreign). */
int st_meta_encode(const st_meta *m, unsigned char **out, size_t *len);
/* Decodes and fully validates (bounds, names, geometry, overlap, extents within files).
 * On success *out is a new st_meta (free with st_meta_free). Errors: STRATA_EFORMAT with
 * a message saying what is wrong and where, STRATA_ENOMEM. Never reads past len, and
 * never allocates more than a small multiple of len. */
int st_meta_decode(st_meta **out, const unsigned char *buf, size_t len);
/* Decodes a foreign index (st_meta_encode of a foreign m) with the same checks, chunk 1 and
 * extents anywhere in their files; st_meta_decode refuses one (a metadata.bin is never
 * foreign) and this refuses strata's own. */
int st_meta_decode_foreign(st_meta **out, const unsigned char *buf, size_t len);
/* The same without the trailer checksum check (for fuzzing the parser in depth; either
 * kind). */
int st_meta_decode_unchecked(st_meta **out, const unsigned char *buf, size_t len);
void st_meta_free(st_meta *m);
/* Checks the shards of one tensor for overlap; STRATA_EOVERLAP naming the pair. Exact,
 * and near-linear in the number of shards on every input: the search is core's
 * (st_overlap_find, core/overlap.h; its work counter st_overlap_work). */
int st_meta_check_overlap(const st_mtensor *t);
/* Is `name` a plain file name (no '/', not "." or "..", no control characters)? */
int st_plain_name(const char *name, size_t len);

/* A commit record. save_id names the save that wrote it (random, never 0; 0 in a version 1
 * record, which has none): a save removes a commit record only if it holds its own id. */
typedef struct st_commit {
    uint32_t version; /* 1 or 2 (ST_COMMIT_VERSION) */
    uint64_t step, meta_size, meta_hash, time_ns, data_bytes, save_id;
} st_commit;

/* Encodes c as a record of its version (1: 64 bytes without save_id; otherwise version 2,
 * ST_COMMIT_SIZE bytes); returns its size. */
size_t st_commit_encode(const st_commit *c, unsigned char out[ST_COMMIT_SIZE]);
/* STRATA_EFORMAT unless buf is exactly one well-formed commit record: version 2 of
 * ST_COMMIT_SIZE bytes or version 1 of ST_COMMIT_V1_SIZE. */
int st_commit_decode(st_commit *c, const unsigned char *buf, size_t len);
/* Do two commit records say the same (every field)? */
int st_commit_same(const st_commit *a, const st_commit *b);

#endif
