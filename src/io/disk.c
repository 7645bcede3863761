/* disk.c - the rate of the block device under a directory, measured the way strata uses it:
 * a scratch file written sequentially with O_DIRECT by a few threads at once (then fsync)
 * and read back cold the same way, through I/O buffers of the kind strata uses (st_io_alloc:
 * huge pages) or of 4 KiB pages (the fallback, to compare), with the average request the
 * device saw from /proc/diskstats (whatever else ran on the device then counts too). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "../core/util.h"
#include "pool.h"

int st_disk_counters(const char *path, uint64_t c[4])
{
    struct stat st;
    if (stat(path, &st))
        return -errno;
    FILE *f = fopen("/proc/diskstats", "r");
    if (!f)
        return -errno;
    char line[512];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned maj, min;
        unsigned long long rd, rs, wr, ws;
        /* major minor name reads merged sectors ms writes merged sectors ... */
        if (sscanf(line, " %u %u %*s %llu %*u %llu %*u %llu %*u %llu", &maj, &min, &rd, &rs,
                   &wr, &ws) == 6 &&
            maj == major(st.st_dev) && min == minor(st.st_dev)) {
            c[0] = rd, c[1] = rs * 512, c[2] = wr, c[3] = ws * 512;
            found = 1;
        }
    }
    fclose(f);
    return found ? 0 : -ENODEV;
}

typedef struct {
    int fd, write;
    unsigned char **buf; /* per thread */
    uint64_t bytes, block;
    atomic_uint_fast64_t next;
    atomic_int err;
} disk_run;

typedef struct {
    disk_run *run;
    int k;
} disk_arg;

static void *disk_thread(void *p)
{
    disk_arg *a = p;
    disk_run *r = a->run;
    for (uint64_t off; !atomic_load(&r->err) &&
                       (off = atomic_fetch_add(&r->next, r->block)) < r->bytes;) {
        size_t n = (size_t)ST_MIN(r->block, r->bytes - off);
        ssize_t got = r->write ? pwrite(r->fd, r->buf[a->k], n, (off_t)off)
                               : pread(r->fd, r->buf[a->k], n, (off_t)off);
        if (got != (ssize_t)n)
            atomic_store(&r->err, got < 0 ? errno : EIO);
    }
    return NULL;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* One pass of nt threads over the file; seconds, or -errno. */
static double disk_pass(disk_run *r, int nt)
{
    pthread_t th[64];
    disk_arg args[64];
    atomic_init(&r->next, 0);
    atomic_init(&r->err, 0);
    double t0 = now_s();
    int started = 0;
    for (; started < nt; started++) {
        args[started] = (disk_arg){r, started};
        if (pthread_create(&th[started], NULL, disk_thread, &args[started]))
            break;
    }
    if (!started)
        return -EAGAIN;
    for (int k = 0; k < started; k++)
        pthread_join(th[k], NULL);
    if (r->write && !atomic_load(&r->err) && fsync(r->fd))
        atomic_store(&r->err, errno);
    return atomic_load(&r->err) ? -(double)atomic_load(&r->err) : now_s() - t0;
}

/* A buffer of 4 KiB pages that stay so (THP refused for it). */
static void *small_pages(size_t n)
{
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    madvise(p, n, MADV_NOHUGEPAGE);
    return p;
}

int st_disk_measure(const char *dir, uint64_t bytes, int threads, uint64_t read_block,
                    uint64_t write_block, int small, st_disk_rate *out)
{
    memset(out, 0, sizeof *out);
    threads = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    bytes = ST_ALIGN_UP(ST_MAX(bytes, write_block), 4096);
    char path[4200];
    snprintf(path, sizeof path, "%s/.strata-disk-%d", dir, (int)getpid());
    size_t bufsize = (size_t)ST_MAX(read_block, write_block);
    unsigned char *bufs[64] = {0};
    int e = 0;
    for (int k = 0; k < threads && !e; k++) {
        bufs[k] = small ? small_pages(bufsize) : st_io_alloc(bufsize);
        if (!bufs[k])
            e = -ENOMEM;
        else
            memset(bufs[k], 0x5a ^ k, bufsize); /* faulted in before the clock runs */
    }
    if (!e)
        out->pages = st_io_pages(bufs[0], bufsize);
    out->max_request = st_dev_max_request(dir);
    int fd = e ? -1 : open(path, O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
    if (!e && fd < 0)
        e = -errno;
    if (!e && fallocate(fd, 0, 0, (off_t)bytes))
        e = -errno;
    uint64_t a[4] = {0}, b[4] = {0};
    int counted = 0;
    disk_run r = {.fd = fd, .buf = bufs, .bytes = bytes};
    for (int write = 1; write >= 0 && !e; write--) {
        r.write = write;
        r.block = write ? write_block : read_block;
        if (!write)
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); /* cold (O_DIRECT kept it so) */
        counted = st_disk_counters(dir, a) == 0;
        double t = disk_pass(&r, threads);
        counted &= st_disk_counters(dir, b) == 0;
        if (t < 0) {
            e = (int)t;
            break;
        }
        double gbps = (double)bytes / t / 1e9;
        uint64_t reqs = b[write ? 2 : 0] - a[write ? 2 : 0];
        double per = counted && reqs ? (double)(b[write ? 3 : 1] - a[write ? 3 : 1]) / (double)reqs : 0;
        if (write)
            out->write_gbps = gbps, out->write_request = per;
        else
            out->read_gbps = gbps, out->read_request = per;
    }
    if (fd >= 0) {
        close(fd);
        unlink(path);
    }
    for (int k = 0; k < threads; k++)
        if (bufs[k]) {
            if (small)
                munmap(bufs[k], bufsize);
            else
                st_io_free(bufs[k], bufsize);
        }
    return e;
}
