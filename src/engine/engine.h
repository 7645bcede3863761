/* engine.h - internals shared by the engine's files: a rank's registered state, and
 * opening a checkpoint directory (commit record + metadata). */
#ifndef STRATA_ENGINE_H
#define STRATA_ENGINE_H
#include <limits.h>

#include "../core/util.h"
#include "../io/vfs.h"
#include "../meta/meta.h"
#include "../plan/plan.h"
#include "../source/source.h"
#include "strata.h"

struct strata_state {
    st_arena names;
    st_entry *sh;
    size_t nsh, capsh;
    st_blobent *bl;
    size_t nbl, capbl;
};

static inline st_rank_view st_state_view(const strata_state *s)
{
    return (st_rank_view){.sh = s->sh, .nsh = s->nsh, .bl = s->bl, .nbl = s->nbl};
}

/* ---- options (opts.c): the one place for defaults and version checks ---- */

#define ST_DEFAULT_MAX_IO (4u << 20) /* largest coalesced read of a load, at least (DESIGN.md, Load) */
#define ST_SAVE_TASK_BYTES (8u << 20) /* a save's write task, at most (but one whole chunk) */
#define ST_SYNC(o) (!((o)->flags & STRATA_SAVE_NO_SYNC))
#define ST_DIRECT(o) (!((o)->flags & STRATA_SAVE_NO_DIRECT))

/* Copies the caller's options (NULL: defaults; any version 1..current) into a full,
 * current one with the defaults filled in (chunk_bytes; a load's max_io_bytes stays 0 for
 * st_default_read_bytes) and checks them. */
int st_save_opts_get(strata_save_opts *out, const strata_save_opts *in);
int st_load_opts_get(strata_load_opts *out, const strata_load_opts *in);
/* The arguments every save and load checks: 1..ST_MAX_TIERS URIs, and the
 * states (st_check_states; skipped for states NULL, nstates -1): at least one, none NULL,
 * one with a communicator. */
int st_check_where(const char *what, strata_comm *comm, const char *const *uris, int nuris,
                   strata_state *const *states, int nstates);
int st_check_states(const char *what, strata_comm *comm, strata_state *const *states,
                    int nstates);
/* Peer replicas or parity (o) need a communicator: STRATA_EINVAL without one. */
int st_check_peer(const strata_save_opts *o, const strata_comm *comm);
/* chunk_bytes: a power of two in 4 KiB..64 MiB. */
int st_check_chunk(uint32_t chunk);
/* A loader's options (NULL: the defaults): a known version, no flags. */
int st_loader_opts_check(const strata_loader_opts *o);
/* The cast level (ST_CAST_*, plan.h) of a load's flags: STRATA_LOAD_CAST, else
 * STRATA_LOAD_WIDEN, else none. */
int st_cast_level(unsigned flags);
/* A caller's stats struct (may be NULL) must carry a known version. */
int st_stats_check(const strata_stats *s);
/* Writes the fields of out's version from full (out may be NULL). */
void st_stats_put(strata_stats *out, const strata_stats *full);

/* ---- the ways a save or load runs; strata_save* and strata_load (saver.c) choose one.
 * Options are full (st_*_opts_get), stats full and never NULL. ---- */

/* The last save plan of a saver with a communicator (dist_cache.c); referenced by the saver and
 * by each save in flight. */
typedef struct st_plan_cache st_plan_cache;
void st_plan_cache_release(st_plan_cache *c);

/* In-process ranks, one destination, on the caller's thread (save.c). */
int st_save_local(const char *uri, strata_state *const *ranks, int nranks,
                  const strata_save_opts *o, strata_stats *stats);
/* One rank of a distributed save, one destination, on the caller's thread (dist_save.c). */
int st_save_dist(strata_comm *comm, st_plan_cache **cache, const char *uri,
                 strata_state *local, const strata_save_opts *o, strata_stats *stats);
/* A saver's background work (committer.c): the count of its saves in flight, and the
 * thread that runs the commits of its distributed asynchronous saves in start order on a
 * communicator of its own. Referenced by the saver and by each of its saves' handles. */
typedef struct st_committer st_committer;
/* A commit to run on the committer's thread: run(arg). Lives in its save's handle. */
typedef struct st_commit_job {
    void (*run)(void *arg);
    void *arg;
    struct st_commit_job *next;
} st_commit_job;
int st_committer_new(st_committer **out);
void st_committer_ref(st_committer *q);
/* The last reference stops the thread and frees its communicator. */
void st_committer_unref(st_committer *q);
/* Starts the thread, which owns comm from now on (freed here on failure: STRATA_ENOMEM). */
int st_committer_start(st_committer *q, strata_comm *comm);
/* Stops the (idle) thread and frees its communicator. */
void st_committer_stop(st_committer *q);
/* The thread's communicator, or NULL (no thread: commits run on the caller's thread). */
strata_comm *st_committer_comm(const st_committer *q);
/* Queues j for the thread: jobs run one at a time, in the order they were pushed. */
void st_committer_push(st_committer *q, st_commit_job *j);
/* A save started / its background work (its commit, when the thread runs it) ended;
 * drain waits until every save begun has ended. */
void st_committer_begin(st_committer *q);
void st_committer_end(st_committer *q);
void st_committer_drain(st_committer *q);

/* One rank of a distributed save to 1..ST_MAX_TIERS destinations, through the pool in the
 * background (dist_save.c). With bg the commit collective runs on q's thread and communicator,
 * in start order; without, it is strata_wait_durable's, on the caller's thread. q (may be
 * NULL) counts the save in flight. */
int st_save_dist_start(strata_handle **out, strata_comm *comm, st_plan_cache **cache,
                       const char *const *uris, int ntiers, strata_state *local,
                       const strata_save_opts *o, strata_pool **pool, st_committer *q, int bg);
/* An opened checkpoint: the index its source read (src/source/source.h). */
typedef st_index st_dir;
typedef struct st_crc_run st_crc_run;       /* a load's CRC-32 checks, below */
typedef struct st_crc_ledger st_crc_ledger; /* a loader's checks across its loads, below */

/* The last load plan of a loader (loader.c) and the request it was made for: a load whose
 * request encodes to the same key reuses it with the new data addresses. */
typedef struct st_load_cache {
    int have;
    st_io_plan plan;
    unsigned char *key; /* malloc'd */
    size_t keylen;
    st_arena arena;      /* distributed: the other ranks' requests, decoded */
    st_rank_view *views; /* distributed: every rank's (this rank's: the last load's) */
} st_load_cache;
void st_load_cache_clear(st_load_cache *c);
/* Is the request key[0..n) the cached one? If not, the cache is cleared (c->key then
 * takes over key on the caller's success: st_load_cache_keep). */
int st_load_cache_hit(const st_load_cache *c, const unsigned char *key, size_t n);

/* Loads from an opened source (load.c): in-process ranks; or one rank of a distributed
 * load (dist_load.c, a collective). *cached: whether the plan in c was reused. */
int st_load_local(const st_dir *d, st_load_cache *c, strata_state *const *ranks, int nranks,
                  const strata_load_opts *o, st_crc_ledger *later, strata_stats *stats);
int st_load_dist(strata_comm *comm, const st_dir *d, st_load_cache *c, strata_state *local,
                 const strata_load_opts *o, strata_stats *stats);

/* ---- save steps (save.c), shared by the local and the distributed save ---- */

/* Checks the options and the rank states and makes the global save plan of them. */
int st_plan_states(st_save_plan *sp, strata_state *const *ranks, int nranks,
                   const strata_save_opts *o);
/* The stats of a finished single-process save (started at t0). */
void st_save_stats(strata_stats *stats, const st_save_plan *sp, uint64_t io_calls, double t0);
/* ---- ownership (own.c) ---- */

/* A new random save id (never 0), written into the save's commit record. */
uint64_t st_save_id_new(void);

/* ---- incremental saves (incr.c) ---- */
typedef struct st_incr st_incr;
typedef struct st_dests st_dests; /* below */
/* The second, independent checksum of a chunk a save refers to instead of writing it:
 * XXH64, seed 0. */
uint64_t st_hash2(const void *p, size_t n);
/* st_hash and st_hash2 of one chunk in one pass over memory. */
void st_hash_both(const void *p, size_t n, uint64_t *h1, uint64_t *h2);
/* For a save with STRATA_SAVE_INCREMENTAL or a base (o->base): gives sp's shards second
 * checksums (metadata version 2); with a base, opens it beside every destination of d
 * (d->final[t]'s parent / o->base; each tier's must be the same save, else the save is a
 * full one), refers every shard whose bytes equal the base's to the base's file (appended
 * to sp's file table as a link) and drops it from sp's writes. *out (NULL when nothing is
 * referred to) lists the links to make: st_incr_link once the save owns destination t.
 * Errors: the base's open (STRATA_ENOENT, STRATA_EINCOMPLETE, ...) wrapped, naming it;
 * STRATA_EINVAL for a base that is not a plain name or not a strata checkpoint. */
int st_incr_plan(st_incr **out, st_save_plan *sp, const st_dests *d, const strata_save_opts *o);
/* Makes destination t's links to its base's files (m: the save's metadata), then checks
 * that the base is still the save matched. STRATA_ECHANGED if the base was removed or
 * replaced meanwhile (nothing of another checkpoint is ever referred to). */
int st_incr_link(const st_incr *x, const st_meta *m, const st_dests *d, int t);
/* A base extent an incremental save is about to refer to (incr_check.c). */
typedef struct st_base_ext {
    const char *file;     /* its file's name in the base directory */
    uint64_t off, bytes;  /* its place there */
    const uint64_t *sums; /* its chunks' XXH3s, as the base recorded them */
    int bad;              /* out: its bytes do not match them, or cannot be read */
} st_base_ext;
/* Reads each of e[0, n) from the base at bdir (on threads I/O threads) and sets its bad
 * unless every chunk's XXH3 is the one recorded; an extent found intact is remembered for
 * the life of the process by its file's version (device, inode, size, modification time;
 * the ETag on S3) and its place, and not read again. 0, or STRATA_ENOMEM. */
int st_incr_check_base(const st_vfs *v, const char *bdir, st_base_ext *e, size_t n,
                       uint32_t chunk, int threads);
/* Tests: bytes of bases read by st_incr_check_base since the process started. */
extern _Atomic uint64_t st_incr_base_read;
/* STRATA_EINVAL unless base is a plain name (no '/', not "." or "..") of a checkpoint,
 * and not a symlink beside any destination of d. */
int st_incr_check_name(const char *base, const st_dests *d);
/* The base beside every destination of d, opened (tier 0's into *bd, closed by the
 * caller with st_dir_close where bd->vfs is set): *id is its save id where it is usable
 * as a base (committed, metadata version 2 of the same chunk size, the same save in every
 * tier, backends that link), else 0 (a full save). missing_ok: a missing or incomplete
 * base is not an error but *id 0. Errors: STRATA_EINVAL (not a plain name, another
 * format), the open's (wrapped). */
int st_incr_open_base(st_dir *bd, uint64_t *id, const st_dests *d, const char *base,
                      uint32_t chunk, int missing_ok);
/* Per piece of sp (metadata order), the base's shard at the very place of its shard with
 * second checksums, the same bytes, in a file that can be linked, or NULL (blobs, device
 * memory, a piece without data where have_data). */
int st_incr_candidates(const st_save_plan *sp, const st_meta *bm, int have_data,
                       const struct st_mshard **bs);
/* Do the piece's bytes have XXH3s s1 and XXH64s s2, chunk by chunk? */
int st_incr_same(const st_piece *pc, const uint64_t *s1, const uint64_t *s2, uint32_t chunk);
/* The name in a new checkpoint of base bm's file bf linked (ref-<id>-<rank>.bin). */
void st_incr_ref_name(char to[ST_REF_FILE_BYTES], const st_meta *bm, uint32_t bf,
                      uint64_t base_id);
/* Appends to m's file table a linked entry for base bm's file bf (its ref name, its size):
 * its index into *out. */
int st_incr_add_link(st_meta *m, const st_meta *bm, uint32_t bf, uint64_t base_id,
                     uint32_t *out);
/* The path of checkpoint `base` beside destination dir (its parent joined with the name). */
int st_incr_base_path(char *out, const char *dir, const char *base);
void st_incr_free(st_incr *x);
/* The parent directory of path ("." for a bare name) into out (PATH_MAX). */
void st_parent_of(char *out, const char *path);
/* Ownership of a checkpoint directory: its lock file (ST_LOCK_FILE) locked by a save from
 * before its first write until after its commit or cleanup, or by a collector while it
 * removes it. Takes it without waiting. mode 0 (a collector): dir must exist; ST_OWN_NEW:
 * makes dir (and parents, each fsynced into its parent) if missing and refuses a
 * committed one (STRATA_EEXIST); ST_OWN_REPLACE: the same, a committed one allowed.
 * STRATA_EBUSY if another save or collector holds it; STRATA_EINVAL if the lock file is not
 * a regular file; STRATA_ENOTSUP if a second lock is granted while ours is held (the
 * file system's locks do not exclude). Release with st_own_release. */
enum { ST_OWN_NEW = 1, ST_OWN_REPLACE = 2 };
int st_own(const st_vfs *v, const char *dir, int mode, st_file **lock);
void st_own_release(const st_vfs *v, st_file *lock);
/* After a commit: removes the lock file (a committed checkpoint has none), then lets go. */
void st_own_committed(const st_vfs *v, const char *dir, st_file *lock);
/* Takes ownership of dir (st_own) and makes it an empty directory for a new checkpoint:
 * clears an incomplete checkpoint there; refuses a committed one or foreign files
 * (STRATA_EEXIST). *lock is held on success only. */
int st_prepare_dir(const st_vfs *v, const char *dir, st_file **lock);
/* After a commit that failed late (an fsync after the rename), or any failure: removes
 * the commit record in dir, durably, if it is this save's (save_id). Returns 0 if dir has
 * no commit record now, 1 if it holds one this save did not write (left alone). */
int st_uncommit(const st_vfs *v, const char *dir, uint64_t save_id);
/* After a failure, as dir's owner: st_uncommit, then removes strata's files in dir (with
 * rmdir: the lock file and dir too), keeping the error - unless dir holds a commit record
 * of another save: then nothing is touched. */
void st_remove_failed(const st_vfs *v, const char *dir, int rmdir, uint64_t save_id);
/* Removes a checkpoint directory as its owner (the caller holds its lock): the commit
 * record first (committed = 1; with 0 a commit record there is STRATA_EEXIST), made
 * durable, then strata's files, the lock file, and dir if nothing foreign is left. */
int st_remove_owned(const st_vfs *v, const char *path, int committed);

/* The directory a replacing save of path writes beside it (".<name>.strata-replace" in
 * the same parent) into out; STRATA_EINVAL if the name is too long. */
int st_replace_sibling(char *out, const char *path);
/* Is name (a plain name) such a directory's? */
int st_is_replace_sibling(const char *name);
/* Tests only: when set, strata_retain calls it between probing the checkpoints of dir and
 * removing those it chose. */
extern void (*st_retain_test_hook)(const char *dir);

/* Writes the data files of sp (every file of sp->meta, from sp->pieces, filling the
 * extents' checksums): reserve, write on the I/O threads, fsync, close. */
int st_write_data(const st_vfs *v, const char *dir, const st_save_plan *sp,
                  const strata_save_opts *o, uint64_t *io_calls);
/* The write tasks of sp: whole chunks, file order (interleaved across files), at most
 * task_bytes (or one chunk) each, as the reads of a load plan. */
int st_layout_writes(st_io_plan *lay, const st_save_plan *sp, uint64_t task_bytes);
/* Fills buf with write task `task`: the sources' bytes (copied from the device for
 * device shards), zero padding, and with hash set each chunk's checksum into the plan's
 * extents (copied and hashed in one pass). buf holds the task's len bytes. 0 or
 * STRATA_EDEVICE. */
int st_fill_write(const st_io_plan *lay, const st_save_plan *sp, size_t task,
                  unsigned char *buf, int hash);
/* The checksums of write task `task` from its filled buffer (st_fill_write without hash):
 * an asynchronous save hashes on its flushers, so that the snapshot, which the training
 * loop may wait for, is a plain copy. */
void st_hash_write(const st_io_plan *lay, const st_save_plan *sp, size_t task,
                   const unsigned char *buf);
int st_write_task(const st_vfs *v, st_file *f, const char *dir, const char *name,
                  const st_io *w, const void *buf);
/* Opens (creating) the data files of sp and reserves their space; files[] gets them. */
int st_create_data_files(const st_vfs *v, const char *dir, const st_save_plan *sp, int direct,
                         st_file **files);
/* fsyncs (unless no_sync) and closes the data files; the first error wins. */
int st_finish_data_files(const st_vfs *v, const char *dir, const st_save_plan *sp,
                         st_file **files, int sync, int rc);
/* Writes metadata.bin, then the commit record with save_id (each as a temporary file,
 * fsynced, renamed into place without replacing an existing one: STRATA_EEXIST when
 * another save wrote there; then fsync of dir + parent). */
int st_commit_dir(const st_vfs *v, const char *dir, const st_meta *m, int sync,
                  uint64_t save_id);

/* Before the commit of a distributed asynchronous save (every rank has written its data
 * file into dir): STRATA_EEXIST if dir holds a commit record or foreign files; removes
 * strata's files that are not data files of sp (left by an earlier incomplete save). */
int st_clear_stale(const st_vfs *v, const char *dir, const st_save_plan *sp);
/* The directory of one rank's part of a distributed asynchronous save: creates dir (and
 * parents) if missing; STRATA_EEXIST if it is not a directory or holds a commit record.
 * Several ranks may call it at once. */
int st_prepare_shared(const st_vfs *v, const char *dir);

/* ---- asynchronous saves (async.c) ---- */

#define ST_MAX_TIERS STRATA_MAX_TIERS

/* Writes name into dir as a new file: "<name>.tmp", fsynced (with sync), renamed to name
 * without replacing one that is there (another save's, where locks do not exclude:
 * STRATA_EEXIST, and its file is left alone). */
int st_write_new(const st_vfs *v, const char *dir, const char *name, const void *buf,
                 size_t n, int sync);

/* The destinations of a save: each one's URI, backend and the directory written. With
 * STRATA_SAVE_REPLACE (replace = 1) that is the directory beside final[t], the path named,
 * which the save owns too (final_lock, rank 0 only) and into which the written directory
 * is swapped after its commit. */
typedef struct st_dests {
    int n, replace;
    char uri[ST_MAX_TIERS][PATH_MAX], dir[ST_MAX_TIERS][PATH_MAX];
    char final[ST_MAX_TIERS][PATH_MAX];
    const st_vfs *vfs[ST_MAX_TIERS];
    st_file *final_lock[ST_MAX_TIERS];
} st_dests;
/* Copies the URIs (1..ST_MAX_TIERS, checked by the caller) and resolves their backends
 * (flags: the save's, STRATA_SAVE_REPLACE); on failure what was resolved stays for
 * st_dests_close, which also lets go of the targets of an unfinished replace. */
int st_dests_resolve(st_dests *d, const char *const *uris, int n, unsigned flags);
void st_dests_close(st_dests *d);
/* Owns destination t before anything is written there: st_prepare_dir (prepare) or
 * st_own (ST_OWN_NEW) of dir[t]; with replace, first the target (made if missing; a
 * committed checkpoint or what a plain save takes, else STRATA_ENOTCKPT) and the directory
 * beside it cleared of what a dead replace left (anything but a directory there, a planted
 * link: STRATA_EINVAL, never followed), and a check that the file system can exchange
 * directories (STRATA_ENOTSUP). *lock: dir[t]'s lock. */
int st_dest_own(st_dests *d, int t, int prepare, st_file **lock);
/* Commits destination t (st_commit_dir) and lets go of it (*lock = NULL); with replace,
 * exchanges dir[t] with the target, then removes the previous checkpoint. On failure
 * *lock is still held if what was written is the caller's to remove (st_remove_failed). */
int st_dest_commit(st_dests *d, int t, const st_meta *m, int sync, uint64_t save_id,
                   st_file **lock);
/* A failed destination whose files are removed: removes dir[t]'s lock file (and with
 * replace, dir[t] when empty) and lets go of it and of the target. */
void st_dest_abandon(st_dests *d, int t, st_file **lock);
/* Lets go of the targets of replaces that did not finish (st_dests_close does). */
void st_dests_release_final(st_dests *d);

/* How an asynchronous save's destinations are made ready and committed: async.c takes the
 * snapshot and writes, these hooks own the directories and the commit record. A save in
 * this process commits each destination on the save's thread (save.c); one rank of a
 * distributed save prepares a shared directory and commits in a collective (dist_save.c). */
typedef struct st_commit_ops {
    /* 1: finish is a collective every rank must reach, so a failure before the save's
     * threads start travels on the handle instead of failing the start */
    int collective;
    const st_dests *(*dests)(void *ctx);
    /* the save's thread, before destination t's data files are created */
    int (*prepare)(void *ctx, int t);
    /* the save's thread, once destination t's data files are written and closed (rc:
     * their outcome): returns t's outcome (a local save commits it, or removes it) */
    int (*tier_done)(void *ctx, int t, int rc, const st_save_plan *sp);
    /* strata_wait_durable, once (may be NULL: the first failure is the outcome): the
     * save's outcome from each destination's (rc[t], msg[t]); stats on success */
    int (*finish)(void *ctx, const int *rc, const char *const *msg, const st_save_plan *sp,
                  uint64_t io_calls, strata_stats *stats);
    void (*release)(void *ctx);
    /* strata_handle_level: the levels reached so far (any thread; may be NULL: the
     * destinations committed, once finished), and why a replication failed */
    int (*level)(void *ctx, const char **msg);
} st_commit_ops;

/* Tests only: when set, every async save's coordinator thread calls it first, before it
 * touches the pool or the destinations. */
extern void (*st_async_test_hook)(strata_pool *pool);

/* The hooks of a save in this process (save.c): ctx from st_local_commit_new. */
extern const st_commit_ops st_local_commit;
int st_local_commit_new(void **ctx, const char *const *uris, int n, const strata_save_opts *o);
/* st_incr_plan of sp against the save's destinations; the links are made by prepare. */
int st_local_commit_incr(void *ctx, st_save_plan *sp, const strata_save_opts *o);

/* Starts an asynchronous save of sp (taken over by the handle, also on failure, as is
 * ctx) through the pool *pool (pool NULL: one of the handle's own; *pool NULL: one made now
 * and left in *pool for the caller to keep). With collective hooks every failure -
 * `failed` (a local one before the start, message set) included - travels on the
 * returned handle, so that the rank still takes part in the commit. q (may be NULL): the
 * saver's committer, which counts the save until its background work ends; with bg, the
 * hooks' finish runs on q's thread as soon as the writes end (else in wait_durable). */
int st_async_start(strata_handle **out, st_save_plan *sp, const strata_save_opts *o,
                   strata_pool **pool, const st_commit_ops *ops, void *ctx, int failed,
                   st_committer *q, int bg);

/* The public read-only view of an opened directory (ckpt.c; a loader holds one). */
struct strata_ckpt {
    st_dir d;
};

/* Opens uri: finds the source that reads what is there (strata's own included) and opens
 * it; when none claims it, fails saying what it is (st_survey). allow_incomplete lets a
 * strata checkpoint without a (valid) commit record through if its metadata decodes. */
int st_dir_open(st_dir *d, const char *uri, int allow_incomplete);
void st_dir_close(st_dir *d);
/* st_dir_open that also returns the source's description (malloc'd) for broadcasting. */
int st_dir_open_raw(st_dir *d, const char *uri, int allow_incomplete, unsigned char **raw,
                    size_t *rawlen);
/* A committed checkpoint opened elsewhere: builds the index from the description the rank
 * that opened it made, without I/O (but a source's own: a safetensors or torch.save path
 * is looked at to tell a file from a directory); source: st_source_id of its source. */
int st_dir_adopt(st_dir *d, const char *uri, const unsigned char *desc, size_t len,
                 uint32_t source);
/* The directory behind a public handle. */
const st_dir *st_ckpt_dir(const strata_ckpt *ck);
/* Counts (and with unlink = 1 removes) strata's regular files in dir (own.c); anything
 * else (other names, symlinks, directories) counts as foreign and is never touched. */
int st_scan_dir(const st_vfs *v, const char *dir, int unlink, int *strata, int *foreign,
                uint64_t *bytes);
/* Removes strata's regular files in dir but its LOCK and the data files of keep. */
int st_scan_dir_keep(const st_vfs *v, const char *dir, const st_save_plan *keep);

/* The CRC-32 checks of one load's reads (crc_check.c): a plan with checks (st_plan_checks)
 * gets a run (st_crc_run_new: *out NULL for a plan without; later: the loader's ledger,
 * for a plan that was not widened, or NULL); each read takes its parts' CRC-32s
 * (st_crc_take, on the I/O thread, after the read and before its scatter: buf holds the
 * read's bytes from its offset, got of them) and the read that completes a check compares
 * it (STRATA_ECHECKSUM naming the tensor, the entry and the file); st_crc_run_end, after
 * every read, gives the ledger the parts of checks the plan read only in part. */
int st_crc_run_new(st_crc_run **out, const st_io_plan *p, st_crc_ledger *later);
int st_crc_take(st_crc_run *r, const st_dir *d, size_t io, const char *buf, uint64_t got);
int st_crc_run_end(st_crc_run *r, const st_dir *d);
uint64_t st_crc_run_checked(const st_crc_run *r); /* checks compared so far */
void st_crc_run_free(st_crc_run *r);
/* A loader's checks of entries its loads read in part (export's windows): each run of
 * bytes read is kept with its CRC-32 until the loads together read the whole entry, which
 * is then compared; st_crc_ledger_finish reads what no load read of every entry begun and
 * compares the rest. counts: entries compared, bytes read by finish. */
int st_crc_ledger_new(st_crc_ledger **out, const st_meta *m);
int st_crc_ledger_finish(st_crc_ledger *l, const st_dir *d);
void st_crc_ledger_counts(const st_crc_ledger *l, uint64_t *checked, uint64_t *bytes);
void st_crc_ledger_free(st_crc_ledger *l);

/* A loader (in this process) whose loads each read a part of what its caller wants (export's
 * windows): its loads of a source with CRC-32 checks read only the bytes they need and keep
 * the CRC-32 of each run of them (the ledger) instead of reading every entry whole in each
 * load; an entry is compared when the loads together have read all of it (the load that
 * completes it fails on a mismatch), and st_loader_crc_finish reads what they did not of
 * every entry begun and compares the rest (*checked: entries compared over the loads and the
 * finish; *bytes: bytes the finish read). Bytes reach the states before their entry is
 * compared: for a caller that publishes nothing until finish has succeeded. loader.c. */
int st_loader_crc_later(strata_loader *ld);
int st_loader_crc_finish(strata_loader *ld, uint64_t *checked, uint64_t *bytes);

/* Executes the reads of a load plan: reads, verifies every chunk (and with crc, the plan's
 * CRC-32 checks), scatters runs (dst NULL: verify only). With report set, a bad chunk is
 * reported and the walk goes on (the result is then STRATA_ECHECKSUM); without, the first
 * bad chunk fails the call. */
int st_exec_reads(const st_dir *d, const st_io_plan *p, int threads, int no_direct,
                  uint64_t max_io, strata_verify_cb report, void *ctx, st_crc_run *crc,
                  uint64_t *bytes_read);

/* The pieces of st_exec_reads, for the distributed load: open the data files the plan
 * reads; do the reads list[0..n) into bufs[i] (each st_read_buf_bytes; bufs NULL: into a
 * scratch buffer per I/O thread, for reads of max_io), verifying every chunk and
 * scattering the runs of only_rank (-1: all ranks). */
int st_open_data_files(const st_dir *d, const st_io_plan *p, int no_direct, st_file ***out);
void st_close_data_files(const st_dir *d, const st_io_plan *p, st_file **files);
int st_read_some(const st_dir *d, const st_io_plan *p, st_file **files, const size_t *list,
                 size_t n, char **bufs, int threads, int only_rank, uint64_t max_io,
                 st_crc_run *crc);
/* Walks the runs of read i that fall in its chunks, in a fixed order (segments, then runs
 * by source offset): fn(ctx, run, x0, x1, at) for the overlap [x0, x1) of each run with
 * the read, `at` its offset in the read's buffer. */
typedef void (*st_walk_fn)(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at);
void st_walk_read(const st_io_plan *p, size_t i, st_walk_fn fn, void *ctx);
/* Copies the bytes [x0, x1) of a run (offsets in its extent, whole saved elements) from
 * src to the run's destination, host or device memory, converting them to its dtype where
 * that differs from the saved one (into device memory through a small host buffer).
 * 0 or STRATA_EDEVICE, STRATA_ENOMEM. */
int st_deliver(const st_io_plan *p, const st_run *run, uint64_t x0, uint64_t x1,
               const void *src);
/* A load's largest read when the caller asks none: the largest request of the device under
 * d (a local file system's block device: max_sectors_kb), whole MiB, from ST_DEFAULT_MAX_IO
 * up to 16 MiB; ST_DEFAULT_MAX_IO elsewhere (loader.c). */
uint32_t st_default_read_bytes(const st_dir *d);
static inline size_t st_read_buf_bytes(const st_meta *m, uint64_t max_io)
{
    return (size_t)ST_ALIGN_UP(ST_MAX(max_io, m->chunk) + 2 * ST_ALIGN, ST_ALIGN);
}
/* A read starts at an ST_ALIGN boundary of its file, so that it may use O_DIRECT: its
 * bytes [off, off + len) begin this far into its buffer (0 for strata's own files, whose
 * extents are aligned; up to ST_ALIGN - 1 for a foreign source's). */
static inline uint64_t st_read_shift(const st_io *rd)
{
    return rd->off % ST_ALIGN;
}

#endif
