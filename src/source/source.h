/* source.h - the formats a load reads, each a source: a reader behind one small table of
 * functions (like the storage backends' st_vfs), in src/source/ beside its format's parser.
 * A source's open reads the format's index and its files' headers into an index (st_index:
 * strata's metadata, st_meta; for another format foreign: extents at byte offsets, no
 * checksums but the format's own), so that the load planner and reader work unchanged; the
 * rank that opens a checkpoint sends the others a description, from which their adopt
 * rebuilds the same index without I/O. strata's own format is a source too, the last one
 * tried. The floor's rule: src/source/ uses core/, io/ and meta/, never engine/.
 * docs/DESIGN.md, "Sources". */
#ifndef STRATA_SOURCE_H
#define STRATA_SOURCE_H
#include <limits.h>

#include "../io/vfs.h"
#include "../meta/meta.h"
#include "strata_types.h"

typedef struct st_source st_source;

/* An opened checkpoint's index: what a load plans and reads. */
typedef struct st_index {
    const st_vfs *vfs;
    const st_source *src; /* the reader that opened it */
    char path[PATH_MAX];  /* the directory read (a DeepSpeed save_dir's tag, ...) */
    char tag[256];        /* a DeepSpeed save_dir's: the tag its `latest` named; "" */
    st_meta *meta;
    int committed;
    st_commit commit; /* strata's own: its commit record (zero for another format) */
} st_index;

/* What a verify reports: strata_verify_cb's shape (strata.h). */
typedef void (*st_report_fn)(void *ctx, const char *object, const char *file,
                             const char *message);

struct st_source {
    const char *name; /* shown by inspect: "strata", "safetensors", "dcp", ... */
    int format;       /* STRATA_FORMAT_* */
    /* Is what is at path (st_vfs stat kind: 0 file, 1 directory, 2 link to a file) this
     * format? Decided by content (magic bytes, the files an index names), never by a name
     * alone; cheap (a few small reads); never fails: 0 when unsure. */
    int (*here)(const st_vfs *v, const char *path, int kind);
    /* Opens the source at ix->path (ix->vfs set, the rest zero): reads the index and
     * headers, builds ix->meta and sets ix->committed; ix->path becomes the directory of
     * the files when it named a file. allow_incomplete: a strata checkpoint without a
     * (valid) commit record is taken if its metadata decodes. desc (may be NULL) gets a
     * malloc'd description for adopt. */
    int (*open)(st_index *ix, int allow_incomplete, unsigned char **desc, size_t *desclen);
    /* Builds ix->meta from a description another rank's open made (ix->path as given to
     * open), without I/O (but a look at whether ix->path is a file or a directory). */
    int (*adopt)(st_index *ix, const unsigned char *desc, size_t len);
    /* strata_ckpt_verify of a checkpoint this source opened: reads every data byte and
     * checks what the format itself holds (DCP: the zip CRC-32s), calling report for each
     * bad item and going on; returns 0, STRATA_ECHECKSUM if any was bad, STRATA_ECHANGED
     * if a file is no longer the one opened, or the first other error. NULL: the engine's
     * walk (every byte read and checked against what the index holds). */
    int (*verify)(const st_index *ix, st_report_fn report, void *ctx);
};

/* ---- the table (source.c): the one file that names the sources ---- */

/* The source of what is at path, tried in order, strata's own last; NULL when none claims
 * it (st_survey then says what it is). */
const st_source *st_source_find(const st_vfs *v, const char *path, int kind);
/* A source's number in the table (1..; 0 for NULL), which travels in broadcasts, and back
 * (NULL for a number out of range). */
uint32_t st_source_id(const st_source *s);
const st_source *st_source_by_id(uint32_t id);
/* strata's own format (strata_src.c). */
extern const st_source st_source_strata;

/* ---- an index (index.c) ---- */

/* Frees ix->meta and lets go of ix->vfs. */
void st_index_close(st_index *ix);
/* A foreign file f (file mf of ix, whose identity was `was` when its header was read) is
 * still that file, unchanged: STRATA_ECHANGED naming it otherwise (the device is not
 * compared: a network file has another on each node). */
int st_check_same_file(const st_index *ix, const st_mfile *mf, const st_mident *was,
                       st_file *f);

/* ---- what a path is when no source claims it (survey.c) ---- */

/* What is at path (stat kind `kind`) when no source claims it: fails saying what it is:
 * STRATA_EFORMAT naming a format strata cannot read (a DeepSpeed checkpoint without the
 * files its source reads, a directory of torch.save files, a bare pickle, a zip that is no
 * torch.save file), STRATA_EINCOMPLETE for a DCP checkpoint without its .metadata,
 * STRATA_ENOENT for a directory of checkpoints (naming one), an empty or unrelated
 * directory, or a file that is none of these. 0 for a directory holding strata's files. */
int st_survey(const st_vfs *v, const char *path, int kind);

#endif
