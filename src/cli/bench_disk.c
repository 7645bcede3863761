/* bench_disk.c - `strata bench disk`: the disk under a directory measured the way strata uses
 * it (strata_disk_rate_measure): its own I/O buffers (huge pages) and, to compare, buffers of
 * 4 KiB pages; the rates that "fraction of the disk" figures are taken against. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char HELP[] =
    "usage: strata bench disk [--dir D] [--size-mb N] [--threads T] [--runs R]\n"
    "\n"
    "Measures the disk under D (default .): writes a scratch file of N MiB (default 2048)\n"
    "with O_DIRECT in 8 MiB requests from T threads (default: strata's I/O threads), fsyncs\n"
    "it, reads it back cold in the requests of a load, and removes it; first through I/O\n"
    "buffers of the kind strata uses (2 MiB-aligned huge pages where the kernel gives them),\n"
    "then through buffers of 4 KiB pages; R times. One line per pass:\n"
    "  run=I buffers=strata|4k write_gbps=X read_gbps=X write_req_kib=K read_req_kib=K\n"
    "      max_request_kib=K read_kib=K pages=\"WHAT BACKED THEM\"\n"
    "req_kib: average bytes per device request in the pass (/proc/diskstats; everything on\n"
    "the device then counts). GB/s are 1e9 bytes per second.\n";

int cli_disk_line(const char *dir, long long mb, int threads, int small, long long run)
{
    strata_disk_rate r = STRATA_DISK_RATE_INIT;
    int rc = strata_disk_rate_measure(&r, dir, (uint64_t)mb << 20, threads, small);
    if (rc)
        return cli_fail("bench disk", rc);
    printf("run=%lld buffers=%s write_gbps=%.3f read_gbps=%.3f write_req_kib=%.0f "
           "read_req_kib=%.0f max_request_kib=%llu read_kib=%llu pages=\"%s\"\n",
           run, small ? "4k" : "strata", r.write_gbps, r.read_gbps, r.write_request / 1024,
           r.read_request / 1024, (unsigned long long)(r.max_request >> 10),
           (unsigned long long)(r.read_block >> 10), r.pages);
    fflush(stdout);
    return 0;
}

int cmd_bench_disk(int argc, char **argv)
{
    const char *dir = ".";
    long long mb = 2048, runs = 1, threads = 0;
    for (int i = 2; i < argc; i += 2) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(k, "--help") == 0 || strcmp(k, "-h") == 0) {
            fputs(HELP, stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "strata bench disk: %s needs a value (see --help)\n", k);
            return EXIT_USAGE;
        }
        if (strcmp(k, "--dir") == 0)
            dir = v;
        else if (strcmp(k, "--size-mb") == 0 && (mb = cli_parse_num(v)) >= 8)
            ;
        else if (strcmp(k, "--runs") == 0 && (runs = cli_parse_num(v)) >= 1)
            ;
        else if (strcmp(k, "--threads") == 0 && (threads = cli_parse_num(v)) >= 1 && threads <= 64)
            ;
        else {
            fprintf(stderr, "strata bench disk: bad option or value '%s %s' (see --help)\n", k, v);
            return EXIT_USAGE;
        }
    }
    for (long long i = 1; i <= runs; i++)
        for (int small = 0; small < 2; small++) {
            int rc = cli_disk_line(dir, mb, (int)threads, small, i);
            if (rc)
                return rc;
        }
    return 0;
}
