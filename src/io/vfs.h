/* vfs.h - storage backends behind one versioned vtable, chosen by URI scheme (after
 * SQLite's VFS). Methods return 0 / a byte count, or a negative errno; they never set a
 * strata error message (the engine does, naming the path). Backends are thread-safe:
 * one st_file may be used by several threads at once with pread/pwrite. */
#ifndef STRATA_VFS_H
#define STRATA_VFS_H
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#define ST_VFS_VERSION 3 /* 2: exchange, undirect; 3: link */

/* open refuses anything but a regular file - a FIFO, a device, a socket, a directory - with
 * -ST_ENOTREG, without opening it or blocking on it (a symlink: -ELOOP). Linux has no
 * EFTYPE; EMEDIUMTYPE is never returned by open for a file of the filesystem. */
#define ST_ENOTREG EMEDIUMTYPE

enum {
    ST_O_READ = 1,
    ST_O_WRITE = 2,   /* create a new file (an existing one is unlinked first, so a write
                         never goes through a hard link into another file) */
    ST_O_DIRECT = 4,  /* ask for O_DIRECT; st_file_direct() tells if it was granted */
    ST_O_FOLLOW = 8,  /* with ST_O_READ: through a symlink to a regular file (foreign
                         sources: a Hugging Face cache links its snapshots to blobs) */
    ST_O_EXACT = 16,  /* with ST_O_READ: buffered reads bring in the ranges asked and no
                         read-ahead beyond them (POSIX_FADV_RANDOM: the bytes after a range
                         may be another reader's, read with O_DIRECT) */
};

enum {
    ST_CAP_DIRECT = 1, /* O_DIRECT may work */
    ST_CAP_RENAME = 2, /* rename is atomic */
};

typedef struct st_vfs st_vfs;
/* Which version of which file an open file is (st_vfs.ident): equal values on two opens
 * mean the same file, unchanged in between (up to the timestamps' resolution). dev is a
 * local number: one network file has other values on other nodes. */
typedef struct st_file_id {
    uint64_t dev, ino, size, mtime_ns, ctime_ns;
} st_file_id;

/* Every backend's open file starts with this header (backends extend it). */
typedef struct st_file {
    const st_vfs *vfs;
} st_file;

/* Called once per directory entry with its size and kind (0 file, 1 directory, 2 symlink,
 * 3 other; never following a symlink). Returns ST_LIST_NEXT, ST_LIST_REMOVE (the backend
 * unlinks that entry, a regular file only) or ST_LIST_STOP. */
enum { ST_LIST_NEXT = 0, ST_LIST_REMOVE = 1, ST_LIST_STOP = -1 };
typedef int (*st_list_fn)(void *ctx, const char *name, uint64_t size, int kind);

struct st_vfs {
    int version;
    const char *scheme;
    unsigned caps;
    int (*open)(const st_vfs *v, const char *path, int flags, st_file **out);
    int64_t (*pread)(st_file *f, void *buf, size_t n, uint64_t off);
    int64_t (*pwrite)(st_file *f, const void *buf, size_t n, uint64_t off);
    int (*sync)(st_file *f);
    int (*size)(st_file *f, uint64_t *out);
    int (*truncate)(st_file *f, uint64_t size);
    int (*close)(st_file *f); /* always frees f */
    int (*direct)(st_file *f); /* 1 if opened with O_DIRECT */
    int (*mkdir)(const st_vfs *v, const char *path); /* 0 if created, -EEXIST if there */
    /* Never replaces an existing `to` (-EEXIST): a commit record is never overwritten. */
    int (*rename)(const st_vfs *v, const char *from, const char *to);
    int (*unlink)(const st_vfs *v, const char *path);
    int (*rmdir)(const st_vfs *v, const char *path);
    int (*sync_dir)(const st_vfs *v, const char *path);
    /* Lists dir, stats and removes entries through one handle on the directory (opened
     * without following a symlink), so that the directory cannot be swapped for a link
     * between the look and the unlink. 0, or the -errno of the listing or of the first
     * failed removal (the walk goes on after a failed removal). */
    int (*list)(const st_vfs *v, const char *dir, st_list_fn fn, void *ctx);
    /* kind: 0 regular file, 1 directory, 2 symlink, 3 other. Does not follow symlinks. */
    int (*stat)(const st_vfs *v, const char *path, uint64_t *size, int *kind);
    /* Reserves space for [0, size) so that later writes neither extend the file nor fail
     * for space; 0 or -errno (-EOPNOTSUPP where the backend cannot). On tmpfs the free
     * space is checked (-ENOSPC) instead: reserving would clear every page beforehand. */
    int (*allocate)(st_file *f, uint64_t size);
    /* Frees a backend instance made by st_vfs_resolve; NULL for static backends. */
    void (*release)(const st_vfs *v);
    /* Last modification time of path, ns since the epoch (not following a symlink). */
    int (*mtime)(const st_vfs *v, const char *path, uint64_t *ns);
    /* Takes the exclusive lock of the lock file at path without waiting: opens (creating)
     * it - a regular file, not through a symlink - and locks it; the lock lasts until
     * *out is closed or the process dies, and a lock file that was removed or replaced
     * meanwhile is never the one locked. 0, -EBUSY if another holder has it, or -errno
     * (-ENOENT when its directory is gone). */
    int (*lock)(const st_vfs *v, const char *path, st_file **out);
    /* The identity of an open file (fstat): 0 or -errno. */
    int (*ident)(st_file *f, st_file_id *out);
    /* ---- version 2 ---- */
    /* Swaps the entries a and b (both must exist; directories included) in one atomic step:
     * each name then leads to what the other did. -EINVAL, -ENOSYS or -EOPNOTSUPP where the
     * filesystem cannot (NFS); the caller falls back to two renames. */
    int (*exchange)(const st_vfs *v, const char *a, const char *b);
    /* Drops O_DIRECT on an open file (a filesystem that accepted the flag at open but refuses
     * the first aligned write with EINVAL): later writes are buffered. 0 or -errno. */
    int (*undirect)(st_file *f);
    /* ---- version 3 ---- */
    /* Makes `to` a new name of the regular file `from` (a hard link: both names lead to
     * one file, whose bytes live until the last name is removed). Never follows a symlink
     * at `from` (-ST_ENOTREG for anything but a regular file) and never replaces `to`
     * (-EEXIST). -EXDEV, -EPERM, -EOPNOTSUPP where the filesystem cannot; may be NULL. */
    int (*link)(const st_vfs *v, const char *from, const char *to);
};

extern const st_vfs st_vfs_posix;

/* Resolves a URI to a backend instance and a path: "file:///a/b" and "/a/b" or "a/b" are
 * POSIX paths; "mem://name" is the host-memory tier, name under $STRATA_MEM_ROOT
 * (default /dev/shm/strata-<euid>; made 0700 when missing, and refused with STRATA_EINVAL
 * unless it is a directory of this user's that no one else can write, not a symlink);
 * "s3://bucket/prefix" is object storage (st_vfs_s3_resolve, below);
 * "<wrapper>+<uri>?<query>" wraps the backend of <uri> in a
 * registered wrapper (st_vfs_register_wrapper). Returns STRATA_ESCHEME (with a message)
 * for any other scheme, STRATA_EINVAL for a malformed URI. path_out gets the path with
 * trailing slashes removed. Release the instance with st_vfs_release. */
int st_vfs_resolve(const char *uri, const st_vfs **vfs, char *path_out, size_t cap);
/* "s3://bucket/prefix" (vfs_s3.c): the object-store backend, its paths the URIs themselves;
 * STRATA_ENOTSUP in a build without libcurl, STRATA_EIO naming the bucket when it does not
 * answer or refuses the credentials. */
int st_vfs_s3_resolve(const char *uri, const st_vfs **vfs, char *path_out, size_t cap);
void st_vfs_release(const st_vfs *v);

/* A backend that wraps another (like SQLite's VFS shims): makes *out around inner,
 * configured by the URI's query string (may be NULL). */
typedef int (*st_vfs_wrap_fn)(const st_vfs **out, const st_vfs *inner, const char *query);
/* Registers the wrapper `name` (URIs "name+<uri>?query"); the resolver knows no wrapper
 * by itself. Thread-safe; registering a name again is a no-op. STRATA_ENOMEM when the
 * table (8 entries) is full. */
int st_vfs_register_wrapper(const char *name, st_vfs_wrap_fn make);

/* Reads a whole small file (metadata, commit record, a safetensors index) into a new
 * buffer, refusing files over max bytes; flags: 0, or ST_O_FOLLOW to read through a link.
 * Returns 0 or a negative errno (-EFBIG when too large). */
int st_vfs_read_all(const st_vfs *v, const char *path, size_t max, int flags,
                    unsigned char **out, size_t *len);
/* Writes n bytes at off, looping over short writes. 0 or negative errno (-EIO for a
 * write that makes no progress). */
int st_vfs_write_full(const st_vfs *v, st_file *f, const void *buf, size_t n, uint64_t off);
/* Reads n bytes at off; returns the count read (short only at end of file) or -errno. */
int64_t st_vfs_read_full(const st_vfs *v, st_file *f, void *buf, size_t n, uint64_t off);

/* Joins dir and a plain name into out (PATH_MAX). STRATA_EINVAL (with a message) if too
 * long. */
int st_path_join(char *out, const char *dir, const char *name);

/* The entries of a directory (st_vfs.list: never following a symlink), sorted by name. */
typedef struct st_dirent {
    char *name;
    int kind; /* st_vfs kinds: 0 file, 1 directory, 2 symlink, 3 other */
} st_dirent;
typedef struct st_dirlist {
    st_dirent *e;
    size_t n, cap;
    int oom;
} st_dirlist;
#define ST_DIRLIST_MAX 65536 /* entries looked at in one directory (a file per rank) */
/* Lists dir into *l (the first ST_DIRLIST_MAX entries), sorted by name: 0, or the listing's
 * -errno (-ENOMEM), l then empty. Free with st_dirlist_free. */
int st_dirlist_read(const st_vfs *v, const char *dir, st_dirlist *l);
void st_dirlist_free(st_dirlist *l);

#endif
