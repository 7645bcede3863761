/* strata_types.h - the shared vocabulary of strata: error codes, dtypes, formats and limits.
 * The ground floor: included by strata.h and by every internal layer, so that nothing
 * below the engine includes the public roof. Depends on nothing but the C library. */
#ifndef STRATA_TYPES_H
#define STRATA_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STRATA_VERSION_MAJOR 0
#define STRATA_VERSION_MINOR 3

/* ---- errors ---------------------------------------------------------------------------- */

/* X(NAME, value, message). One table generates the enum, strata_error_name() and
 * strata_error_str(); language bindings map it to exceptions. */
#define STRATA_ERRNO_MAP(X)                                                                   \
    X(OK, 0, "success")                                                                       \
    X(EINVAL, -1, "invalid argument")                                                         \
    X(ENOMEM, -2, "out of memory")                                                            \
    X(EIO, -3, "I/O error")                                                                   \
    X(ENOSPC, -4, "no space left on device or quota exceeded")                                \
    X(EFORMAT, -5, "malformed or truncated checkpoint metadata")                              \
    X(ECHECKSUM, -6, "checksum mismatch: data is corrupt")                                    \
    X(EINCOMPLETE, -7, "checkpoint is incomplete (no valid commit record)")                   \
    X(EMISMATCH, -8, "dtype or global shape differs from the saved tensor")                   \
    X(ENOTFOUND, -9, "tensor or blob is not in the checkpoint")                               \
    X(EUNFILLED, -10, "request is not fully covered by the saved shards")                     \
    X(EEXIST, -11, "a committed checkpoint already exists there")                             \
    X(ESCHEME, -12, "unknown URI scheme")                                                     \
    X(ENOENT, -13, "file or checkpoint does not exist")                                       \
    X(EOVERLAP, -14, "saved shards overlap without being identical replicas")                 \
    X(EABORTED, -15, "operation aborted")                                                     \
    X(EDEVICE, -16, "device memory given but CUDA is not usable")                            \
    X(EBUSY, -17, "another save or collector owns the checkpoint directory")                  \
    X(ECHANGED, -18, "a source file changed while it was being loaded")                       \
    X(ENOTSUP, -19, "the storage cannot do this safely (locks that do not exclude, no atomic exchange)") \
    X(ENOTCKPT, -20, "the path holds something other than a strata checkpoint to replace")  \
    X(ENOREPLICA, -21, "the surviving peer replicas cannot rebuild the checkpoint")

typedef enum strata_error_code {
#define STRATA_X_(name, val, msg) STRATA_##name = (val),
    STRATA_ERRNO_MAP(STRATA_X_)
#undef STRATA_X_
} strata_error_code;

/* The message of the last failing call on this thread ("" if none). Valid until the next
 * strata call on this thread. */
const char *strata_error_last(void);
/* "STRATA_ECHECKSUM" etc.; "STRATA_E?" for unknown codes. Never NULL. */
const char *strata_error_name(int code);
/* The one-line description from the table. Never NULL. */
const char *strata_error_str(int code);
/* Sets this thread's last error message (printf-style) and returns code: for code that
 * plugs into strata (host collectives, communicators) and reports a failure back to it. */
int strata_error_set(int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ---- dtypes ---------------------------------------------------------------------------- */

typedef enum strata_dtype {
    STRATA_F64 = 0,
    STRATA_F32,
    STRATA_F16,
    STRATA_BF16,
    STRATA_FP8_E4M3,
    STRATA_FP8_E5M2,
    STRATA_I64,
    STRATA_I32,
    STRATA_I16,
    STRATA_I8,
    STRATA_U8,
    STRATA_BOOL,
    STRATA_DTYPE_COUNT
} strata_dtype;

/* Element size in bytes (0 for an invalid dtype). */
size_t strata_dtype_size(strata_dtype dt);
/* "f32", "bf16", "fp8_e4m3", ... or NULL. */
const char *strata_dtype_name(strata_dtype dt);
/* Parses a name printed by strata_dtype_name. Returns STRATA_EINVAL if unknown. */
int strata_dtype_parse(strata_dtype *out, const char *name);

/* ---- formats (strata_ckpt_format) ------------------------------------------------------ */

#define STRATA_FORMAT_STRATA 0
#define STRATA_FORMAT_SAFETENSORS 1
#define STRATA_FORMAT_DCP 2 /* PyTorch torch.distributed.checkpoint */
#define STRATA_FORMAT_TORCH_SAVE 3 /* torch.save files, Hugging Face pytorch_model.bin */
#define STRATA_FORMAT_MEGATRON 4 /* Megatron-Core torch_dist (DCP + metadata.json) */
#define STRATA_FORMAT_DEEPSPEED 5 /* DeepSpeed ZeRO, its default engine's torch.save files */
#define STRATA_FORMAT_STRATA_DEEPSPEED 6 /* a DeepSpeed tag saved through strata.deepspeed */
#define STRATA_FORMAT_STRATA_MEGATRON 7 /* a Megatron checkpoint saved through strata.megatron */

/* ---- limits ---------------------------------------------------------------------------- */

#define STRATA_MAX_DIMS 8
#define STRATA_MAX_NAME 1024 /* bytes of a tensor or blob name, not counting the NUL */
#define STRATA_MAX_TIERS 8   /* destinations of one save, sources of one load */
#define STRATA_DEFAULT_CHUNK (4u << 20) /* checksum chunk when none is asked for */

#ifdef __cplusplus
}
#endif
#endif /* STRATA_TYPES_H */
