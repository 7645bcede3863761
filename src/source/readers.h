/* readers.h - what the sources of src/source/ share below their table (source.c): the
 * helpers of an index (index.c), the readers each source is (for the table), and what one
 * reader lends another (Megatron reads through DCP, ZeRO and strata.deepspeed through
 * torch.save and strata's own, strata.megatron through strata's own). Nothing above
 * src/source/ includes it. */
#ifndef STRATA_READERS_H
#define STRATA_READERS_H
#include "source.h"

/* ---- building an index (index.c) ---- */

/* Takes the metadata a reader built (foreign; its strings may live elsewhere, such as a
 * parser's arena): encodes it once and decodes that (and so validates it, as every other
 * rank will) into ix->meta, and sets ix->committed. The encoded bytes become the
 * description other ranks adopt (*desc, when desc is not NULL; st_index_adopt_meta), else
 * are freed. built stays the caller's. Errors: the decoder's, wrapped naming `what` (e.g.
 * "DCP checkpoint") and ix->path; STRATA_ENOMEM. */
int st_index_take(st_index *ix, const st_meta *built, const char *what, unsigned char **desc,
                  size_t *desclen);
/* Adopts a description st_index_take made: decodes and checks it, sets ix->meta and
 * ix->committed. */
int st_index_adopt_meta(st_index *ix, const unsigned char *desc, size_t len);

/* A description may carry trailers: st_desc_add appends n bytes of p, then n as a u32, to
 * *desc (STRATA_ENOMEM, *desc unchanged); st_desc_take takes the last trailer off (*len
 * shrinks; *p points into desc), -1 when there is none that fits. */
int st_desc_add(unsigned char **desc, size_t *len, const void *p, size_t n);
int st_desc_take(const unsigned char *desc, size_t *len, const unsigned char **p, size_t *n);

/* Helpers of the sources' open: is there a regular file (or a link to one) at dir/name;
 * dir/name opened for reading (through a link) with its identity (STRATA_ENOENT when
 * missing, naming it as `what`). */
int st_source_has_file(const st_vfs *v, const char *dir, const char *name);
int st_source_open_file(const st_vfs *v, const char *dir, const char *name, const char *what,
                        st_file **f, st_file_id *id);
/* ix->path named a file (not a directory): it becomes the file's directory and the file's
 * name goes into name (PATH_MAX); 1 then, else 0. */
int st_index_to_dir(st_index *ix, char *name);

/* ---- the readers, in the order the table tries them ---- */

extern const st_source st_source_safetensors; /* safetensors_src.c */
extern const st_source st_source_mgstrata;    /* mgstrata_src.c */
extern const st_source st_source_megatron;    /* megatron_src.c */
extern const st_source st_source_dcp;         /* dcp_src.c */
extern const st_source st_source_torchsave;   /* torchsave_src.c */
extern const st_source st_source_zero;        /* zero_src.c */
extern const st_source st_source_dstag;       /* dstag_src.c */
/* st_source_strata (source.h), strata_src.c: the last */

/* ---- strata's own (strata_src.c) ---- */

/* Does the directory at path hold a commit record (of any kind: a FIFO in its place too)
 * or any of strata's regular files? */
int st_strata_here(const st_vfs *v, const char *path);
/* How many of strata's regular files (st_is_strata_file) the listing l holds. */
size_t st_strata_files(const st_dirlist *l);

/* ---- PyTorch DCP (dcp_src.c), for the sources built on it (Megatron torch_dist) ---- */

struct st_dcp;
/* Reads the DCP checkpoint in directory dir (its .metadata and, for each tensor item, the
 * headers of its torch.save archive) into a new foreign *built, not validated (st_index_take
 * does), whose strings live in *dc (free both: st_meta_free, st_dcp_free). Errors: as
 * st_source_dcp's open. */
int st_dcp_build(const st_vfs *v, const char *dir, struct st_dcp *dc, st_meta **built);
/* st_source_dcp's verify of ix, whose first nfiles files are the DCP files (those after
 * them, a source built on DCP's to check itself). */
int st_dcp_verify_files(const st_index *ix, uint32_t nfiles, st_report_fn report, void *ctx);
/* Checks the CRC-32 of every entry of the zip archive that is the first len bytes of the
 * open file f (shown: its path), reporting what is wrong as item `name` of `file`. 0,
 * STRATA_ECHECKSUM (reported), or another error (STRATA_EIO, STRATA_ENOMEM). */
int st_dcp_verify_archive(const st_vfs *v, st_file *f, const char *shown, const char *name,
                          const char *file, uint64_t len, st_report_fn report, void *ctx);

/* ---- DeepSpeed (zero_src.c, dstag_src.c) ---- */

/* A DeepSpeed save_dir's `latest`: the tag it names (a plain directory name, trailing white
 * space dropped), into tag (cap bytes). STRATA_ENOENT (no `latest`), STRATA_EFORMAT (not a
 * plain name, too long), an I/O error. zero_src.c. */
int st_zero_read_latest(const st_vfs *v, const char *dir, char *tag, size_t cap);
/* A tag saved through strata.deepspeed: each file DeepSpeed saved is a stub beginning with
 * this magic, and the data is the strata checkpoint in the subdirectory ST_DSTAG_SUBDIR
 * (docs/FORMAT.md, "DeepSpeed tags (strata.deepspeed)"). */
#define ST_DSTAG_STUB "STRATA-DEEPSPEED 1\n"
#define ST_DSTAG_SUBDIR "strata"

/* ---- torch.save (torchsave_src.c), for the sources built on it ---- */

/* Opens the torch.save file dir/name as an archive into *a (torchsave.h) and describes it in
 * *tf (name points to `name`; its identity taken before anything is read: a later change
 * shows when the data is opened). Errors: STRATA_ENOENT (missing), STRATA_ENOTSUP (legacy
 * format), st_ts_open's. */
struct st_ts_archive;
struct st_ts_file;
int st_ts_open_file(const st_vfs *v, const char *dir, const char *name,
                    struct st_ts_archive *a, struct st_ts_file *tf);
/* Opens the zip archive that is the open file f (size bytes; path for messages) into *z
 * (zip.h; nothing read but its end records and central directory). */
struct st_zip;
int st_source_zip_open(const st_vfs *v, st_file *f, const char *path, uint64_t size,
                       struct st_zip *z);
/* The first bytes of dir/name (name NULL: of dir itself, a file): 1 a zip archive, 2
 * torch.save's legacy format, 0 neither or unreadable (no error left set). */
int st_ts_kind(const st_vfs *v, const char *dir, const char *name);

#endif
