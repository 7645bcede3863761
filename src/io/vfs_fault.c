/* vfs_fault.c - a fault-injecting wrapper around any backend (after SQLite's test_vfs.c):
 * fails the N-th call of one operation with a chosen errno, or makes the N-th write short
 * (and the retry fail), or kills the process there (SIGKILL: a rank dying mid-load). Selected by URI: fault+file:///p?op=fsync&n=3&errno=ENOSPC.
 * Thread-safe: the call counter is atomic, so "the N-th call" is well defined even when
 * the I/O threads race (which call is N-th may then differ from run to run). */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../core/util.h"
#include "vfs_fault.h"

enum {
    OP_OPEN,
    OP_WRITE,
    OP_FSYNC,
    OP_RENAME,
    OP_READ,
    OP_MKDIR,
    OP_ALLOCATE,
    OP_UNLINK,
    OP_LOCK,
    OP_EXCHANGE,
    OP_COUNT
};
static const char *const op_names[OP_COUNT] = {"open",   "write",  "fsync", "rename",
                                               "read",   "mkdir",  "allocate", "unlink",
                                               "lock",   "exchange"};

enum { LOCK_REAL, LOCK_NONE, LOCK_LOCAL };

typedef struct {
    st_vfs base;
    const st_vfs *inner;
    int op, err, short_write, sticky, lockmode, kill;
    uint64_t n;
    atomic_uint_fast64_t calls;
    atomic_int shorted; /* a short write happened: the next write fails */
    pthread_mutex_t mu; /* lock=local: the paths locked through this instance */
    char **held;
    size_t nheld, capheld;
} fault_vfs;

typedef struct {
    st_file base;
    st_file *inner;    /* NULL: an emulated lock (lock=none / local) */
    char *lockpath;    /* lock=local: the path held */
} fault_file;

#define FV(v) ((fault_vfs *)(v))
#define FF(f) ((fault_file *)(f))
#define INNER(f) (FF(f)->inner)
#define FVF(f) FV((f)->vfs)

/* Counts a call of op; returns the errno to fail it with, or 0. */
static int hit(fault_vfs *v, int op)
{
    if (op != v->op)
        return 0;
    uint64_t k = atomic_fetch_add(&v->calls, 1) + 1;
    if (k == v->n && v->kill)
        raise(SIGKILL);
    if (k == v->n || (v->sticky && k > v->n))
        return v->err;
    return 0;
}

/* Wraps the file the inner backend's open or lock makes (0, or its -errno). */
static int wrap_file(const st_vfs *v, int rc, fault_file *f, st_file **out)
{
    if (rc) {
        free(f);
        return rc;
    }
    f->base.vfs = v;
    *out = &f->base;
    return 0;
}

static int f_open(const st_vfs *v, const char *path, int flags, st_file **out)
{
    int e = hit(FV(v), OP_OPEN);
    fault_file *f = e ? NULL : calloc(1, sizeof *f);
    if (e || !f)
        return e ? -e : -ENOMEM;
    const st_vfs *in = FV(v)->inner;
    return wrap_file(v, in->open(in, path, flags, &f->inner), f, out);
}

static int64_t f_pread(st_file *f, void *buf, size_t n, uint64_t off)
{
    int e = hit(FVF(f), OP_READ);
    if (e)
        return -e;
    return INNER(f)->vfs->pread(INNER(f), buf, n, off);
}

static int64_t f_pwrite(st_file *f, const void *buf, size_t n, uint64_t off)
{
    fault_vfs *v = FVF(f);
    if (v->short_write && v->op == OP_WRITE) {
        if (atomic_exchange(&v->shorted, 0))
            return -v->err; /* the retry after a short write fails: the disk is full */
        uint64_t k = atomic_fetch_add(&v->calls, 1) + 1;
        if (k == v->n) {
            size_t half = (n / 2) & ~(size_t)4095; /* keep O_DIRECT alignment */
            if (half == 0)
                return -v->err;
            atomic_store(&v->shorted, 1);
            return INNER(f)->vfs->pwrite(INNER(f), buf, half, off);
        }
    } else {
        int e = hit(v, OP_WRITE);
        if (e)
            return -e;
    }
    return INNER(f)->vfs->pwrite(INNER(f), buf, n, off);
}

static int f_sync(st_file *f)
{
    int e = hit(FVF(f), OP_FSYNC);
    return e ? -e : INNER(f)->vfs->sync(INNER(f));
}

static int f_size(st_file *f, uint64_t *out) { return INNER(f)->vfs->size(INNER(f), out); }
static int f_ident(st_file *f, st_file_id *out) { return INNER(f)->vfs->ident(INNER(f), out); }

static int f_truncate(st_file *f, uint64_t size)
{
    return INNER(f)->vfs->truncate(INNER(f), size);
}

static int f_allocate(st_file *f, uint64_t size)
{
    int e = hit(FVF(f), OP_ALLOCATE);
    return e ? -e : INNER(f)->vfs->allocate(INNER(f), size);
}

static int f_close(st_file *f)
{
    fault_vfs *v = FVF(f);
    int rc = INNER(f) ? INNER(f)->vfs->close(INNER(f)) : 0;
    if (FF(f)->lockpath) {
        pthread_mutex_lock(&v->mu);
        for (size_t i = 0; i < v->nheld; i++)
            if (v->held[i] == FF(f)->lockpath) {
                v->held[i] = v->held[--v->nheld];
                break;
            }
        pthread_mutex_unlock(&v->mu);
        free(FF(f)->lockpath);
    }
    free(FF(f));
    return rc;
}

static int f_direct(st_file *f) { return INNER(f)->vfs->direct(INNER(f)); }

static int f_mkdir(const st_vfs *v, const char *path)
{
    int e = hit(FV(v), OP_MKDIR);
    return e ? -e : FV(v)->inner->mkdir(FV(v)->inner, path);
}

/* lock=none / local: makes the lock file as the inner lock does (a regular file, not
 * through a link) but holds no lock on it; with local, refuses a path this instance holds. */
static int emulated_lock(fault_vfs *v, const char *path, fault_file *f)
{
    const st_vfs *in = v->inner;
    int rc = 0;
    pthread_mutex_lock(&v->mu);
    for (size_t i = 0; v->lockmode == LOCK_LOCAL && i < v->nheld && !rc; i++)
        if (strcmp(v->held[i], path) == 0)
            rc = -EBUSY;
    st_file *real;
    if (!rc && (rc = in->lock(in, path, &real)) == 0)
        in->close(real);
    if (rc == -EBUSY && v->lockmode == LOCK_NONE)
        rc = 0; /* held elsewhere: granted anyway */
    if (!rc && v->lockmode == LOCK_LOCAL) {
        if (st_grow(&v->held, &v->capheld, v->nheld + 1, sizeof *v->held) ||
            !(f->lockpath = strdup(path)))
            rc = -ENOMEM;
        else
            v->held[v->nheld++] = f->lockpath;
    }
    pthread_mutex_unlock(&v->mu);
    return rc;
}

static int f_lock(const st_vfs *v, const char *path, st_file **out)
{
    int e = hit(FV(v), OP_LOCK);
    fault_file *f = e ? NULL : calloc(1, sizeof *f);
    if (e || !f)
        return e ? -e : -ENOMEM;
    if (FV(v)->lockmode != LOCK_REAL)
        return wrap_file(v, emulated_lock(FV(v), path, f), f, out);
    const st_vfs *in = FV(v)->inner;
    return wrap_file(v, in->lock(in, path, &f->inner), f, out);
}

static int f_rename(const st_vfs *v, const char *from, const char *to)
{
    int e = hit(FV(v), OP_RENAME);
    return e ? -e : FV(v)->inner->rename(FV(v)->inner, from, to);
}

/* an exchange is a rename (it replaces a name), and op=exchange counts exchanges alone */
static int f_exchange(const st_vfs *v, const char *a, const char *b)
{
    int e = hit(FV(v), OP_RENAME);
    if (!e)
        e = hit(FV(v), OP_EXCHANGE);
    return e ? -e : FV(v)->inner->exchange(FV(v)->inner, a, b);
}

static int f_undirect(st_file *f) { return INNER(f)->vfs->undirect(INNER(f)); }

/* a link makes a name, as a rename does: op=rename faults it too */
static int f_link(const st_vfs *v, const char *from, const char *to)
{
    const st_vfs *in = FV(v)->inner;
    int e = hit(FV(v), OP_RENAME);
    return e ? -e : in->version >= 3 && in->link ? in->link(in, from, to) : -EOPNOTSUPP;
}

static int f_unlink(const st_vfs *v, const char *path)
{
    int e = hit(FV(v), OP_UNLINK);
    return e ? -e : FV(v)->inner->unlink(FV(v)->inner, path);
}

static int f_rmdir(const st_vfs *v, const char *path)
{
    return FV(v)->inner->rmdir(FV(v)->inner, path);
}

static int f_sync_dir(const st_vfs *v, const char *path)
{
    int e = hit(FV(v), OP_FSYNC);
    return e ? -e : FV(v)->inner->sync_dir(FV(v)->inner, path);
}

typedef struct {
    fault_vfs *v;
    st_list_fn fn;
    void *ctx;
    int err;
} list_ctx;

/* A removal asked for during a listing counts as an unlink call. */
static int f_list_one(void *p, const char *name, uint64_t size, int kind)
{
    list_ctx *c = p;
    int what = c->fn(c->ctx, name, size, kind);
    if (what == ST_LIST_REMOVE && kind == 0) {
        int e = hit(c->v, OP_UNLINK);
        if (e) {
            if (!c->err)
                c->err = e;
            return ST_LIST_NEXT;
        }
    }
    return what;
}

static int f_list(const st_vfs *v, const char *dir, st_list_fn fn, void *ctx)
{
    list_ctx c = {FV(v), fn, ctx, 0};
    int rc = FV(v)->inner->list(FV(v)->inner, dir, f_list_one, &c);
    return rc ? rc : -c.err;
}

static int f_stat(const st_vfs *v, const char *path, uint64_t *size, int *kind)
{
    return FV(v)->inner->stat(FV(v)->inner, path, size, kind);
}

static int f_mtime(const st_vfs *v, const char *path, uint64_t *ns)
{
    return FV(v)->inner->mtime(FV(v)->inner, path, ns);
}

static void f_release(const st_vfs *v)
{
    st_vfs_release(FV(v)->inner);
    pthread_mutex_destroy(&FV(v)->mu);
    free(FV(v)->held);
    free(FV(v));
}

static const struct {
    const char *name;
    int value;
} errnos[] = {{"EIO", EIO}, {"ENOSPC", ENOSPC}, {"EDQUOT", EDQUOT}, {"EROFS", EROFS},
              {"EACCES", EACCES}, {"ENOENT", ENOENT}, {"EINVAL", EINVAL},
              {"EXDEV", EXDEV},   {"EPERM", EPERM}};

static int fault_new(const st_vfs **out, const st_vfs *inner, const char *query)
{
    fault_vfs *v = calloc(1, sizeof *v);
    if (!v)
        return st_fail(STRATA_ENOMEM, "out of memory");
    v->base = (st_vfs){
        .version = ST_VFS_VERSION, .scheme = "fault", .caps = inner->caps,
        .open = f_open, .pread = f_pread, .pwrite = f_pwrite, .sync = f_sync, .size = f_size,
        .truncate = f_truncate, .close = f_close, .direct = f_direct, .mkdir = f_mkdir,
        .rename = f_rename, .unlink = f_unlink, .rmdir = f_rmdir, .sync_dir = f_sync_dir,
        .list = f_list, .stat = f_stat, .allocate = f_allocate, .release = f_release,
        .mtime = f_mtime, .lock = f_lock, .ident = f_ident, .exchange = f_exchange,
        .undirect = f_undirect, .link = f_link,
    };
    v->inner = inner;
    v->op = -1;
    v->err = EIO;
    atomic_init(&v->calls, 0);
    atomic_init(&v->shorted, 0);
    pthread_mutex_init(&v->mu, NULL);
    char key[16], val[32];
    const char *p = query ? query : "";
    int rc = 0;
    while (*p && !rc) {
        int used = 0;
        if (sscanf(p, "%15[a-z]=%31[A-Za-z0-9]%n", key, val, &used) != 2) {
            rc = st_fail(STRATA_EINVAL, "fault URI: cannot parse '%s' (want op=OP&n=N&errno=E)", p);
            break;
        }
        p += used;
        if (*p == '&')
            p++;
        if (strcmp(key, "op") == 0) {
            int op = -1; /* not v->op: a bad op after a good one must not pass */
            for (int i = 0; i < OP_COUNT; i++)
                if (strcmp(val, op_names[i]) == 0)
                    op = i;
            if (op < 0)
                rc = st_fail(STRATA_EINVAL, "fault URI: unknown op '%s' (open, write, fsync, "
                             "rename, read, mkdir, allocate, unlink, lock, exchange)", val);
            v->op = op;
        } else if (strcmp(key, "n") == 0) {
            char *end;
            v->n = strtoull(val, &end, 10);
            if (*end || v->n == 0)
                rc = st_fail(STRATA_EINVAL, "fault URI: n must be a call number >= 1");
        } else if (strcmp(key, "errno") == 0) {
            size_t i = 0;
            while (i < sizeof errnos / sizeof errnos[0] && strcmp(val, errnos[i].name) != 0)
                i++;
            if (i == sizeof errnos / sizeof errnos[0])
                rc = st_fail(STRATA_EINVAL, "fault URI: unknown errno '%s' (EIO, ENOSPC, "
                             "EDQUOT, EROFS, EACCES, ENOENT, EINVAL, EXDEV, EPERM)", val);
            else
                v->err = errnos[i].value;
        } else if (strcmp(key, "short") == 0 || strcmp(key, "sticky") == 0 ||
                   strcmp(key, "kill") == 0) {
            if (strcmp(val, "0") != 0 && strcmp(val, "1") != 0)
                rc = st_fail(STRATA_EINVAL, "fault URI: %s must be 0 or 1, not '%s'", key, val);
            *(key[0] == 'k'   ? &v->kill
              : key[1] == 'h' ? &v->short_write
                              : &v->sticky) = strcmp(val, "1") == 0;
        } else if (strcmp(key, "lock") == 0) {
            v->lockmode = strcmp(val, "none") == 0 ? LOCK_NONE : strcmp(val, "local") == 0 ? LOCK_LOCAL : -1;
            if (v->lockmode < 0)
                rc = st_fail(STRATA_EINVAL, "fault URI: lock must be none or local, not '%s'", val);
        } else {
            rc = st_fail(STRATA_EINVAL, "fault URI: unknown key '%s'", key);
        }
    }
    if (!rc && (v->op < 0 || v->n == 0) && (v->lockmode == LOCK_REAL || v->op >= 0 || v->n))
        rc = st_fail(STRATA_EINVAL, "fault URI needs op=OP and n=N (or only lock=none/local)");
    if (!rc && v->short_write && v->op != OP_WRITE)
        rc = st_fail(STRATA_EINVAL, "fault URI: short=1 needs op=write");
    if (rc) {
        pthread_mutex_destroy(&v->mu);
        free(v);
        return rc;
    }
    *out = &v->base;
    return 0;
}

int st_vfs_fault_register(void) { return st_vfs_register_wrapper("fault", fault_new); }
