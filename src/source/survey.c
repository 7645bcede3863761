/* survey.c - what a path holds when no source claims it (st_survey, source.h): another
 * framework's checkpoint that strata does not read (a DeepSpeed checkpoint without the ZeRO
 * files its source reads, a directory of torch.save files), an unfinished DCP save, a
 * directory of checkpoints, an empty or unrelated directory - told by the files' content
 * where the name could lie. Above the table (it asks whether a subdirectory is a
 * checkpoint of some source), below the engine. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "dcp.h"
#include "readers.h"
#include "torchsave.h"

/* ---- what a path is ---------------------------------------------------------------------- */

/* The first n bytes of the regular file dir/name (n = 0 when unreadable). */
static size_t head(const st_vfs *v, const char *dir, const char *name, unsigned char *buf,
                   size_t n)
{
    char p[PATH_MAX];
    st_file *f;
    int bad = name ? st_path_join(p, dir, name) != 0
                   : snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p;
    if (bad || v->open(v, p, ST_O_READ | ST_O_FOLLOW, &f) != 0) {
        st_clear_error();
        return 0;
    }
    int64_t got = st_vfs_read_full(v, f, buf, n, 0);
    v->close(f);
    return got > 0 ? (size_t)got : 0;
}

/* A pickle (protocol 2..5, how torch.save's legacy format begins)? */
static int is_pickle(const unsigned char *b, size_t n)
{
    return n >= 2 && b[0] == 0x80 && b[1] >= 2 && b[1] <= 5;
}

/* A zip archive (torch.save's format since torch 1.6)? */
static int is_zip(const unsigned char *b, size_t n)
{
    return n >= 4 && memcmp(b, "PK\x03\x04", 4) == 0;
}

/* Is dir/name a torch.save file (a zip or a pickle)? */
static int torch_saved(const st_vfs *v, const char *dir, const char *name)
{
    unsigned char b[4];
    size_t n = head(v, dir, name, b, sizeof b);
    return is_zip(b, n) || is_pickle(b, n);
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* DeepSpeed's `latest`: a small file naming a tag directory beside it (global_step100)? */
static int deepspeed_latest(const st_vfs *v, const char *dir, const st_dirlist *l)
{
    char p[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    if (st_path_join(p, dir, "latest") || st_vfs_read_all(v, p, 256, 0, &buf, &len) != 0) {
        st_clear_error();
        return 0;
    }
    while (len && (buf[len - 1] == '\n' || buf[len - 1] == '\r' || buf[len - 1] == ' '))
        len--;
    int yes = 0;
    for (size_t i = 0; i < l->n && !yes; i++)
        yes = l->e[i].kind == 1 && strlen(l->e[i].name) == len && len &&
              memcmp(l->e[i].name, buf, len) == 0;
    free(buf);
    return yes;
}

/* The .distcp files in the list (a DCP directory's data, one or more per rank). */
static size_t distcp_files(const st_dirlist *l)
{
    size_t n = 0;
    for (size_t i = 0; i < l->n; i++)
        n += l->e[i].kind == 0 && ends_with(l->e[i].name, ".distcp");
    return n;
}

/* Is dir a DCP checkpoint whose save did not finish: .distcp files but no .metadata, which
 * dcp.save writes last (its rename of .metadata.tmp commits it)? */
static int dcp_unfinished(const st_vfs *v, const char *dir)
{
    st_dirlist l;
    int kind;
    char p[PATH_MAX];
    if (st_path_join(p, dir, ST_DCP_METADATA) == 0 && v->stat(v, p, NULL, &kind) == 0)
        return 0;
    if (st_dirlist_read(v, dir, &l))
        return 0;
    size_t n = distcp_files(&l);
    st_dirlist_free(&l);
    return n > 0;
}

/* The directory at path has no strata file: says what it is (STRATA_EFORMAT for a format
 * strata does not read, STRATA_EINCOMPLETE for a DCP checkpoint without its .metadata,
 * STRATA_ENOENT for no checkpoint at all). Its subdirectories are checkpoints when they hold
 * strata's files or another format strata reads (a source's). */
static int name_dir(const st_vfs *v, const char *dir, const char *path, const st_dirlist *l)
{
    size_t saved = 0, ckpts = 0, committed = 0, distcp = distcp_files(l);
    const char *a_saved = NULL, *last = NULL;
    int deepspeed = 0;
    if (distcp && !st_source_has_file(v, dir, ST_DCP_METADATA))
        return st_fail(STRATA_EINCOMPLETE, "'%s' is an incomplete PyTorch DCP checkpoint: %zu "
                       ".distcp file%s, no %s (dcp.save writes it last: the save did not "
                       "finish)", path, distcp, distcp == 1 ? "" : "s", ST_DCP_METADATA);
    for (size_t i = 0; i < l->n; i++) {
        const char *nm = l->e[i].name;
        char c[PATH_MAX], p[PATH_MAX];
        if (l->e[i].kind == 1) { /* a child holding strata's files, or another format's? */
            if (st_path_join(c, dir, nm))
                continue;
            int has_commit = st_path_join(p, c, ST_COMMIT_FILE) == 0 &&
                             v->stat(v, p, NULL, NULL) == 0;
            int has_meta = !has_commit && st_path_join(p, c, ST_META_FILE) == 0 &&
                           v->stat(v, p, NULL, NULL) == 0;
            const st_source *src = has_commit || has_meta ? NULL : st_source_find(v, c, 1);
            int other = src && src != &st_source_strata; /* another format's */
            int unfinished = !has_commit && !has_meta && !other && dcp_unfinished(v, c);
            ckpts += has_commit || has_meta || other || unfinished;
            if (has_commit || other)
                committed++, last = nm;
            continue;
        }
        if (l->e[i].kind != 0)
            continue;
        if ((ends_with(nm, ".pt") || ends_with(nm, ".pth") || ends_with(nm, ".bin")) &&
            torch_saved(v, dir, nm)) {
            saved++;
            a_saved = a_saved ? a_saved : nm;
            deepspeed |= strncmp(nm, "mp_rank_", 8) == 0 && ends_with(nm, "_model_states.pt");
        }
    }
    deepspeed |= deepspeed_latest(v, dir, l);
    st_clear_error();
    if (deepspeed)
        return st_fail(STRATA_EFORMAT, "'%s' is a DeepSpeed checkpoint (a 'latest' tag or "
                       "mp_rank_*_model_states.pt) without the ZeRO files strata reads (a "
                       "model-states file and zero_pp_rank_0_mp_rank_00_optim_states.pt in "
                       "the tag; one without ZeRO is not read yet)", path);
    if (committed)
        return st_fail(STRATA_ENOENT, "'%s' is a directory of checkpoints, not one (%zu committed "
                       "under it); did you mean %s/%s? (strata ls %s lists them)", path,
                       committed, path, last, path);
    if (ckpts)
        return st_fail(STRATA_ENOENT, "'%s' is a directory of checkpoints, not one, and none of "
                       "the %zu under it is committed (strata ls %s lists them)", path, ckpts,
                       path);
    if (saved)
        return st_fail(STRATA_EFORMAT, "'%s' holds PyTorch torch.save files (%zu, such as %s) "
                       "but neither %s nor %s: strata reads a torch.save file named by its "
                       "path (%s/%s)", path, saved, a_saved, ST_TS_SINGLE_FILE,
                       ST_TS_INDEX_FILE, path, a_saved);
    if (!l->n)
        return st_fail(STRATA_ENOENT, "'%s' is an empty directory, not a checkpoint", path);
    return st_fail(STRATA_ENOENT, "'%s' is not a checkpoint: it holds no strata files (COMMIT, "
                   "metadata.bin, data-*.bin) and no format strata knows", path);
}

int st_survey(const st_vfs *v, const char *path, int kind)
{
    if (kind != 1) { /* a file, a link to one (safetensors: taken before) */
        unsigned char b[4];
        size_t n = head(v, path, NULL, b, sizeof b);
        if (is_zip(b, n)) /* torch.save's are taken before (torchsave_src.c) */
            return st_fail(STRATA_EFORMAT, "'%s' is a zip archive without a <dir>/data.pkl "
                           "entry: not a torch.save file, nor a checkpoint", path);
        if (is_pickle(b, n))
            return st_fail(STRATA_EFORMAT, "'%s' is a bare pickle, not a torch.save file (a zip "
                           "archive) nor a checkpoint; strata never runs pickle", path);
        return st_fail(STRATA_ENOENT, "checkpoint '%s' is not a directory", path);
    }
    /* a symlink to a directory ("latest", which the caller reads through): listed as
     * "link/." (the listing itself never follows a link) */
    char dir[PATH_MAX];
    int lk = 1, rc = 0;
    if (v->stat(v, path, NULL, &lk) == 0 && lk == 2)
        rc = st_path_join(dir, path, ".");
    else
        snprintf(dir, sizeof dir, "%s", path);
    if (rc)
        return rc;
    st_dirlist l;
    int e = st_dirlist_read(v, dir, &l);
    if (e)
        return st_fail(st_from_errno(-e), "cannot list '%s': %s", dir, strerror(-e));
    /* strata's files: a strata checkpoint (its source says what is missing) */
    rc = st_strata_files(&l) ? 0 : name_dir(v, dir, path, &l);
    st_dirlist_free(&l);
    return rc;
}
