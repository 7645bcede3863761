/* safetensors.h - the hostile-input-proof parser of a safetensors file's header (the first
 * piece of "Load from safetensors", issue 12). Pure; no I/O: the caller reads the bytes.
 *
 * A safetensors file is: an 8-byte little-endian header length N, N bytes of JSON (UTF-8,
 * possibly padded with spaces), then the data. The JSON is one object: the optional key
 * "__metadata__" maps to an object of string values; every other key is a tensor name
 * mapping to {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, offsets
 * relative to the start of the data (8 + N). Rules enforced (docs/FORMAT.md, "Reading
 * safetensors"), each refusal STRATA_EFORMAT with a message naming the file and the problem:
 *   - 8 + N <= file size, N <= ST_ST_MAX_HEADER (100 MB; refused before reading the JSON);
 *   - the JSON is strict (json.h, the reader the formats share): objects, arrays, strings
 *     (escapes, \u with surrogate pairs, valid UTF-8, no raw control characters),
 *     true/false/null only where skipped, numbers as non-negative integers below 2^64 where
 *     read; nesting at most ST_JSON_MAX_DEPTH;
 *     nothing but whitespace after the top-level object;
 *   - tensor names 1..STRATA_MAX_NAME bytes, no NUL, unique; each tensor has the fields
 *     dtype, shape and data_offsets (2 entries), each once (other fields are skipped, as by
 *     the reference reader, after checking their JSON); "__metadata__" at most once, its
 *     values strings, its keys unique;
 *   - dtype one of F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U8 BOOL; at most
 *     STRATA_MAX_DIMS dims; numel x element size does not overflow 62 bits and equals
 *     end - begin; begin <= end <= data length (file size - 8 - N);
 *   - sorted by offset, the tensors tile [0, data length) exactly: no overlap, no gap,
 *     nothing after the last tensor.
 * safetensors has no checksums: nothing here (or anywhere) can detect corrupted data bytes.
 *
 * Memory is bounded by a small multiple of N (no count read from the input sizes an
 * allocation), time is O(N log N). */
#ifndef STRATA_SAFETENSORS_H
#define STRATA_SAFETENSORS_H
#include <stddef.h>
#include <stdint.h>

#include "../core/util.h"
#include "../meta/meta.h"
#include "strata_types.h"

#define ST_ST_MAX_HEADER 100000000ull /* bytes of JSON a reader accepts (as the reference) */

typedef struct st_st_tensor {
    char *name; /* UTF-8, NUL-terminated, 1..STRATA_MAX_NAME bytes */
    strata_dtype dtype;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS];
    uint64_t begin, end; /* absolute file offsets: 8 + N + data_offsets */
} st_st_tensor;

typedef struct st_st_kv {
    char *key, *value; /* UTF-8; may hold NUL bytes (see key_len, value_len) */
    size_t key_len, value_len;
} st_st_kv;

typedef struct st_st_index {
    st_arena arena;         /* owns everything below */
    uint64_t header_len;    /* N */
    uint64_t data_begin;    /* 8 + N */
    uint64_t file_size;
    size_t ntensors;
    st_st_tensor *tensors;  /* sorted by begin (then end, then name): they tile the data */
    size_t nmeta;
    st_st_kv *meta;         /* "__metadata__", sorted by key */
} st_st_index;

/* Reads N from a file's first 8 bytes and checks it: N <= ST_ST_MAX_HEADER and
 * 8 + N <= file_size (file_size >= 8). STRATA_EFORMAT otherwise (the message does not
 * name the file: the caller wraps it, or calls st_st_parse, which names it). The caller then
 * reads 8 + N bytes of the file. */
int st_st_header_len(const unsigned char first8[8], uint64_t file_size, uint64_t *n);

/* Parses and validates the header of a safetensors file of file_size bytes, whose first
 * head_len bytes are file_head (at least 8 + N of them; more are ignored). On success *out
 * holds the index (free with st_st_free); on failure *out is left empty (st_st_free is
 * harmless). Errors: STRATA_EFORMAT naming file_name (NULL: "safetensors file") and the
 * problem (and, for JSON errors, the byte of the header); STRATA_EINVAL when fewer than
 * 8 + N bytes were passed though the file holds them; STRATA_ENOMEM. */
int st_st_parse(st_st_index *out, const unsigned char *file_head, size_t head_len,
                uint64_t file_size, const char *file_name);
void st_st_free(st_st_index *ix);

/* The safetensors name of a dtype ("F32", "F8_E4M3", ...), or NULL; and the reverse
 * (STRATA_EINVAL if unknown). */
const char *st_st_dtype_name(strata_dtype dt);
int st_st_dtype_parse(strata_dtype *out, const char *name, size_t len);

/* ---- a directory of safetensors files as a load source ---- */

#define ST_ST_SINGLE_FILE "model.safetensors"
#define ST_ST_INDEX_FILE "model.safetensors.index.json"

/* The index of a sharded set, model.safetensors.index.json: {"metadata": {...},
 * "weight_map": {tensor name: file name}} (other keys are skipped after their JSON is
 * checked). */
typedef struct st_st_wm {
    char *name, *file;
} st_st_wm;

typedef struct st_st_map {
    st_arena arena;  /* owns everything below */
    size_t n;
    st_st_wm *e;     /* sorted by name, unique */
    size_t nfiles;
    char **files;    /* the distinct files named, sorted */
} st_st_map;

/* Parses an index (len bytes of JSON, at most ST_ST_MAX_HEADER). Rules: the strict JSON of
 * the header; weight_map present once, its keys tensor names as in a header (unique), its
 * values plain file names (no '/', not "." or "..", at most 255 bytes). STRATA_EFORMAT
 * naming file_name and the problem, STRATA_ENOMEM. */
int st_st_parse_index(st_st_map *out, const unsigned char *json, size_t len,
                      const char *file_name);
void st_st_map_free(st_st_map *m);

/* A source description: the headers of a source's files in one buffer, what the rank that
 * read them sends the others (never stored). "STSAFE02", varint file count, then per file
 * its name (varint length, bytes), varints size, inode, modification and change time (ns)
 * of the file the header was read from, varint header length and the file's first 8 + N
 * bytes. Writers: */
void st_st_src_begin(st_buf *b, uint32_t nfiles);
void st_st_src_put(st_buf *b, const char *name, uint64_t file_size, const st_mident *id,
                   const unsigned char *head, size_t head_len);

/* Builds the metadata of a source from its description: one tensor per safetensors tensor
 * (sorted by name), each one whole-box shard whose extent is its bytes in its file, with no
 * checksums (m->foreign = 1, m->chunk = 1: reads are planned to the byte). Every header is
 * parsed and checked (st_st_parse); a tensor in two files is refused; with map (the
 * index), each weight_map entry must name a tensor of the file it names and every tensor
 * must be listed. Errors: STRATA_EFORMAT naming `where` (the directory) and the file,
 * STRATA_ENOMEM. */
int st_st_meta(st_meta **out, const unsigned char *src, size_t len, const st_st_map *map,
               const char *where);

#endif
