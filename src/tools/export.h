/* export.h - what export/ shares: an export's output directory, replaced all at once
 * (export_dir.c), export.c's window, and copy.c's block size (tests set it). */
#ifndef STRATA_EXPORT_H
#define STRATA_EXPORT_H
#include <limits.h>

#include "../io/vfs.h"

/* The staging directory beside OUT is OUT + EXDIR_MARK + "<pid>-<random hex>". */
#define EXDIR_MARK ".strata-export-"
#define EXPORT_INDEX "model.safetensors.index.json"
#define EXPORT_SINGLE "model.safetensors" /* a one-file export: no index (as Hugging Face) */
/* export.c's window: each of its two window buffers holds this many bytes (the load of one
 * overlaps the write of the other); tests size their tensors by it */
#ifndef EXPORT_BUF
#define EXPORT_BUF (32u << 20)
#endif

typedef struct st_exdir {
    const st_vfs *v;
    char out[PATH_MAX];    /* OUT */
    char parent[PATH_MAX]; /* the directory that holds OUT */
    char stage[PATH_MAX];  /* OUT.strata-export-<id>: this export's, locked */
    char set[PATH_MAX];    /* stage/set: the new files; after the swap, the old ones */
    st_file *lock;         /* stage/EXPORT.LOCK, held until the stage is gone */
    int out_existed;       /* OUT was there when the swap came */
} st_exdir;

/* Resolves uri (a path, file://, mem://, or a wrapper such as fault+), checks OUT (missing,
 * or a directory holding only files an export writes: else STRATA_EEXIST naming what is
 * there; a symlink is refused), removes the staging directories that earlier exports to
 * OUT left when they were killed (never one whose export is alive: its lock is held), and
 * makes and locks this export's staging directory. On failure nothing is left and d needs
 * no st_exdir_end. */
int st_exdir_begin(st_exdir *d, const char *uri);
/* The path of a new file `name` in the staging set (PATH_MAX bytes). */
int st_exdir_path(const st_exdir *d, char *out, const char *name);
/* Makes the staged set OUT's content at once: fsyncs the set's directory, swaps it with OUT
 * (RENAME_EXCHANGE; a rename when OUT is missing; two renames where the filesystem cannot
 * exchange), then fsyncs OUT's parent. On failure OUT is what it was (the swap undone). */
int st_exdir_commit(st_exdir *d);
/* Removes the staging directory (after a commit it holds OUT's previous files) and releases
 * it. Failures leave it behind, locked by no one, for the next export to OUT to remove. */
void st_exdir_end(st_exdir *d);
/* Is name a file an export writes (the index, model-NNNNN-of-NNNNN.safetensors,
 * model.safetensors, or one of those + ".partial", which exports of strata 0.2 wrote into
 * OUT itself)? */
int st_exdir_is_export_file(const char *name);

/* The bytes strata_copy reads and writes at once (copy.c; 64 MiB; tests make it small, so
 * that small files are many blocks). */
extern uint64_t st_copy_block;

#endif
