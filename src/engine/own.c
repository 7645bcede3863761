/* own.c - one owner per checkpoint directory (docs/FORMAT.md, Ownership): making it, its
 * LOCK, its commit (metadata.bin and the commit record), letting go after a commit or a
 * failure (never removing a commit record another save wrote), and the atomic replace of a
 * committed checkpoint (STRATA_SAVE_REPLACE: the new one is written beside it, then the two
 * directories are exchanged); and strata's files in a directory, counted or removed, which
 * the collector (retain.c) counts too. Threading: called
 * on a save's or collector's own thread; no state is shared but the file system's. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "engine.h"

/* ---- strata's files in a directory (st_is_strata_file, meta.h), counted or removed ---- */

typedef struct {
    int strata, foreign, unlink;
    uint64_t bytes;
    const st_save_plan *keep; /* with unlink: the data files of this plan stay */
} scan_ctx;

/* Is name a data file of sp (data-<writer rank>.bin) or a base's file it links? */
static int in_plan(const st_save_plan *sp, const char *name)
{
    for (uint32_t f = 0; st_is_ref_file(name) && f < sp->meta->nfiles; f++)
        if (st_file_linked(sp->meta, f) && strcmp(sp->meta->files[f].name, name) == 0)
            return 1;
    long r = st_data_file_rank(name);
    if (r < 0 || r >= sp->nranks || sp->writer_file[r] < 0)
        return 0;
    return strcmp(sp->meta->files[sp->writer_file[r]].name, name) == 0;
}

static int scan_one(void *p, const char *name, uint64_t size, int kind)
{
    scan_ctx *c = p;
    if (!st_is_strata_file(name) || kind != 0) {
        c->foreign++; /* symlinks and directories with our names are not ours */
        return ST_LIST_NEXT;
    }
    c->strata++;
    c->bytes += size;
    /* the lock file is the owner's: removed only by st_remove_failed and the collector,
     * after everything else */
    int keep = strcmp(name, ST_LOCK_FILE) == 0 || (c->keep && in_plan(c->keep, name));
    return c->unlink && !keep ? ST_LIST_REMOVE : ST_LIST_NEXT;
}

int st_scan_dir(const st_vfs *v, const char *dir, int unlink, int *strata, int *foreign,
                uint64_t *bytes)
{
    scan_ctx c = {.unlink = unlink};
    int e = v->list(v, dir, scan_one, &c);
    if (e)
        return st_fail(st_from_errno(-e), "cannot %s '%s': %s",
                       unlink ? "remove the files in" : "list", dir, strerror(-e));
    if (strata)
        *strata = c.strata;
    if (foreign)
        *foreign = c.foreign;
    if (bytes)
        *bytes = c.bytes;
    return 0;
}

int st_scan_dir_keep(const st_vfs *v, const char *dir, const st_save_plan *keep)
{
    scan_ctx c = {.unlink = 1, .keep = keep};
    int e = v->list(v, dir, scan_one, &c);
    return e ? st_fail(st_from_errno(-e), "cannot clear stale files in '%s': %s", dir,
                       strerror(-e))
             : 0;
}

/* ---- the owner ---- */

uint64_t st_save_id_new(void)
{
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) { /* no entropy source: mix */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        static _Atomic uint64_t seq;
        id = st_mix64((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                      ((uint64_t)getpid() << 12) ^ (seq++ << 48));
    }
    return id ? id : 1; /* 0 means "no id" (a version 1 commit record) */
}

void st_parent_of(char *out, const char *path)
{
    snprintf(out, PATH_MAX, "%s", path);
    char *slash = strrchr(out, '/');
    if (!slash)
        strcpy(out, ".");
    else if (slash == out)
        out[1] = 0;
    else
        *slash = 0;
}

/* mkdir -p of dir's parents. Each directory made is fsynced into its own parent, so that
 * a power loss cannot take it (and the checkpoint that will be committed below it) away;
 * the checkpoint directory's own entry is made durable by its commit. */
static int make_parents(const st_vfs *v, const char *dir)
{
    char p[PATH_MAX], pp[PATH_MAX];
    st_parent_of(p, dir);
    int kind;
    if (strcmp(p, dir) == 0 || v->stat(v, p, NULL, &kind) == 0)
        return 0;
    int rc = make_parents(v, p);
    if (rc)
        return rc;
    int e = v->mkdir(v, p);
    if (e == -EEXIST)
        return 0;
    st_parent_of(pp, p);
    if (e == 0 && (e = v->sync_dir(v, pp)) != 0)
        return st_fail(st_from_errno(-e), "syncing directory '%s' after creating '%s' in it: %s",
                       pp, p, strerror(-e));
    if (e)
        return st_fail(st_from_errno(-e), "cannot create directory '%s': %s", p, strerror(-e));
    return 0;
}

static int refuse_committed(const char *dir)
{
    return st_fail(STRATA_EEXIST,
                   "'%s' already holds a committed checkpoint; it is never overwritten (to "
                   "replace it atomically, save with STRATA_SAVE_REPLACE)",
                   dir);
}

static int has_commit(const st_vfs *v, const char *dir)
{
    char p[PATH_MAX];
    return st_path_join(p, dir, ST_COMMIT_FILE) == 0 && v->stat(v, p, NULL, NULL) == 0;
}

/* Creates dir (and its parents) if missing; refuses a non-directory, and (unless
 * committed_ok) a committed checkpoint there (STRATA_EEXIST). */
static int make_dir(const st_vfs *v, const char *dir, int committed_ok)
{
    int rc = make_parents(v, dir);
    if (rc)
        return rc;
    int e = v->mkdir(v, dir), kind;
    if (e == 0)
        return 0;
    if (e != -EEXIST)
        return st_fail(st_from_errno(-e), "cannot create checkpoint directory '%s': %s", dir,
                       strerror(-e));
    if ((e = v->stat(v, dir, NULL, &kind)) != 0 || kind != 1)
        return st_fail(STRATA_EEXIST, "'%s' exists and is not a directory", dir);
    return !committed_ok && has_commit(v, dir) ? refuse_committed(dir) : 0;
}

int st_prepare_shared(const st_vfs *v, const char *dir) { return make_dir(v, dir, 0); }

/* A second lock on the lock file, taken while ours is held, must be refused: where it is
 * granted, the file system's locks do not exclude (NFS mounted nolock, some FUSE file
 * systems), and two owners could act on one directory. */
static int check_excludes(const st_vfs *v, const char *dir, const char *lockpath)
{
    st_file *again;
    if (v->lock(v, lockpath, &again) != 0)
        return 0; /* -EBUSY: it excludes (any other failure is no proof that it does not) */
    v->close(again);
    return st_fail(STRATA_ENOTSUP,
                   "the file system holding '%s' grants two locks on %s at once: its locks "
                   "do not exclude (NFS mounted nolock, some FUSE file systems), so two saves "
                   "or a save and a collector could act there together; strata does not "
                   "write or remove anything there",
                   dir, lockpath);
}

int st_own(const st_vfs *v, const char *dir, int mode, st_file **lock)
{
    *lock = NULL;
    char p[PATH_MAX];
    int rc = st_path_join(p, dir, ST_LOCK_FILE);
    for (int tries = 0; !rc; tries++) {
        if (mode && (rc = make_dir(v, dir, mode == ST_OWN_REPLACE)))
            return rc;
        int e = v->lock(v, p, lock);
        if (e == -ENOENT && mode && tries < 64) {
            /* a collector removed the (still empty) directory meanwhile: make it again,
             * after a pause growing to 10 ms from the third try on, so that a collector
             * looping without pause cannot keep hitting the gap between mkdir and lock
             * (8 quick tries were once all lost to one) */
            if (tries >= 2) {
                long us = 100L << (tries - 2 < 7 ? tries - 2 : 7);
                struct timespec ts = {0, (us < 10000 ? us : 10000) * 1000};
                nanosleep(&ts, NULL);
            }
            continue;
        }
        if (e == -EBUSY)
            return st_fail(STRATA_EBUSY, "'%s' is owned by another save or collector (%s is "
                           "locked); nothing was touched", dir, ST_LOCK_FILE);
        if (e == -ELOOP || e == -ST_ENOTREG || e == -EISDIR || e == -ENXIO)
            return st_fail(STRATA_EINVAL, "'%s' is not a lock file strata made (a symlink, "
                           "FIFO, socket or directory in its place): nothing was touched in "
                           "'%s'; remove it by hand if the directory is strata's", p, dir);
        if (e)
            return st_fail(st_from_errno(-e), "cannot lock '%s': %s", p, strerror(-e));
        break;
    }
    if (!rc)
        rc = check_excludes(v, dir, p);
    /* committed between make_dir's look and the lock: the committing save has let go */
    if (!rc && mode == ST_OWN_NEW && has_commit(v, dir))
        rc = refuse_committed(dir);
    if (rc) {
        st_own_release(v, *lock);
        *lock = NULL;
    }
    return rc;
}

void st_own_release(const st_vfs *v, st_file *lock)
{
    if (lock)
        v->close(lock);
}

void st_own_committed(const st_vfs *v, const char *dir, st_file *lock)
{
    char p[PATH_MAX];
    if (lock && st_path_join(p, dir, ST_LOCK_FILE) == 0)
        v->unlink(v, p); /* a save that opened it meanwhile finds it gone, then the commit */
    st_own_release(v, lock);
}

int st_prepare_dir(const st_vfs *v, const char *dir, st_file **lock)
{
    int rc = st_own(v, dir, ST_OWN_NEW, lock);
    if (rc)
        return rc;
    int foreign = 0, ours = 0;
    char p[PATH_MAX];
    if (!(rc = st_scan_dir(v, dir, 0, &ours, &foreign, NULL)) && foreign) {
        rc = st_fail(STRATA_EEXIST,
                     "'%s' is not empty and holds files that are not strata's; refusing to "
                     "save there",
                     dir);
        if (st_path_join(p, dir, ST_LOCK_FILE) == 0)
            v->unlink(v, p); /* held by us: a user's directory keeps nothing of this save */
    }
    if (!rc) /* an incomplete save: replace it (the lock file stays) */
        rc = st_scan_dir(v, dir, 1, NULL, NULL, NULL);
    if (rc) {
        st_own_release(v, *lock);
        *lock = NULL;
    }
    return rc;
}

int st_uncommit(const st_vfs *v, const char *dir, uint64_t save_id)
{
    /* the commit record goes first (and durably), so that a crash during the cleanup
     * leaves an incomplete checkpoint, never a "committed" one with files missing; only
     * this save's own: where locks do not exclude, another save may have committed here */
    char p[PATH_MAX];
    if (st_path_join(p, dir, ST_COMMIT_FILE) || v->stat(v, p, NULL, NULL) != 0)
        return 0;
    unsigned char *buf = NULL;
    size_t len = 0;
    st_commit c;
    int ours = st_vfs_read_all(v, p, 4096, 0, &buf, &len) == 0 &&
               st_commit_decode(&c, buf, len) == 0 && c.save_id == save_id;
    free(buf);
    if (!ours)
        return 1;
    if (v->unlink(v, p) == 0)
        v->sync_dir(v, dir);
    return 0;
}

void st_remove_failed(const st_vfs *v, const char *dir, int rmdir, uint64_t save_id)
{
    /* the error message is kept: cleanup failures are not the story */
    char msg[ST_ERR_BYTES], p[PATH_MAX];
    st_err_keep(msg, ST_ERR_ALWAYS);
    if (st_uncommit(v, dir, save_id) == 0) { /* else another save's: nothing is touched */
        st_scan_dir(v, dir, 1, NULL, NULL, NULL);
        if (rmdir && st_path_join(p, dir, ST_LOCK_FILE) == 0) {
            v->unlink(v, p); /* still held by us: a save waiting on it finds it gone, retries */
            v->rmdir(v, dir);
        }
    }
    st_err_restore(0, msg);
}

/* ---- atomic replace (STRATA_SAVE_REPLACE) ---- */

int st_replace_sibling(char *out, const char *path)
{
    char parent[PATH_MAX];
    st_parent_of(parent, path);
    const char *slash = strrchr(path, '/'), *name = slash ? slash + 1 : path;
    int n = snprintf(out, PATH_MAX, "%s/.%s%s", parent, name, ST_REPLACE_SUFFIX);
    if (n < 0 || n >= PATH_MAX || strlen(name) + 1 + strlen(ST_REPLACE_SUFFIX) > 255)
        return st_fail(STRATA_EINVAL, "'%s': its name is too long for the directory a "
                       "replacing save writes beside it", path);
    return 0;
}

int st_is_replace_sibling(const char *name)
{
    size_t n = strlen(name), k = strlen(ST_REPLACE_SUFFIX);
    return n > k + 1 && name[0] == '.' && strcmp(name + n - k, ST_REPLACE_SUFFIX) == 0;
}

/* Can the file system of dir (owned, freshly cleared) exchange two entries atomically?
 * Two empty files with names of strata's temporary files (so that a crash leaves nothing
 * but what any cleanup removes) are made, swapped and removed. */
static int check_exchange(const st_vfs *v, const char *dir)
{
    if (strcmp(v->scheme, "s3") == 0)
        return st_fail(STRATA_ENOTSUP,
                       "'%s': object storage has no atomic rename of a prefix, which a "
                       "replacing save (replace=True, STRATA_SAVE_REPLACE) needs so that the "
                       "path always holds a committed checkpoint; nothing was written: on "
                       "s3:// save each version to a new prefix (step-N, as the "
                       "CheckpointManager does) and load the newest committed one",
                       dir);
    char a[PATH_MAX], b[PATH_MAX];
    int rc = st_path_join(a, dir, ST_COMMIT_FILE ".tmp");
    if (!rc)
        rc = st_path_join(b, dir, ST_META_FILE ".tmp");
    if (rc)
        return rc;
    st_file *f;
    int e = v->open(v, a, ST_O_WRITE, &f);
    if (e == 0 && (e = v->close(f)) == 0 && (e = v->open(v, b, ST_O_WRITE, &f)) == 0 &&
        (e = v->close(f)) == 0)
        e = v->exchange ? v->exchange(v, a, b) : -EOPNOTSUPP;
    v->unlink(v, a);
    v->unlink(v, b);
    if (e == -EINVAL || e == -ENOSYS || e == -EOPNOTSUPP)
        return st_fail(STRATA_ENOTSUP,
                       "the file system holding '%s' cannot exchange two directories "
                       "atomically (renameat2 RENAME_EXCHANGE: %s), which a replacing save "
                       "needs so that the path always holds a committed checkpoint; nothing "
                       "was written: save to a new path instead",
                       dir, strerror(-e));
    if (e)
        return st_fail(st_from_errno(-e), "'%s': cannot check that entries can be exchanged "
                       "there: %s", dir, strerror(-e));
    return 0;
}

/* Lets go of a replace's target: removes the LOCK file made there (and the target itself
 * if the replace made it and it is still empty). */
static void release_final(const st_vfs *v, const char *final, st_file *lock)
{
    char p[PATH_MAX];
    if (!lock)
        return;
    if (st_path_join(p, final, ST_LOCK_FILE) == 0)
        v->unlink(v, p);
    if (!has_commit(v, final))
        v->rmdir(v, final); /* fails unless empty */
    st_own_release(v, lock);
}

typedef struct {
    int strata, foreign, kind;
    char name[256]; /* the first entry that is not strata's */
} target_scan;

static int scan_target(void *p, const char *name, uint64_t size, int kind)
{
    (void)size;
    target_scan *c = p;
    if (st_is_strata_file(name) && kind == 0) {
        c->strata++;
    } else if (!c->foreign++) {
        snprintf(c->name, sizeof c->name, "%s", name);
        c->kind = kind;
    }
    return ST_LIST_NEXT;
}

static const char *kind_name(int kind)
{
    return kind == 0 ? "a file" : kind == 1 ? "a directory" : kind == 2 ? "a symlink"
                                                                      : "a special file";
}

/* May a replace take path? What a plain save takes (nothing, an empty directory, an
 * incomplete checkpoint) and what it refuses only for being a committed checkpoint; never
 * a file, a symlink, or a directory holding anything strata does not write there (a
 * user's files, a run directory of checkpoints, another format's checkpoint), which the
 * exchange would hide beside the path: STRATA_ENOTCKPT naming what is there. */
static int check_replaceable(const st_vfs *v, const char *path)
{
    static const char tail[] = "; a replacing save (STRATA_SAVE_REPLACE, replace=True) "
                               "replaces only a strata checkpoint: nothing was touched";
    int kind, e = v->stat(v, path, NULL, &kind);
    if (e == -ENOENT)
        return 0;
    if (e)
        return st_fail(st_from_errno(-e), "'%s': %s", path, strerror(-e));
    if (kind != 1)
        return st_fail(STRATA_ENOTCKPT, "'%s' is %s, not a directory%s", path,
                       kind == 2 ? "a symlink (never followed)" : kind_name(kind), tail);
    target_scan c = {0};
    if ((e = v->list(v, path, scan_target, &c)) != 0)
        return st_fail(st_from_errno(-e), "cannot list '%s': %s", path, strerror(-e));
    if (!c.foreign)
        return 0;
    if (c.strata)
        return st_fail(STRATA_ENOTCKPT, "'%s' holds a checkpoint's files and %d entr%s strata "
                       "does not write there (such as '%s', %s)%s", path, c.foreign,
                       c.foreign == 1 ? "y" : "ies", c.name, kind_name(c.kind), tail);
    char what[ST_ERR_BYTES];
    st_survey(v, path, 1); /* says what the directory is */
    st_err_keep(what, ST_ERR_ALWAYS);
    return st_fail(STRATA_ENOTCKPT, "refusing to replace: %s%s", what, tail);
}

/* The name a replace writes beside its target is strata's: anything there but a
 * directory (a link planted to another checkpoint) is refused, never followed. */
static int check_sibling(const st_vfs *v, const char *sib)
{
    int kind, e = v->stat(v, sib, NULL, &kind);
    if (e == -ENOENT || (e == 0 && kind == 1))
        return 0;
    if (e)
        return st_fail(st_from_errno(-e), "'%s': %s", sib, strerror(-e));
    return st_fail(STRATA_EINVAL, "'%s' is %s, not the directory a replacing save writes "
                   "there: it is never followed, and nothing was touched; remove it by hand",
                   sib, kind_name(kind));
}

/* Owns the directory beside a replace's target (made if missing), cleared of what a dead
 * replace of the same target left there; looked at before each of its locks is taken and
 * after, so that a link swapped in between is never acted through. */
static int own_sibling(const st_vfs *v, const char *sib, int prepare, st_file **lock)
{
    int rc = check_sibling(v, sib);
    if (!rc && has_commit(v, sib)) {
        st_file *old;
        if (!(rc = st_own(v, sib, 0, &old))) {
            if (!(rc = check_sibling(v, sib)))
                rc = st_remove_owned(v, sib, 1);
            st_own_release(v, old);
        }
    }
    if (!rc)
        rc = prepare ? st_prepare_dir(v, sib, lock) : st_own(v, sib, ST_OWN_NEW, lock);
    if (!rc && (rc = check_sibling(v, sib))) {
        st_own_release(v, *lock);
        *lock = NULL;
    }
    return rc;
}

int st_dest_own(st_dests *d, int t, int prepare, st_file **lock)
{
    const st_vfs *v = d->vfs[t];
    *lock = NULL;
    if (!d->replace)
        return prepare ? st_prepare_dir(v, d->dir[t], lock)
                       : st_own(v, d->dir[t], ST_OWN_NEW, lock);
    /* the target first (made if missing; a checkpoint, committed or not, and nothing
     * else: looked at before its lock is taken, so that nothing else gets a LOCK, and
     * again under it), then the directory beside it */
    int rc = check_replaceable(v, d->final[t]);
    if (rc)
        return rc;
    if ((rc = st_own(v, d->final[t], ST_OWN_REPLACE, &d->final_lock[t])))
        return rc;
    if (!(rc = check_replaceable(v, d->final[t])))
        rc = own_sibling(v, d->dir[t], prepare, lock);
    if (!rc && (rc = check_exchange(v, d->dir[t]))) {
        st_remove_failed(v, d->dir[t], 1, 0);
        st_own_release(v, *lock);
        *lock = NULL;
    }
    if (rc) {
        release_final(v, d->final[t], d->final_lock[t]);
        d->final_lock[t] = NULL;
    }
    return rc;
}

/* After the commit of the directory beside the target: exchanges the two, makes that
 * durable, then removes the previous checkpoint (now beside) as its owner. */
static int replace_swap(st_dests *d, int t, st_file *lock, int sync)
{
    const st_vfs *v = d->vfs[t];
    const char *sib = d->dir[t], *final = d->final[t];
    char parent[PATH_MAX];
    int e = v->exchange ? v->exchange(v, sib, final) : -EOPNOTSUPP;
    if (e)
        return st_fail(e == -EINVAL || e == -ENOSYS || e == -EOPNOTSUPP ? STRATA_ENOTSUP
                                                                        : st_from_errno(-e),
                       "exchanging '%s' with '%s': %s; '%s' still holds the previous "
                       "checkpoint", sib, final, strerror(-e), final);
    st_parent_of(parent, final);
    e = sync ? v->sync_dir(v, parent) : 0;
    /* the previous checkpoint (or the empty directory made for the replace) is now beside
     * the target, locked by final_lock; the new one at the target, locked by lock */
    st_remove_owned(v, sib, has_commit(v, sib));
    st_own_release(v, d->final_lock[t]);
    d->final_lock[t] = NULL;
    st_own_committed(v, final, lock);
    if (e)
        return st_fail(st_from_errno(-e), "'%s' holds the new checkpoint, but syncing its "
                       "directory '%s' failed: %s", final, parent, strerror(-e));
    return 0;
}

int st_dest_commit(st_dests *d, int t, const st_meta *m, int sync, uint64_t save_id,
                   st_file **lock)
{
    int rc = st_commit_dir(d->vfs[t], d->dir[t], m, sync, save_id);
    if (rc)
        return rc;
    if (d->replace) {
        rc = replace_swap(d, t, *lock, sync);
        if (rc && d->final_lock[t]) /* not exchanged: the caller removes what it wrote */
            return rc;
    } else {
        st_own_committed(d->vfs[t], d->dir[t], *lock);
    }
    *lock = NULL;
    return rc;
}

void st_dest_abandon(st_dests *d, int t, st_file **lock)
{
    const st_vfs *v = d->vfs[t];
    char p[PATH_MAX];
    if (*lock && st_path_join(p, d->dir[t], ST_LOCK_FILE) == 0)
        v->unlink(v, p);
    if (*lock && d->replace)
        v->rmdir(v, d->dir[t]);
    st_own_release(v, *lock);
    *lock = NULL;
    release_final(v, d->final[t], d->final_lock[t]);
    d->final_lock[t] = NULL;
}

void st_dests_release_final(st_dests *d)
{
    for (int t = 0; t < d->n; t++) {
        release_final(d->vfs[t], d->final[t], d->final_lock[t]);
        d->final_lock[t] = NULL;
    }
}

int st_clear_stale(const st_vfs *v, const char *dir, const st_save_plan *sp)
{
    char p[PATH_MAX];
    int rc = st_path_join(p, dir, ST_COMMIT_FILE);
    if (!rc && v->stat(v, p, NULL, NULL) == 0)
        rc = st_fail(STRATA_EEXIST,
                     "'%s' already holds a committed checkpoint; it is never overwritten", dir);
    int foreign = 0;
    if (!rc && !(rc = st_scan_dir(v, dir, 0, NULL, &foreign, NULL)) && foreign)
        rc = st_fail(STRATA_EEXIST,
                     "'%s' holds files that are not strata's; refusing to commit there", dir);
    if (rc)
        return rc;
    return st_scan_dir_keep(v, dir, sp);
}

int st_remove_owned(const st_vfs *v, const char *path, int committed)
{
    char p[PATH_MAX];
    int rc = st_path_join(p, path, ST_COMMIT_FILE), e;
    if (rc)
        return rc;
    if (committed) {
        if ((e = v->unlink(v, p)) != 0)
            return st_fail(st_from_errno(-e), "cannot remove '%s': %s", p, strerror(-e));
        v->sync_dir(v, path);
    } else if (v->stat(v, p, NULL, NULL) == 0) {
        return st_fail(STRATA_EEXIST,
                       "'%s' has a commit record: it is not removed as incomplete", path);
    }
    int foreign = 0;
    if ((rc = st_scan_dir(v, path, 1, NULL, &foreign, NULL)))
        return rc;
    if ((rc = st_path_join(p, path, ST_LOCK_FILE)))
        return rc;
    v->unlink(v, p); /* still locked by us: a save that opened it meanwhile retries */
    if (!foreign && (e = v->rmdir(v, path)) != 0 && e != -ENOENT)
        return st_fail(st_from_errno(-e), "cannot remove '%s': %s", path, strerror(-e));
    return 0;
}

/* ---- the commit ---- */

int st_write_new(const st_vfs *v, const char *dir, const char *name, const void *buf,
                 size_t n, int sync)
{
    char tmp[PATH_MAX], to[PATH_MAX], tname[64];
    snprintf(tname, sizeof tname, "%s.tmp", name);
    int rc = st_path_join(tmp, dir, tname);
    if (!rc)
        rc = st_path_join(to, dir, name);
    if (rc)
        return rc;
    st_file *f;
    int e = v->open(v, tmp, ST_O_WRITE, &f);
    if (e == 0) {
        e = st_vfs_write_full(v, f, buf, n, 0);
        if (e == 0 && sync)
            e = v->sync(f);
        int ce = v->close(f);
        if (e == 0)
            e = ce;
    }
    if (e) {
        int rc2 = st_fail(st_from_errno(-e), "writing '%s': %s", tmp, strerror(-e));
        v->unlink(v, tmp);
        return rc2;
    }
    if ((e = v->rename(v, tmp, to)) == 0)
        return 0;
    v->unlink(v, tmp);
    if (e == -EEXIST)
        return st_fail(STRATA_EEXIST, "committing '%s': %s appeared meanwhile: another save "
                       "wrote there at the same time (the file system's locks did not keep "
                       "it out); its files are left alone",
                       dir, name);
    return st_fail(st_from_errno(-e), "committing '%s': renaming %s: %s", dir, tname,
                   strerror(-e));
}

int st_commit_dir(const st_vfs *v, const char *dir, const st_meta *m, int sync,
                  uint64_t save_id)
{
    unsigned char *mbuf;
    size_t mlen;
    int rc = st_meta_encode(m, &mbuf, &mlen);
    if (rc)
        return rc;
    rc = st_write_new(v, dir, ST_META_FILE, mbuf, mlen, sync);
    st_commit c = {.version = ST_COMMIT_VERSION, .step = m->step, .meta_size = mlen,
                   .meta_hash = st_hash(mbuf, mlen), .data_bytes = m->data_bytes,
                   .save_id = save_id};
    free(mbuf);
    if (rc)
        return rc;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    c.time_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    unsigned char rec[ST_COMMIT_SIZE];
    size_t rlen = st_commit_encode(&c, rec);
    if ((rc = st_write_new(v, dir, ST_COMMIT_FILE, rec, rlen, sync)))
        return rc;
    int e = sync ? v->sync_dir(v, dir) : 0;
    if (e == 0 && sync) { /* the checkpoint directory's own entry */
        char parent[PATH_MAX];
        st_parent_of(parent, dir);
        e = v->sync_dir(v, parent);
    }
    if (e)
        return st_fail(st_from_errno(-e), "committing '%s': %s", dir, strerror(-e));
    return 0;
}
