/* zero_src.c - the DeepSpeed ZeRO source (source.h): a tag directory written by DeepSpeed's
 * default checkpoint engine (its torch.save files, ZeRO stage 1, 2 or 3, one model-parallel
 * rank), or a save_dir whose `latest` file names such a tag. The files' archives are opened
 * (central directory and pickle only) and read by zero.h into named full tensors of
 * flat pieces; a load reads only the byte ranges its requests need. The description for
 * other ranks is the foreign metadata as st_index_take encoded it, with the tag `latest`
 * named ("" if none) as a trailer.
 * docs/FORMAT.md, "DeepSpeed ZeRO as strata reads it".
 *
 * here: a directory without strata's metadata or commit record holding a model-states file
 * (mp_rank_00_model_states.pt, or zero_pp_rank_0_mp_rank_00_model_states.pt) and rank 0's
 * [bf16_]zero_pp_rank_0_mp_rank_00_optim_states.pt, both zip archives (torch.save's format);
 * or one holding `latest` that names such a directory. open: STRATA_ENOENT (a rank's file
 * missing), STRATA_ENOTSUP (more than one model-parallel rank), zero.h's and the torch.save
 * reader's errors. verify: the zip CRC-32 of every entry (the torch.save source's). No
 * threads. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "zero.h"
#include "readers.h"

static const char *const optim_prefix[] = {"", "bf16_"};

/* The layout of tag directory dir: 12 (stage 1/2 names), 3 (stage 3 names) or 0 (not a
 * ZeRO tag); *prefix the optim files' ("" or "bf16_"). */
static int layout(const st_vfs *v, const char *dir, const char **prefix)
{
    char name[128];
    int lay = st_source_has_file(v, dir, ST_ZERO_MODEL12) ? 12 : 0;
    snprintf(name, sizeof name, ST_ZERO_MODEL_FMT, 0u);
    if (!lay && st_source_has_file(v, dir, name))
        lay = 3;
    if (!lay || st_ts_kind(v, dir, lay == 12 ? ST_ZERO_MODEL12 : name) != 1)
        return 0;
    for (size_t i = 0; i < 2; i++) {
        snprintf(name, sizeof name, ST_ZERO_OPTIM_FMT, optim_prefix[i], 0u);
        if (st_source_has_file(v, dir, name) && st_ts_kind(v, dir, name) == 1) {
            *prefix = optim_prefix[i];
            return lay;
        }
    }
    return 0;
}

int st_zero_read_latest(const st_vfs *v, const char *dir, char *tag, size_t cap)
{
    char p[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    int rc = st_path_join(p, dir, ST_ZERO_LATEST);
    int e = rc ? 0 : st_vfs_read_all(v, p, ST_ZERO_MAX_LATEST, ST_O_FOLLOW, &buf, &len);
    if (!rc && e)
        rc = st_fail(e == -ENOENT ? STRATA_ENOENT : e == -EFBIG ? STRATA_EFORMAT
                                                                : st_from_errno(-e),
                     "DeepSpeed '%s': %s", p, e == -EFBIG ? "over its size limit" : strerror(-e));
    while (!rc && len && (buf[len - 1] == '\n' || buf[len - 1] == '\r' || buf[len - 1] == ' '))
        len--;
    if (!rc && (len == 0 || len >= cap || !st_plain_name((const char *)buf, len) ||
                memchr(buf, 0, len)))
        rc = st_fail(STRATA_EFORMAT, "DeepSpeed '%s': does not name a tag (a plain directory "
                     "name)", p);
    if (!rc) {
        memcpy(tag, buf, len);
        tag[len] = 0;
    }
    free(buf);
    return rc;
}

static int zero_here(const st_vfs *v, const char *path, int kind)
{
    const char *prefix;
    char tag[256], p[PATH_MAX];
    int yes = 0;
    if (kind == 1 && !st_source_has_file(v, path, ST_META_FILE) &&
        !st_source_has_file(v, path, ST_COMMIT_FILE)) {
        yes = layout(v, path, &prefix) != 0;
        if (!yes && st_source_has_file(v, path, ST_ZERO_LATEST) &&
            st_zero_read_latest(v, path, tag, sizeof tag) == 0 && st_path_join(p, path, tag) == 0)
            yes = layout(v, p, &prefix) != 0;
    }
    st_clear_error();
    return yes;
}

/* A second model-parallel rank's files are refused by name (strata reads mp_rank_00). */
static int check_mp(const st_vfs *v, const char *dir, const char *prefix)
{
    char name[128];
    const char *mp1[3] = {"mp_rank_01_model_states.pt",
                          "zero_pp_rank_0_mp_rank_01_model_states.pt", name};
    snprintf(name, sizeof name, "%szero_pp_rank_0_mp_rank_01_optim_states.pt", prefix);
    for (size_t i = 0; i < 3; i++)
        if (st_source_has_file(v, dir, mp1[i]))
            return st_fail(STRATA_ENOTSUP, "DeepSpeed ZeRO checkpoint '%s' has files of a "
                           "second model-parallel rank ('%s'): strata reads ZeRO checkpoints "
                           "of one model-parallel rank (mp_rank_00) only", dir, mp1[i]);
    return 0;
}

/* Opens the files of tag directory dir and builds *meta. */
static int read_tag(const st_vfs *v, const char *dir, st_meta **meta)
{
    const char *prefix = "";
    int lay = layout(v, dir, &prefix), stage = 0, rc;
    uint32_t ranks = 0;
    char where[PATH_MAX + 64];
    snprintf(where, sizeof where, "DeepSpeed ZeRO checkpoint '%s'", dir);
    if (!lay)
        return st_fail(STRATA_ENOENT, "%s: no model-states file (%s or %s) and rank 0's optim "
                       "file beside it", where, ST_ZERO_MODEL12,
                       "zero_pp_rank_0_mp_rank_00_model_states.pt");
    if ((rc = check_mp(v, dir, prefix)))
        return rc;
    /* rank 0's optim file says the stage and the number of ranks */
    char (*names)[128] = NULL;
    st_ts_archive *a = NULL, a0;
    st_ts_file *tf = NULL, tf0;
    char name0[128];
    snprintf(name0, sizeof name0, ST_ZERO_OPTIM_FMT, prefix, 0u);
    if ((rc = st_ts_open_file(v, dir, name0, &a0, &tf0)))
        return rc;
    rc = st_zero_optim_info(&a0, &stage, &ranks, name0);
    st_ts_close(&a0);
    if (!rc && (stage == 3) != (lay == 3))
        rc = st_fail(STRATA_EFORMAT, "%s: '%s' says ZeRO stage %d, but the model-states files "
                     "are named as stage %s writes them", where, name0, stage,
                     lay == 3 ? "3" : "1 and 2");
    if (rc)
        return rc;
    size_t nmodel = stage == 3 ? ranks : 1, n = nmodel + ranks;
    names = calloc(n, sizeof *names);
    a = calloc(n, sizeof *a);
    tf = calloc(n, sizeof *tf);
    if (!names || !a || !tf)
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < n && !rc; i++) {
        if (i < nmodel)
            snprintf(names[i], sizeof names[i], "%s",
                     stage == 3 ? "" : ST_ZERO_MODEL12);
        if (i < nmodel && stage == 3)
            snprintf(names[i], sizeof names[i], ST_ZERO_MODEL_FMT, (unsigned)i);
        if (i >= nmodel)
            snprintf(names[i], sizeof names[i], ST_ZERO_OPTIM_FMT, prefix,
                     (unsigned)(i - nmodel));
        if (!st_source_has_file(v, dir, names[i]))
            rc = st_fail(STRATA_ENOENT, "%s: '%s' is missing (partition_count in '%s' says %u "
                         "data-parallel ranks)", where, names[i], name0, ranks);
        else
            rc = st_ts_open_file(v, dir, names[i], &a[i], &tf[i]);
    }
    if (!rc) {
        char extra[128];
        snprintf(extra, sizeof extra, ST_ZERO_OPTIM_FMT, prefix, ranks);
        if (st_source_has_file(v, dir, extra))
            rc = st_fail(STRATA_EFORMAT, "%s: '%s' is there, but partition_count in '%s' says "
                         "%u data-parallel ranks (a rank's file left from another save?)",
                         where, extra, name0, ranks);
    }
    if (!rc)
        rc = st_zero_meta(meta, tf, nmodel, stage, ranks, where);
    for (size_t i = 0; a && i < n; i++)
        st_ts_close(&a[i]);
    free(a);
    free(tf);
    free(names);
    return rc;
}

static int zero_open(st_index *ix, int allow_incomplete, unsigned char **desc, size_t *desclen)
{
    (void)allow_incomplete;
    const st_vfs *v = ix->vfs;
    const char *prefix;
    char tag[256] = "";
    int rc = 0;
    if (!layout(v, ix->path, &prefix) && st_source_has_file(v, ix->path, ST_ZERO_LATEST)) {
        if ((rc = st_zero_read_latest(v, ix->path, tag, sizeof tag)))
            return rc;
        char p[PATH_MAX];
        if ((rc = st_path_join(p, ix->path, tag)))
            return rc;
        memcpy(ix->path, p, strlen(p) + 1);
        snprintf(ix->tag, sizeof ix->tag, "%s", tag);
    }
    st_meta *m = NULL;
    if ((rc = read_tag(v, ix->path, &m)))
        return rc;
    rc = st_index_take(ix, m, "DeepSpeed ZeRO checkpoint", desc, desclen);
    st_meta_free(m);
    if (!rc && desc && (rc = st_desc_add(desc, desclen, tag, strlen(tag)))) {
        free(*desc);
        *desc = NULL;
    }
    return rc;
}

static int zero_adopt(st_index *ix, const unsigned char *desc, size_t len)
{
    const unsigned char *t;
    size_t tl;
    if (st_desc_take(desc, &len, &t, &tl) || tl >= 256 ||
        (tl && !st_plain_name((const char *)t, tl)))
        return st_fail(STRATA_EFORMAT, "checkpoint '%s': the index another rank read: a bad "
                       "tag", ix->path);
    if (tl) {
        char tag[256], p[PATH_MAX];
        memcpy(tag, t, tl);
        tag[tl] = 0;
        int rc = st_path_join(p, ix->path, tag);
        if (rc)
            return rc;
        memcpy(ix->path, p, strlen(p) + 1);
        snprintf(ix->tag, sizeof ix->tag, "%s", tag);
    }
    return st_index_adopt_meta(ix, desc, len);
}

static int zero_verify(const st_index *ix, st_report_fn report, void *ctx)
{
    return st_source_torchsave.verify(ix, report, ctx);
}

const st_source st_source_zero = {"deepspeed", STRATA_FORMAT_DEEPSPEED, zero_here, zero_open,
                                  zero_adopt, zero_verify};
