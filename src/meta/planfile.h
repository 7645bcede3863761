/* planfile.h - the save plan stored with a checkpoint (plan.bin, docs/FORMAT.md): each
 * rank's part of the plan of the distributed save that wrote the checkpoint, behind an
 * index, so that a rank reads its own part alone. Encoder and validating decoders. Pure;
 * no I/O. */
#ifndef STRATA_PLANFILE_H
#define STRATA_PLANFILE_H
#include <stddef.h>
#include <stdint.h>

#include "meta.h" /* ST_PLAN_FILE */

#define ST_PLAN_MAGIC "STRATAPL"
#define ST_PLAN_VERSION 1u
#define ST_PLAN_HEADER 48u /* magic, version, ranks, chunk, 0, save id, size, checksum */

/* One piece a rank writes: the metadata's piece meta_index (tensors' shards in order, then
 * blobs), from `src_off` bytes into its registration `local`, to `offset` of its data
 * file. */
typedef struct {
    uint64_t meta_index;
    uint32_t local;
    uint64_t src_off, offset, bytes;
} st_ppiece;

/* A rank's part: the hash of its local plan when the plan was made (st_plan_hash), its
 * data file's size, its pieces in the order of their offsets. */
typedef struct {
    uint64_t hash, file_bytes;
    size_t n;
    st_ppiece *p;
} st_ppart;

typedef struct {
    uint32_t ranks, chunk;
    uint64_t save_id; /* the save that wrote it: its commit record's */
    uint64_t size;    /* the file's bytes (st_planfile_encode fills it) */
} st_phead;

/* Encodes a plan of h->ranks parts into a new malloc'd buffer. STRATA_ENOMEM. */
int st_planfile_encode(const st_phead *h, const st_ppart *parts, unsigned char **out,
                       size_t *len);
/* Decodes the header, buf[0 .. ST_PLAN_HEADER): STRATA_EFORMAT unless it is one. */
int st_planfile_header(st_phead *h, const unsigned char *buf, size_t len);
/* Where part r lies (bytes [*off, *off + *len) of the file), from the two index entries
 * at st_planfile_index_at(r) (16 bytes) and the file's size: STRATA_EFORMAT unless inside
 * the file, after the index. */
static inline uint64_t st_planfile_index_at(uint32_t r) { return ST_PLAN_HEADER + 8ull * r; }
int st_planfile_span(uint64_t *off, uint64_t *len, const st_phead *h, uint32_t r,
                     const unsigned char idx[16], uint64_t file_size);
/* Decodes part r from its bytes; hdr: the file's first ST_PLAN_HEADER bytes (its checksum
 * covers them, r and the part). Checks the pieces: offsets aligned, increasing and not
 * overlapping, within file_bytes; metadata indices increasing. STRATA_EFORMAT saying what
 * is wrong, STRATA_ENOMEM. out->p is malloc'd (st_ppart_free). Never reads past len and
 * allocates at most a small multiple of len. */
int st_planfile_part(st_ppart *out, const unsigned char *hdr, uint32_t r,
                     const unsigned char *buf, size_t len);
void st_ppart_free(st_ppart *p);
/* The whole file: header, index (consecutive parts, the last ending the file) and every
 * part; *parts (h->ranks of them) malloc'd, free with st_planfile_free. */
int st_planfile_decode(st_phead *h, st_ppart **parts, const unsigned char *buf, size_t len);
void st_planfile_free(st_ppart *parts, uint32_t n);

#endif
