/* src_dstag.c - a DeepSpeed tag saved through strata.deepspeed as a source (source.h): the
 * tag directory (DeepSpeed's files there are stubs naming their entries, the data is the
 * strata checkpoint tag/strata), or the save_dir whose `latest` names one. What is read is
 * that strata checkpoint, as strata's own (its metadata, commit record and checksums); the
 * source only finds it. The description for other ranks is the tag `latest` named (or ""),
 * the commit record and the metadata. docs/FORMAT.md, "DeepSpeed tags (strata.deepspeed)".
 *
 * here: a directory without strata's metadata or commit record holding a model-states stub
 * (mp_rank_00_model_states.pt, or zero_pp_rank_0_mp_rank_00_model_states.pt, beginning with
 * the stub's magic) and a subdirectory strata; or one holding `latest` that names such a
 * directory. open: the strata checkpoint's errors (STRATA_EINCOMPLETE naming tag/strata for
 * a tag whose save did not commit), `latest`'s (src_zero.c). No threads. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "../core/util.h"
#include "zero.h"
#include "source.h"

/* Does dir/name begin with the stub's magic? */
static int stub_at(const st_vfs *v, const char *dir, const char *name)
{
    char p[PATH_MAX];
    st_file *f;
    unsigned char b[sizeof ST_DSTAG_STUB - 1];
    if (st_path_join(p, dir, name) || v->open(v, p, ST_O_READ, &f) != 0)
        return 0;
    int64_t got = st_vfs_read_full(v, f, b, sizeof b, 0);
    v->close(f);
    return got == (int64_t)sizeof b && memcmp(b, ST_DSTAG_STUB, sizeof b) == 0;
}

/* Is dir a tag saved through strata.deepspeed? */
static int is_tag(const st_vfs *v, const char *dir)
{
    char p[PATH_MAX], model3[128];
    int kind = -1;
    snprintf(model3, sizeof model3, ST_ZERO_MODEL_FMT, 0u);
    int yes = (stub_at(v, dir, ST_ZERO_MODEL12) || stub_at(v, dir, model3)) &&
              st_path_join(p, dir, ST_DSTAG_SUBDIR) == 0 && v->stat(v, p, NULL, &kind) == 0 &&
              kind == 1;
    st_clear_error();
    return yes;
}

static int dstag_here(const st_vfs *v, const char *path, int kind)
{
    char tag[256], p[PATH_MAX];
    int yes = 0;
    if (kind == 1 && !st_source_has_file(v, path, ST_META_FILE) &&
        !st_source_has_file(v, path, ST_COMMIT_FILE)) {
        yes = is_tag(v, path);
        if (!yes && st_source_has_file(v, path, ST_ZERO_LATEST) &&
            st_zero_read_latest(v, path, tag, sizeof tag) == 0 && st_path_join(p, path, tag) == 0)
            yes = is_tag(v, p);
    }
    st_clear_error();
    return yes;
}

/* d->path, the tag directory (or the save_dir `tag` names a tag of), becomes its strata
 * checkpoint's. */
static int to_ckpt(st_dir *d, const char *tag)
{
    char p[PATH_MAX];
    int rc = 0;
    if (*tag && !(rc = st_path_join(p, d->path, tag))) {
        memcpy(d->path, p, strlen(p) + 1);
        snprintf(d->tag, sizeof d->tag, "%s", tag);
    }
    if (!rc && !(rc = st_path_join(p, d->path, ST_DSTAG_SUBDIR)))
        memcpy(d->path, p, strlen(p) + 1);
    return rc;
}

/* The description: u32 tag length, the tag, u32 commit record length, the record, and the
 * metadata as stored. */
static int dstag_open(st_dir *d, unsigned char **desc, size_t *desclen)
{
    char tag[256] = "";
    int rc = 0;
    if (!is_tag(d->vfs, d->path) &&
        (rc = st_zero_read_latest(d->vfs, d->path, tag, sizeof tag)))
        return rc;
    unsigned char *meta = NULL;
    size_t mlen = 0;
    if ((rc = to_ckpt(d, tag)) ||
        (rc = st_dir_read_own(d, d->incomplete_ok, 0, desc ? &meta : NULL, &mlen)))
        return rc;
    if (desc) {
        unsigned char c[ST_COMMIT_SIZE];
        size_t clen = st_commit_encode(&d->commit, c);
        st_buf b = {0};
        st_buf_u32(&b, (uint32_t)strlen(tag));
        st_buf_put(&b, tag, strlen(tag));
        st_buf_u32(&b, (uint32_t)clen);
        st_buf_put(&b, c, clen);
        st_buf_put(&b, meta, mlen);
        free(meta);
        if (b.oom) {
            free(b.p);
            return st_fail(STRATA_ENOMEM, "out of memory");
        }
        *desc = b.p;
        *desclen = b.n;
    }
    return 0;
}

static int dstag_adopt(st_dir *d, const unsigned char *desc, size_t len)
{
    st_rd r = {desc, desc + len, desc, 0, ""};
    char tag[256] = "";
    uint32_t tl = st_rd_u32(&r);
    const unsigned char *t = tl < sizeof tag ? st_rd_take(&r, tl) : NULL;
    uint32_t cl = st_rd_u32(&r);
    const unsigned char *c = t && cl <= ST_COMMIT_SIZE ? st_rd_take(&r, cl) : NULL;
    st_commit commit;
    if (!c || (tl && !st_plain_name((const char *)t, tl)) || st_commit_decode(&commit, c, cl))
        return st_fail(STRATA_EFORMAT, "checkpoint '%s': the index another rank read: a bad "
                       "tag or commit record", d->path);
    memcpy(tag, t, tl);
    int rc = to_ckpt(d, tag);
    return rc ? rc : st_dir_parse_own(d, &commit, r.p, st_rd_left(&r));
}

const st_source st_source_dstag = {"strata.deepspeed", STRATA_FORMAT_STRATA_DEEPSPEED,
                                   dstag_here, dstag_open, dstag_adopt, NULL};
