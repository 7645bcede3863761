/* progress.c - the progress line of a long command (export, copy) on a terminal, and the
 * stop on SIGINT / SIGTERM / SIGHUP through the operation's progress callback. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

static volatile sig_atomic_t stop_signal; /* the signal that asks the operation to stop */

static void on_stop_signal(int sig) { stop_signal = sig; }

void cli_progress_start(cli_progress *p, const char *what, const char *stopped, int quiet)
{
    memset(p, 0, sizeof *p);
    p->what = what;
    p->stopped = stopped;
    p->show = !quiet && isatty(2);
    p->t0 = p->last_print = cli_now();
    /* the first signal stops the operation at its next report; a second one kills */
    struct sigaction sa = {0};
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}

static void fmt_bytes(char *out, size_t n, double b)
{
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024 && i < 4)
        b /= 1024, i++;
    snprintf(out, n, "%.1f %s", b, u[i]);
}

static void print_progress(cli_progress *p, int final)
{
    double now = cli_now();
    if (!final && now - p->last_print < 0.2)
        return;
    p->last_print = now;
    double el = now - p->t0, rate = el > 0 ? (double)p->done / el : 0;
    char d[32], t[32], r[32], eta[32] = "?";
    fmt_bytes(d, sizeof d, (double)p->done);
    fmt_bytes(t, sizeof t, (double)p->total);
    fmt_bytes(r, sizeof r, rate);
    if (rate > 0)
        snprintf(eta, sizeof eta, "%.0f s", (double)(p->total - p->done) / rate);
    fprintf(stderr, "\r\033[K%s: %s / %s  %s/s  %s left", p->what, d, t, r, eta);
    if (final)
        fputc('\n', stderr);
    p->shown = !final;
    fflush(stderr);
}

int cli_progress_cb(void *ctx, uint64_t done, uint64_t total)
{
    cli_progress *p = ctx;
    if (stop_signal) {
        strata_error_set(STRATA_EABORTED, "interrupted by %s: %s", strsignal(stop_signal),
                         p->stopped);
        return 1;
    }
    p->done = done;
    p->total = total;
    if (done && p->show) /* not the call before the first write */
        print_progress(p, 0);
    return 0;
}

void cli_progress_end(cli_progress *p, int ok)
{
    if (ok && p->show)
        print_progress(p, 1);
    else if (p->shown)
        fputc('\n', stderr);
}
