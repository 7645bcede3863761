/* retain.c - what is at a path (strata_probe), the subdirectories of a directory
 * (strata_list_dirs), and collecting checkpoints: removing an incomplete one, retention in
 * a directory of checkpoints. Each removal owns the
 * checkpoint (own.c) while it runs. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "engine.h"

static int probe(const st_vfs *v, const char *uri, const char *path, strata_probe_info *out,
                 st_commit *commit);

/* strata_probe, and the commit record of a committed checkpoint (commit may be NULL;
 * zeroed if not committed). */
static int probe_uri(const char *uri, strata_probe_info *out, st_commit *commit)
{
    memset(out, 0, sizeof *out);
    if (commit)
        memset(commit, 0, sizeof *commit);
    const st_vfs *v;
    char path[PATH_MAX];
    int rc = st_vfs_resolve(uri, &v, path, sizeof path);
    if (rc)
        return rc;
    rc = probe(v, uri, path, out, commit);
    st_vfs_release(v);
    return rc;
}

int strata_probe(strata_probe_info *out, const char *uri) { return probe_uri(uri, out, NULL); }

int strata_uri_path(char *out, size_t cap, const char *uri)
{
    const st_vfs *v;
    char path[PATH_MAX];
    int rc = st_vfs_resolve(uri, &v, path, sizeof path);
    if (rc)
        return rc;
    st_vfs_release(v);
    size_t n = strlen(path);
    if (!out || n >= cap)
        return st_fail(STRATA_EINVAL, "%s: its path (%zu bytes) does not fit in %zu", uri, n, cap);
    memcpy(out, path, n + 1);
    return 0;
}

static int probe(const st_vfs *v, const char *uri, const char *path, strata_probe_info *out,
                 st_commit *commit)
{
    int rc;
    int kind;
    int e = v->stat(v, path, NULL, &kind);
    if (e)
        return st_fail(st_from_errno(-e), "'%s': %s", path, strerror(-e));
    if (kind != 1)
        return 0;
    int ns = 0;
    if ((rc = st_scan_dir(v, path, 0, &ns, NULL, &out->disk_bytes)))
        return rc;
    out->is_ckpt = ns > 0;
    if (!ns)
        return 0;
    char p[PATH_MAX];
    if ((rc = st_path_join(p, path, ST_COMMIT_FILE)))
        return rc;
    out->has_commit = v->stat(v, p, NULL, NULL) == 0;
    st_dir d;
    if (st_dir_open(&d, uri, 1) == 0) {
        out->committed = d.committed;
        out->has_metadata = 1;
        out->step = d.meta->step;
        if (commit && d.committed)
            *commit = d.commit;
        st_dir_close(&d);
    }
    st_clear_error();
    return 0;
}

/* How remove_ckpt treats a commit record: */
enum {
    RM_INCOMPLETE, /* only without one */
    RM_SEEN,       /* only the very one probed (seen), still there under the lock */
    RM_ANY,        /* whatever is there: what a replacing save left beside its target */
};

static int remove_ckpt(const st_vfs *v, const char *path, int how, const st_commit *seen);

int strata_remove_incomplete(const char *uri)
{
    const st_vfs *v;
    char path[PATH_MAX];
    int rc = st_vfs_resolve(uri, &v, path, sizeof path);
    if (rc)
        return rc;
    const char *slash = strrchr(path, '/');
    rc = remove_ckpt(v, path, st_is_replace_sibling(slash ? slash + 1 : path) ? RM_ANY
                                                                               : RM_INCOMPLETE,
                     NULL);
    st_vfs_release(v);
    return rc;
}


/* Is the commit record at dir the one seen (every field)? */
static int same_commit(const st_vfs *v, const char *dir, const st_commit *seen)
{
    char p[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    st_commit now;
    int same = st_path_join(p, dir, ST_COMMIT_FILE) == 0 &&
               st_vfs_read_all(v, p, 4096, 0, &buf, &len) == 0 &&
               st_commit_decode(&now, buf, len) == 0 && st_commit_same(&now, seen);
    free(buf);
    return same;
}

/* Takes ownership of the checkpoint at path (never one a live save owns: STRATA_EBUSY)
 * and removes it, as `how` allows. */
static int remove_ckpt(const st_vfs *v, const char *path, int how, const st_commit *seen)
{
    int kind, strata = 0;
    int e = v->stat(v, path, NULL, &kind), rc;
    if (e)
        return st_fail(st_from_errno(-e), "'%s': %s", path, strerror(-e));
    if (kind != 1)
        return st_fail(STRATA_EINVAL, "'%s' is not a directory (symlinks are not followed)", path);
    if ((rc = st_scan_dir(v, path, 0, &strata, NULL, NULL)))
        return rc;
    if (!strata) { /* nothing of strata's: nothing to remove (but an empty replace leftover) */
        if (how == RM_ANY)
            v->rmdir(v, path);
        return 0;
    }
    st_file *lock;
    if ((rc = st_own(v, path, 0, &lock)))
        return rc;
    char p[PATH_MAX];
    int committed = st_path_join(p, path, ST_COMMIT_FILE) == 0 && v->stat(v, p, NULL, NULL) == 0;
    /* under the lock, still the checkpoint that was probed? (another collector may have
     * removed it and a save committed a new one under the same name meanwhile) */
    if (how == RM_SEEN && !same_commit(v, path, seen))
        rc = st_fail(STRATA_ENOENT, "'%s' is not the checkpoint probed any more (removed or "
                     "replaced meanwhile); left alone", path);
    if (!rc)
        rc = st_remove_owned(v, path, how == RM_INCOMPLETE ? 0 : committed);
    st_own_release(v, lock);
    return rc;
}

/* ---- the subdirectories of a directory (ls, gc) ---- */

int strata_list_dirs(const char *dir_uri, strata_dir_cb fn, void *ctx)
{
    st_clear_error();
    if (!dir_uri || !fn)
        return st_fail(STRATA_EINVAL, "strata_list_dirs: %s is NULL", dir_uri ? "fn" : "dir_uri");
    const st_vfs *v;
    char path[PATH_MAX];
    int rc = st_vfs_resolve(dir_uri, &v, path, sizeof path);
    if (rc)
        return rc;
    st_dirlist l;
    int e = st_dirlist_read(v, path, &l);
    st_vfs_release(v);
    if (e == -ENOMEM)
        return st_fail(STRATA_ENOMEM, "out of memory listing '%s'", path);
    if (e)
        return st_fail(st_from_errno(-e), "cannot list '%s': %s", path, strerror(-e));
    size_t n = strlen(dir_uri);
    while (n > 1 && dir_uri[n - 1] == '/')
        n--;
    for (size_t i = 0; i < l.n && !rc; i++) {
        if (l.e[i].kind != 1)
            continue;
        char *child;
        if (asprintf(&child, "%.*s/%s", (int)n, dir_uri, l.e[i].name) < 0)
            rc = st_fail(STRATA_ENOMEM, "out of memory");
        else if (fn(ctx, child) != 0)
            rc = st_fail(STRATA_EABORTED, "strata_list_dirs: stopped by its callback");
        if (rc != STRATA_ENOMEM)
            free(child);
    }
    st_dirlist_free(&l);
    return rc;
}

/* ---- retention ---- */

void (*st_retain_test_hook)(const char *dir);

typedef struct {
    char name[256];
    int committed, has_commit, sibling;
    uint64_t time;
    st_commit seen; /* the commit record probed */
} entry_t;

typedef struct {
    entry_t *e;
    size_t n, cap;
} entries;

static int collect_dir(void *p, const char *name, uint64_t size, int kind)
{
    (void)size;
    entries *es = p;
    if (kind != 1 || strlen(name) >= sizeof es->e[0].name)
        return ST_LIST_NEXT;
    if (st_grow(&es->e, &es->cap, es->n + 1, sizeof *es->e))
        return ST_LIST_STOP;
    memset(&es->e[es->n], 0, sizeof es->e[es->n]);
    snprintf(es->e[es->n].name, sizeof es->e[0].name, "%s", name);
    es->e[es->n++].sibling = st_is_replace_sibling(name);
    return ST_LIST_NEXT;
}

static int cmp_newest_first(const void *a, const void *b)
{
    const entry_t *x = a, *y = b;
    return (x->time < y->time) - (x->time > y->time);
}

int strata_retain(int *removed, const char *dir_uri, int keep)
{
    return strata_retain_report(removed, dir_uri, keep, NULL, NULL);
}

int strata_retain_report(int *removed, const char *dir_uri, int keep, strata_skip_cb skipped,
                         void *ctx)
{
    if (removed)
        *removed = 0;
    if (keep < 0)
        return st_fail(STRATA_EINVAL, "keep must be 0 or more, not %d", keep);
    const st_vfs *v;
    char dir[PATH_MAX];
    int rc = st_vfs_resolve(dir_uri, &v, dir, sizeof dir);
    if (rc)
        return rc;
    entries es = {0};
    int e = v->list(v, dir, collect_dir, &es);
    if (e)
        rc = st_fail(st_from_errno(-e), "cannot list '%s': %s", dir, strerror(-e));
    for (size_t i = 0; i < es.n && !rc; i++) {
        char p[PATH_MAX];
        if (es.e[i].sibling || st_path_join(p, dir, es.e[i].name))
            continue;
        strata_probe_info pi;
        if (probe_uri(p, &pi, &es.e[i].seen) || !pi.is_ckpt) {
            es.e[i].has_commit = 1; /* not ours: never touched */
            continue;
        }
        es.e[i].has_commit = pi.has_commit;
        es.e[i].committed = pi.committed;
        if (pi.committed) {
            es.e[i].time = es.e[i].seen.time_ns;
        } else if (v->mtime(v, p, &es.e[i].time)) {
            es.e[i].time = UINT64_MAX; /* unknown: treat as new, keep */
        }
    }
    if (es.n) /* qsort of NULL is undefined, even of 0 entries */
        qsort(es.e, es.n, sizeof *es.e, cmp_newest_first);
    if (st_retain_test_hook && !rc)
        st_retain_test_hook(dir);
    int kept = 0, count = 0;
    for (size_t i = 0; i < es.n && !rc; i++) {
        char p[PATH_MAX];
        if (st_path_join(p, dir, es.e[i].name))
            continue;
        if (es.e[i].sibling) {
            rc = remove_ckpt(v, p, RM_ANY, NULL); /* left by a replace that died */
        } else if (es.e[i].committed) {
            if (kept++ < keep)
                continue;
            rc = remove_ckpt(v, p, RM_SEEN, &es.e[i].seen);
        } else if (!es.e[i].has_commit) {
            rc = remove_ckpt(v, p, RM_INCOMPLETE, NULL); /* unless a live save owns it */
        } else {
            continue; /* corrupt: kept for a person to look at */
        }
        if (rc == STRATA_EBUSY || rc == STRATA_EEXIST || rc == STRATA_ENOENT ||
            rc == STRATA_EINVAL) {
            /* owned by a live save, committed, removed or changed meanwhile, or its LOCK is
             * not a lock file: that one is left, the others are collected */
            if (skipped)
                skipped(ctx, p, rc, strata_error_last());
            rc = 0;
            continue;
        }
        count += rc == 0;
    }
    free(es.e);
    st_vfs_release(v);
    if (removed)
        *removed = count;
    return rc;
}
