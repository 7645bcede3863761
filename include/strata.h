/* strata.h - the public API of strata, a checkpoint engine for sharded training state.
 *
 * This header is the manual. Conventions (after libgit2):
 *  - functions that can fail return int: 0 on success or a negative STRATA_E* code;
 *  - outputs come first (`**out` for objects, owned by the caller and freed with the
 *    matching *_free; a struct pointer for results, which may be NULL where so said);
 *  - every failing call also leaves a message in a thread-local slot read by
 *    strata_error_last(); the message names the tensor, the file, the offending value;
 *  - options structs start with a `version` field and are initialised with *_INIT; any
 *    version from 1 to the current one is accepted (fields added later take their
 *    defaults). Result structs that may grow carry a version the caller sets the same way;
 *  - yes/no choices are bits of a `flags` word (STRATA_SAVE_*, STRATA_OPEN_*, ...).
 *
 * One way to save, one way to load. A save names its destinations (one URI, or tiers
 * fastest first), its ranks (an array of states in this process, or this rank's state
 * when the saver has a communicator), and options; strata_save_start starts it,
 * strata_wait_snapshot / strata_wait_durable wait for it, strata_handle_free ends it.
 * strata_save is the same followed by the waits. A load names its sources (one, or tiers
 * to fall back through), its ranks and a communicator (or NULL) the same way.
 *
 * Threading: strata_state and strata_saver objects are used by one thread at a time.
 * Saves and loads may run from several threads at once on different checkpoints; each
 * uses its own I/O threads. strata_ckpt handles are read-only after open and may be
 * shared between threads. strata_pool is thread-safe.
 */
#ifndef STRATA_H
#define STRATA_H

#include <stddef.h>
#include <stdint.h>

#include "strata_comm.h"
#include "strata_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- data model ------------------------------------------------------------------------ */

/* A shard of a tensor: a box of the global tensor (per-dim offset and length), optionally
 * narrowed to the element range [flat_start, flat_end) of the row-major flattening of that
 * box (an FSDP / ZeRO flat-parameter piece). `data` holds exactly the shard's elements,
 * contiguous, row-major. Several ranks holding the same name+box+range are replicas.
 * All arrays are read during the call that takes the struct and not kept. */
typedef struct strata_shard {
    const char *name;             /* fully qualified tensor name: 1..STRATA_MAX_NAME bytes of
                                     valid UTF-8 (no NUL) */
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
    unsigned flags;               /* STRATA_SHARD_* (0: none); other bits: STRATA_EINVAL */
} strata_shard;

/* The caller's promise that the shard's bytes equal, byte for byte, those of the same shard
 * (same tensor name, dtype, global shape, box and flat range) in the base of every
 * incremental save that uses this registration (strata_save_opts.base): frozen weights,
 * which no step changes. Where the base holds that very shard (committed, saved with
 * STRATA_SAVE_INCREMENTAL, same chunk_bytes, in a data file strata can link), the save
 * takes the base's checksums and refers to its bytes without reading `data` at all - no
 * hash, no copy into the pool, not even for device memory - so `data` may be unreadable
 * then. strata cannot check the promise: a marked shard whose bytes changed since the base
 * is saved holding the base's bytes, and that checkpoint verifies and loads them. Where the
 * base holds no such shard (another box, dtype or shape, a tensor the base lacks, another
 * chunk size, no base, a save with a communicator), the mark is ignored: the bytes are
 * read, hashed and compared (or written) as for any shard - never trusted. With replicas in
 * one process, a shard is taken as marked only if every rank registering it marked it. */
#define STRATA_SHARD_UNCHANGED (1u << 0)
/* The caller's statement that this shard is not the main copy of its elements: another
 * rank registers them unmarked (Megatron's replica_id != 0: a data- or tensor-parallel
 * copy). Unmarked shards are the main copies: identical ones (same tensor name, dtype,
 * global shape, box and flat range) are one piece, saved once, as without marks; two that
 * overlap without being identical are STRATA_EOVERLAP naming both ranks. A save takes a
 * marked shard identical to a main copy as one more holder of that piece, which may write
 * it to balance the writes. A marked shard identical to no main copy (a tensor-parallel
 * copy of a replicated tensor whose ZeRO flat range was cut elsewhere) is not saved, and
 * its tensor's main copies must then hold the whole tensor: else STRATA_EUNFILLED, naming
 * the tensor and the marked shard's rank, before anything is written. With a communicator
 * a marked shard travels to the coordinator as the 64-bit keys of its tensor and of its
 * piece (about 17 bytes) instead of its description, and the coordinator keeps no more of
 * it than which rank holds it: mark the copies of a large job so that its plan stays small
 * (docs/DESIGN.md, "Planning at scale"). A load ignores the mark. */
#define STRATA_SHARD_REPLICA (1u << 1)

/* Number of elements a shard holds (0 if the description is invalid). */
uint64_t strata_shard_numel(const strata_shard *s);

/* ---- one rank's state ------------------------------------------------------------------ */

/* A rank's registered shards and blobs: what it saves, or what it wants loaded. Only
 * pointers to the data are kept; the caller keeps the buffers alive until the save or
 * load that uses the state has ended (for a save: strata_wait_snapshot). */
typedef struct strata_state strata_state;

int strata_state_new(strata_state **out);
void strata_state_free(strata_state *st);

/* Registers a shard (copied, except the data pointer). Validates the name (1..
 * STRATA_MAX_NAME bytes of valid UTF-8: overlong forms, surrogates and truncated sequences
 * are refused) and the geometry: offsets + lengths within the global shape, flat range
 * within the box, no overflow of numel * element size. Errors: STRATA_EINVAL (the message
 * names the offending byte), STRATA_EDEVICE. */
int strata_state_add_shard(strata_state *st, const strata_shard *shard);

/* Byte blobs carry non-tensor state (data-loader, RNG, step, config).
 * flags STRATA_BLOB_RANK_LOCAL: the blob belongs to this rank (saved as owner = this
 * rank's index); without it, one global blob (replicas with the same name are saved once).
 * Save reads `size` bytes from data. Load: `owner` names which saved rank's blob to read
 * (-1 for a global blob; ignored at save), data receives exactly `size` bytes, and a
 * saved blob of another size is STRATA_EMISMATCH. Names are copied; like tensor names they
 * are 1..STRATA_MAX_NAME bytes of valid UTF-8 (else STRATA_EINVAL). */
#define STRATA_BLOB_RANK_LOCAL (1u << 0)
int strata_state_add_blob(strata_state *st, const char *name, unsigned flags, int owner,
                          void *data, uint64_t size);

/* ---- options and results ------------------------------------------------------------- */

#define STRATA_SAVE_NO_SYNC (1u << 0)   /* skip fsync (tests only: NOT crash safe) */
#define STRATA_SAVE_NO_DIRECT (1u << 1) /* never use O_DIRECT */
/* Replace the checkpoint at each destination atomically (DCP / torch.save users writing a
 * fixed path such as "latest"): the new checkpoint is written into ".<name>"
 * STRATA_REPLACE_SUFFIX beside it (same parent directory), committed there, and then the
 * two directories are exchanged (renameat2 RENAME_EXCHANGE), so that at every instant the
 * path holds a complete committed checkpoint - the previous one, then the new one; the
 * previous one is then removed. The save owns both the path and the directory beside it
 * (STRATA_EBUSY if another save or a collector holds either). A path with no committed
 * checkpoint (missing, empty, or incomplete) gets the new one the same way; anything else
 * there (a file, a symlink, a directory holding files strata does not write: a user's, a
 * run directory of checkpoints) is refused with STRATA_ENOTCKPT naming it, and a link
 * planted at the name beside it with STRATA_EINVAL, nothing touched. Readers that opened
 * the previous one's files keep reading them (POSIX); a load that read its metadata before
 * the exchange and opens data files after it fails (the new files' checksums or sizes do
 * not match), never loads a mix. A file system that cannot exchange directories (NFS,
 * older FUSE) is refused before anything is written: STRATA_ENOTSUP. A crash leaves the
 * path holding the previous or the new checkpoint, and the directory beside it for
 * strata_retain / strata_remove_incomplete (`strata gc`) to remove. With a communicator,
 * rank 0 swaps after the commit. */
#define STRATA_SAVE_REPLACE (1u << 2)
#define STRATA_REPLACE_SUFFIX ".strata-replace"
/* Record with every chunk a second checksum (XXH64) beside its XXH3, so that a later save
 * may name this one as its base (strata_save_opts.base). A save with a base does so
 * always. Such a checkpoint has metadata version 2 (docs/FORMAT.md): strata releases
 * before incremental saves refuse to read it ("metadata format version 2 is not
 * supported"). Costs one more hash of the bytes written (about a tenth of a copy). */
#define STRATA_SAVE_INCREMENTAL (1u << 3)

#define STRATA_SAVE_OPTS_VERSION 4
typedef struct strata_save_opts {
    int version;           /* STRATA_SAVE_OPTS_VERSION, or an older one */
    unsigned flags;        /* STRATA_SAVE_* */
    uint64_t step;         /* recorded in the metadata and the commit record */
    uint32_t chunk_bytes;  /* checksum granularity; 0 = STRATA_DEFAULT_CHUNK; a power of
                              two, 4 KiB..64 MiB */
    int io_threads;        /* 0 = default (4, or $STRATA_IO_THREADS) */
    /* version 2: asynchronous saves (Linux): niceness added to the thread that takes the
     * snapshot (0 = default 10); its writer threads run at 19, so they yield the CPU to
     * the training loop. -1 = leave both at the caller's. */
    int bg_nice;
    /* version 3: an incremental save. The name of a committed strata checkpoint beside
     * each destination (in the same parent directory: with tiers, each tier's own copy,
     * which must be the same save on every tier, else the save is a full one; the
     * destination itself with STRATA_SAVE_REPLACE), or NULL. A shard whose bytes equal the
     * base's shard at the same place (same tensor, dtype, shape, box, flat range and
     * chunk_bytes; every chunk's XXH3-64 and XXH64 equal to the base's) is not written
     * (nor, asynchronously, copied): the base's data file holding it is hard-linked into
     * the new checkpoint, which stays self-contained - loads, verify and export read it
     * as any other, and removing the base (gc, retention, rm -r) frees none of its bytes.
     * A shard marked STRATA_SHARD_UNCHANGED is referred to without being read where the
     * base holds it (above). Unmarked shards in device memory, blobs, a base saved without
     * STRATA_SAVE_INCREMENTAL, one of another chunk size, or a backend or file system that
     * cannot link (EXDEV, EPERM): written as usual. On s3:// a link is a copy made by the
     * server (no byte uploaded; FORMAT.md); a copy the server refuses fails a save in one
     * process. The base's bytes a shard would refer to are read and checked against their
     * checksums first (once per process and base file version: a chain of saves reads
     * its base once); where they fail, the caller's bytes are written instead, so the
     * new checkpoint verifies. Errors: the base's open (missing: STRATA_ENOENT,
     * not committed: STRATA_EINCOMPLETE, not strata's: STRATA_EINVAL, a name with '/' or
     * a symlink's: STRATA_EINVAL); a base removed or replaced while the save links its
     * files: STRATA_ECHANGED (the save is removed, nothing else touched).
     * With a communicator every rank gives a base, or none (else STRATA_EINVAL on every
     * rank, before anything is written); rank 0's base is used: where it is missing, not
     * committed or not incremental-ready the save is a full one, and a rank that cannot
     * link its base files (EXDEV, EPERM, ...) or finds the base removed or replaced writes
     * its own part in full (and a rank whose base bytes fail their check, those pieces);
     * a base that cannot be read (not strata's, corrupt metadata) fails the save on every
     * rank, as in one process. Marks are not carried between ranks: a distributed save
     * hashes its candidates. */
    const char *base;
    /* version 4: peer-memory replicas (docs/DESIGN.md, "Peer replicas"). With a
     * communicator, once destination 0 (each node's memory tier: mem://) is committed, its
     * files are copied to the same destination on this many other nodes, as
     * strata_peer_replicate does, by the commit (on the saver's commit thread where it has
     * one); strata_handle_level says when it is done. A replication that fails leaves the
     * save committed (not STRATA_LEVEL_REPLICATED; strata_handle_level's message says
     * why). 0: none. Without a communicator: STRATA_EINVAL. */
    int peer_replicas;
    /* version 4: the same with Reed-Solomon parity instead of whole copies
     * (strata_peer_encode): peer_k data and peer_m parity blocks per codeword, both > 0,
     * or both 0 (none); not with peer_replicas (STRATA_EINVAL). */
    int peer_k, peer_m;
} strata_save_opts;
#define STRATA_SAVE_OPTS_INIT {STRATA_SAVE_OPTS_VERSION, 0, 0, 0, 0, 0, NULL, 0, 0, 0}

#define STRATA_LOAD_NO_DIRECT (1u << 0) /* never use O_DIRECT */
/* Load a shard registered with another dtype than the saved tensor's by converting it
 * (without this flag that is STRATA_EMISMATCH). Each element is converted once, as it is
 * scattered from the reader's buffer into the shard (into device memory through a 1 MiB
 * host buffer), after the stored bytes' checksums were verified; no full-size temporary.
 * With a communicator each rank's own flag holds for its shards (bytes travel between
 * ranks as stored and are converted by the receiver). The pairs converted:
 *  - f64, f32, f16, bf16 to one another: round to nearest, ties to even, once (f64 to bf16
 *    too: not through f32); a value beyond the target's largest finite becomes an
 *    infinity of its sign, one below half its least subnormal a zero of its sign (IEEE
 *    754); infinities stay infinities; a NaN stays a NaN of its sign, quiet, keeping the
 *    high bits of its payload;
 *  - integers and bool where every value is exact: bool to every integer (a nonzero byte
 *    is 1); u8, i8 to i16, i32, i64; i16 to i32, i64; i32 to i64; bool, u8, i8 to every
 *    float; i16 to f32, f64; i32 to f64.
 * Any other pair (narrowing integers, float to integer, i64 to float, fp8) is
 * STRATA_EMISMATCH naming the tensor and both dtypes. Shapes must still match. */
#define STRATA_LOAD_CAST (1u << 1)
/* Load a shard registered with another dtype than the saved tensor's by converting it
 * only where every value of the saved dtype is exact in the requested one (a widening):
 * f16, bf16 to f32, f64; f32 to f64; and the integer and bool conversions above, all
 * exact. Nothing is rounded: a narrowing pair (f32 to bf16, f16 to bf16 and back, f64 to
 * f32) stays STRATA_EMISMATCH, with a message saying STRATA_LOAD_CAST would convert it.
 * Converted as STRATA_LOAD_CAST converts; with STRATA_LOAD_CAST this flag adds nothing. */
#define STRATA_LOAD_WIDEN (1u << 2)

/* 1 if a load with `flags` (STRATA_LOAD_* ; only STRATA_LOAD_CAST and STRATA_LOAD_WIDEN
 * matter) fills a shard of dtype `requested` from a tensor saved as `saved`, else 0:
 * equal (valid) dtypes always, other pairs as the two flags above say. Pure; thread-safe. */
int strata_load_converts(strata_dtype saved, strata_dtype requested, unsigned flags);

/* Leave the zip CRC-32s of a DCP, torch.save, DeepSpeed ZeRO or Megatron checkpoint
 * unchecked. By default every zip entry a load reads a byte of is read whole and its CRC-32
 * checked before its bytes reach the states (where the load needs part of an entry, the
 * rest is read too: strata_stats.crc_bytes), and a mismatch is STRATA_ECHECKSUM naming the
 * tensor, the entry and the file. With this flag only the requested bytes are read and
 * nothing is checked; strata_stats.crc_skipped says so. strata's own checksums are always
 * verified (they cover exactly what is read); safetensors has none. With a communicator,
 * rank 0's flag holds for every rank (the reads of the one plan depend on it). */
#define STRATA_LOAD_SKIP_CRC (1u << 3)

#define STRATA_LOAD_OPTS_VERSION 1
typedef struct strata_load_opts {
    int version;           /* STRATA_LOAD_OPTS_VERSION */
    unsigned flags;        /* STRATA_LOAD_* (each rank its own) */
    /* With a communicator, rank 0's io_threads and max_io_bytes (after defaults and
     * $STRATA_IO_THREADS) are used by every rank; strata_stats v2 tells which. Each I/O
     * thread keeps two reads in flight (one read, one verified and copied out). */
    int io_threads;        /* 0 = default (4, or $STRATA_IO_THREADS) */
    uint32_t max_io_bytes; /* largest coalesced read; 0 = the largest request the device
                              under the checkpoint takes (max_sectors_kb), from 4 MiB up to
                              16 MiB (4 MiB off a local block device) */
} strata_load_opts;
#define STRATA_LOAD_OPTS_INIT {STRATA_LOAD_OPTS_VERSION, 0, 0, 0}

/* What a save or load did. The caller sets version (STRATA_STATS_INIT, or any older
 * one); strata fills the fields of that version. strata_save and strata_load refuse a
 * version outside 1..STRATA_STATS_VERSION with STRATA_EINVAL before doing anything;
 * strata_wait_durable leaves such a struct untouched (the save's outcome stands). */
#define STRATA_STATS_VERSION 4
typedef struct strata_stats {
    int version;
    int tier;              /* load: the index of the source that was loaded */
    uint64_t data_bytes;   /* distinct shard + blob bytes in the checkpoint */
    uint64_t bytes;        /* bytes written (save; shards an incremental save referred to
                              its base are not counted) or payload bytes read (load), this
                              rank (with a communicator, a chunk that several ranks of a node
                              read through the page cache counts for one of them) */
    uint64_t io_calls;     /* pwrite/pread calls issued */
    double seconds;        /* wall time from the start to the end of the save or load */
    /* save: balance of the write work. max_writer_bytes is the largest rank's payload;
     * balance_bound is a lower bound on it for any assignment (ranks that share no
     * shard, like pipeline stages, cannot share work). */
    uint64_t max_writer_bytes, writers, balance_bound;
    uint64_t all_bytes; /* with a communicator: bytes written / read summed over all ranks */
    int plan_cached;    /* save with a communicator: 1 if the saver's last plan was reused;
                           strata_loader_load: 1 if the loader's last load plan was reused */
    /* version 2, load: the I/O threads and the largest read it used. With a communicator
     * these are rank 0's on every rank (options or $STRATA_IO_THREADS of other ranks that
     * differ are overridden: the ranks' reads and rounds must agree). */
    int io_threads;
    uint32_t max_io_bytes;
    /* version 3, load and export: how often the checkpoint's index was read and agreed on.
     * meta_reads: the reads of its index (commit record + metadata.bin, or a source's own
     * index and headers) by this rank; meta_bcasts: the broadcasts of it by the rank that
     * read it to the others (with a communicator: one when the index is at most
     * STRATA_LOADER_INLINE_BYTES, else two, the second with the rest; none without one).
     * For strata_loader_load, counted since its strata_loader_open (a fallback to a later
     * tier reads and broadcasts again); for strata_load, in the call; for
     * strata_export_safetensors, the export's one open. */
    uint64_t meta_reads, meta_bcasts;
    /* version 4, load and export: the zip CRC-32s of a DCP, torch.save, DeepSpeed ZeRO or
     * Megatron checkpoint (STRATA_LOAD_SKIP_CRC). crc_checked: the entries this rank checked,
     * each read whole; crc_bytes: the bytes it read only to check them (parts of entries no
     * request needed); with a communicator, of the entries that several ranks of a node read
     * and check, one rank's count (as bytes); crc_skipped: 1 when STRATA_LOAD_SKIP_CRC
     * (STRATA_EXPORT_SKIP_CRC) left them unchecked. 0, 0, 0 for strata's own checkpoints and
     * safetensors. */
    uint64_t crc_checked, crc_bytes;
    int crc_skipped;
} strata_stats;
#define STRATA_STATS_INIT {STRATA_STATS_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
                           0, 0, 0}

/* ---- buffer pools ---------------------------------------------------------------------- */

/* A fixed pool of aligned host memory, allocated and pre-faulted by strata_pool_new,
 * reused by every save given it (several at once included) and never grown: the snapshot
 * copy waits for a free buffer when all are in flight (back-pressure). A pool of `bytes`
 * has buffers of min(bytes / 2, max(8 MiB, bytes / 16), 64 MiB) (a multiple of 4 KiB, at
 * least 4 KiB), max(1, bytes / buffer) of them. A save's checksum chunk must fit in one
 * buffer: chunk_bytes C needs a pool of at least 2 C bytes for C up to 8 MiB and 16 C
 * above (256 MiB for 16 MiB chunks, 1 GiB for 64 MiB); a smaller pool is STRATA_EINVAL,
 * with the size needed. Thread-safe. */
typedef struct strata_pool strata_pool;
int strata_pool_new(strata_pool **out, uint64_t bytes);
/* Frees the pool; no save may still be using it. */
void strata_pool_free(strata_pool *p);
uint64_t strata_pool_bytes(const strata_pool *p);

/* ---- saving ---------------------------------------------------------------------------- */

/* What repeated saves share, owned by the caller and reused across a training loop: the
 * communicator (borrowed; NULL: the ranks are states in this process), the buffer pool
 * (borrowed; NULL: the saver makes one of its own at its first save that needs one,
 * min(1 GiB, the state) in buffers large enough for that save's chunks, and keeps it; its
 * buffers are allocated by the saves' background threads as they are first used, never on
 * the caller's thread. A later save with larger chunks makes it again when no save is
 * using it, else gets a pool of its own for that save), and the last save plan (with a
 * communicator: when every rank's layout is unchanged, the next save skips the plan
 * exchange). One thread at a time; with a communicator, every rank makes the same calls
 * on its saver.
 * With a communicator, the saver's asynchronous saves commit in the background: a thread
 * of the saver's own runs each save's commit collective as soon as this rank's part is
 * written, on a duplicate of the communicator (strata_comm.h, "Background commits"),
 * one save at a time in the order they were started (on every rank the same order).
 * strata_handle_done then turns 1 with no call from the caller, and strata_wait_durable
 * and strata_handle_free return at once with the outcome. Where the communicator cannot
 * be duplicated, the commit is strata_wait_durable's collective on the caller's thread
 * (strata_saver_background). */
typedef struct strata_saver strata_saver;
int strata_saver_new(strata_saver **out, strata_comm *comm, strata_pool *pool);
/* Frees the saver, first waiting for the saves started with it that are still in flight
 * to end (committed or failed; with background commits, their commits included). Their
 * handles stay valid: strata_wait_durable gives each one's outcome, strata_handle_free
 * frees it (with commits on the caller's thread, their commit collectives run there, on
 * the communicator, which must outlive them). The communicator (borrowed) outlives the
 * saver; a pool given outlives it too. */
void strata_saver_free(strata_saver *sv);
/* Makes the save plan stored with the committed checkpoint at uri (docs/FORMAT.md, "The
 * stored save plan": every distributed save stores its plan beside its metadata) the
 * saver's last plan, as if this job had made it: a job restarted with the layout that saved
 * uri then saves with no planning collective - its next save's one agreement (an allgather
 * of a flag and the plan's id per rank) finds every rank's layout what it was and every
 * rank holding the same plan, and each rank writes its part of it. Every rank calls it with
 * the same uri; it is local (no collective): rank 0 reads the commit record, the metadata
 * and the whole plan, every other rank its own part alone (three small reads). A layout
 * that changed since (a shard, a box, a flat range, a mark, the chunk size, the world size)
 * is found by that agreement - each rank compares its local plan's hash with the one stored
 * for it - and the save then plans afresh: a stored plan is never trusted beyond it. The
 * saver's last plan is dropped first, so on error the next save plans afresh. With a
 * communicator only (else STRATA_EINVAL). Errors: STRATA_ENOENT (no stored plan: saved in
 * one process, or by a strata without stored plans), STRATA_EFORMAT (corrupt, or not the
 * plan of the save committed there), STRATA_EMISMATCH (a plan of another world size), the
 * checkpoint's open errors (rank 0). One thread at a time, with no save in flight. */
int strata_saver_reuse_plan(strata_saver *sv, const char *uri);
/* Where the saver's asynchronous saves commit: 1 in the background (also every saver
 * without a communicator: each save commits on its own thread), 0 on the caller's thread,
 * in strata_wait_durable (the communicator has no dup op, or it failed on some rank: MPI
 * without MPI_THREAD_MULTIPLE), -1 not known before the saver's first asynchronous save.
 * *why (may be NULL) gets the reason for 0 (a message of the saver's, "" for 1). */
int strata_saver_background(const char **why, const strata_saver *sv);

/* A save in flight. */
typedef struct strata_handle strata_handle;

/* Starts a save of the ranks' states to the destinations uris[0..nuris) (1 to
 * STRATA_MAX_TIERS; "file:///abs/path", a plain path, "mem://name", or
 * "s3://bucket/prefix" in a build with libcurl (else STRATA_ENOTSUP; endpoint, region and
 * credentials from AWS_*; STRATA_SAVE_REPLACE refused there; a prefix with an empty, "."
 * or ".." segment: STRATA_EINVAL); tiers fastest first) and
 * returns once the plan is made, before any I/O or copying.
 *  - Ranks: without a communicator, `nstates` logical ranks in this process (index =
 *    rank); with one, this rank's one state (nstates = 1), and every rank of the
 *    communicator calls strata_save_start with the same destinations and options.
 *  - Every distinct shard is written once, balanced over the ranks that hold it. In the
 *    background the shards are copied chunk by chunk into the saver's pool and each full
 *    buffer is written to every destination while the next fills; then fsync, metadata,
 *    and a commit record last (temp file, fsync, rename, fsync of the directory), one per
 *    destination. A destination with no commit record is replaced; a committed one is
 *    never touched (STRATA_EEXIST). A save owns each destination directory (its LOCK
 *    file, docs/FORMAT.md) from before its first write until after its commit: another
 *    save or a collector on the same path fails at once with STRATA_EBUSY and touches
 *    nothing, in this process or any other.
 *  - The caller must not change its buffers until strata_wait_snapshot returns, and keeps
 *    the states alive until then.
 *  - A destination that fails is abandoned (its files removed) and the others go on;
 *    strata_wait_durable then returns its error, naming it, although the others are
 *    committed. With a communicator, a rank that fails makes every rank fail that
 *    destination (the others with a message naming the failing rank).
 *  - With a communicator, one collective finds whether the saver's cached plan still
 *    holds; if not, rank 0 gathers the local plans, dedups replicas, balances the writes
 *    and sends each rank its part. Every rank writes its own data file.
 * sv NULL: a saver of its own for this save (ranks in this process; its pool, allocated
 * in the background like a saver's own, is freed with the handle).
 * Errors here: STRATA_EINVAL (bad arguments or layout; different dtype/shape for one
 * name: STRATA_EMISMATCH; overlapping non-identical shards: STRATA_EOVERLAP),
 * STRATA_ENOMEM; later ones (STRATA_EEXIST, STRATA_EBUSY, STRATA_ESCHEME, STRATA_EIO,
 * STRATA_ENOSPC, STRATA_EDEVICE, STRATA_EABORTED) travel on the handle. With a
 * communicator, errors of one rank travel on its handle to strata_wait_durable, so that
 * every rank returns there with the same outcome; if this call fails, it failed on every
 * rank (rank 0 takes ownership of the destinations here, so STRATA_EBUSY and
 * STRATA_EEXIST come from this call). */
int strata_save_start(strata_handle **out, strata_saver *sv, const char *const *uris, int nuris,
                      strata_state *const *states, int nstates, const strata_save_opts *opts);
/* Returns once every byte has been copied out of the caller's buffers (or the save
 * failed): the caller may change them after it. 0 or the save's error so far. Local. */
int strata_wait_snapshot(strata_handle *h);
/* Returns once every destination is committed (0) or the save failed (its code, with its
 * message in strata_error_last()); stats (may be NULL) gets what the save did. With a
 * communicator, every rank returns the same result; with background commits (the
 * saver's) it waits for the saver's thread, else it is the collective that commits and
 * every rank calls it. Calling it again returns the same result. */
int strata_wait_durable(strata_stats *stats, strata_handle *h);
/* The save's error so far (0 if none), without waiting; *msg (may be NULL) its message. */
int strata_handle_status(const char **msg, strata_handle *h);
/* 1 once the save's background work has ended, without waiting: the save is then
 * committed or failed, and strata_wait_durable returns at once (with a communicator and
 * background commits: once the saver's thread has run the commit; with a communicator and
 * commits on the caller's thread: once this rank's part has ended, and the commit is
 * strata_wait_durable's collective). */
int strata_handle_done(strata_handle *h);
/* The levels a save has reached, without waiting (bits): STRATA_LEVEL_LOCAL, destination
 * 0 committed; STRATA_LEVEL_REPLICATED, its files held by strata_save_opts.peer_replicas
 * other nodes, each node's replica set committed; STRATA_LEVEL_DURABLE, a destination
 * that is not mem:// committed (storage). 0 before the commit or after a failed save.
 * *msg (may be NULL): why a replication asked for failed ("" if it did not). */
#define STRATA_LEVEL_LOCAL 1
#define STRATA_LEVEL_REPLICATED 2
#define STRATA_LEVEL_DURABLE 4
int strata_handle_level(const char **msg, strata_handle *h);
/* Waits for the save to end - its commit included (with a communicator and commits on
 * the caller's thread, strata_wait_durable's collective runs here, so that no rank is left
 * waiting) - then frees the handle. May come after strata_saver_free. */
void strata_handle_free(strata_handle *h);

/* strata_save_start, strata_wait_durable and strata_handle_free in one call: returns when
 * the save is committed or failed. To one destination the bytes go straight from the
 * caller's buffers to the files on I/O threads, with no copy (the pool is not used); to
 * several, through the saver's pool as strata_save_start does. stats may be NULL. */
int strata_save(strata_stats *stats, strata_saver *sv, const char *const *uris, int nuris,
                strata_state *const *states, int nstates, const strata_save_opts *opts);

/* ---- loading --------------------------------------------------------------------------- */

/* Loads into the shards and blobs registered in the states, whatever layout they were
 * saved in, from the first source of uris[0..nuris) (fastest first) that is committed and
 * loads with every checksum right, falling back to the next on any error; stats->tier
 * tells which. Ranks: without a communicator (comm NULL), `nstates` logical ranks in this
 * process; with one, this rank's state (nstates = 1), every rank calling together: rank 0
 * reads the commit record and metadata and broadcasts them, the requests of all ranks are
 * exchanged, every rank computes the same plan, and each saved chunk any rank needs is
 * read once, by one of the ranks that need it, verified, and sent to the others. All
 * ranks agree on the source used.
 * Only the checksum chunks that hold requested bytes are read, each once; every chunk is
 * verified before its bytes are scattered. A source of another format is checked as its
 * format allows: every zip entry of a DCP, torch.save, DeepSpeed or Megatron checkpoint
 * that holds a requested byte is read whole and its CRC-32 compared (STRATA_LOAD_SKIP_CRC);
 * safetensors has no checksum. Every requested byte is filled, or the call fails (the
 * destinations may then hold partial data). opts may be NULL.
 * Errors (of the last source, with the reasons of all): STRATA_EINCOMPLETE,
 * STRATA_EFORMAT, STRATA_ECHECKSUM (naming tensor and file; a zip entry too), STRATA_ENOTFOUND,
 * STRATA_EMISMATCH, STRATA_EUNFILLED, STRATA_ENOENT, STRATA_EIO, STRATA_ESCHEME,
 * STRATA_ECHANGED (a safetensors file replaced or rewritten after its header was read),
 * STRATA_EABORTED (another rank failed). */
int strata_load(strata_stats *stats, strata_comm *comm, const char *const *uris, int nuris,
                strata_state *const *states, int nstates, const strata_load_opts *opts);

/* ---- the loader: a checkpoint opened once, loaded many times ------------------------- */

/* What repeated loads of one checkpoint share (the load side of strata_saver): the source
 * chosen among tiers, its index (read once and, with a communicator, agreed on by every
 * rank with one broadcast), and the plan of the last load. strata_load is
 * strata_loader_open + strata_loader_load + strata_loader_free.
 *
 * strata_loader_open opens the first of uris[0..nuris) (1 to STRATA_MAX_TIERS, fastest
 * first) that holds a committed checkpoint whose index reads and validates (strata's
 * own, or a source strata reads: see strata_ckpt_open), passing over the others. comm
 * (borrowed; it must outlive the loader) NULL: this process only, the loads' ranks are
 * states in this process; else every rank of comm calls it together: rank 0 alone reads
 * the index (the commit record and metadata, or the source's index and headers) and
 * broadcasts it - one broadcast of STRATA_LOADER_INLINE_BYTES + ~1 KiB carrying the
 * outcome, the tier and an index that fits; a larger index follows in a second - and the
 * other ranks rebuild it from those bytes without any I/O; every rank returns the same
 * outcome. opts may be NULL (its version 1..STRATA_LOADER_OPTS_VERSION, flags 0, else
 * STRATA_EINVAL). Errors: STRATA_EINVAL (no URIs, a URI empty or too long, bad options),
 * and when no tier opens, the last tier's code (STRATA_ENOENT, STRATA_EINCOMPLETE,
 * STRATA_EFORMAT, STRATA_ESCHEME, STRATA_EIO) with a message naming every tier's reason
 * ("no copy could be loaded: <uri>: <why>; ..."; one tier: its own message); with a
 * communicator also STRATA_EABORTED (the collective failed).
 *
 * strata_loader_index gives the index as a read-only strata_ckpt: the strata_ckpt_*
 * accessors (tensors, dtypes, global shapes, blobs, files, format, chunk_bytes - 0: no
 * checksums - step) answer for it, on every rank. It lives until strata_loader_free or the
 * next strata_loader_load that falls back to another tier (which replaces it; call
 * strata_loader_index again); never strata_ckpt_free it. strata_loader_tier: the index
 * of the tier open now. Both say none (NULL, -1) once a failed load found no tier left.
 *
 * strata_loader_load loads into the states as strata_load does (any saved layout into any
 * requested layout, each needed chunk read once and verified; with a communicator every
 * rank calls it together with its one state, nstates = 1), as many times as the caller
 * wants, with other states or the same, without reading the index again. The load plan is
 * kept on the loader: a load whose requests (every rank's names, dtypes, boxes, flat
 * ranges, blobs, STRATA_LOAD_CAST and STRATA_LOAD_WIDEN; not the data addresses) equal the
 * last load's reuses it (stats->plan_cached = 1). If the load fails on the tier open now
 * (a bad checksum, a missing or changed data file) and later tiers remain, the loader
 * opens the next tier that opens and loads from it (stats->tier says which; the index is
 * then that tier's), as strata_load falls back (on any error, a request the tier cannot
 * fill included; not once the communicator is broken). When no tier is left, the message names every tier's
 * reason, and the loader has no tier open: later loads fail with STRATA_EINVAL saying so.
 * The states' buffers may hold partial data after a failure. Errors: those of strata_load,
 * STRATA_EINVAL (bad arguments or options; ld NULL; no tier left).
 *
 * One thread at a time per loader; loaders of different checkpoints are independent. */
typedef struct strata_loader strata_loader;
typedef struct strata_ckpt strata_ckpt; /* below: reading a checkpoint's description */

#define STRATA_LOADER_INLINE_BYTES (64u << 10)

#define STRATA_LOADER_OPTS_VERSION 1
typedef struct strata_loader_opts {
    int version;    /* STRATA_LOADER_OPTS_VERSION */
    unsigned flags; /* none defined yet: 0 */
} strata_loader_opts;
#define STRATA_LOADER_OPTS_INIT {STRATA_LOADER_OPTS_VERSION, 0}

int strata_loader_open(strata_loader **out, strata_comm *comm, const char *const *uris, int nuris,
                       const strata_loader_opts *opts);
const strata_ckpt *strata_loader_index(const strata_loader *ld);
int strata_loader_tier(const strata_loader *ld);
int strata_loader_load(strata_stats *stats, strata_loader *ld, strata_state *const *states,
                       int nstates, const strata_load_opts *opts);
/* Frees the loader (NULL: nothing). Not a collective. */
void strata_loader_free(strata_loader *ld);

/* ---- reading a checkpoint's description ------------------------------------------------ */


/* Opens a checkpoint's metadata. A checkpoint without a valid commit record is refused
 * with STRATA_EINCOMPLETE unless flags has STRATA_OPEN_INCOMPLETE (then the metadata is
 * still validated). Errors: STRATA_ENOENT, STRATA_EFORMAT, STRATA_EINCOMPLETE, STRATA_ESCHEME.
 *
 * A path with no commit record that is not a strata checkpoint at all is named for what it
 * is: another framework's checkpoint (Megatron torch_dist, DeepSpeed; told by content) is
 * STRATA_EFORMAT naming the format, which strata cannot read yet;
 * a directory of checkpoints (naming one under it), an empty or unrelated directory, or a
 * missing path is STRATA_ENOENT; STRATA_EINCOMPLETE is only for a directory holding strata's
 * files without a valid commit record. strata_load answers the same.
 *
 * Hugging Face safetensors opens here too (and is a source strata_load accepts like a
 * checkpoint): a directory holding model.safetensors.index.json and the files it names, or
 * model.safetensors, or a path to one .safetensors file - where no strata metadata or
 * commit record is. Every header is validated (docs/FORMAT.md, "Reading safetensors"); each
 * safetensors tensor is one whole shard in its file. Such a source has no checksums
 * (strata_ckpt_chunk_bytes is 0, strata_ckpt_verify can only read every byte), no step and
 * no blobs, and counts as committed.
 *
 * So does a PyTorch DCP checkpoint (torch.distributed.checkpoint; STRATA_FORMAT_DCP): a
 * directory whose .metadata is a pickle (read by the restricted reader, never executed) and
 * the .distcp files it names (docs/FORMAT.md, "DCP as strata reads it"). Each non-empty
 * chunk of a tensor is a shard (its bytes inside the chunk's torch.save archive); each
 * non-tensor value a global blob holding the torch.save archive of the object. No strata
 * checksums (strata_ckpt_chunk_bytes is 0); strata_ckpt_verify reads every archive and
 * checks its zip CRC-32s. No step; committed. Errors beyond the above: STRATA_ENOTSUP for
 * items strata does not read (transform_descriptors, complex dtypes, non-contiguous or
 * big-endian tensors).
 *
 * torch.save files open here too (STRATA_FORMAT_TORCH_SAVE): a path to one file of torch's
 * zip format (any name: told by content), or a directory holding pytorch_model.bin, or
 * pytorch_model.bin.index.json and the files it names. Each tensor is one whole shard (its
 * bytes in the archive), each file's pickle one global blob "<file>/<dir>/data.pkl" (the
 * values; read, never executed). No checksums (strata_ckpt_chunk_bytes 0; strata_ckpt_verify
 * checks every zip entry's CRC-32, reporting each that differs by entry name), no step,
 * committed. Refused: STRATA_ENOTSUP for the legacy (pre-zip) format, a compressed entry, a
 * tensor not contiguous in its storage or complex; STRATA_EFORMAT for a forbidden pickle
 * global, a duplicate dict key, sizes that disagree (docs/FORMAT.md, "torch.save as strata
 * reads it").
 *
 * So does a DeepSpeed ZeRO checkpoint of DeepSpeed's default engine (STRATA_FORMAT_DEEPSPEED):
 * a tag directory (mp_rank_00_model_states.pt or zero_pp_rank_<r>_mp_rank_00_model_states.pt,
 * and [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt per data-parallel rank; stages 1-3),
 * or the save_dir whose `latest` names one. Its tensors are zero_to_fp32's (each parameter's
 * fp32 weight, frozen parameters, buffers, shared aliases) and optim.state.<fqn>.<key> for
 * each per-element optimizer state, every one made of flat pieces of the ranks' partitions
 * (docs/FORMAT.md, "DeepSpeed ZeRO as strata reads it"). Step: global_steps; no blobs, no
 * checksums (verify checks the zip CRC-32s); committed. Errors beyond torch.save's:
 * STRATA_ENOENT (a rank's file missing), STRATA_EUNFILLED (the partitions do not cover a
 * parameter), STRATA_EMISMATCH (param_shapes and the partitions disagree), STRATA_ENOTSUP (a
 * partition not fp32, a second model-parallel rank).
 *
 * So does a DeepSpeed tag saved through strata.deepspeed (STRATA_FORMAT_STRATA_DEEPSPEED):
 * the tag directory (its DeepSpeed files are stubs) or the save_dir whose `latest` names
 * one; what is read is the strata checkpoint tag/strata, with its checksums and commit
 * record (an incomplete one: STRATA_EINCOMPLETE). strata_ckpt_tag says which tag `latest`
 * named.
 *
 * So does a Megatron-Core checkpoint saved through strata.megatron
 * (STRATA_FORMAT_STRATA_MEGATRON): the checkpoint directory, whose metadata.json names the
 * sharded backend "strata"; what is read is the strata checkpoint dir/strata, with its
 * checksums and commit record (STRATA_ENOENT when it is missing, STRATA_EINCOMPLETE when its
 * save did not commit). */
#define STRATA_OPEN_INCOMPLETE (1u << 0)
int strata_ckpt_open(strata_ckpt **out, const char *uri, unsigned flags);
void strata_ckpt_free(strata_ckpt *ck);

int strata_ckpt_committed(const strata_ckpt *ck);
uint64_t strata_ckpt_step(const strata_ckpt *ck);
size_t strata_ckpt_ntensors(const strata_ckpt *ck);
size_t strata_ckpt_nblobs(const strata_ckpt *ck);
size_t strata_ckpt_nfiles(const strata_ckpt *ck);
uint64_t strata_ckpt_data_bytes(const strata_ckpt *ck); /* payload bytes of all shards+blobs */
uint32_t strata_ckpt_chunk_bytes(const strata_ckpt *ck); /* 0: no checksums (safetensors) */
/* An incremental checkpoint's base (strata_save_opts.base): the name of the checkpoint it
 * was saved against, beside it, or NULL for a full one (and for other formats). The base
 * may be gone since: its bytes this checkpoint uses are in its own files. *own_bytes (may
 * be NULL) gets the shard and blob bytes in the files its save wrote (all of
 * strata_ckpt_data_bytes for a full one); the rest lie in files linked from the base
 * (ref-<id>-<rank>.bin, docs/FORMAT.md). */
const char *strata_ckpt_base(const strata_ckpt *ck, uint64_t *own_bytes);
int strata_ckpt_format(const strata_ckpt *ck); /* STRATA_FORMAT_* (strata_types.h) */
/* The format's name: "strata", "safetensors", "dcp", "torch.save", "megatron", "deepspeed",
 * "strata.deepspeed", "strata.megatron". */
const char *strata_ckpt_format_name(const strata_ckpt *ck);
/* A DeepSpeed checkpoint opened through its save_dir: the tag its `latest` named, which is
 * what was read; NULL for any other (a tag directory named directly too). */
const char *strata_ckpt_tag(const strata_ckpt *ck);

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
typedef struct strata_file_info {
    const char *name;   /* data file name inside the checkpoint directory */
    uint64_t bytes;
} strata_file_info;

void strata_ckpt_tensor(strata_tensor_info *out, const strata_ckpt *ck, size_t i);
void strata_ckpt_shard(strata_shard_info *out, const strata_ckpt *ck, size_t tensor, size_t shard);
void strata_ckpt_blob(strata_blob_info *out, const strata_ckpt *ck, size_t i);
void strata_ckpt_file(strata_file_info *out, const strata_ckpt *ck, size_t i);

/* Reads every data byte and checks every checksum. For each bad chunk `report` (if not
 * NULL) is called with the tensor (or blob) name, the file and a message; the walk goes on.
 * Returns 0 if everything matched, STRATA_ECHECKSUM if any chunk was bad (or, for a
 * safetensors source, which has no checksums, if a file is shorter than its header says),
 * STRATA_ECHANGED if a safetensors file is no longer the one whose header was read, or the
 * first I/O error (STRATA_ENOENT for a missing file). */
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
int strata_probe(strata_probe_info *out, const char *uri);

/* The local path that uri names, into out (cap bytes): a plain path or file:// URI as
 * given, without trailing slashes; mem://name under the mem:// root ($STRATA_MEM_ROOT,
 * default /dev/shm/strata-<euid>: made 0700 when missing, refused as a save refuses it
 * when not this user's own); an s3:// URI as given (after a HEAD of its bucket). For
 * callers that list a tier's checkpoints (strata_probe each). STRATA_EINVAL (an empty, malformed or too long URI; a root not this user's;
 * out too small), STRATA_ESCHEME. */
int strata_uri_path(char *out, size_t cap, const char *uri);

/* Copies the committed strata checkpoint at src_uri into dst_uri, a new checkpoint
 * directory on any backend (a tier flushed behind a faster one: disk or mem:// to s3://).
 * Every data file is read once, in blocks that never cut a checksum chunk, each chunk's
 * checksum checked against the metadata before its bytes are written (a few threads per
 * file); then metadata.bin and the commit record are written last, as a save commits, so
 * that a copy stopped at any instant leaves no committed checkpoint at dst_uri (on s3://
 * its multipart uploads are aborted on failure, and by strata_retain / `strata gc` after a
 * kill). The copy owns dst_uri as a save does (STRATA_EBUSY while a save or collector
 * holds it); an incomplete checkpoint there is replaced, a committed one refused
 * (STRATA_EEXIST). The copy is the same checkpoint (same metadata, step and data files,
 * an incremental one's linked files included: it stands on its own) with a commit record
 * of its own. flags: 0. stats (may be NULL): bytes = data file bytes copied, io_calls,
 * seconds. Errors: the source's open (STRATA_EINCOMPLETE, STRATA_ENOENT, ...),
 * STRATA_ENOTSUP (another format's checkpoint), STRATA_ECHECKSUM naming the tensor or blob
 * and the file (nothing is committed), the destination's storage errors. The source must
 * not be removed meanwhile (the caller's retention keeps it). */
int strata_copy(strata_stats *stats, const char *src_uri, const char *dst_uri, unsigned flags);

/* ---- Peer-memory replicas (docs/DESIGN.md, "Peer replicas") ----
 * Each rank names its own node's copy of one checkpoint directory (normally the same
 * mem:// URI, which each node resolves to its own memory); nodes are grouped as a load
 * groups them (host name and boot id; STRATA_LOAD_NODES=k makes k groups of consecutive
 * ranks, for tests). Both are collectives. */
typedef struct strata_peer_info {
    int nodes;               /* nodes of the communicator */
    int replicas;            /* copies of each node's files on other nodes (replicate) */
    uint64_t step, save_id;  /* the checkpoint's, from its commit record */
    uint64_t bytes_sent;     /* this rank: file bytes (and 16-byte headers) sent */
    uint64_t bytes_received; /* this rank: file bytes received and written */
    uint64_t bytes_held;     /* this node's copy: the data file bytes it now holds */
    uint64_t share_bytes;    /* replicate: the data file bytes this node's ranks wrote */
} strata_peer_info;
/* After a save committed uri on every rank (rank 0's node holds the commit record, every
 * node its ranks' data files): copies each rank's data file to the rank of the same index
 * on each of the next `replicas` nodes of the ring of nodes (by lowest rank), and
 * metadata.bin to every node; each node whose ranks all hold their part then commits its
 * replica set (its PEER record, written last). A node then holds (replicas + 1) times its
 * share. Errors: STRATA_EINVAL (replicas < 1, or more than the other nodes), the commit
 * record or metadata missing on rank 0's node (STRATA_ENOENT, ...), STRATA_ENOTSUP (an
 * incremental checkpoint), storage errors; every rank fails where one does, and a node
 * whose ranks did not all succeed commits nothing. */
int strata_peer_replicate(strata_peer_info *out, strata_comm *comm, const char *uri,
                          int replicas);
/* The same with Reed-Solomon parity instead of whole copies (ISA-L): the nodes in groups
 * of k + m consecutive ones (the node count a multiple of k + m), each node holding its
 * share and m/k of a share of its group's parity (PEER-<codeword>.par; info->bytes_held
 * counts both), so that any m nodes of a group may be lost. Each node sends (k - 1 + m)/k
 * of its share. Errors: as strata_peer_replicate's; STRATA_EINVAL (k < 1, m < 1, k + m >
 * 255 or not dividing the nodes), STRATA_ENOTSUP (built without ISA-L). */
int strata_peer_encode(strata_peer_info *out, strata_comm *comm, const char *uri, int k,
                       int m);
/* On a job restarted on the surviving nodes (any number of ranks per node, nodes new or
 * old): finds the save whose replica sets the survivors committed, sends every node the
 * files its copy lacks, and commits every node's copy (the save's own commit record), so
 * that strata_load / strata_loader_open reads uri into any layout. Errors:
 * STRATA_ENOREPLICA (no survivor holds a committed replica set of uri, or some data file
 * is held by none: the message names the step and the files), STRATA_EEXIST (a node's copy
 * committed by another save), storage errors; every rank fails where one does. */
int strata_peer_restore(strata_peer_info *out, strata_comm *comm, const char *uri);

/* Progress of a long operation (strata_copy_ext): bytes done of the total so far. Return 0 to
 * go on; anything else stops it with STRATA_EABORTED (the callback may set the message with
 * strata_error_set). */
typedef int (*strata_progress_cb)(void *ctx, uint64_t bytes_done, uint64_t bytes_total);

#define STRATA_COPY_OPTS_VERSION 1
typedef struct strata_copy_opts {
    int version;                 /* STRATA_COPY_OPTS_VERSION */
    unsigned flags;              /* 0 */
    strata_progress_cb progress; /* may be NULL: once before the first byte (0 of the data
                                    files' total), then after each block written, from the
                                    copy's threads one call at a time */
    void *progress_ctx;
} strata_copy_opts;
#define STRATA_COPY_OPTS_INIT {STRATA_COPY_OPTS_VERSION, 0, NULL, NULL}

/* strata_copy with options (opts may be NULL: strata_copy's defaults): a progress callback,
 * which may stop the copy (STRATA_EABORTED; nothing is committed at dst_uri and what was
 * written there is removed, as after any failure). `strata copy SRC DST` is this call. */
int strata_copy_ext(strata_stats *stats, const char *src_uri, const char *dst_uri,
                    const strata_copy_opts *opts);

/* Retention in a directory of checkpoints (one tier): keeps the `keep` newest committed
 * checkpoints directly under dir_uri (by commit time) and removes the older ones (commit
 * record first, so a crash midway leaves an incomplete checkpoint, never a broken
 * committed one), and removes incomplete checkpoints that no live save owns (a save in
 * progress holds its directory's lock, whatever its age, and is left alone; so is one a
 * concurrent collector is removing). Each removal owns the checkpoint while it runs.
 * Corrupt ones are kept for a person to look at. *removed (may be NULL) gets the count
 * removed. */
int strata_retain(int *removed, const char *dir_uri, int keep);
/* strata_retain that tells, for each checkpoint it would remove but leaves, why: skipped
 * (may be NULL) gets its path, the code (STRATA_EBUSY: a live save or collector owns it;
 * STRATA_EINVAL: its LOCK is a symlink, FIFO, socket or directory, not a lock file strata
 * made; STRATA_ENOENT: removed or committed anew meanwhile, so no longer the one probed;
 * STRATA_EEXIST: committed meanwhile) and the message. Directories a replacing save left
 * (".<name>" STRATA_REPLACE_SUFFIX, STRATA_SAVE_REPLACE) are removed whatever they hold
 * once no save owns them; they never count as checkpoints kept. Where the storage's locks
 * do not exclude, nothing is removed: STRATA_ENOTSUP. */
typedef void (*strata_skip_cb)(void *ctx, const char *path, int code, const char *message);
int strata_retain_report(int *removed, const char *dir_uri, int keep, strata_skip_cb skipped,
                         void *ctx);

/* Calls fn(ctx, uri) for each subdirectory directly under dir_uri (any scheme: file://,
 * mem://, s3:// (its sub-prefixes; an empty prefix lists as an empty directory), a path), in
 * name order, with uri = dir_uri "/" name, hidden names included;
 * symlinks are skipped (a checkpoint is never reached through a link). The uri lives during
 * the call. fn returning nonzero stops the walk (STRATA_EABORTED). Errors: STRATA_ENOENT
 * (no such directory), STRATA_ESCHEME, STRATA_EIO, STRATA_ENOMEM. */
typedef int (*strata_dir_cb)(void *ctx, const char *uri);
int strata_list_dirs(const char *dir_uri, strata_dir_cb fn, void *ctx);

/* Removes a checkpoint directory that has no valid commit record (never a committed one:
 * STRATA_EEXIST; never one a live save owns: STRATA_EBUSY; STRATA_EINVAL if its LOCK is not
 * a lock file). Only strata's own files are unlinked, and symlinks are never followed. A
 * directory a replacing save left beside its target (".<name>" STRATA_REPLACE_SUFFIX) is
 * removed whatever it holds, once no save owns it. */
int strata_remove_incomplete(const char *uri);

/* Removes what distributed loads of earlier strata versions, killed on this node, left in
 * /dev/shm (a load now makes nothing there: ranks of one node share reads through the page
 * cache): the shared memory segments named by this effective uid, this boot and this pid
 * namespace, owned by this uid, whose creating process is gone. Never another user's
 * segment, nor a live process's. *removed (may be NULL) gets the count. Returns 0 (nothing
 * listable: nothing removed). */
int strata_reclaim_load_segments(int *removed);

/* ---- the device under a directory (for benchmarks) ------------------------------------ */

/* The block device under dir measured the way strata uses it: a scratch file of `bytes`
 * written sequentially with O_DIRECT by `threads` threads (0: strata's default I/O threads)
 * in 8 MiB requests (a save's write tasks), fsynced, then read back cold in the requests of a
 * load (max_io_bytes' default), through I/O buffers of the kind strata uses (2 MiB-aligned,
 * huge pages where the kernel gives them) or, small_pages, of 4 KiB pages; the file is
 * removed. GB/s are 1e9 bytes per second. out: STRATA_DISK_RATE_INIT. Errors: STRATA_EIO
 * and the like (naming dir), STRATA_EINVAL (a filesystem that refuses O_DIRECT),
 * STRATA_ENOMEM. */
#define STRATA_DISK_RATE_VERSION 1
typedef struct strata_disk_rate {
    int version; /* STRATA_DISK_RATE_VERSION */
    double write_gbps, read_gbps;
    double write_request, read_request; /* average bytes per device request in each pass
                                           (/proc/diskstats, all of the device's traffic
                                           then; 0: unknown) */
    uint64_t max_request;               /* the device's largest request (max_sectors_kb;
                                           0: unknown, as on tmpfs) */
    uint64_t read_block;                /* the reads' size */
    const char *pages;                  /* what backed the buffers, measured: "4 KiB pages",
                                           "transparent huge pages", "hugetlb pages" or
                                           "partly huge pages" (a static string) */
} strata_disk_rate;
#define STRATA_DISK_RATE_INIT {STRATA_DISK_RATE_VERSION, 0, 0, 0, 0, 0, 0, NULL}
int strata_disk_rate_measure(strata_disk_rate *out, const char *dir, uint64_t bytes,
                             int threads, int small_pages);
/* Requests and bytes so far of the block device under path, out[0..3]: reads, bytes read,
 * writes, bytes written (/proc/diskstats). 0, or STRATA_ENOENT where none is listed. */
int strata_disk_counters(const char *path, uint64_t out[4]);

/* ---- export to Hugging Face safetensors ---------------------------------------------- */

/* Progress of strata_export_safetensors, called on the caller's thread: once before the
 * first write (bytes_done 0), then after each window written. Bytes count tensor data as
 * written (after a conversion). Return 0 to go on; anything else stops the export, which
 * then fails with STRATA_EABORTED, leaves out_dir as it was and removes its staging
 * directory (the callback may set the message with strata_error_set). A signal handler
 * that sets a flag which the callback returns is how a command stops on Ctrl-C. */
typedef int (*strata_export_progress_cb)(void *ctx, uint64_t bytes_done, uint64_t bytes_total);

/* Convert f64, f32 and f16 tensors to bf16 (rounding once, to nearest even; NaN stays a
 * NaN of its sign); tensors of other dtypes are written as saved. */
#define STRATA_EXPORT_BF16 (1u << 0)
/* Never use O_DIRECT, reading the checkpoint or writing the files (by default the files
 * are written with O_DIRECT where the file system allows it: the page cache is left alone). */
#define STRATA_EXPORT_NO_DIRECT (1u << 1)
/* Leave the zip CRC-32s of a DCP, torch.save, DeepSpeed or Megatron checkpoint unchecked
 * (STRATA_LOAD_SKIP_CRC; stats->crc_skipped says so). By default every zip entry the
 * export reads a byte of is checked, before anything is published: the windows keep the
 * CRC-32 of what each read, and the rest of an entry no window read is read at the end
 * (stats->crc_bytes); a mismatch fails the export with STRATA_ECHECKSUM naming the tensor,
 * the entry and the file, and out_dir is left as it was. */
#define STRATA_EXPORT_SKIP_CRC (1u << 2)

#define STRATA_EXPORT_OPTS_VERSION 2
typedef struct strata_export_opts {
    int version;             /* STRATA_EXPORT_OPTS_VERSION, or 1 (every tensor exported) */
    unsigned flags;          /* STRATA_EXPORT_* */
    const char *prefix;      /* stripped from the start of tensor names (NULL or "": none);
                                names without it, or equal to it, are exported unchanged */
    uint64_t max_file_bytes; /* the most tensor bytes per file; 0 = 5e9. A tensor larger
                                than that gets a file of its own */
    int io_threads;          /* the loads' I/O threads; 0 = default */
    strata_export_progress_cb progress; /* may be NULL */
    void *progress_ctx;
    /* version 2: which tensors are exported (by default, and with version 1, all). A tensor
     * is exported when its name in the checkpoint matches a pattern of `include` (NULL:
     * every name matches), no pattern of `exclude` (exclude wins), and, with model_only,
     * the model rule below. Both are NULL-terminated arrays of fnmatch(3) glob patterns
     * matched with no flags against the whole name: '*' and '?' match any characters,
     * '.' and '/' included ("model.*", "*.exp_avg*", "*@rank*"); [...] is a class;
     * valid UTF-8, else STRATA_EINVAL. */
    const char *const *include;
    const char *const *exclude;
    /* NULL, or P (non-empty): export only what a model's state_dict holds under the key P
     * of a state saved by strata.torch ({"model": model, "optim": optimizer, ...} flattens
     * to "model.layers.0.w", "optim.state.0.exp_avg", per-rank values as "key@rank<r>"):
     * the tensors named "P.<rest>", written as <rest>, never a per-rank one (a name ending
     * in "@rank" and digits). Optimizer state lies under its own key (optim.), outside P.
     * With prefix too: STRATA_EINVAL (model_only strips P.). */
    const char *model_only;
} strata_export_opts;
#define STRATA_EXPORT_OPTS_INIT {STRATA_EXPORT_OPTS_VERSION, 0, NULL, 0, 0, NULL, NULL, NULL, NULL, NULL}

/* Writes the tensors of the checkpoint at ckpt_uri, merged to their full global shapes from
 * whatever shards, flat pieces and replicas were saved, as Hugging Face safetensors files
 * in the directory out_dir (a path, file:// or mem:// URI; made if missing, not its
 * parents): model-0000i-of-0000N.safetensors, tensors in the checkpoint's order, each file
 * a header {"__metadata__": {"format": "pt"}, name: {dtype, shape, data_offsets}} padded
 * with spaces to a multiple of 8, then the data; and model.safetensors.index.json
 * ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}); when all fit one file,
 * model.safetensors alone, without an index, as Hugging Face writes it. Blobs are not
 * exported. Memory stays bounded whatever the model: the checkpoint is opened once (one
 * strata_loader, its index read once: stats->meta_reads) and each tensor is loaded from it
 * (every checksum verified) in windows of at most 64 MiB, flat element ranges, into one
 * reused buffer, and the files' bytes are written in order through an 8 MiB staging buffer
 * (peak RSS: `make bench`).
 * All or nothing: out_dir belongs to the export and is replaced as a whole. The files are
 * written into a new staging directory beside it (out_dir.strata-export-<id>/, on the same
 * filesystem; every file created new, never through a link), fsynced, and when all are
 * complete the staging set takes out_dir's place in one step (renameat2 RENAME_EXCHANGE, or
 * a rename when out_dir is missing), out_dir's parent is fsynced, and the previous files are
 * removed. A reader of out_dir sees the previous complete set or the new one, never a mix;
 * on failure (or a stop by the progress callback) out_dir is as it was and the staging
 * directory is removed. An export killed midway leaves only its staging directory, which the
 * next export to out_dir removes (never one whose export is alive: it holds a lock), as does
 * strata_remove_export_staging of out_dir's parent. So
 * out_dir must be missing (its parent existing: made, not its parents), an empty directory,
 * or a directory holding only files an export writes (an earlier export's output); anything
 * else there, and a symlink as out_dir, is refused with STRATA_EEXIST before anything is
 * written. opts may be NULL. stats (may be NULL) gets data_bytes (tensor bytes read), bytes
 * and all_bytes (tensor bytes written: total_size), io_calls, seconds, meta_reads (1),
 * crc_checked, crc_bytes, crc_skipped (STRATA_EXPORT_SKIP_CRC).
 * A selection (include, exclude, model_only) that keeps no tensor is STRATA_ENOTFOUND,
 * nothing written; only selected tensors are loaded, counted and written.
 * Errors: those of strata_ckpt_open and strata_load (STRATA_ENOENT, STRATA_EINCOMPLETE,
 * STRATA_ECHECKSUM, ...), STRATA_EINVAL (bad options; a name that is not UTF-8; two names
 * equal once the prefix is stripped, or one that the prefix makes "__metadata__"),
 * STRATA_ENOTFOUND (the selection keeps nothing),
 * STRATA_EMISMATCH (a tensor named "__metadata__": safetensors keeps that key for the file's
 * metadata, so it cannot be exported), STRATA_EEXIST (out_dir as above), STRATA_ENOENT (its
 * parent is missing), STRATA_ESCHEME, STRATA_EIO, STRATA_ENOSPC, STRATA_ENOMEM,
 * STRATA_EABORTED (the progress callback stopped it). */
int strata_export_safetensors(strata_stats *stats, const char *ckpt_uri, const char *out_dir,
                              const strata_export_opts *opts);

/* Removes what killed exports left directly under dir_uri: every staging directory
 * (OUT.strata-export-<id>, beside an OUT in dir_uri) whose lock no live export holds, as
 * the next export to that OUT would (an OUT that a kill between the fallback's two renames
 * left missing gets its previous files back from it). Only an export's own files are
 * unlinked; anything else keeps its directory. *removed (may be NULL) gets the count of
 * directories removed. Errors: STRATA_ENOENT (no such directory), STRATA_ESCHEME,
 * STRATA_EIO, STRATA_ENOMEM. */
int strata_remove_export_staging(int *removed, const char *dir_uri);

/* ---- restricted pickles: values read without executing pickle ------------------------- */

/* strata reads pickles (a torch.save archive's data.pkl, a DCP item, Megatron's common.pt)
 * with its own bounded reader, which builds plain values and never calls anything: only an
 * allow-list of globals (torch dtypes and storage types, the tensor rebuild functions,
 * collections.OrderedDict, io.BytesIO, DCP's and DeepSpeed's metadata classes) may appear,
 * and only those the list allows may be called - each call a tagged value for the reader to
 * interpret, never run (docs/FORMAT.md, "Reading pickle and zip"). These calls give it to a
 * caller that builds its own values (the Python package builds Python objects from them).
 * A strata_pickle is read-only once made and may be shared between threads. */
typedef struct strata_pickle strata_pickle;             /* a parsed pickle */
typedef struct strata_pickle_value strata_pickle_value; /* one of its values */

#define STRATA_PICKLE_NONE 0
#define STRATA_PICKLE_BOOL 1
#define STRATA_PICKLE_INT 2    /* one that fits int64 */
#define STRATA_PICKLE_BIGINT 3 /* a larger one: its bytes */
#define STRATA_PICKLE_FLOAT 4
#define STRATA_PICKLE_STR 5
#define STRATA_PICKLE_BYTES 6
#define STRATA_PICKLE_TUPLE 7   /* torch.Size too */
#define STRATA_PICKLE_LIST 8
#define STRATA_PICKLE_DICT 9    /* collections.OrderedDict too (ordered) */
#define STRATA_PICKLE_GLOBAL 10 /* a global used as a value (torch.float32) */
#define STRATA_PICKLE_TENSOR 11 /* a torch tensor or parameter: strata_pickle_tensor */
#define STRATA_PICKLE_BYTES_IO 12 /* an io.BytesIO: its bytes and position */
#define STRATA_PICKLE_OTHER 13  /* a call or persistent id strata does not interpret: why */

/* What a value is (strata_pickle_get). Pointers live as long as the pickle. */
typedef struct strata_pickle_value_info {
    int kind;       /* STRATA_PICKLE_* */
    int ordered;    /* DICT: a collections.OrderedDict */
    int64_t i;      /* BOOL (0 or 1), INT; BYTES_IO: its position */
    double f;       /* FLOAT */
    const unsigned char *bytes; /* STR (valid UTF-8, NUL-terminated), BYTES, BIGINT (two's
                                   complement, little-endian), BYTES_IO (its buffer) */
    size_t len;     /* their bytes */
    size_t n;       /* TUPLE, LIST: items; DICT: (key, value) pairs */
    const char *module, *name; /* GLOBAL: the global; OTHER: the one called (NULL for a
                                  persistent id) */
    char why[256];  /* OTHER: what it is, for a message */
} strata_pickle_value_info;

/* Parses len bytes of pickle (protocols 2 to 5) into *out; name names it in messages (NULL:
 * "pickle"). data is copied: it may go once the call returns. Free with strata_pickle_free.
 * Errors: STRATA_EFORMAT (malformed, truncated, a global off the allow-list named as
 * module.name, a call of one the list does not allow, a bound exceeded: nesting, size,
 * memo, values), STRATA_ENOMEM; each naming name and the byte. */
int strata_pickle_parse(strata_pickle **out, const void *data, size_t len, const char *name);
/* Opens the torch.save archive (the zip format of torch >= 1.6) that is the len bytes at
 * data: its data.pkl is parsed as by strata_pickle_parse, and its tensors are placed in its
 * stored entries (strata_pickle_tensor gives their bytes). data is borrowed: it must live as
 * long as *out. Errors: STRATA_EFORMAT, STRATA_ENOTSUP (legacy format, a compressed entry,
 * big-endian data, a non-contiguous or complex tensor), STRATA_ECHECKSUM (data.pkl's
 * CRC-32), STRATA_ENOMEM; each naming name (NULL: "torch.save archive"). */
int strata_pickle_open_archive(strata_pickle **out, const void *data, size_t len,
                               const char *name);
void strata_pickle_free(strata_pickle *pk);

/* The value the pickle returns (its STOP). Never NULL for an open pickle. */
const strata_pickle_value *strata_pickle_root(const strata_pickle *pk);
/* What v is (*out filled; never fails). A value referenced twice by the pickle (its memo) is
 * one strata_pickle_value: compare pointers to share what it shares. */
void strata_pickle_get(strata_pickle_value_info *out, const strata_pickle_value *v);
/* Item i of a TUPLE or LIST (i < n); of a DICT, its pair i / 2: the key for an even i, the
 * value for an odd one (i < 2 n). NULL for another kind or an index out of range. */
const strata_pickle_value *strata_pickle_item(const strata_pickle_value *v, size_t i);
/* A dict key as a part of a tensor's name, as strata.torch joins them ("layers.0.weight"):
 * a str as it is, an int or bool in decimal, into buf (cap bytes, NUL-terminated). Its
 * length, or -1 for a key that cannot name a tensor (another kind, a NUL inside, too long). */
int strata_pickle_key(char *buf, size_t cap, const strata_pickle_value *key);

/* A TENSOR value read by torch.save's rules: its dtype and shape and, in an archive, its
 * bytes (a pointer into the archive's data; NULL and 0 for a bare pickle, whose bytes are
 * elsewhere). */
typedef struct strata_pickle_tensor_info {
    strata_dtype dtype;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS];
    const void *data;
    uint64_t bytes;
} strata_pickle_tensor_info;
/* Reads the TENSOR value v of pk, named name (its keys joined with '.', strata_pickle_key; in
 * an archive, the name its bytes are found by). Errors: STRATA_EINVAL (v is not a tensor),
 * STRATA_EFORMAT (a malformed call; in an archive, no tensor of that name), STRATA_ENOTSUP
 * (non-contiguous, complex); each naming name. */
int strata_pickle_tensor(strata_pickle_tensor_info *out, const strata_pickle *pk,
                         const strata_pickle_value *v, const char *name);

#ifdef __cplusplus
}
#endif
#endif /* STRATA_H */
