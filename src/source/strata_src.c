/* strata_src.c - strata's own format as a source (source.h), the last the table tries: a
 * directory holding a commit record or any of strata's files. Its open reads the commit
 * record, then the metadata it vouches for (docs/FORMAT.md); its description for the other
 * ranks is the metadata as stored with the commit record as a trailer (readers.h), and its
 * verify is the engine's walk (every chunk's XXH3). strata.deepspeed's tags read through it
 * (dstag_src.c).
 *
 * here: a directory with a commit record entry (of any kind: open says what is wrong with
 * it) or one of strata's regular files (an incomplete checkpoint). open: STRATA_EINCOMPLETE
 * (no valid commit record, without allow_incomplete; or a metadata.bin missing there),
 * STRATA_EFORMAT (a metadata.bin that does not decode or does not match its commit record),
 * I/O errors. No threads. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "readers.h"

/* metadata.bin is read only up to the size its commit record states (and never beyond
 * 16 GiB); without a valid commit record (an incomplete checkpoint opened to look at,
 * probe, ls, gc) up to 256 MiB. The size is checked before anything is allocated, so a
 * sparse file of any length costs nothing. docs/FORMAT.md. */
#define MAX_META_BYTES ((uint64_t)1 << 34)
#define MAX_UNCOMMITTED_META_MIB 256

size_t st_strata_files(const st_dirlist *l)
{
    size_t n = 0;
    for (size_t i = 0; i < l->n; i++)
        n += l->e[i].kind == 0 && st_is_strata_file(l->e[i].name);
    return n;
}

int st_strata_here(const st_vfs *v, const char *path)
{
    char p[PATH_MAX];
    st_dirlist l;
    if (st_path_join(p, path, ST_COMMIT_FILE) || v->stat(v, p, NULL, NULL) != -ENOENT)
        return 1; /* open says what is wrong with it */
    /* a symlink to a directory ("latest", read through): listed as "link/." (a listing
     * never follows a link) */
    int lk = 1;
    if (v->stat(v, path, NULL, &lk) == 0 && lk == 2) {
        if (st_path_join(p, path, "."))
            return 0;
    } else {
        snprintf(p, sizeof p, "%s", path);
    }
    if (st_dirlist_read(v, p, &l) != 0)
        return 0;
    size_t n = st_strata_files(&l);
    st_dirlist_free(&l);
    return n > 0;
}

static int strata_here(const st_vfs *v, const char *path, int kind)
{
    int yes = kind == 1 && st_strata_here(v, path);
    st_clear_error();
    return yes;
}

/* Decodes metadata and checks it against the commit record (if committed). */
static int parse(st_index *ix, const unsigned char *mbuf, size_t mlen)
{
    int rc = st_meta_decode(&ix->meta, mbuf, mlen);
    if (rc)
        return st_wrap(rc, "checkpoint '%s': %s", ix->path, ST_META_FILE);
    if (ix->committed &&
        (ix->commit.meta_size != mlen || ix->commit.meta_hash != st_hash(mbuf, mlen)))
        return st_fail(STRATA_EFORMAT,
                       "checkpoint '%s': %s does not match its commit record (truncated, "
                       "replaced or corrupt)",
                       ix->path, ST_META_FILE);
    return 0;
}

/* Reads the commit record into ix->commit (ix->committed set when it is valid); why says
 * what is wrong when it is not. */
static int read_commit(st_index *ix, char *why, size_t cap)
{
    const st_vfs *v = ix->vfs;
    unsigned char *cbuf = NULL;
    size_t clen = 0;
    char p[PATH_MAX];
    int rc = st_path_join(p, ix->path, ST_COMMIT_FILE);
    if (rc)
        return rc;
    int e = st_vfs_read_all(v, p, 4096, 0, &cbuf, &clen);
    if (e == 0) {
        if (st_commit_decode(&ix->commit, cbuf, clen) == 0)
            ix->committed = 1;
        else
            snprintf(why, cap, "its commit record is invalid (%s)", strata_error_last());
    } else if (e == -ENOENT || e == -EFBIG) {
        snprintf(why, cap, "it has no commit record (an interrupted or failed save)");
    } else if (e == -ST_ENOTREG) { /* a FIFO, a device: no commit record strata wrote */
        snprintf(why, cap, "its commit record %s is not a regular file", ST_COMMIT_FILE);
    } else {
        rc = st_fail(st_from_errno(-e), "checkpoint '%s': reading %s: %s", ix->path,
                     ST_COMMIT_FILE, strerror(-e));
    }
    free(cbuf);
    return rc;
}

/* Reads metadata.bin (at most what the commit record states) into *mbuf. */
static int read_meta(st_index *ix, unsigned char **mbuf, size_t *mlen)
{
    char p[PATH_MAX];
    int rc = st_path_join(p, ix->path, ST_META_FILE);
    if (rc)
        return rc;
    if (ix->committed && ix->commit.meta_size > MAX_META_BYTES)
        return st_fail(STRATA_EFORMAT,
                       "checkpoint '%s': its commit record states %llu bytes of %s, more than "
                       "a reader accepts (%llu)",
                       ix->path, (unsigned long long)ix->commit.meta_size, ST_META_FILE,
                       (unsigned long long)MAX_META_BYTES);
    size_t max = ix->committed ? (size_t)ix->commit.meta_size
                               : (size_t)MAX_UNCOMMITTED_META_MIB << 20;
    int e = st_vfs_read_all(ix->vfs, p, max, 0, mbuf, mlen);
    /* missing, oversized or not a file: a broken checkpoint (or, without a commit record,
     * an incomplete one); EIO is an EIO */
    int broken = ix->committed ? STRATA_EFORMAT : STRATA_EINCOMPLETE;
    if (e == -EFBIG && ix->committed)
        return st_fail(STRATA_EFORMAT,
                       "checkpoint '%s': %s is larger than the %llu bytes its commit record "
                       "states (replaced or corrupt)",
                       ix->path, ST_META_FILE, (unsigned long long)ix->commit.meta_size);
    if (e == -EFBIG)
        return st_fail(STRATA_EINCOMPLETE,
                       "checkpoint '%s' is incomplete and its %s is larger than %d MiB, the "
                       "most read without a valid commit record",
                       ix->path, ST_META_FILE, MAX_UNCOMMITTED_META_MIB);
    if (e == -ST_ENOTREG)
        return st_fail(broken,
                       "checkpoint '%s': %s is not a regular file (a FIFO, a device or a "
                       "directory in its place)",
                       ix->path, ST_META_FILE);
    if (e)
        return st_fail(e == -ENOENT ? broken : st_from_errno(-e),
                       "checkpoint '%s': cannot read %s: %s", ix->path, ST_META_FILE,
                       strerror(-e));
    return 0;
}

static int strata_open(st_index *ix, int allow_incomplete, unsigned char **desc,
                       size_t *desclen)
{
    char why[256] = "";
    unsigned char *mbuf = NULL;
    size_t mlen = 0;
    int rc = read_commit(ix, why, sizeof why);
    if (rc)
        return rc;
    if (!ix->committed && !allow_incomplete)
        return st_fail(STRATA_EINCOMPLETE, "checkpoint '%s' is incomplete: %s", ix->path, why);
    if ((rc = read_meta(ix, &mbuf, &mlen)) || (rc = parse(ix, mbuf, mlen)))
        goto out;
    if (desc && ix->committed) { /* the metadata as stored, the commit record after it */
        unsigned char c[ST_COMMIT_SIZE];
        size_t clen = st_commit_encode(&ix->commit, c);
        if (!(rc = st_desc_add(&mbuf, &mlen, c, clen))) {
            *desc = mbuf;
            *desclen = mlen;
            mbuf = NULL;
        }
    } else if (desc) { /* another rank adopts committed checkpoints only */
        rc = st_fail(STRATA_EINCOMPLETE, "checkpoint '%s' is incomplete: %s", ix->path, why);
    }
out:
    free(mbuf);
    return rc;
}

static int strata_adopt(st_index *ix, const unsigned char *desc, size_t len)
{
    const unsigned char *c;
    size_t clen;
    if (st_desc_take(desc, &len, &c, &clen) || st_commit_decode(&ix->commit, c, clen))
        return st_fail(STRATA_EFORMAT, "checkpoint '%s': the index another rank read: a bad "
                       "commit record", ix->path);
    ix->committed = 1;
    return parse(ix, desc, len);
}

const st_source st_source_strata = {"strata", STRATA_FORMAT_STRATA, strata_here, strata_open,
                                    strata_adopt, NULL};
