/* torchsave.h - torch.save archives (the zip format of torch >= 1.6: `.pt`, `.pth`, Hugging
 * Face `pytorch_model.bin`) read as state dicts of tensors, without executing pickle. Pure:
 * every byte comes through the caller's read callback (zip.h); fuzzable.
 *
 * An archive holds <dir>/data.pkl (a pickle, read by the restricted reader, pickle.h),
 * <dir>/byteorder ("little"; absent in old archives, meaning little) and one stored entry
 * <dir>/data/<key> per storage. Rules (docs/FORMAT.md, "torch.save as strata reads it"):
 *   - exactly one entry <dir>/data.pkl with <dir> one plain name; stored, at most
 *     ST_TS_MAX_PKL bytes, its CRC-32 right (STRATA_ECHECKSUM); byteorder "little";
 *   - the tensors are the calls of torch._utils._rebuild_tensor_v2 / _v3 (also inside
 *     _rebuild_parameter) in the pickle's tree of dicts (OrderedDict too), lists and tuples,
 *     each named by its keys joined with "." (str keys as they are, int and bool keys as
 *     decimal, list and tuple items by index: strata.torch's flattening); a tensor under a
 *     key of another kind, an empty name, a name over STRATA_MAX_NAME bytes, two tensors of
 *     one name, or a dict with two equal keys (str, int/bool, bytes, None) is EFORMAT;
 *   - a tensor's storage is a persistent id ('storage', storage type, key, location, numel):
 *     its dtype from the storage type (FloatStorage, ...; an UntypedStorage takes the dtype of
 *     a _v3 call), numel elements (bytes for an untyped one); a key used with two dtypes or
 *     sizes is EFORMAT; the entry <dir>/data/<key> must exist (EFORMAT), be stored
 *     (compressed: STRATA_ENOTSUP naming it) and hold exactly the storage's bytes (EFORMAT);
 *   - shape and stride: tuples of ints >= 0, at most STRATA_MAX_DIMS dims; the tensor must be
 *     contiguous in its storage (a stride other than the row-major one on a dim longer than
 *     1 is STRATA_ENOTSUP naming the tensor: valid torch, but strata reads each tensor as one
 *     run of bytes); its bytes [offset, offset + numel x size) lie inside the storage;
 *   - a complex tensor (strata has no complex dtype) is STRATA_ENOTSUP naming it; a root that
 *     is itself a tensor is STRATA_ENOTSUP (strata reads state dicts).
 * Storages shared by several tensors (views, tied weights) are fine: each tensor is its own
 * byte run of the archive. Anything the pickle holds besides tensors is a value, returned
 * untouched in the pickle's tree (doc.root) for the caller to convert.
 * Not thread-safe per object; separate objects are independent. */
#ifndef STRATA_TORCHSAVE_H
#define STRATA_TORCHSAVE_H
#include <stddef.h>
#include <stdint.h>

#include "../meta/meta.h"
#include "pickle.h"
#include "safetensors.h"
#include "zip.h"

#define ST_TS_MAX_PKL (256ull << 20) /* bytes of data.pkl a reader accepts */
#define ST_TS_SINGLE_FILE "pytorch_model.bin"
#define ST_TS_INDEX_FILE "pytorch_model.bin.index.json"
/* The first bytes of the legacy (pre-zip) format: a protocol 2 pickle of its magic number
 * 0x1950a86a20f9469cfc6c (LONG1 of 10 bytes). */
#define ST_TS_LEGACY_MAGIC "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
#define ST_TS_LEGACY_MAGIC_LEN 14

typedef struct st_ts_tensor {
    char *name;             /* the joined keys, NUL-terminated */
    strata_dtype dtype;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS];
    const char *storage;    /* its storage's key */
    uint64_t offset, bytes; /* its bytes in the storage: [offset, offset + bytes) */
    uint64_t at;            /* st_ts_open: the absolute offset of its first byte in the file */
} st_ts_tensor;

typedef struct st_ts_storage {
    const char *key;
    strata_dtype dtype;
    uint64_t bytes;
    const st_zip_entry *entry; /* st_ts_open: <dir>/data/<key> */
} st_ts_storage;

typedef struct st_ts_doc {
    st_arena arena;      /* owns everything below, pk's values excepted */
    pk_doc pk;           /* the pickle (its values) */
    size_t n;
    st_ts_tensor *t;     /* sorted by name, unique */
    size_t nstorages;
    st_ts_storage *s;    /* sorted by key, unique */
} st_ts_doc;

/* Finds the tensors of a parsed pickle (the rules above): fills out->n, t, nstorages, s.
 * out->pk must hold the parsed pickle (pk_parse); file names the archive in messages.
 * Errors: STRATA_EFORMAT, STRATA_ENOTSUP, STRATA_ENOMEM. */
int st_ts_tensors(st_ts_doc *out, const char *file);
void st_ts_doc_free(st_ts_doc *d);

/* The name part of a dict key as strata.torch joins it: a str as it is, an int or bool in
 * decimal, into buf (cap bytes, NUL-terminated). Returns its length, or -1 for a key that
 * cannot name a tensor (another kind, a NUL inside, too long). */
int st_ts_key_part(const pk_val *key, char *buf, size_t cap);
/* Is this value a tensor (a _rebuild_tensor_v2/_v3 or _rebuild_parameter call)? Its
 * _rebuild_tensor call (NULL if not). */
const pk_val *st_ts_tensor_call(const pk_val *v);

/* One tensor's call (st_ts_tensor_call) read by the rules above into *out (name and `at`
 * not set; storage points into the pickle) and its storage's bytes, for the tensor named nm
 * of file (messages). Errors: STRATA_EFORMAT, STRATA_ENOTSUP. */
int st_ts_tensor_info(st_ts_tensor *out, uint64_t *storage_bytes, const pk_val *call,
                      const char *nm, const char *file);

typedef struct st_ts_archive {
    st_zip zip;
    const st_zip_entry *pkl;   /* <dir>/data.pkl */
    unsigned char *pkl_bytes;  /* malloc'd, pkl->usize bytes */
    st_ts_doc doc;             /* its tensors, each with its absolute offset `at` */
} st_ts_archive;

/* Opens the torch.save archive of file_size bytes read through rd (the rules above): the
 * zip, data.pkl read whole and parsed, every tensor placed in the file. On failure *a is
 * empty (st_ts_close is harmless). Errors: STRATA_EFORMAT, STRATA_ENOTSUP (a compressed
 * entry, big-endian data, a non-contiguous or complex tensor), STRATA_ECHECKSUM (data.pkl's
 * CRC-32), the callback's code, STRATA_ENOMEM; each naming file. */
int st_ts_open(st_ts_archive *a, uint64_t file_size, st_zip_read_fn rd, void *ctx,
               const char *file);
void st_ts_close(st_ts_archive *a);
/* The tensor named name, or NULL. */
const st_ts_tensor *st_ts_find(const st_ts_doc *d, const char *name);

/* One file of a source: its name in the directory, size, identity and opened archive. */
typedef struct st_ts_file {
    const char *name;
    uint64_t size;
    st_mident id;
    const st_ts_archive *a;
} st_ts_file;

/* Builds the foreign metadata of a source of nfiles archives: one tensor per archive tensor
 * that has elements (sorted by name; a name in two files is EFORMAT), each one whole shard
 * whose extent is its bytes in its file (an empty tensor has no bytes to read and is left
 * out: its dtype and shape are in the pickle, where strata.torch finds it); one global blob per file, named "<file>/<dir>/data.pkl", whose extent is
 * that stored entry (the pickle of the file's values: strata.torch decodes it). With map
 * (pytorch_model.bin.index.json), each weight_map entry must name a tensor of the file it
 * names and every tensor must be listed. The check table (checks.h) holds the stored zip
 * entries that hold a tensor's or a pickle's bytes (their CRC-32s). Errors: STRATA_EFORMAT
 * naming `where`, STRATA_ENOMEM. */
int st_ts_meta(st_meta **out, const st_ts_file *files, size_t nfiles, const st_st_map *map,
               const char *where);
/* Sets the check table of m (whose files are files[0, nfiles), in order) from the stored
 * entries of their archives (checks.h): what st_ts_meta and st_zero_meta do last. */
int st_ts_zip_checks(st_meta *m, const st_ts_file *files, size_t nfiles, const char *where);

#endif
