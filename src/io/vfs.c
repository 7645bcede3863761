/* vfs.c - URI resolution and whole-file helpers over any backend. */
#include "vfs.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/error.h"

void st_vfs_release(const st_vfs *v)
{
    if (v && v->release)
        v->release(v);
}

#define MAX_WRAPPERS 8

static struct {
    char name[16];
    st_vfs_wrap_fn make;
} wrappers[MAX_WRAPPERS];
static int nwrappers;
static pthread_mutex_t wrappers_mu = PTHREAD_MUTEX_INITIALIZER;

int st_vfs_register_wrapper(const char *name, st_vfs_wrap_fn make)
{
    int rc = 0;
    pthread_mutex_lock(&wrappers_mu);
    int i = 0;
    while (i < nwrappers && strcmp(wrappers[i].name, name) != 0)
        i++;
    if (i == nwrappers) {
        if (nwrappers == MAX_WRAPPERS || strlen(name) >= sizeof wrappers[0].name) {
            rc = st_fail(STRATA_ENOMEM, "cannot register the storage wrapper '%s'", name);
        } else {
            snprintf(wrappers[i].name, sizeof wrappers[i].name, "%s", name);
            wrappers[i].make = make;
            nwrappers++;
        }
    }
    pthread_mutex_unlock(&wrappers_mu);
    return rc;
}

/* The wrapper whose name is the n bytes at uri, or NULL. */
static st_vfs_wrap_fn find_wrapper(const char *uri, size_t n)
{
    st_vfs_wrap_fn make = NULL;
    pthread_mutex_lock(&wrappers_mu);
    for (int i = 0; i < nwrappers && !make; i++)
        if (strlen(wrappers[i].name) == n && strncmp(wrappers[i].name, uri, n) == 0)
            make = wrappers[i].make;
    pthread_mutex_unlock(&wrappers_mu);
    return make;
}

/* Makes the mem:// root: its missing parents 0755 (as a save makes a checkpoint's), the root
 * itself 0700. 0 or -errno (-EEXIST when someone made it first). */
static int mem_root_make(const char *root)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s", root);
    for (char *s = strchr(p + 1, '/'); s; s = strchr(s + 1, '/')) {
        *s = 0;
        if (mkdir(p, 0755) && errno != EEXIST) {
            int e = errno;
            *s = '/';
            return -e;
        }
        *s = '/';
    }
    return mkdir(root, 0700) ? -errno : 0;
}

/* The mem:// root must be this user's own: a directory (not a symlink) owned by the
 * effective uid and writable by no one else, made so (0700) when missing. On a node shared
 * by several users, one who made the root first could otherwise swap in checkpoints of
 * their own, or read and remove the victim's. STRATA_EINVAL naming the root and why. */
static int mem_root_check(const char *root)
{
    struct stat st;
    int e = lstat(root, &st) ? errno : 0;
    if (e == ENOENT) {
        int m = mem_root_make(root);
        if (m && m != -EEXIST)
            return st_fail(st_from_errno(-m), "cannot create the mem:// root '%s': %s", root,
                           strerror(-m));
        e = lstat(root, &st) ? errno : 0;
    }
    if (e)
        return st_fail(st_from_errno(e), "mem:// root '%s': %s", root, strerror(e));
    if (S_ISLNK(st.st_mode))
        return st_fail(STRATA_EINVAL,
                       "the mem:// root '%s' is a symlink: it must be a directory of this "
                       "user's (set $STRATA_MEM_ROOT to the real path)",
                       root);
    if (!S_ISDIR(st.st_mode))
        return st_fail(STRATA_EINVAL, "the mem:// root '%s' is not a directory", root);
    if (st.st_uid != geteuid())
        return st_fail(STRATA_EINVAL,
                       "the mem:// root '%s' is owned by uid %u, not by this user (uid %u): "
                       "its checkpoints could be anyone's; remove it or set $STRATA_MEM_ROOT "
                       "to a directory of your own",
                       root, (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & 022)
        return st_fail(STRATA_EINVAL,
                       "the mem:// root '%s' is writable by others (mode %04o): make it "
                       "private (chmod 700) or set $STRATA_MEM_ROOT to a directory of your own",
                       root, (unsigned)(st.st_mode & 07777));
    return 0;
}

/* The path of "mem://<rest>" into out: the host-memory tier, files in shared memory that
 * outlive the process but not the node, under $STRATA_MEM_ROOT (default
 * /dev/shm/strata-<euid>), a root private to the user. Not inlined: st_vfs_resolve recurses
 * once per wrapper, and its frame must stay small. */
__attribute__((noinline)) static int mem_path(char *out, size_t cap, const char *uri,
                                              const char *rest)
{
    const char *env = getenv("STRATA_MEM_ROOT");
    while (*rest == '/')
        rest++;
    if (!*rest || strstr(rest, ".."))
        return st_fail(STRATA_EINVAL, "mem URI needs a relative name without '..': '%s'", uri);
    char root[PATH_MAX];
    int k = env && *env ? snprintf(root, sizeof root, "%s", env)
                        : snprintf(root, sizeof root, "/dev/shm/strata-%u", (unsigned)geteuid());
    if (k < 0 || (size_t)k >= sizeof root)
        return st_fail(STRATA_EINVAL, "$STRATA_MEM_ROOT is too long");
    while (k > 1 && root[k - 1] == '/') /* "root/" would follow a symlink */
        root[--k] = 0;
    k = snprintf(out, cap, "%s/%s", root, rest);
    if (k < 0 || (size_t)k >= cap)
        return st_fail(STRATA_EINVAL, "URI too long: '%s'", uri);
    return mem_root_check(root);
}

int st_vfs_resolve(const char *uri, const st_vfs **vfs, char *path_out, size_t cap)
{
    if (!uri || !*uri)
        return st_fail(STRATA_EINVAL, "empty checkpoint URI");
    const char *plus = strchr(uri, '+'), *colon = strstr(uri, "://");
    st_vfs_wrap_fn make = plus && (!colon || plus < colon) ? find_wrapper(uri, (size_t)(plus - uri))
                                                          : NULL;
    if (make) { /* "wrapper+<uri>?query"; an unregistered name is parsed as a path or URI */
        char inner_uri[PATH_MAX];
        const char *q = strchr(plus, '?');
        size_t n = q ? (size_t)(q - plus) - 1 : strlen(plus) - 1;
        if (n >= sizeof inner_uri)
            return st_fail(STRATA_EINVAL, "URI too long: '%s'", uri);
        memcpy(inner_uri, plus + 1, n);
        inner_uri[n] = 0;
        const st_vfs *inner;
        int rc = st_vfs_resolve(inner_uri, &inner, path_out, cap);
        if (rc)
            return rc;
        if ((rc = make(vfs, inner, q ? q + 1 : NULL)))
            st_vfs_release(inner);
        return rc;
    }
    const char *sep = strstr(uri, "://");
    const char *path = uri;
    char mem[PATH_MAX];
    if (sep) {
        size_t n = (size_t)(sep - uri);
        if (n == 4 && strncmp(uri, "file", 4) == 0) {
            path = sep + 3;
            if (*path != '/')
                return st_fail(STRATA_EINVAL, "file URI must hold an absolute path: '%s'", uri);
        } else if (n == 3 && strncmp(uri, "mem", 3) == 0) {
            int rc = mem_path(mem, sizeof mem, uri, sep + 3);
            if (rc)
                return rc;
            path = mem;
        } else if (n == 2 && strncmp(uri, "s3", 2) == 0) {
            return st_vfs_s3_resolve(uri, vfs, path_out, cap);
        } else {
            return st_fail(STRATA_ESCHEME,
                           "unknown URI scheme '%.*s' in '%s' (known: file://, mem://, s3://)",
                           (int)n, uri, uri);
        }
    }
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/')
        len--;
    if (len == 0 || len >= cap)
        return st_fail(STRATA_EINVAL, "checkpoint path is empty or too long: '%s'", uri);
    memcpy(path_out, path, len);
    path_out[len] = 0;
    *vfs = &st_vfs_posix;
    return 0;
}

int st_vfs_read_all(const st_vfs *v, const char *path, size_t max, int flags,
                    unsigned char **out, size_t *len)
{
    st_file *f;
    int rc = v->open(v, path, ST_O_READ | (flags & ST_O_FOLLOW), &f);
    if (rc)
        return rc;
    uint64_t size;
    rc = v->size(f, &size);
    if (rc == 0 && size > max)
        rc = -EFBIG;
    unsigned char *buf = NULL;
    if (rc == 0 && !(buf = malloc(size ? size : 1)))
        rc = -ENOMEM;
    if (rc == 0) {
        int64_t r = st_vfs_read_full(v, f, buf, size, 0);
        if (r < 0)
            rc = (int)r;
        else
            size = (uint64_t)r; /* shrank meanwhile: the decoder will see a truncated file */
    }
    v->close(f);
    if (rc) {
        free(buf);
        return rc;
    }
    *out = buf;
    *len = size;
    return 0;
}

int st_vfs_write_full(const st_vfs *v, st_file *f, const void *buf, size_t n, uint64_t off)
{
    const char *p = buf;
    while (n) {
        int64_t w = v->pwrite(f, p, n, off);
        if (w < 0)
            return (int)w;
        if (w == 0)
            return -EIO;
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

int64_t st_vfs_read_full(const st_vfs *v, st_file *f, void *buf, size_t n, uint64_t off)
{
    char *p = buf;
    size_t got = 0;
    while (got < n) {
        int64_t r = v->pread(f, p + got, n - got, off + got);
        if (r < 0)
            return r;
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (int64_t)got;
}

int st_path_join(char *out, const char *dir, const char *name)
{
    int n = snprintf(out, PATH_MAX, "%s/%s", dir, name);
    if (n < 0 || n >= PATH_MAX)
        return st_fail(STRATA_EINVAL, "path too long: %s/%s", dir, name);
    return 0;
}

static int dirlist_add(void *ctx, const char *name, uint64_t size, int kind)
{
    (void)size;
    st_dirlist *l = ctx;
    if (l->n == ST_DIRLIST_MAX)
        return ST_LIST_STOP;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 32;
        st_dirent *more = realloc(l->e, cap * sizeof *more);
        if (!more) {
            l->oom = 1;
            return ST_LIST_STOP;
        }
        l->e = more, l->cap = cap;
    }
    if (!(l->e[l->n].name = strdup(name))) {
        l->oom = 1;
        return ST_LIST_STOP;
    }
    l->e[l->n++].kind = kind;
    return ST_LIST_NEXT;
}

static int cmp_dirent(const void *a, const void *b)
{
    return strcmp(((const st_dirent *)a)->name, ((const st_dirent *)b)->name);
}

void st_dirlist_free(st_dirlist *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->e[i].name);
    free(l->e);
    memset(l, 0, sizeof *l);
}

int st_dirlist_read(const st_vfs *v, const char *dir, st_dirlist *l)
{
    memset(l, 0, sizeof *l);
    int e = v->list(v, dir, dirlist_add, l);
    if (l->oom || e) {
        e = l->oom ? -ENOMEM : e;
        st_dirlist_free(l);
        return e;
    }
    if (l->n)
        qsort(l->e, l->n, sizeof *l->e, cmp_dirent);
    return 0;
}
