/* pickle.h - the restricted pickle reader: parses a pickle (protocols 2-5, the opcodes
 * torch.save and torch.distributed.checkpoint emit) into a graph of plain values without
 * executing anything. Pure; no I/O. Not thread-safe per document; separate documents are
 * independent.
 *
 * Values: None, bool, int (any size: kept as little-endian two's complement bytes when it
 * does not fit int64), float, str (valid UTF-8), bytes, tuple, list, dict (also
 * collections.OrderedDict, flagged). Globals come only from an allow-list (module, name)
 * (docs/FORMAT.md, "Reading pickle and zip"); the opcodes that would call something become
 * tagged nodes that a format reader interprets later:
 *   REDUCE of an allowed callable G with args A  -> PK_CALL {g = G, args = A}
 *   NEWOBJ of an allowed class C with args A     -> PK_CALL {g = C, args = A, newobj = 1}
 *   BUILD of state S on a call or OrderedDict    -> that node's state = S
 *   BINPERSID of P                               -> PK_PID {args = P}
 * Two calls are folded while parsing: collections.OrderedDict() is an (ordered) dict, and
 * _codecs.encode(s, "latin1") (protocol 2's bytes) is bytes. Any other global, a call of a
 * global the list does not allow to be called, EXT*, INST/OBJ, the protocol 0/1 text
 * opcodes, sets and out-of-band buffers are STRATA_EFORMAT naming the global (module.name)
 * or the opcode and the caller's context string.
 *
 * Bounds (each refusal STRATA_EFORMAT): input PK_MAX_INPUT bytes; stack PK_MAX_STACK values;
 * marks and the depth of the finished graph PK_MAX_DEPTH; memo indices < PK_MAX_MEMO;
 * PK_MAX_NODES values built; an int at most PK_MAX_INT_BYTES bytes; the graph expanded as a
 * tree (memo references counted each time) at most PK_MAX_EXPANDED values, so that a
 * consumer walking it recursively stays bounded; no cycles. Memory is bounded by a small
 * multiple of the input's size plus the memo's index table (at most PK_MAX_MEMO pointers). */
#ifndef STRATA_PICKLE_H
#define STRATA_PICKLE_H
#include <stddef.h>
#include <stdint.h>

#include "../core/util.h"
#include "strata_types.h"

#define PK_MAX_INPUT (1ull << 30)     /* bytes of pickle */
#define PK_MAX_STACK (1u << 20)       /* values on the stack at once */
#define PK_MAX_DEPTH 64               /* marks open at once; depth of the result */
#define PK_MAX_MEMO (1u << 20)        /* memo indices */
#define PK_MAX_NODES (1u << 24)       /* values built */
#define PK_MAX_INT_BYTES 1024         /* bytes of a LONG1/LONG4 int */
#define PK_MAX_EXPANDED (1ull << 26)  /* values of the result expanded as a tree */

typedef enum pk_kind {
    PK_NONE, PK_BOOL, PK_INT, PK_BIGINT, PK_FLOAT, PK_STR, PK_BYTES, PK_TUPLE, PK_LIST,
    PK_DICT, PK_GLOBAL, PK_CALL, PK_PID
} pk_kind;

/* The allow-list's entries; pk_global_module / pk_global_name name them. */
typedef enum pk_global {
#define PK_GLOBALS(X)                                                                        \
    X(ORDERED_DICT, "collections", "OrderedDict", PK_G_CALL)                                 \
    X(CODECS_ENCODE, "_codecs", "encode", PK_G_CALL)                                         \
    X(REBUILD_TENSOR_V2, "torch._utils", "_rebuild_tensor_v2", PK_G_CALL)                    \
    X(REBUILD_TENSOR_V3, "torch._utils", "_rebuild_tensor_v3", PK_G_CALL)                    \
    X(REBUILD_PARAMETER, "torch._utils", "_rebuild_parameter", PK_G_CALL)                    \
    /* a tensor with Python attributes (DeepSpeed's ZeRO-3 fp32_flat_groups: ds_id) */        \
    X(REBUILD_FROM_TYPE_V2, "torch._tensor", "_rebuild_from_type_v2", PK_G_CALL)             \
    X(TORCH_TENSOR, "torch", "Tensor", 0)                                                    \
    X(TORCH_SIZE, "torch", "Size", PK_G_CALL)                                                \
    X(DTYPE_F64, "torch", "float64", 0) X(DTYPE_F32, "torch", "float32", 0)                  \
    X(DTYPE_F16, "torch", "float16", 0) X(DTYPE_BF16, "torch", "bfloat16", 0)                \
    X(DTYPE_F8E4M3, "torch", "float8_e4m3fn", 0) X(DTYPE_F8E5M2, "torch", "float8_e5m2", 0)  \
    X(DTYPE_I64, "torch", "int64", 0) X(DTYPE_I32, "torch", "int32", 0)                      \
    X(DTYPE_I16, "torch", "int16", 0) X(DTYPE_I8, "torch", "int8", 0)                        \
    X(DTYPE_U8, "torch", "uint8", 0) X(DTYPE_BOOL, "torch", "bool", 0)                       \
    X(DTYPE_C64, "torch", "complex64", 0) X(DTYPE_C128, "torch", "complex128", 0)            \
    X(STORAGE_F64, "torch", "DoubleStorage", 0) X(STORAGE_F32, "torch", "FloatStorage", 0)   \
    X(STORAGE_F16, "torch", "HalfStorage", 0) X(STORAGE_BF16, "torch", "BFloat16Storage", 0) \
    X(STORAGE_I64, "torch", "LongStorage", 0) X(STORAGE_I32, "torch", "IntStorage", 0)       \
    X(STORAGE_I16, "torch", "ShortStorage", 0) X(STORAGE_I8, "torch", "CharStorage", 0)      \
    X(STORAGE_U8, "torch", "ByteStorage", 0) X(STORAGE_BOOL, "torch", "BoolStorage", 0)      \
    X(STORAGE_C64, "torch", "ComplexFloatStorage", 0)                                        \
    X(STORAGE_C128, "torch", "ComplexDoubleStorage", 0)                                      \
    X(STORAGE_F8E4M3, "torch", "Float8_e4m3fnStorage", 0)                                    \
    X(STORAGE_F8E5M2, "torch", "Float8_e5m2Storage", 0)                                      \
    X(STORAGE_UNTYPED, "torch.storage", "UntypedStorage", 0)                                 \
    X(LAYOUT_STRIDED, "torch", "strided", 0)                                                 \
    X(MF_CONTIGUOUS, "torch", "contiguous_format", 0)                                        \
    X(MF_PRESERVE, "torch", "preserve_format", 0)                                            \
    X(MF_CHANNELS_LAST, "torch", "channels_last", 0)                                         \
    X(DCP_METADATA, DCP_MOD ".metadata", "Metadata", PK_G_CALL)                              \
    X(DCP_TENSOR_STORAGE_METADATA, DCP_MOD ".metadata", "TensorStorageMetadata", PK_G_CALL)  \
    X(DCP_CHUNK_STORAGE_METADATA, DCP_MOD ".metadata", "ChunkStorageMetadata", PK_G_CALL)    \
    X(DCP_BYTES_STORAGE_METADATA, DCP_MOD ".metadata", "BytesStorageMetadata", PK_G_CALL)    \
    X(DCP_METADATA_INDEX, DCP_MOD ".metadata", "MetadataIndex", PK_G_CALL)                   \
    X(DCP_TENSOR_PROPERTIES, DCP_MOD ".metadata", "TensorProperties", PK_G_CALL)             \
    X(DCP_STORAGE_META, DCP_MOD ".metadata", "StorageMeta", PK_G_CALL)                       \
    X(DCP_MEM_FORMAT, DCP_MOD ".metadata", "_MEM_FORMAT_ENCODING", PK_G_CALL)                \
    X(DCP_STORAGE_INFO, DCP_MOD ".filesystem", "_StorageInfo", PK_G_CALL)                    \
    /* Metadata.all_local_plans (megatron-core 0.16.1's torch_dist on torch 2.13) */          \
    X(DCP_SAVE_PLAN, DCP_MOD ".planner", "SavePlan", PK_G_CALL)                              \
    X(DCP_WRITE_ITEM, DCP_MOD ".planner", "WriteItem", PK_G_CALL)                            \
    X(DCP_WRITE_ITEM_TYPE, DCP_MOD ".planner", "WriteItemType", PK_G_CALL)                   \
    X(DCP_TENSOR_WRITE_DATA, DCP_MOD ".planner", "TensorWriteData", PK_G_CALL)               \
    X(GET_LAYOUT, "torch.serialization", "_get_layout", PK_G_CALL)                           \
    X(POSIX_PATH, "pathlib", "PosixPath", PK_G_CALL)                                         \
    X(BYTES_IO, "_io", "BytesIO", PK_G_CALL)                                                 \
    /* DeepSpeed's optimizer state (*_optim_states.pt of its default checkpoint engine) */    \
    X(DS_LOSS_SCALER, DS_MOD ".runtime.fp16.loss_scaler", "LossScaler", PK_G_CALL)           \
    X(DS_DYN_LOSS_SCALER, DS_MOD ".runtime.fp16.loss_scaler", "DynamicLossScaler", PK_G_CALL) \
    X(DS_ZERO_STAGE, DS_MOD ".runtime.zero.config", "ZeroStageEnum", PK_G_CALL)              \
    X(DS_FRAGMENT_ADDRESS, DS_MOD ".utils.tensor_fragment", "fragment_address", PK_G_CALL)
#define DS_MOD "deepspeed"
#define DCP_MOD "torch.distributed.checkpoint"
#define PK_X_(id, mod, name, flags) PK_G_##id,
    PK_GLOBALS(PK_X_)
#undef PK_X_
    PK_G_COUNT
} pk_global;

#define PK_G_CALL 1 /* REDUCE / NEWOBJ of it is allowed (a tagged node, never run) */

typedef struct pk_val pk_val;
struct pk_val {
    pk_kind kind;
    uint8_t ordered;   /* PK_DICT: collections.OrderedDict */
    uint8_t newobj;    /* PK_CALL: by NEWOBJ (cls.__new__(cls, *args)) rather than REDUCE */
    pk_global g;       /* PK_GLOBAL, PK_CALL: the global (called) */
    int64_t i;         /* PK_BOOL (0/1), PK_INT */
    double f;          /* PK_FLOAT */
    const unsigned char *s; /* PK_STR (NUL-terminated, UTF-8), PK_BYTES, PK_BIGINT (LE) */
    size_t len;        /* their bytes */
    pk_val **items;    /* PK_TUPLE, PK_LIST: n items; PK_DICT: n (key, value) pairs, 2n */
    size_t n;
    pk_val *args;      /* PK_CALL: the argument tuple; PK_PID: the persistent id */
    pk_val *state;     /* PK_CALL, PK_DICT: the state BUILD applied, or NULL */
    size_t cap;        /* internal */
    uint32_t depth;    /* internal (the final check): 0 unseen, else 1 + children's */
    uint64_t exp;      /* internal: values when expanded as a tree */
};

typedef struct pk_doc {
    st_arena arena; /* owns every value */
    pk_val *root;   /* what STOP returned */
    size_t nodes;   /* values built */
    int proto;      /* the PROTO opcode's protocol (2 if none) */
} pk_doc;

/* Parses n bytes of pickle. ctx names the input in messages ("x.pt: archive/data.pkl").
 * On failure *doc is empty (pk_free is harmless). Errors: STRATA_EFORMAT naming ctx, the
 * byte offset and the problem (a global off the list as module.name), STRATA_ENOMEM. */
int pk_parse(pk_doc *doc, const unsigned char *b, size_t n, const char *ctx);
void pk_free(pk_doc *doc);

/* An int value (PK_INT, PK_BIGINT, PK_BOOL) as int64: STRATA_EFORMAT if v is not an int or
 * does not fit. */
int pk_int64(const pk_val *v, int64_t *out);
const char *pk_global_module(pk_global g);
const char *pk_global_name(pk_global g);
/* The strata dtype of a torch dtype global (torch.float32) or storage type
 * (torch.FloatStorage): 0 (*dt set), 1 (neither), 2 (a torch dtype strata does not hold:
 * complex). */
int pk_torch_dtype(pk_global g, strata_dtype *dt);
/* Is g a torch storage type (torch.FloatStorage, ..., torch.storage.UntypedStorage)? */
int pk_is_storage(pk_global g);
/* The entry for (module, name), or -1 if not on the list. */
int pk_global_find(const char *module, size_t mlen, const char *name, size_t nlen);
/* A dict's value for a str key, or NULL (the last pair with that key, as Python's). */
const pk_val *pk_dict_get(const pk_val *d, const char *key);

#endif
