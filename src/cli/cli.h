/* cli.h - the `strata` command's subcommands and shared helpers. Uses only strata.h. */
#ifndef STRATA_CLI_H
#define STRATA_CLI_H
#include <stdio.h>

#include "strata.h"

/* Exit statuses: 0 success, 1 failure of the operation (I/O, bad request, mismatch),
 * 2 usage error, 3 the checkpoint is corrupt or incomplete. */
enum { EXIT_OPFAIL = 1, EXIT_USAGE = 2, EXIT_CORRUPT = 3 };

int cli_exit_code(int strata_rc);
/* Prints "strata CMD: <message> (STRATA_E...)" to stderr and returns the exit status. */
int cli_fail(const char *cmd, int strata_rc);
/* Parses a decimal size; -1 on error. */
long long cli_parse_num(const char *s);
int cli_wants_help(int argc, char **argv);
/* Removes a directory tree (symlinks are removed, not followed); errors are ignored. */
void cli_rm_rf(const char *dir);
/* Monotonic seconds. */
double cli_now(void);
/* Writes str as a JSON string that parses whatever its bytes: invalid UTF-8 becomes U+FFFD;
 * '"', '\\', control characters and DEL are escaped. */
void cli_json_str(FILE *f, const char *str);
/* str made safe for a terminal, for text output of names, paths and messages that may come
 * from a checkpoint: C0 controls and DEL as \xNN, C1 and bidirectional controls as \uNNNN,
 * bytes that are not UTF-8 as \xNN, and a backslash doubled (so no escape can be forged);
 * everything else as is. The result lives until the 4th next call (a ring of buffers: up
 * to four in one printf). Not thread-safe. */
const char *cli_esc(const char *str);

/* The progress line of a long command (export, copy), shown only when stderr is a terminal
 * and not quiet: cli_progress_start (also makes SIGINT, SIGTERM and SIGHUP stop the
 * operation at its next report: the callback fails it with STRATA_EABORTED, "interrupted by
 * <signal>: <stopped>"), cli_progress_cb as the operation's progress callback (ctx: the
 * cli_progress; one call at a time), cli_progress_end once it returned (ok: the final
 * line). */
typedef struct {
    const char *what, *stopped;
    double t0, last_print;
    uint64_t done, total;
    int show;  /* print a progress line */
    int shown; /* a progress line is on the terminal */
} cli_progress;
void cli_progress_start(cli_progress *p, const char *what, const char *stopped, int quiet);
int cli_progress_cb(void *ctx, uint64_t done, uint64_t total);
void cli_progress_end(cli_progress *p, int ok);

int cmd_demo(int argc, char **argv);
/* `demo save` / `demo load` under MPI (demo_mpi.c); argv[1] is "save" or "load". */
int cmd_demo_mpi(int argc, char **argv);
int cmd_bench(int argc, char **argv);
/* `bench async` (bench_async.c); argv[1] is "async". */
int cmd_bench_async(int argc, char **argv);
/* `bench disk` (bench_disk.c); argv[1] is "disk". */
int cmd_bench_disk(int argc, char **argv);
/* One `bench disk` line for dir: the disk measured through strata's I/O buffers (small: 4 KiB
 * pages). 0 or the exit status of a failure. */
int cli_disk_line(const char *dir, long long mb, int threads, int small, long long run);
int cmd_inspect(int argc, char **argv);
int cmd_ls(int argc, char **argv);
int cmd_verify(int argc, char **argv);
int cmd_gc(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_copy(int argc, char **argv);

#endif
