/* vfs_posix.c - the file:// backend: POSIX calls, O_DIRECT when the filesystem allows. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "../core/error.h"
#include "vfs.h"

typedef struct {
    st_file base;
    int fd;
    int direct;
} px_file;

#define PX(f) ((px_file *)(f))

static int px_open(const st_vfs *v, const char *path, int flags, st_file **out)
{
    /* never through a symlink: one planted after the save checked the directory must not
     * get its target truncated (ELOOP instead) */
    int of = O_CLOEXEC | O_NOFOLLOW;
    if (flags & ST_O_WRITE) {
        /* a new inode: truncating an existing file would write through a hard link into
         * another checkpoint (cp -al, rsync --link-dest) */
        struct stat st;
        if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode))
            return -ELOOP; /* a planted link stays for a person to see */
        if (unlink(path) && errno != ENOENT)
            return -errno;
        of |= O_WRONLY | O_CREAT | O_EXCL;
    } else {
        /* only a regular file is opened: opening a FIFO blocks until a writer comes, a
         * device may act on open (a tape rewinds) */
        struct stat st;
        int follow = (flags & ST_O_FOLLOW) != 0;
        if ((follow ? stat(path, &st) : lstat(path, &st)) == 0 && !S_ISREG(st.st_mode))
            return S_ISLNK(st.st_mode) ? -ELOOP : -ST_ENOTREG;
        of |= O_RDONLY;
        if (follow)
            of &= ~O_NOFOLLOW;
    }
    of |= O_NONBLOCK; /* swapped for a FIFO after that look: open returns at once */
    int fd = -1, direct = 0;
    if (flags & ST_O_DIRECT) {
        fd = open(path, of | O_DIRECT, 0644);
        direct = fd >= 0;
    }
    if (fd < 0) { /* tmpfs and some network filesystems refuse O_DIRECT with EINVAL */
        if ((flags & ST_O_WRITE) && unlink(path) && errno != ENOENT) /* it may have made it */
            return -errno;
        fd = open(path, of, 0644);
    }
    if (fd < 0)
        return -errno;
    /* what was opened is a regular file; then blocking I/O as usual */
    struct stat fst;
    int fl, e = fstat(fd, &fst) ? errno : !S_ISREG(fst.st_mode) ? ST_ENOTREG : 0;
    if (!e && ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK)))
        e = errno;
    if (e) {
        close(fd);
        return -e;
    }
    if ((flags & ST_O_EXACT) && !direct)
        posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM); /* advice: its failure changes nothing */
    px_file *f = malloc(sizeof *f);
    if (!f) {
        close(fd);
        return -ENOMEM;
    }
    f->base.vfs = v;
    f->fd = fd;
    f->direct = direct;
    *out = &f->base;
    return 0;
}

static int64_t px_pread(st_file *f, void *buf, size_t n, uint64_t off)
{
    ssize_t r;
    do
        r = pread(PX(f)->fd, buf, n, (off_t)off);
    while (r < 0 && errno == EINTR);
    return r < 0 ? -errno : r;
}

static int64_t px_pwrite(st_file *f, const void *buf, size_t n, uint64_t off)
{
    ssize_t r;
    do
        r = pwrite(PX(f)->fd, buf, n, (off_t)off);
    while (r < 0 && errno == EINTR);
    return r < 0 ? -errno : r;
}

static int px_sync(st_file *f) { return fsync(PX(f)->fd) ? -errno : 0; }

static int px_size(st_file *f, uint64_t *out)
{
    struct stat st;
    if (fstat(PX(f)->fd, &st))
        return -errno;
    *out = (uint64_t)st.st_size;
    return 0;
}

static int px_ident(st_file *f, st_file_id *out)
{
    struct stat st;
    if (fstat(PX(f)->fd, &st))
        return -errno;
    *out = (st_file_id){(uint64_t)st.st_dev, (uint64_t)st.st_ino, (uint64_t)st.st_size,
                        (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec,
                        (uint64_t)st.st_ctim.tv_sec * 1000000000ull + (uint64_t)st.st_ctim.tv_nsec};
    return 0;
}

static int px_truncate(st_file *f, uint64_t size)
{
    return ftruncate(PX(f)->fd, (off_t)size) ? -errno : 0;
}

static int px_allocate(st_file *f, uint64_t size)
{
    if (size == 0)
        return 0;
    /* tmpfs (the host-memory tier): fallocate would clear every page of the file ahead of
     * the copy that fills it, a second pass over memory on the training's cores; the free
     * space is checked instead (a file of this save growing meanwhile is not counted) */
    struct statfs fs;
    struct statvfs vs;
    if (fstatfs(PX(f)->fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC &&
        fstatvfs(PX(f)->fd, &vs) == 0)
        return (uint64_t)vs.f_bavail * vs.f_frsize < size ? -ENOSPC : 0;
    return fallocate(PX(f)->fd, 0, 0, (off_t)size) ? -errno : 0;
}

static int px_close(st_file *f)
{
    int rc = close(PX(f)->fd) ? -errno : 0;
    free(PX(f));
    return rc;
}

static int px_direct(st_file *f) { return PX(f)->direct; }

static int px_mkdir(const st_vfs *v, const char *path)
{
    (void)v;
    return mkdir(path, 0755) ? -errno : 0;
}

static int px_rename(const st_vfs *v, const char *from, const char *to)
{
    (void)v;
    if (renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE) == 0)
        return 0;
    if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
        return -errno;
    /* filesystems without RENAME_NOREPLACE (NFS): link fails if `to` exists, atomically */
    if (link(from, to) == 0)
        return unlink(from) ? -errno : 0;
    if (errno != EPERM)
        return -errno;
    /* a directory cannot be linked: rename(2) never replaces a directory that holds
     * anything (ENOTEMPTY), so at worst an empty one made meanwhile is replaced */
    struct stat st;
    if (lstat(to, &st) == 0)
        return -EEXIST;
    return rename(from, to) ? -errno : 0;
}

static int px_lock(const st_vfs *v, const char *path, st_file **out)
{
    for (int tries = 0; tries < 16; tries++) {
        int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
        if (fd < 0)
            return -errno;
        struct stat a, b;
        if (fstat(fd, &a) || !S_ISREG(a.st_mode)) {
            close(fd);
            return -ST_ENOTREG;
        }
        /* an open file description lock: exclusive between threads of one process too,
         * released on close or death, forwarded to the server's lock manager over NFS */
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
        if (fcntl(fd, F_OFD_SETLK, &fl)) {
            int e = errno;
            close(fd);
            return e == EAGAIN || e == EACCES ? -EBUSY : -e;
        }
        /* the holder before us may have removed the file (and its directory) between our
         * open and our lock: only the file at path counts */
        int seen = lstat(path, &b) == 0 ? 0 : errno;
        if (!seen && b.st_dev == a.st_dev && b.st_ino == a.st_ino) {
            px_file *f = malloc(sizeof *f);
            if (!f) {
                close(fd);
                return -ENOMEM;
            }
            *f = (px_file){{v}, fd, 0};
            *out = &f->base;
            return 0;
        }
        int gone = seen == ENOENT;
        close(fd);
        if (gone) { /* the directory may be gone too: the caller makes it again */
            struct stat d;
            char dir[4096];
            snprintf(dir, sizeof dir, "%s", path);
            char *slash = strrchr(dir, '/');
            if (slash && slash != dir)
                *slash = 0;
            if (slash && lstat(dir, &d) != 0)
                return -ENOENT;
        }
    }
    return -EBUSY;
}

static int px_unlink(const st_vfs *v, const char *path)
{
    (void)v;
    return unlink(path) ? -errno : 0;
}

static int px_rmdir(const st_vfs *v, const char *path)
{
    (void)v;
    return rmdir(path) ? -errno : 0;
}

static int px_sync_dir(const st_vfs *v, const char *path)
{
    (void)v;
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) ? -errno : 0;
    close(fd);
    return rc;
}

static int px_list(const st_vfs *v, const char *dir, st_list_fn fn, void *ctx)
{
    (void)v;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0)
        return -errno;
    int lfd = dup(dfd);
    DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
    if (!d) {
        int e = -errno;
        if (lfd >= 0)
            close(lfd);
        close(dfd);
        return e;
    }
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        struct stat st;
        if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW))
            continue; /* gone meanwhile */
        int kind = S_ISREG(st.st_mode) ? 0 : S_ISDIR(st.st_mode) ? 1 : S_ISLNK(st.st_mode) ? 2 : 3;
        int what = fn(ctx, e->d_name, (uint64_t)st.st_size, kind);
        if (what == ST_LIST_STOP)
            break;
        if (what == ST_LIST_REMOVE && kind == 0 && unlinkat(dfd, e->d_name, 0) && !rc)
            rc = -errno;
    }
    closedir(d);
    close(dfd);
    return rc;
}

static int px_stat(const st_vfs *v, const char *path, uint64_t *size, int *kind)
{
    (void)v;
    struct stat st;
    if (lstat(path, &st))
        return -errno;
    if (size)
        *size = (uint64_t)st.st_size;
    if (kind)
        *kind = S_ISREG(st.st_mode) ? 0 : S_ISDIR(st.st_mode) ? 1 : S_ISLNK(st.st_mode) ? 2 : 3;
    return 0;
}

static int px_mtime(const st_vfs *v, const char *path, uint64_t *ns)
{
    (void)v;
    struct stat st;
    if (lstat(path, &st))
        return -errno;
    *ns = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
    return 0;
}

static int px_exchange(const st_vfs *v, const char *a, const char *b)
{
    (void)v;
    return renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) ? -errno : 0;
}

static int px_undirect(st_file *f)
{
    int fl = fcntl(PX(f)->fd, F_GETFL);
    if (fl < 0 || fcntl(PX(f)->fd, F_SETFL, fl & ~O_DIRECT))
        return -errno;
    PX(f)->direct = 0;
    return 0;
}

static int px_link(const st_vfs *v, const char *from, const char *to)
{
    (void)v;
    struct stat st;
    if (lstat(from, &st))
        return -errno;
    if (!S_ISREG(st.st_mode))
        return -ST_ENOTREG;
    return linkat(AT_FDCWD, from, AT_FDCWD, to, 0) ? -errno : 0; /* 0: a symlink stays one */
}

const st_vfs st_vfs_posix = {
    .version = ST_VFS_VERSION,
    .scheme = "file",
    .caps = ST_CAP_DIRECT | ST_CAP_RENAME,
    .open = px_open,
    .pread = px_pread,
    .pwrite = px_pwrite,
    .sync = px_sync,
    .size = px_size,
    .truncate = px_truncate,
    .close = px_close,
    .direct = px_direct,
    .mkdir = px_mkdir,
    .rename = px_rename,
    .unlink = px_unlink,
    .rmdir = px_rmdir,
    .sync_dir = px_sync_dir,
    .list = px_list,
    .stat = px_stat,
    .allocate = px_allocate,
    .mtime = px_mtime,
    .lock = px_lock,
    .ident = px_ident,
    .exchange = px_exchange,
    .undirect = px_undirect,
    .link = px_link,
};
