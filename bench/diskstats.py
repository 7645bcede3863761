"""The block device under a path and its counters in /proc/diskstats (device-wide: on a
shared machine they count other processes' requests too). Used by bench_crc.py and
bench_megatron.py for bytes per device request."""

import os


def device(path):
    """The name in /proc/diskstats of the block device holding path (None if not found)."""
    st = os.stat(path)
    mj, mn = os.major(st.st_dev), os.minor(st.st_dev)
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if int(p[0]) == mj and int(p[1]) == mn:
                return p[2]
    return None


def counters(dev):
    """(read requests completed, sectors read, write requests completed, sectors written)
    of dev; zeros when it is not listed."""
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[3]), int(p[5]), int(p[7]), int(p[9])
    return 0, 0, 0, 0
