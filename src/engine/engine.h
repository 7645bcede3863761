/* engine.h - internals shared by the engine's files: a rank's registered state, and
 * opening a checkpoint directory (commit record + metadata). */
#ifndef STRATA_ENGINE_H
#define STRATA_ENGINE_H
#include <limits.h>

#include "../core/util.h"
#include "../io/vfs.h"
#include "../meta/meta.h"
#include "../plan/plan.h"
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
    return (st_rank_view){s->sh, s->nsh, s->bl, s->nbl};
}

/* ---- save steps (save.c), shared by strata_save and strata_save_dist ---- */

int st_check_chunk(uint32_t chunk);
/* Checks the options and the rank states and makes the global save plan of them. */
int st_plan_states(st_save_plan *sp, strata_state *const *ranks, int nranks,
                   const strata_save_opts *o);
/* The stats of a finished single-process save (started at t0). */
void st_save_stats(strata_stats *stats, const st_save_plan *sp, uint64_t io_calls, double t0);
/* Makes dir an empty directory for a new checkpoint (creating parents), or clears an
 * incomplete checkpoint there; refuses a committed one or foreign files (STRATA_EEXIST). */
int st_prepare_dir(const st_vfs *v, const char *dir);
/* Writes the data files of sp (every file of sp->meta, from sp->pieces, filling the
 * extents' checksums): reserve, write on the I/O threads, fsync, close. */
int st_write_data(const st_vfs *v, const char *dir, const st_save_plan *sp,
                  const strata_save_opts *o, uint64_t *io_calls);
/* The write tasks of sp: whole chunks, file order (interleaved across files), at most
 * task_bytes (or one chunk) each, as the reads of a load plan. */
int st_layout_writes(st_load_plan *lay, const st_save_plan *sp, uint64_t task_bytes);
/* Fills buf with write task `task`: the sources' bytes (copied from the device for
 * device shards), zero padding, and each chunk's checksum into the plan's extents. buf
 * holds the task's len bytes. 0 or STRATA_EDEVICE. */
int st_fill_write(const st_load_plan *lay, const st_save_plan *sp, size_t task,
                  unsigned char *buf);
int st_write_task(const st_vfs *v, st_file *f, const char *dir, const char *name,
                  const st_read *w, const void *buf);
/* Opens (creating) the data files of sp and reserves their space; files[] gets them. */
int st_create_data_files(const st_vfs *v, const char *dir, const st_save_plan *sp, int direct,
                         st_file **files);
/* fsyncs (unless no_sync) and closes the data files; the first error wins. */
int st_finish_data_files(const st_vfs *v, const char *dir, const st_save_plan *sp,
                         st_file **files, int sync, int rc);
/* Writes metadata.bin, then the commit record (temp, fsync, rename, fsync dir + parent). */
int st_commit_dir(const st_vfs *v, const char *dir, const st_meta *m, int sync);
/* After a commit that failed late (an fsync after the rename): removes the commit record
 * of this save, durably, before anything else is removed. */
void st_uncommit(const st_vfs *v, const char *dir);
/* After a failure: removes strata's files in dir (and dir if rmdir), keeping the error. */
void st_remove_failed(const st_vfs *v, const char *dir, int rmdir);

/* Before the commit of a distributed asynchronous save (every rank has written its data
 * file into dir): STRATA_EEXIST if dir holds a commit record or foreign files; removes
 * strata's files that are not data files of sp (left by an earlier incomplete save). */
int st_clear_stale(const st_vfs *v, const char *dir, const st_save_plan *sp);
/* The directory of one rank's part of a distributed asynchronous save: creates dir (and
 * parents) if missing; STRATA_EEXIST if it is not a directory or holds a commit record.
 * Several ranks may call it at once. */
int st_prepare_shared(const st_vfs *v, const char *dir);

/* ---- asynchronous saves (async.c) ---- */

#define ST_MAX_TIERS 8 /* destinations of one save */

/* The part of an asynchronous save that is a distributed one's (dist.c): after this
 * rank's writes, strata_wait_durable calls st_dist_finish (a collective) with their
 * outcome; it gathers every rank's, and rank 0 commits. */
typedef struct st_async_dist st_async_dist;
/* rc[t], msg[t]: this rank's outcome for each destination (tier) t of d. */
int st_dist_finish(st_async_dist *d, const int *rc, const char *const *msg,
                   const st_save_plan *mine, uint64_t io_calls, strata_stats *stats);
void st_dist_free(st_async_dist *d);
int st_dist_tiers(const st_async_dist *d);
/* Marks that this rank prepared tier t's directory for this save and may write its data
 * file there (so that a failure removes it). */
void st_dist_wrote(st_async_dist *d, int t);
/* The backend (owned by d) and directory (into dir, PATH_MAX) of tier t. */
const st_vfs *st_dist_vfs(st_async_dist *d, int t, char *dir);
/* Starts an asynchronous save of sp (taken over by the handle, also on failure) to the
 * destinations. With dist (taken over too), sp is one rank's part of a distributed save:
 * its directory is prepared with st_prepare_shared, the commit is st_dist_finish's, and
 * every failure - failed (a local one before the start, message set) included - travels
 * on the returned handle, so that the rank still takes part in st_dist_finish. */
int st_async_start(strata_handle **out, st_save_plan *sp, const char *const *uris, int ntiers,
                   const strata_save_opts *o, strata_pool *pool, st_async_dist *dist,
                   int failed);

/* An opened checkpoint directory. */
typedef struct st_dir {
    const st_vfs *vfs;
    char path[PATH_MAX];
    st_meta *meta;
    int committed;
    st_commit commit;
} st_dir;

/* Joins dir and a plain name into out (PATH_MAX). STRATA_EINVAL if too long. */
int st_path_join(char *out, const char *dir, const char *name);
/* Opens uri: reads and validates the commit record and metadata. allow_incomplete lets
 * a checkpoint without a (valid) commit record through if its metadata decodes. */
int st_dir_open(st_dir *d, const char *uri, int allow_incomplete);
void st_dir_close(st_dir *d);
/* st_dir_open that also returns the raw metadata bytes (malloc'd) for broadcasting. */
int st_dir_open_raw(st_dir *d, const char *uri, int allow_incomplete, unsigned char **raw,
                    size_t *rawlen);
/* A committed checkpoint opened elsewhere: decodes and checks metadata received from the
 * rank that read it. */
int st_dir_adopt(st_dir *d, const char *uri, const st_commit *c, const unsigned char *meta,
                 size_t mlen);
/* The directory behind a public handle. */
const st_dir *st_ckpt_dir(const strata_ckpt *ck);
/* Is name a file strata writes into a checkpoint directory? */
int st_is_strata_file(const char *name);
/* Counts (and with unlink = 1 removes) strata's regular files in dir; anything else
 * (other names, symlinks, directories) counts as foreign and is never touched. */
int st_scan_dir(const st_vfs *v, const char *dir, int unlink, int *strata, int *foreign,
                uint64_t *bytes);

/* Executes the reads of a load plan: reads, verifies every chunk, scatters runs (dst NULL:
 * verify only). With report set, a bad chunk is reported and the walk goes on (the
 * result is then STRATA_ECHECKSUM); without, the first bad chunk fails the call. */
int st_exec_reads(const st_dir *d, const st_load_plan *p, int threads, int no_direct,
                  uint64_t max_io, strata_verify_cb report, void *ctx, uint64_t *bytes_read);

/* The pieces of st_exec_reads, for the distributed load: open the data files the plan
 * reads; do the reads list[0..n) into bufs[i] (each st_read_buf_bytes), verifying every
 * chunk and scattering the runs of only_rank (-1: all ranks). */
int st_open_data_files(const st_dir *d, const st_load_plan *p, int no_direct, st_file ***out);
void st_close_data_files(const st_dir *d, const st_load_plan *p, st_file **files);
int st_read_some(const st_dir *d, const st_load_plan *p, st_file **files, const size_t *list,
                 size_t n, char **bufs, int threads, int only_rank);
/* Walks the runs of read i that fall in its chunks, in a fixed order (segments, then runs
 * by source offset): fn(ctx, run, x0, x1, at) for the overlap [x0, x1) of each run with
 * the read, `at` its offset in the read's buffer. */
typedef void (*st_walk_fn)(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at);
void st_walk_read(const st_load_plan *p, size_t i, st_walk_fn fn, void *ctx);
/* Copies the bytes [x0, x1) of a run (offsets in its extent) from src to the run's
 * destination, host or device memory. 0 or STRATA_EDEVICE. */
int st_deliver(const st_load_plan *p, const st_run *run, uint64_t x0, uint64_t x1,
               const void *src);
static inline size_t st_read_buf_bytes(const st_meta *m, uint64_t max_io)
{
    return (size_t)ST_ALIGN_UP(ST_MAX(max_io, m->chunk) + ST_ALIGN, ST_ALIGN);
}

#endif
