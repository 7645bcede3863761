/* strata.h - the public API of strata, a checkpoint engine for sharded training state.
 *
 * This header is the manual. Conventions (after libgit2):
 *  - functions that can fail return int: 0 on success or a negative STRATA_E* code;
 *  - outputs come first as `**out` and are owned by the caller (free them with the
 *    matching *_free function);
 *  - every failing call also leaves a message in a thread-local slot read by
 *    strata_error_last(); the message names the tensor, the file, the offending value;
 *  - options structs start with a `version` field and are initialised with *_INIT.
 *
 * Threading: strata_state objects are not thread-safe; use one per thread or lock.
 * strata_save/strata_load may be called from several threads at once on different
 * checkpoints. Internally they use a pool of I/O threads and return when done.
 * strata_ckpt handles are read-only after open and may be shared between threads.
 */
#ifndef STRATA_H
#define STRATA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STRATA_VERSION_MAJOR 0
#define STRATA_VERSION_MINOR 1

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
    X(EDEVICE, -16, "device memory given but CUDA is not usable")

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

/* ---- data model ------------------------------------------------------------------------ */

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

#define STRATA_MAX_DIMS 8
#define STRATA_MAX_NAME 1024 /* bytes, not counting the NUL */

/* Element size in bytes (0 for an invalid dtype). */
size_t strata_dtype_size(strata_dtype dt);
/* "f32", "bf16", "fp8_e4m3", ... or NULL. */
const char *strata_dtype_name(strata_dtype dt);
/* Parses a name printed by strata_dtype_name. Returns STRATA_EINVAL if unknown. */
int strata_dtype_parse(strata_dtype *out, const char *name);

/* A shard of a tensor: a box of the global tensor (per-dim offset and length), optionally
 * narrowed to the element range [flat_start, flat_end) of the row-major flattening of that
 * box (an FSDP / ZeRO flat-parameter piece). `data` holds exactly the shard's elements,
 * contiguous, row-major. Several ranks holding the same name+box+range are replicas.
 * All arrays are read during the call that takes the struct and not kept. */
typedef struct strata_shard {
    const char *name;             /* fully qualified tensor name, 1..STRATA_MAX_NAME bytes */
    strata_dtype dtype;
    int ndim;                     /* 0..STRATA_MAX_DIMS; 0 is a scalar */
    const uint64_t *global_shape; /* ndim entries */
    const uint64_t *offsets;      /* ndim entries; NULL means all zero */
    const uint64_t *lengths;      /* ndim entries; NULL means the global shape */
    int flat;                     /* 0: the whole box; 1: only [flat_start, flat_end) */
    uint64_t flat_start, flat_end;
    void *data;                   /* save: read; load: written */
    int device;                   /* 1: data is CUDA device memory (cudart is loaded at run
                                     time; without a usable driver: STRATA_EDEVICE) */
} strata_shard;

/* Number of elements a shard holds (0 if the description is invalid). */
uint64_t strata_shard_numel(const strata_shard *s);

/* ---- one rank's state ------------------------------------------------------------------ */

/* A rank's registered shards and blobs: what it saves, or what it wants loaded. Only
 * pointers to the data are kept; the caller keeps the buffers alive until the save or
 * load that uses the state has returned. */
typedef struct strata_state strata_state;

int strata_state_new(strata_state **out);
void strata_state_free(strata_state *st);

/* Registers a shard (copied, except the data pointer). Validates geometry: offsets +
 * lengths within the global shape, flat range within the box, no overflow of
 * numel * element size. Errors: STRATA_EINVAL. */
int strata_state_add_shard(strata_state *st, const strata_shard *shard);

/* Byte blobs carry non-tensor state (data-loader, RNG, step, config).
 * rank_local = 1: the blob belongs to this rank (saved as owner = this rank's index);
 * rank_local = 0: one global blob (replicas with the same name are saved once).
 * Save reads `size` bytes from data. Load: `owner` names which saved rank's blob to read
 * (-1 for a global blob; ignored at save), data receives exactly `size` bytes, and a
 * saved blob of another size is STRATA_EMISMATCH. Names are copied. */
int strata_state_add_blob(strata_state *st, const char *name, int rank_local, int owner,
                          void *data, uint64_t size);

/* ---- save and load (ranks in one process) ---------------------------------------------- */

#define STRATA_SAVE_OPTS_VERSION 2
typedef struct strata_save_opts {
    int version;
    uint64_t step;         /* recorded in the metadata and the commit record */
    uint32_t chunk_bytes;  /* checksum granularity; 0 = 4 MiB; power of two, 4 KiB..64 MiB */
    int io_threads;        /* 0 = default (4, or $STRATA_IO_THREADS) */
    int no_sync;           /* 1 = skip fsync (tests only: NOT crash safe) */
    int no_direct;         /* 1 = never use O_DIRECT */
    /* asynchronous saves (Linux): niceness added to the thread that takes the snapshot
     * (0 = default 10); its writer threads run at 19. They yield the CPU to the training
     * loop. -1 = leave both at the caller's. */
    int bg_nice;
} strata_save_opts;
#define STRATA_SAVE_OPTS_INIT {STRATA_SAVE_OPTS_VERSION, 0, 0, 0, 0, 0, 0}

typedef struct strata_stats {
    uint64_t data_bytes;   /* distinct shard + blob bytes in the checkpoint */
    uint64_t bytes;        /* bytes written (save) or payload bytes read (load) */
    uint64_t io_calls;     /* pwrite/pread calls issued */
    double seconds;        /* wall time of the whole call */
    /* save: balance of the write work. max_writer_bytes is the largest rank's payload;
     * balance_bound is a lower bound on it for any assignment (ranks that share no
     * shard, like pipeline stages, cannot share work). */
    uint64_t max_writer_bytes, writers, balance_bound;
    uint64_t all_bytes; /* distributed calls: bytes written / read summed over all ranks */
    int plan_cached;    /* strata_save_dist: 1 if the previous plan was reused */
} strata_stats;

/* Saves the states of `nranks` logical ranks (index = rank) to the checkpoint at `uri`
 * ("file:///abs/path", or a plain path). Every distinct shard is written once, balanced
 * over the ranks that hold it; data files are written first, then the metadata, and a
 * commit record last (temp file, fsync, rename, fsync of the directory).
 * A directory without a commit record is replaced; a committed one is never touched.
 * stats may be NULL. Errors: STRATA_EINVAL (bad layout: different dtype/shape for one
 * name: STRATA_EMISMATCH; overlapping non-identical shards: STRATA_EOVERLAP),
 * STRATA_EEXIST, STRATA_ESCHEME, STRATA_EIO, STRATA_ENOSPC, STRATA_ENOMEM. */
int strata_save(const char *uri, strata_state *const *ranks, int nranks,
                const strata_save_opts *opts, strata_stats *stats);

#define STRATA_LOAD_OPTS_VERSION 1
typedef struct strata_load_opts {
    int version;
    int io_threads;        /* 0 = default */
    uint32_t max_io_bytes; /* largest coalesced read; 0 = 16 MiB */
    int no_direct;
} strata_load_opts;
#define STRATA_LOAD_OPTS_INIT {STRATA_LOAD_OPTS_VERSION, 0, 0, 0}

/* Loads into the shards and blobs registered in each of the `nranks` states, whatever
 * layout they were saved in. Only the checksum chunks that hold requested bytes are read,
 * each once even when several ranks want it; every chunk read is verified before its
 * bytes are scattered. Every requested byte is filled, or the call fails (the
 * destinations may then hold partial data).
 * Errors: STRATA_EINCOMPLETE, STRATA_EFORMAT, STRATA_ECHECKSUM (message names tensor and
 * file), STRATA_ENOTFOUND, STRATA_EMISMATCH, STRATA_EUNFILLED, STRATA_ENOENT, STRATA_EIO. */
int strata_load(const char *uri, strata_state *const *ranks, int nranks,
                const strata_load_opts *opts, strata_stats *stats);

/* ---- many processes: communicators ------------------------------------------------------ */

/* All communication of a distributed save or load goes through a strata_comm: the
 * single-process default, MPI (libstrata is built against MPICH), or the caller's own
 * collectives (host callbacks, e.g. torch.distributed from the Python package).
 * A strata_comm is used by one thread at a time; every rank must make the same sequence
 * of strata calls on it. It also caches the last save plan (see strata_save_dist). */
typedef struct strata_comm strata_comm;

#define STRATA_COMM_OPS_VERSION 1
/* Collectives a host provides. Every call is made by all ranks together. Each returns 0,
 * or a negative STRATA_E* code (STRATA_EABORTED when a peer is gone or a time limit
 * passed); after an error the communicator is not used again. */
typedef struct strata_comm_ops {
    int version;
    /* Every rank sends n bytes; recv gets size * n bytes, in rank order. */
    int (*allgather)(void *ctx, const void *send, size_t n, void *recv);
    /* Rank r sends scounts[d] bytes to each rank d, packed in rank order in send, and
     * receives rcounts[s] bytes from each rank s, packed in rank order in recv. */
    int (*alltoallv)(void *ctx, const void *send, const size_t *scounts, void *recv,
                     const size_t *rcounts);
    /* root's n bytes of buf are copied to every rank's buf. */
    int (*bcast)(void *ctx, void *buf, size_t n, int root);
} strata_comm_ops;

/* The single-process communicator (rank 0 of 1). */
int strata_comm_self(strata_comm **out);
/* A communicator over an MPI communicator: mpi_comm points to an MPI_Comm (NULL:
 * MPI_COMM_WORLD; MPI must be initialised). It is duplicated, so strata's traffic never
 * mixes with the caller's. */
int strata_comm_mpi(strata_comm **out, const void *mpi_comm);
/* A communicator over the host's own collectives; ops and ctx must outlive it. */
int strata_comm_host(strata_comm **out, const strata_comm_ops *ops, void *ctx, int rank,
                     int size);
void strata_comm_free(strata_comm *c);
int strata_comm_rank(const strata_comm *c);
int strata_comm_size(const strata_comm *c);
/* Time limit of every collective (MPI communicator): a peer that does not take part
 * within ms milliseconds (a dead rank) makes the call return STRATA_EABORTED instead of
 * waiting forever. Default 300000 (5 minutes); 0 waits forever. */
void strata_comm_set_timeout(strata_comm *c, int ms);

/* Saves this rank's state as part of a save by every rank of comm (each calls it with
 * its own state and the same uri and opts). The coordinator (rank 0) gathers the local
 * plans, dedups replicas and balances the writes, and sends each rank its part; every
 * rank writes its own data file; the coordinator writes the metadata and the commit
 * record only after every rank reported success and its checksums. When every rank's
 * layout (names, dtypes, shapes, shards, blob names and sizes, world size) is the same
 * as at the previous save on this comm, the plan exchange is skipped: one collective
 * compares a hash of each local plan. stats: this rank's bytes; plan_cached tells.
 * Errors: as strata_save; a rank that fails makes every rank fail (the others with
 * STRATA_EABORTED and a message naming the failing rank), and nothing is committed. */
int strata_save_dist(strata_comm *comm, const char *uri, strata_state *local,
                     const strata_save_opts *opts, strata_stats *stats);

/* Loads this rank's requests as part of a load by every rank of comm. The coordinator
 * reads the commit record and metadata and broadcasts them; the requests of all ranks
 * are exchanged so every rank computes the same global plan; each saved chunk that any
 * rank needs is read once, by one of the ranks that need it (spread over them), verified,
 * and sent to the others. stats->bytes is this rank's reads; all_bytes the sum over ranks.
 * Errors: as strata_load; STRATA_EABORTED when another rank failed. */
int strata_load_dist(strata_comm *comm, const char *uri, strata_state *local,
                     const strata_load_opts *opts, strata_stats *stats);

/* ---- asynchronous (lazy) saving --------------------------------------------------------- */

/* A fixed pool of aligned host memory, allocated and pre-faulted once, reused by every
 * asynchronous save given it (several at once included) and never grown: the snapshot
 * copy waits for a free buffer when all are in flight (back-pressure). Buffers are up to
 * 8 MiB; a pool of `bytes` has max(1, bytes / buffer) of them. Thread-safe. */
typedef struct strata_pool strata_pool;
int strata_pool_new(strata_pool **out, uint64_t bytes);
/* Frees the pool; no save may still be using it. */
void strata_pool_free(strata_pool *p);
uint64_t strata_pool_bytes(const strata_pool *p);

/* An asynchronous save in flight. */
typedef struct strata_handle strata_handle;

/* Starts saving the ranks' states like strata_save and returns once the plan is made,
 * before any I/O or copying. In the background the shards are copied, chunk by chunk,
 * into buffers of `pool` (NULL: a pool of its own, min(1 GiB, the state's size), made and
 * freed by this save), and each full buffer is written while the next fills; then fsync,
 * metadata, commit record. The caller must not change its buffers until
 * strata_wait_snapshot returns, and keeps the states alive until strata_wait_durable.
 * Errors here: as strata_save's planning errors; later ones travel on the handle. */
int strata_save_async(strata_handle **out, const char *uri, strata_state *const *ranks,
                      int nranks, const strata_save_opts *opts, strata_pool *pool);
/* The same to several destinations ("tiers"), fastest first, e.g. mem://run/step-100,
 * then file:///local/..., then file:///shared/... (at most 8). Every buffer is written to
 * each tier in order; each tier gets its own commit record once its copy is complete. A
 * tier that fails is abandoned (its files removed) and the others go on; wait_durable
 * then returns that tier's error although the other tiers are committed. */
int strata_save_async_tiers(strata_handle **out, const char *const *uris, int ntiers,
                            strata_state *const *ranks, int nranks,
                            const strata_save_opts *opts, strata_pool *pool);
/* Returns once every byte has been copied out of the caller's buffers (or the save
 * failed): the caller may change them after it. 0 or the save's error so far. */
int strata_wait_snapshot(strata_handle *h);
/* Returns once the checkpoint is committed (0) or the save failed (its code, with its
 * message in strata_error_last()). stats may be NULL. */
int strata_wait_durable(strata_handle *h, strata_stats *stats);
/* The save's error so far (0 if none), without waiting; message in *msg if not NULL. */
int strata_handle_error(strata_handle *h, const char **msg);
/* Waits for the save to end, then frees the handle. */
void strata_handle_free(strata_handle *h);

/* The asynchronous strata_save_dist, a collective. It returns once this rank knows its
 * part of the plan: with a cached plan (every rank's layout unchanged) after one small
 * collective, with no I/O and no copy. The snapshot and this rank's writes go on in the
 * background through pool (NULL: one of its own, as for strata_save_async), into the
 * directory (created by whichever rank comes first). strata_wait_snapshot is local.
 * strata_wait_durable is a collective: it waits for this rank's writes, then every
 * rank's outcome and checksums go to rank 0, which checks the directory (no commit record,
 * no foreign files; stale files of an earlier incomplete save are removed) and commits;
 * every rank returns the same result. Every rank must call strata_wait_durable before its
 * next collective on comm. Errors of one rank (a bad URI, a failed write) travel on its
 * handle to wait_durable, where they fail the save on every rank; a failed save removes
 * what it wrote. */
int strata_save_dist_async(strata_handle **out, strata_comm *comm, const char *uri,
                           strata_state *local, const strata_save_opts *opts,
                           strata_pool *pool);
/* strata_save_dist_async to several destinations (1 to 8, fastest first), as
 * strata_save_async_tiers: each pool buffer goes to every tier, and rank 0 commits each
 * tier in which every rank succeeded. A failed tier is removed and wait_durable returns
 * its error (naming the destination) although the other tiers are committed. */
int strata_save_dist_async_tiers(strata_handle **out, strata_comm *comm,
                                 const char *const *uris, int ntiers, strata_state *local,
                                 const strata_save_opts *opts, strata_pool *pool);

/* Loads from the first of several copies (fastest first) that is committed and loads
 * with every checksum right, falling back to the next on any error. *used (may be NULL)
 * gets the index of the copy used. Errors: the last copy's, with the reasons of all. */
int strata_load_tiers(const char *const *uris, int ntiers, strata_state *const *ranks,
                      int nranks, const strata_load_opts *opts, strata_stats *stats,
                      int *used);

/* ---- reading a checkpoint's description ------------------------------------------------ */

typedef struct strata_ckpt strata_ckpt;

/* Opens a checkpoint's metadata. A checkpoint without a valid commit record is refused
 * with STRATA_EINCOMPLETE unless allow_incomplete is 1 (then the metadata is still
 * validated). Errors: STRATA_ENOENT, STRATA_EFORMAT, STRATA_EINCOMPLETE, STRATA_ESCHEME. */
int strata_ckpt_open(strata_ckpt **out, const char *uri, int allow_incomplete);
void strata_ckpt_free(strata_ckpt *ck);

int strata_ckpt_committed(const strata_ckpt *ck);
uint64_t strata_ckpt_step(const strata_ckpt *ck);
size_t strata_ckpt_ntensors(const strata_ckpt *ck);
size_t strata_ckpt_nblobs(const strata_ckpt *ck);
size_t strata_ckpt_nfiles(const strata_ckpt *ck);
uint64_t strata_ckpt_data_bytes(const strata_ckpt *ck); /* payload bytes of all shards+blobs */
uint32_t strata_ckpt_chunk_bytes(const strata_ckpt *ck);

typedef struct strata_tensor_info {
    const char *name;
    strata_dtype dtype;
    int ndim;
    const uint64_t *shape;
    size_t nshards;
    uint64_t bytes; /* saved bytes over all its shards */
} strata_tensor_info;

typedef struct strata_shard_info {
    const uint64_t *offsets, *lengths; /* ndim entries each */
    int flat;
    uint64_t flat_start, flat_end;
    const char *file;   /* data file name inside the checkpoint directory */
    uint64_t file_offset, bytes;
} strata_shard_info;

typedef struct strata_blob_info {
    const char *name;
    int owner;          /* saving rank, or -1 for a global blob */
    const char *file;
    uint64_t file_offset, bytes;
} strata_blob_info;

/* i must be < the matching count; pointers live as long as ck. */
void strata_ckpt_tensor(const strata_ckpt *ck, size_t i, strata_tensor_info *out);
void strata_ckpt_shard(const strata_ckpt *ck, size_t tensor, size_t shard, strata_shard_info *out);
void strata_ckpt_blob(const strata_ckpt *ck, size_t i, strata_blob_info *out);
void strata_ckpt_file(const strata_ckpt *ck, size_t i, const char **name, uint64_t *bytes);

/* Reads every data byte and checks every checksum. For each bad chunk `report` (if not
 * NULL) is called with the tensor (or blob) name, the file and a message; the walk goes on.
 * Returns 0 if everything matched, STRATA_ECHECKSUM if any chunk was bad, or the first I/O
 * error (STRATA_ENOENT for a missing file). */
typedef void (*strata_verify_cb)(void *ctx, const char *object, const char *file,
                                 const char *message);
int strata_ckpt_verify(const strata_ckpt *ck, strata_verify_cb report, void *ctx);

/* What is at a path, without trusting it: is_ckpt = 1 if it holds any strata file
 * (commit record, metadata or data file); has_commit = 1 if a commit record file exists;
 * committed = 1 only if the commit record is valid and matches valid metadata (so
 * has_commit && !committed means corrupt, !has_commit means incomplete); step comes from
 * readable metadata (0 if none); disk_bytes sums the sizes of strata's files there. */
typedef struct strata_probe_info {
    int is_ckpt, has_commit, committed, has_metadata;
    uint64_t step, disk_bytes;
} strata_probe_info;
int strata_probe(const char *uri, strata_probe_info *out);

/* Retention in a directory of checkpoints (one tier): keeps the `keep` newest committed
 * checkpoints directly under dir_uri (by commit time) and removes the older ones (commit
 * record first, so a crash midway leaves an incomplete checkpoint, never a broken
 * committed one), and removes incomplete checkpoints older than the newest committed one
 * (a save in progress is newer and is left alone). Corrupt ones are kept for a person to
 * look at. *removed (may be NULL) gets the count removed. */
int strata_retain(const char *dir_uri, int keep, int *removed);

/* Removes a checkpoint directory that has no valid commit record (never a committed one:
 * STRATA_EEXIST). Only strata's own files are unlinked, and symlinks are never followed. */
int strata_remove_incomplete(const char *uri);

#ifdef __cplusplus
}
#endif
#endif /* STRATA_H */
