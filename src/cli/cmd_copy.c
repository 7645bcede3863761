/* cmd_copy.c - `strata copy SRC DST`: a committed checkpoint to a new directory on any
 * backend (s3:// too), a thin wrapper of strata_copy_ext: the arguments, --help, the
 * progress line on a terminal, and a stop on Ctrl-C (progress.c), after which nothing is
 * committed at DST. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const char COPY_HELP[] =
    "usage: strata copy SRC DST [--quiet]\n"
    "\n"
    "Copies the committed strata checkpoint SRC to DST, a new checkpoint directory on any\n"
    "backend (a path, file://, mem:// or s3://bucket/prefix): every data file is read once\n"
    "and each checksum chunk verified before its bytes are written; then the metadata and a\n"
    "commit record of DST's own are written last, as a save commits. A copy stopped at any\n"
    "point (a failure, a corrupt chunk, Ctrl-C, a kill) leaves no committed checkpoint at DST\n"
    "(what it wrote is removed; after a kill, strata gc of DST's parent removes it). DST must\n"
    "not hold a committed checkpoint (exit 1, nothing touched); an incomplete one there is\n"
    "replaced. The copy is the same checkpoint (metadata, step, data files; an incremental\n"
    "one's linked files included: it stands on its own). Only strata's own checkpoints are\n"
    "copied: another format's is exported (strata export) or loaded.\n"
    "\n"
    "  --quiet   no progress line (it is shown only when stderr is a terminal) and no summary\n"
    "\n"
    "Exit status: 0 copied, 1 the copy failed, 2 usage, 3 SRC is corrupt or incomplete.\n";

int cmd_copy(int argc, char **argv)
{
    const char *src = NULL, *dst = NULL;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(COPY_HELP, stdout);
            return 0;
        } else if (strcmp(argv[i], "--quiet") == 0 || strcmp(argv[i], "-q") == 0) {
            quiet = 1;
        } else if (argv[i][0] != '-' && !src) {
            src = argv[i];
        } else if (argv[i][0] != '-' && !dst) {
            dst = argv[i];
        } else {
            fprintf(stderr, "strata copy: unexpected argument '%s' (see --help)\n", argv[i]);
            return EXIT_USAGE;
        }
    }
    if (!src || !dst) {
        fputs(COPY_HELP, stderr);
        return EXIT_USAGE;
    }
    cli_progress p;
    cli_progress_start(&p, "copy", "the copy stopped; nothing is committed at its destination",
                       quiet);
    strata_copy_opts o = STRATA_COPY_OPTS_INIT;
    o.progress = cli_progress_cb;
    o.progress_ctx = &p;
    strata_stats st = STRATA_STATS_INIT;
    int rc = strata_copy_ext(&st, src, dst, &o);
    cli_progress_end(&p, !rc);
    if (rc)
        return cli_fail("copy", rc);
    if (!quiet)
        printf("copied %s to %s: %llu bytes of data files, every chunk verified, in %.2f s; "
               "committed\n", cli_esc(src), cli_esc(dst), (unsigned long long)st.bytes,
               st.seconds);
    return 0;
}
