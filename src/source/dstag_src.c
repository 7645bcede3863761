/* dstag_src.c - a DeepSpeed tag saved through strata.deepspeed as a source (source.h): the
 * tag directory (DeepSpeed's files there are stubs naming their entries, the data is the
 * strata checkpoint tag/strata), or the save_dir whose `latest` names one. What is read is
 * that strata checkpoint, by strata's own source (strata_src.c: its metadata, commit record
 * and checksums); this source only finds it. The description for other ranks is strata's
 * own, with the tag `latest` named ("" if none) as a trailer. docs/FORMAT.md, "DeepSpeed tags (strata.deepspeed)".
 *
 * here: a directory without strata's metadata or commit record holding a model-states stub
 * (mp_rank_00_model_states.pt, or zero_pp_rank_0_mp_rank_00_model_states.pt, beginning with
 * the stub's magic) and a subdirectory strata; or one holding `latest` that names such a
 * directory. open: the strata checkpoint's errors (STRATA_EINCOMPLETE naming tag/strata for
 * a tag whose save did not commit), `latest`'s (zero_src.c). No threads. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "../core/util.h"
#include "zero.h"
#include "readers.h"

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

/* ix->path, the tag directory (or the save_dir `tag` names a tag of), becomes its strata
 * checkpoint's. */
static int to_ckpt(st_index *ix, const char *tag)
{
    char p[PATH_MAX];
    int rc = 0;
    if (*tag && !(rc = st_path_join(p, ix->path, tag))) {
        memcpy(ix->path, p, strlen(p) + 1);
        snprintf(ix->tag, sizeof ix->tag, "%s", tag);
    }
    if (!rc && !(rc = st_path_join(p, ix->path, ST_DSTAG_SUBDIR)))
        memcpy(ix->path, p, strlen(p) + 1);
    return rc;
}

static int dstag_open(st_index *ix, int allow_incomplete, unsigned char **desc,
                      size_t *desclen)
{
    char tag[256] = "";
    int rc = 0;
    if (!is_tag(ix->vfs, ix->path) &&
        (rc = st_zero_read_latest(ix->vfs, ix->path, tag, sizeof tag)))
        return rc;
    if ((rc = to_ckpt(ix, tag)) ||
        (rc = st_source_strata.open(ix, allow_incomplete, desc, desclen)))
        return rc;
    if (desc && (rc = st_desc_add(desc, desclen, tag, strlen(tag)))) {
        free(*desc);
        *desc = NULL;
    }
    return rc;
}

static int dstag_adopt(st_index *ix, const unsigned char *desc, size_t len)
{
    const unsigned char *t;
    size_t tl;
    char tag[256] = "";
    if (st_desc_take(desc, &len, &t, &tl) || tl >= sizeof tag ||
        (tl && !st_plain_name((const char *)t, tl)))
        return st_fail(STRATA_EFORMAT, "checkpoint '%s': the index another rank read: a bad "
                       "tag", ix->path);
    memcpy(tag, t, tl);
    int rc = to_ckpt(ix, tag);
    return rc ? rc : st_source_strata.adopt(ix, desc, len);
}

const st_source st_source_dstag = {"strata.deepspeed", STRATA_FORMAT_STRATA_DEEPSPEED,
                                   dstag_here, dstag_open, dstag_adopt, NULL};
