/* disk_rate.c - strata_disk_rate_measure and strata_disk_counters: the device under a
 * directory, for benchmarks that compare strata with the disk's own rate (src/io/disk.c). */
#include <stdio.h>
#include <string.h>

#include "../core/error.h"
#include "../io/pool.h"
#include "../engine/engine.h"

int strata_disk_rate_measure(strata_disk_rate *out, const char *dir, uint64_t bytes,
                             int threads, int small_pages)
{
    st_clear_error();
    if (!out || !dir || out->version < 1 || out->version > STRATA_DISK_RATE_VERSION)
        return st_fail(STRATA_EINVAL, "strata_disk_rate_measure: %s",
                       !out || !dir ? "out and dir are required" : "unknown version");
    st_disk_rate r;
    uint64_t rb = st_read_bytes_for(dir);
    int e = st_disk_measure(dir, bytes, st_io_threads(threads), rb, ST_SAVE_TASK_BYTES,
                            small_pages, &r);
    if (e)
        return st_fail(st_from_errno(-e), "measuring the disk under '%s': %s", dir,
                       strerror(-e));
    out->write_gbps = r.write_gbps;
    out->read_gbps = r.read_gbps;
    out->write_request = r.write_request;
    out->read_request = r.read_request;
    out->max_request = r.max_request;
    out->read_block = rb;
    out->pages = st_io_pages_name(r.pages);
    return 0;
}

int strata_disk_counters(const char *path, uint64_t out[4])
{
    st_clear_error();
    int e = st_disk_counters(path, out);
    if (e)
        return st_fail(STRATA_ENOENT, "no block device listed in /proc/diskstats under '%s'",
                       path);
    return 0;
}
