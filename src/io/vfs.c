/* vfs.c - URI resolution and whole-file helpers over any backend. */
#include "vfs.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
            /* the host-memory tier: files in shared memory, which outlive the process but
             * not the node ($STRATA_MEM_ROOT, default /dev/shm/strata) */
            const char *root = getenv("STRATA_MEM_ROOT");
            const char *rest = sep + 3;
            while (*rest == '/')
                rest++;
            if (!*rest || strstr(rest, ".."))
                return st_fail(STRATA_EINVAL, "mem URI needs a relative name without '..': '%s'",
                               uri);
            int k = snprintf(mem, sizeof mem, "%s/%s", root && *root ? root : "/dev/shm/strata",
                             rest);
            if (k < 0 || (size_t)k >= sizeof mem)
                return st_fail(STRATA_EINVAL, "URI too long: '%s'", uri);
            path = mem;
        } else {
            return st_fail(STRATA_ESCHEME,
                           "unknown URI scheme '%.*s' in '%s' (known: file://, mem://)",
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

int st_vfs_read_all(const st_vfs *v, const char *path, size_t max, unsigned char **out,
                    size_t *len)
{
    st_file *f;
    int rc = v->open(v, path, ST_O_READ, &f);
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
