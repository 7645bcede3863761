/* main.c - the `strata` command: dispatch to subcommands, exit-status mapping. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ftw.h>
#include <sys/stat.h>

#include "cli.h"

int cli_exit_code(int rc)
{
    switch (rc) {
    case STRATA_OK:
        return 0;
    case STRATA_ECHECKSUM:
    case STRATA_EFORMAT:
    case STRATA_EINCOMPLETE:
        return EXIT_CORRUPT;
    case STRATA_EINVAL:
    case STRATA_ESCHEME:
        return EXIT_USAGE;
    default:
        return EXIT_OPFAIL;
    }
}

int cli_fail(const char *cmd, int rc)
{
    const char *msg = strata_error_last(); /* it names tensors and paths: escaped */
    fprintf(stderr, "strata %s: %s (%s)\n", cmd, msg && *msg ? cli_esc(msg) : strata_error_str(rc),
            strata_error_name(rc));
    return cli_exit_code(rc);
}

long long cli_parse_num(const char *s)
{
    if (!s || !*s)
        return -1;
    char *end;
    long long v = strtoll(s, &end, 10);
    return (*end || v < 0) ? -1 : v;
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

void cli_rm_rf(const char *dir) { nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

double cli_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int cli_wants_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0)
            return 1;
    return 0;
}

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} cmds[] = {
    {"demo", cmd_demo, "save a synthetic GPT-style state in one layout, load it into another, check every element"},
    {"inspect", cmd_inspect, "show a checkpoint's tensors, dtypes, shapes, shards and files"},
    {"ls", cmd_ls, "list the checkpoints under a directory: committed or incomplete, size, step"},
    {"verify", cmd_verify, "read every byte of a checkpoint and check every checksum"},
    {"gc", cmd_gc, "remove incomplete checkpoints under a directory"},
    {"export", cmd_export, "write a checkpoint's tensors as Hugging Face safetensors files"},
    {"copy", cmd_copy, "copy a committed checkpoint to a new place, any backend (s3://), verified"},
    {"bench", cmd_bench, "measure save and load bandwidth (cold page cache)"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: strata COMMAND [ARGS]   (strata COMMAND --help for its options)\n\n"
               "strata %d.%d: a checkpoint engine for sharded training state.\n\ncommands:\n",
            STRATA_VERSION_MAJOR, STRATA_VERSION_MINOR);
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        fprintf(f, "  %-8s %s\n", cmds[i].name, cmds[i].what);
    fprintf(f, "\nCheckpoints are named by a path, or a file://, mem:// or s3://bucket/prefix URI\n"
               "(s3:// takes AWS_ENDPOINT_URL, AWS_REGION and the AWS_* credentials, and needs a\n"
               "build with libcurl). inspect, verify and export also read, by their content,\n"
               "PyTorch DCP, Megatron torch_dist, DeepSpeed ZeRO, torch.save files and safetensors.\n"
               "Exit status: 0 ok, 1 the operation failed, 2 usage error, 3 the checkpoint is\n"
               "corrupt or incomplete.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("strata %d.%d\n", STRATA_VERSION_MAJOR, STRATA_VERSION_MINOR);
        return 0;
    }
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (strcmp(argv[1], cmds[i].name) == 0)
            return cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "strata: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return EXIT_USAGE;
}

/* The UTF-8 sequence at s (NUL-terminated): its length, with *ok = 1 if it is one valid
 * character (shortest form, no surrogate, at most U+10FFFF); else *ok = 0 and the length
 * of the maximal prefix of a valid sequence (at least 1), which Unicode recommends
 * replacing by one U+FFFD (as Python's errors="replace" does). */
static size_t utf8_seq(const unsigned char *s, int *ok)
{
    unsigned c = s[0], lo = 0x80, hi = 0xBF;
    size_t need;
    *ok = 0;
    if (c < 0x80) {
        *ok = 1;
        return 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 2;
        lo = c == 0xE0 ? 0xA0 : 0x80;
        hi = c == 0xED ? 0x9F : 0xBF;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 3;
        lo = c == 0xF0 ? 0x90 : 0x80;
        hi = c == 0xF4 ? 0x8F : 0xBF;
    } else {
        return 1;
    }
    for (size_t i = 1; i <= need; i++) { /* the NUL at the end is never in range */
        if (s[i] < lo || s[i] > hi)
            return i;
        lo = 0x80;
        hi = 0xBF;
    }
    *ok = 1;
    return need + 1;
}

/* A JSON string that parses whatever the bytes: names are UTF-8 when registered, but a
 * checkpoint written before that was checked may hold any byte but NUL. Invalid UTF-8
 * becomes U+FFFD; control characters, DEL, '"' and '\\' are escaped. */
void cli_json_str(FILE *f, const char *str)
{
    const unsigned char *s = (const unsigned char *)str;
    fputc('"', f);
    while (*s) {
        int ok;
        size_t n = utf8_seq(s, &ok);
        if (!ok)
            fputs("\\ufffd", f);
        else if (*s == '"' || *s == '\\')
            fprintf(f, "\\%c", *s);
        else if (*s < 0x20 || *s == 0x7f)
            fprintf(f, "\\u%04x", *s);
        else
            fwrite(s, 1, n, f);
        s += n;
    }
    fputc('"', f);
}

/* Is code point c one a terminal acts on or that reorders what it shows: C0 and C1
 * controls, DEL, and the bidirectional marks, embeddings, overrides and isolates? */
static int unprintable(unsigned c)
{
    return c < 0x20 || (c >= 0x7f && c <= 0x9f) || c == 0x200e || c == 0x200f ||
           (c >= 0x202a && c <= 0x202e) || (c >= 0x2066 && c <= 0x2069);
}

/* The code point of the valid UTF-8 sequence s of n bytes. */
static unsigned utf8_cp(const unsigned char *s, size_t n)
{
    static const unsigned lead_mask[] = {0, 0x7f, 0x1f, 0x0f, 0x07};
    unsigned c = s[0] & lead_mask[n];
    for (size_t i = 1; i < n; i++)
        c = (c << 6) | (s[i] & 0x3f);
    return c;
}

const char *cli_esc(const char *str)
{
    static char *ring[4];
    static size_t cap[4];
    static int next;
    const unsigned char *s = (const unsigned char *)str;
    size_t need = strlen(str) * 4 + 1; /* the longest escape per byte: \xNN */
    int k = next;
    next = (next + 1) % 4;
    if (cap[k] < need) {
        char *b = realloc(ring[k], need);
        if (!b)
            return "(out of memory)";
        ring[k] = b, cap[k] = need;
    }
    char *o = ring[k];
    while (*s) {
        int ok;
        size_t n = utf8_seq(s, &ok);
        unsigned c = ok ? utf8_cp(s, n) : 0;
        if (!ok) { /* a byte of no character: 0x9b alone is a CSI to some terminals */
            o += sprintf(o, "\\x%02x", *s);
            n = 1;
        } else if (c == '\\') {
            o += sprintf(o, "\\\\");
        } else if (c < 0x80 && unprintable(c)) {
            o += sprintf(o, "\\x%02x", c);
        } else if (unprintable(c)) { /* 2 or 3 bytes: at most 6 characters */
            o += sprintf(o, "\\u%04x", c);
        } else {
            memcpy(o, s, n);
            o += n;
        }
        s += n;
    }
    *o = 0;
    return ring[k];
}
