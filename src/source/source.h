/* source.h - the formats a load reads: each is a source, a reader behind one small table of
 * functions (like the storage backends' st_vfs), in its own file. A source reads another
 * format's index and files' headers into strata's metadata (st_meta, foreign: extents at
 * byte offsets, no checksums), so that the load planner and reader work unchanged. The rank
 * that opens a checkpoint sends the others a description; they rebuild the same metadata
 * from it without I/O. strata's own checkpoints are not a source here (ckpt.c reads them).
 * docs/DESIGN.md, "Sources". */
#ifndef STRATA_SOURCE_H
#define STRATA_SOURCE_H
#include "../engine/engine.h"

typedef struct st_source {
    const char *name; /* shown by inspect: "safetensors", "dcp", ... */
    int format;       /* STRATA_FORMAT_* */
    /* Is what is at path (st_vfs stat kind: 0 file, 1 directory, 2 link to a file) this
     * format? Decided by content (magic bytes, the files an index names), never by a name
     * alone; cheap (a few small reads); never fails: 0 when unsure. */
    int (*here)(const st_vfs *v, const char *path, int kind);
    /* Opens the source at d->path (d->vfs set): reads the index and headers, builds
     * d->meta (foreign) and sets d->committed; d->path becomes the directory of the files
     * when it named a file. desc (may be NULL) gets a malloc'd description for adopt. */
    int (*open)(st_dir *d, unsigned char **desc, size_t *desclen);
    /* Builds d->meta from a description another rank's open made (d->path as given to
     * open). NULL: the description is st_meta_encode of the foreign metadata
     * (st_source_adopt_meta). */
    int (*adopt)(st_dir *d, const unsigned char *desc, size_t len);
    /* strata_ckpt_verify of a checkpoint this source opened (d): reads every data byte and
     * checks what the format itself holds (DCP: the zip CRC-32s), calling report for each
     * bad item and going on; returns 0, STRATA_ECHECKSUM if any was bad, STRATA_ECHANGED
     * if a file is no longer the one opened, or the first other error. NULL: strata's
     * generic walk (every byte read, only a short file shows). */
    int (*verify)(const st_dir *d, strata_verify_cb report, void *ctx);
} st_source;

/* The sources, in the order they are tried; st_sources[i]'s index travels in broadcasts. */
extern const st_source *const st_sources[];
extern const size_t st_nsources;

/* The source of what is at path, or NULL (strata's own, or nothing known). */
const st_source *st_source_find(const st_vfs *v, const char *path, int kind);
/* A source's index in st_sources (+1: 0 stands for strata's own), and back (NULL for 0 or
 * an index out of range). */
uint32_t st_source_id(const st_source *s);
const st_source *st_source_by_id(uint32_t id);

/* For a source's open: encodes d->meta (foreign) as the description others adopt. */
int st_source_describe(const st_dir *d, unsigned char **desc, size_t *desclen);
/* Adopts a description made by st_source_describe: decodes and checks it, sets d->meta and
 * d->committed. */
int st_source_adopt_meta(st_dir *d, const unsigned char *desc, size_t len);

/* A foreign file f (file mf of d, whose identity was `was` when its header was read) is
 * still that file, unchanged: STRATA_ECHANGED naming it otherwise (the device is not
 * compared: a network file has another on each node). */
int st_check_same_file(const st_dir *d, const st_mfile *mf, const st_mident *was, st_file *f);

/* Helpers of the sources' open: is there a regular file (or a link to one) at dir/name;
 * path's directory into dir (PATH_MAX; "." if none), returning its name; dir/name opened
 * for reading (through a link) with its identity (STRATA_ENOENT when missing, naming it as
 * `what`). */
int st_source_has_file(const st_vfs *v, const char *dir, const char *name);
const char *st_source_split(const char *path, char *dir);
int st_source_open_file(const st_vfs *v, const char *dir, const char *name, const char *what,
                        st_file **f, st_file_id *id);

/* The sources (one file each). */
extern const st_source st_source_safetensors; /* foreign.c */
extern const st_source st_source_megatron;    /* src_megatron.c */
extern const st_source st_source_dcp;         /* src_dcp.c */

/* Reads the PyTorch DCP checkpoint in directory dir (its .metadata and, for each tensor
 * item, the headers of its torch.save archive) into a new foreign *out (validated as
 * st_meta_decode_foreign does). For the DCP source and those built on DCP (Megatron
 * torch_dist). Errors: as st_source_dcp's open. */
int st_dcp_read_meta(const st_vfs *v, const char *dir, st_meta **out);
/* st_source_dcp's verify of d, whose first nfiles files are the DCP files (those after
 * them, a source built on DCP's to check itself). */
int st_dcp_verify_files(const st_dir *d, uint32_t nfiles, strata_verify_cb report, void *ctx);
/* Checks the CRC-32 of every entry of the zip archive that is the first len bytes of the
 * open file f (shown: its path), reporting what is wrong as item `name` of `file`. 0,
 * STRATA_ECHECKSUM (reported), or another error (STRATA_EIO, STRATA_ENOMEM). */
int st_dcp_verify_archive(const st_vfs *v, st_file *f, const char *shown, const char *name,
                          const char *file, uint64_t len, strata_verify_cb report, void *ctx);
extern const st_source st_source_torchsave;   /* src_torchsave.c */
extern const st_source st_source_zero;        /* src_zero.c */
extern const st_source st_source_dstag;       /* src_dstag.c */

/* A DeepSpeed save_dir's `latest`: the tag it names (a plain directory name, trailing white
 * space dropped), into tag (cap bytes). STRATA_ENOENT (no `latest`), STRATA_EFORMAT (not a
 * plain name, too long), an I/O error. src_zero.c. */
int st_zero_read_latest(const st_vfs *v, const char *dir, char *tag, size_t cap);
/* A tag saved through strata.deepspeed: each file DeepSpeed saved is a stub beginning with
 * this magic, and the data is the strata checkpoint in the subdirectory ST_DSTAG_SUBDIR
 * (docs/FORMAT.md, "DeepSpeed tags (strata.deepspeed)"). */
#define ST_DSTAG_STUB "STRATA-DEEPSPEED 1\n"
#define ST_DSTAG_SUBDIR "strata"

/* Opens the torch.save file dir/name as an archive into *a (torchsave.h) and describes it in
 * *tf (name points to `name`; its identity taken before anything is read: a later change
 * shows when the data is opened). Errors: STRATA_ENOENT (missing), STRATA_ENOTSUP (legacy
 * format), st_ts_open's. src_torchsave.c. */
struct st_ts_archive;
struct st_ts_file;
int st_ts_open_file(const st_vfs *v, const char *dir, const char *name,
                    struct st_ts_archive *a, struct st_ts_file *tf);
/* Opens the zip archive that is the open file f (size bytes; path for messages) into *z
 * (zip.h; nothing read but its end records and central directory). src_torchsave.c. */
struct st_zip;
int st_source_zip_open(const st_vfs *v, st_file *f, const char *path, uint64_t size,
                       struct st_zip *z);
/* The first bytes of dir/name (name NULL: of dir itself, a file): 1 a zip archive, 2
 * torch.save's legacy format, 0 neither or unreadable (no error left set). */
int st_ts_kind(const st_vfs *v, const char *dir, const char *name);

#endif
