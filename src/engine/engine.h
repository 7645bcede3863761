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

#endif
