/* export_dir.c - the output directory of an export, replaced all at once: readers of OUT see
 * the previous complete set of files or the new one, never a mix, whenever the export stops.
 *
 * OUT belongs to the export. An export makes OUT.strata-export-<id>/ beside OUT (the same
 * filesystem), locks its EXPORT.LOCK, writes the new files into its set/ and fsyncs them;
 * then set/ and OUT trade places in one step (renameat2 RENAME_EXCHANGE; a rename when OUT
 * is missing), OUT's parent is fsynced, and the staging directory - now holding the previous
 * files - is removed. A killed export leaves its staging directory, unlocked; the next export
 * to the same OUT removes it (it never touches one whose lock is held). Where the filesystem
 * cannot exchange (NFS), OUT is first renamed to the staging directory's old/, then set/ to
 * OUT: for that instant OUT is missing, and an export killed then is undone by the next one
 * (old/ goes back to OUT). Every call goes through the storage layer (vfs.h). */
#include "export.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../core/error.h"
#include "../engine/engine.h"

#define EXDIR_LOCK "EXPORT.LOCK"

static int join(char *out, const char *dir, const char *name)
{
    int n = snprintf(out, PATH_MAX, "%s/%s", dir, name);
    if (n < 0 || n >= PATH_MAX)
        return st_fail(STRATA_EINVAL, "path too long: %s/%s", dir, name);
    return 0;
}

/* The failure to change the output: STRATA_ENOSPC when the disk or quota is full, else
 * STRATA_EIO (never STRATA_ENOENT, which means a missing checkpoint). */
static int out_code(int e)
{
    return e == ENOSPC || e == EDQUOT || e == EFBIG ? STRATA_ENOSPC : STRATA_EIO;
}

int st_exdir_is_export_file(const char *name)
{
    size_t n = strlen(name);
    if (n > 8 && strcmp(name + n - 8, ".partial") == 0)
        n -= 8;
    if ((n == strlen(EXPORT_INDEX) && strncmp(name, EXPORT_INDEX, n) == 0) ||
        (n == strlen(EXPORT_SINGLE) && strncmp(name, EXPORT_SINGLE, n) == 0))
        return 1;
    /* model-NNNNN-of-NNNNN.safetensors */
    if (n != 32 || strncmp(name, "model-", 6) != 0 || strncmp(name + 11, "-of-", 4) != 0 ||
        strncmp(name + 20, ".safetensors", 12) != 0)
        return 0;
    for (int i = 0; i < 5; i++)
        if (name[6 + i] < '0' || name[6 + i] > '9' || name[15 + i] < '0' || name[15 + i] > '9')
            return 0;
    return 1;
}

/* ---- removing a staging directory ---- */

static int remove_export_file(void *ctx, const char *name, uint64_t size, int kind)
{
    (void)ctx, (void)size;
    return kind == 0 && st_exdir_is_export_file(name) ? ST_LIST_REMOVE : ST_LIST_NEXT;
}

/* Removes the export's files in dir, then dir (kept if anything else is there). */
static void clear_set(const st_vfs *v, const char *dir)
{
    int kind;
    if (v->stat(v, dir, NULL, &kind) != 0 || kind != 1)
        return;
    v->list(v, dir, remove_export_file, NULL);
    v->rmdir(v, dir);
}

/* Removes the staging directory stage of OUT, whose lock the caller holds. An old/ there is
 * OUT's previous content, moved out by the two-rename swap: it goes back when OUT is
 * missing (the export stopped between the renames), else it is removed. */
static void remove_stage(const st_vfs *v, const char *out, const char *stage)
{
    char p[PATH_MAX];
    int kind;
    if (join(p, stage, "old") == 0 && v->stat(v, p, NULL, &kind) == 0 && kind == 1) {
        if (v->stat(v, out, NULL, &kind) != -ENOENT || v->rename(v, p, out) != 0)
            clear_set(v, p);
    }
    if (join(p, stage, "set") == 0)
        clear_set(v, p);
    if (join(p, stage, EXDIR_LOCK) == 0)
        v->unlink(v, p);
    v->rmdir(v, stage);
}

typedef struct {
    const char *base; /* OUT's name in its parent */
    size_t blen;
    char **names;
    size_t n, cap;
    int nomem;
} stale_ctx;

/* The length of OUT's name in a staging directory's name (OUT + EXDIR_MARK + id), or 0. */
static size_t stage_base_len(const char *name)
{
    const char *m = NULL;
    for (const char *q = name; (q = strstr(q, EXDIR_MARK)) != NULL; q++)
        m = q; /* the last mark: the id after it holds none */
    return m && m > name && m[strlen(EXDIR_MARK)] ? (size_t)(m - name) : 0;
}

/* Collects the staging directories of OUT = c->base (any OUT when base is NULL). */
static int collect_stale(void *p, const char *name, uint64_t size, int kind)
{
    (void)size;
    stale_ctx *c = p;
    size_t bl = stage_base_len(name);
    if (kind != 1 || !bl || (c->base && (bl != c->blen || strncmp(name, c->base, bl) != 0)))
        return ST_LIST_NEXT;
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 8;
        char **more = realloc(c->names, cap * sizeof *more);
        if (!more)
            return c->nomem = 1, ST_LIST_STOP;
        c->names = more, c->cap = cap;
    }
    if (!(c->names[c->n] = strdup(name)))
        return c->nomem = 1, ST_LIST_STOP;
    c->n++;
    return ST_LIST_NEXT;
}

/* Removes what killed exports to OUT left beside it: staging directories whose lock no one
 * holds. Best effort: what cannot be removed stays for a later export. */
static int clear_stale(st_exdir *d, const char *base)
{
    stale_ctx c = {.base = base, .blen = strlen(base)};
    int e = d->v->list(d->v, d->parent, collect_stale, &c);
    int rc = c.nomem ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
    if (!rc && e)
        rc = st_fail(out_code(-e), "cannot list '%s': %s", d->parent, strerror(-e));
    for (size_t i = 0; i < c.n && !rc; i++) {
        char stage[PATH_MAX], lock[PATH_MAX];
        st_file *lk;
        if (join(stage, d->parent, c.names[i]) || join(lock, stage, EXDIR_LOCK))
            continue;
        if (d->v->lock(d->v, lock, &lk) != 0) /* alive (-EBUSY), or gone meanwhile */
            continue;
        remove_stage(d->v, d->out, stage);
        d->v->close(lk);
    }
    for (size_t i = 0; i < c.n; i++)
        free(c.names[i]);
    free(c.names);
    return rc;
}

int strata_remove_export_staging(int *removed, const char *dir_uri)
{
    st_clear_error();
    if (removed)
        *removed = 0;
    if (!dir_uri)
        return st_fail(STRATA_EINVAL, "strata_remove_export_staging: dir_uri is NULL");
    const st_vfs *v;
    char dir[PATH_MAX];
    int rc = st_vfs_resolve(dir_uri, &v, dir, sizeof dir);
    if (rc)
        return rc;
    stale_ctx c = {0};
    int e = v->list(v, dir, collect_stale, &c);
    rc = c.nomem ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
    if (!rc && e)
        rc = st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e), "cannot list '%s': %s",
                     dir, strerror(-e));
    for (size_t i = 0; i < c.n && !rc; i++) {
        char stage[PATH_MAX], lock[PATH_MAX], out[PATH_MAX];
        st_file *lk;
        if (join(stage, dir, c.names[i]) || join(lock, stage, EXDIR_LOCK) ||
            join(out, dir, c.names[i]))
            continue;
        out[strlen(dir) + 1 + stage_base_len(c.names[i])] = 0; /* OUT beside it */
        if (v->lock(v, lock, &lk) != 0) /* a live export (-EBUSY), or gone meanwhile */
            continue;
        remove_stage(v, out, stage);
        v->close(lk);
        int kind;
        if (removed && v->stat(v, stage, NULL, &kind) == -ENOENT)
            (*removed)++;
    }
    for (size_t i = 0; i < c.n; i++)
        free(c.names[i]);
    free(c.names);
    st_vfs_release(v);
    return rc;
}

/* ---- beginning ---- */

typedef struct {
    char first[256]; /* the first entry that no export writes */
} check_ctx;

static int check_one(void *p, const char *name, uint64_t size, int kind)
{
    (void)size;
    check_ctx *c = p;
    if (kind == 0 && st_exdir_is_export_file(name))
        return ST_LIST_NEXT;
    snprintf(c->first, sizeof c->first, "%s%s", name, kind == 1 ? "/" : "");
    return ST_LIST_STOP;
}

/* OUT is missing (its parent there), or a directory holding only an export's files. */
static int check_out(st_exdir *d)
{
    const st_vfs *v = d->v;
    int kind, e = v->stat(v, d->out, NULL, &kind);
    if (e == -ENOENT) {
        if ((e = v->stat(v, d->parent, NULL, &kind)) == 0 && kind == 1)
            return 0;
        return st_fail(STRATA_ENOENT,
                       "the directory '%s' that would hold '%s' does not exist (export makes "
                       "its output directory, not its parents)",
                       d->parent, d->out);
    }
    if (e)
        return st_fail(out_code(-e), "cannot look at '%s': %s", d->out, strerror(-e));
    if (kind == 2)
        return st_fail(STRATA_EEXIST,
                       "'%s' is a symbolic link (dangling or not): an export replaces its output "
                       "directory as a whole, so it must be a directory or missing; name the "
                       "directory itself",
                       d->out);
    if (kind != 1)
        return st_fail(STRATA_EEXIST, "'%s' exists and is not a directory", d->out);
    check_ctx c = {""};
    if ((e = v->list(v, d->out, check_one, &c)) != 0)
        return st_fail(out_code(-e), "cannot list '%s': %s", d->out, strerror(-e));
    if (c.first[0])
        return st_fail(STRATA_EEXIST,
                       "'%s' holds '%s', which is not a file an export writes: an export "
                       "replaces its output directory as a whole, so it must be missing, empty "
                       "or an earlier export's output; nothing was touched",
                       d->out, c.first);
    return 0;
}

/* Makes and locks this export's staging directory and its set/. */
static int make_stage(st_exdir *d)
{
    static atomic_uint seq;
    const st_vfs *v = d->v;
    char lock[PATH_MAX];
    int e = 0;
    for (int tries = 0; tries < 8; tries++) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        unsigned id = (unsigned)ts.tv_nsec ^ ((unsigned)ts.tv_sec << 20) ^
                      (atomic_fetch_add(&seq, 1) * 2654435761u);
        int n = snprintf(d->stage, PATH_MAX, "%s" EXDIR_MARK "%ld-%08x", d->out, (long)getpid(),
                         id);
        if (n < 0 || n >= PATH_MAX)
            return st_fail(STRATA_EINVAL, "path too long: %s" EXDIR_MARK, d->out);
        if ((e = v->mkdir(v, d->stage)) == -EEXIST)
            continue;
        if (e)
            return st_fail(out_code(-e), "cannot create '%s': %s", d->stage, strerror(-e));
        int rc = join(lock, d->stage, EXDIR_LOCK);
        if (!rc)
            rc = join(d->set, d->stage, "set");
        if (rc) {
            v->rmdir(v, d->stage);
            return rc;
        }
        /* another export's cleanup may take a fresh directory before its lock is held:
         * then it is gone (or going), and a new name is tried */
        if ((e = v->lock(v, lock, &d->lock)) == -EBUSY || e == -ENOENT)
            continue;
        if (!e && (e = v->mkdir(v, d->set)) == 0)
            return 0;
        if (d->lock) {
            v->unlink(v, lock);
            v->close(d->lock);
            d->lock = NULL;
        }
        v->rmdir(v, d->stage);
        return st_fail(out_code(-e), "cannot prepare '%s': %s", d->stage, strerror(-e));
    }
    return st_fail(STRATA_EIO, "cannot make a staging directory beside '%s' (%s)", d->out,
                   strerror(e < 0 ? -e : EEXIST));
}

int st_exdir_begin(st_exdir *d, const char *uri)
{
    memset(d, 0, sizeof *d);
    const st_vfs *v;
    int rc = st_vfs_resolve(uri, &v, d->out, sizeof d->out);
    if (rc)
        return rc;
    d->v = v;
    const char *slash = strrchr(d->out, '/');
    const char *base = slash ? slash + 1 : d->out;
    if (v->version < 2 || !v->exchange)
        rc = st_fail(STRATA_ESCHEME, "export needs a storage backend of version 2: '%s'", uri);
    else if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
        rc = st_fail(STRATA_EINVAL,
                     "'%s': name the output directory by a path that ends in its own name",
                     uri);
    if (!rc) {
        if (!slash)
            snprintf(d->parent, PATH_MAX, ".");
        else if (slash == d->out)
            snprintf(d->parent, PATH_MAX, "/");
        else
            snprintf(d->parent, PATH_MAX, "%.*s", (int)(slash - d->out), d->out);
        rc = check_out(d);
    }
    if (!rc)
        rc = clear_stale(d, base);
    if (!rc)
        rc = make_stage(d);
    if (rc) {
        st_vfs_release(v);
        d->v = NULL;
    }
    return rc;
}

int st_exdir_path(const st_exdir *d, char *out, const char *name)
{
    return join(out, d->set, name);
}

/* ---- the swap ---- */

enum { SWAP_NONE, SWAP_EXCHANGE, SWAP_RENAME, SWAP_TWO_RENAMES };

/* Puts OUT's previous content back after a swap of kind how. */
static void unswap(st_exdir *d, int how, const char *old)
{
    const st_vfs *v = d->v;
    if (how == SWAP_EXCHANGE) {
        v->exchange(v, d->set, d->out);
    } else if (v->rename(v, d->out, d->set) == 0 && how == SWAP_TWO_RENAMES) {
        v->rename(v, old, d->out);
    }
}

int st_exdir_commit(st_exdir *d)
{
    const st_vfs *v = d->v;
    char old[PATH_MAX];
    int rc = join(old, d->stage, "old");
    if (rc)
        return rc;
    int e = v->sync_dir(v, d->set), how = SWAP_NONE, kind;
    if (e)
        return st_fail(out_code(-e), "fsync of '%s': %s", d->set, strerror(-e));
    d->out_existed = v->stat(v, d->out, NULL, &kind) == 0;
    if (!d->out_existed && (e = v->rename(v, d->set, d->out)) == 0)
        how = SWAP_RENAME;
    if (how == SWAP_NONE && (d->out_existed || e == -EEXIST || e == -ENOTEMPTY)) {
        d->out_existed = 1;
        if ((e = v->exchange(v, d->set, d->out)) == 0) {
            how = SWAP_EXCHANGE;
        } else if (e == -EINVAL || e == -ENOSYS || e == -EOPNOTSUPP) {
            /* no exchange here (NFS): OUT is missing between these two renames */
            if ((e = v->rename(v, d->out, old)) == 0) {
                if ((e = v->rename(v, d->set, d->out)) == 0)
                    how = SWAP_TWO_RENAMES;
                else
                    v->rename(v, old, d->out);
            }
        }
    }
    if (how == SWAP_NONE)
        return st_fail(out_code(-e), "cannot put the exported files in place of '%s': %s",
                       d->out, strerror(-e));
    /* OUT's entry in its parent: the swap lasts once this is on disk */
    if ((e = v->sync_dir(v, d->parent)) != 0) {
        unswap(d, how, old);
        return st_fail(out_code(-e),
                       "fsync of '%s' (after putting the export in place of '%s'): %s; the "
                       "previous content is back",
                       d->parent, d->out, strerror(-e));
    }
    return 0;
}

void st_exdir_end(st_exdir *d)
{
    if (!d->v)
        return;
    remove_stage(d->v, d->out, d->stage);
    if (d->lock)
        d->v->close(d->lock);
    st_vfs_release(d->v);
    d->v = NULL;
    d->lock = NULL;
}
