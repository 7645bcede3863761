/* cmd_export.c - `strata export`: a checkpoint to Hugging Face safetensors files, with
 * bounded memory. Uses only the public API (strata.h).
 *
 * The layout is decided first (which file each tensor goes to, at which offset); then each
 * file is written header first and its tensors filled window by window: every window is a
 * flat element range of one tensor's row-major flattening (or several small whole tensors
 * packed together), loaded by strata_load (which merges shards, flat pieces and replicas
 * and verifies every checksum it reads) into one reused buffer of EXPORT_BUF bytes,
 * converted in place if asked, and written with pwrite at its offset. The files are
 * written under temporary names (NAME.partial) and renamed when all of them are complete;
 * on any failure they are removed. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

#define EXPORT_BUF (64u << 20) /* the one window buffer */
#define EXPORT_ALIGN 64        /* pieces packed in the buffer start at multiples of this */
#define EXPORT_MAX_PIECES 4096 /* whole small tensors packed into one load */

static const char EXPORT_HELP[] =
    "usage: strata export CKPT OUT [--format safetensors] [--prefix P] [--max-file-gb N]\n"
    "                     [--dtype bf16] [--quiet]\n"
    "\n"
    "Writes the checkpoint's tensors, merged to their full global shapes from whatever\n"
    "shards, flat pieces and replicas were saved, as Hugging Face safetensors into the\n"
    "directory OUT (made if missing): model-0000i-of-0000N.safetensors files and\n"
    "model.safetensors.index.json ({\"metadata\": {\"total_size\": N}, \"weight_map\":\n"
    "{name: file}}). Blobs (non-tensor state) are not exported.\n"
    "\n"
    "  --format F       only safetensors (the default)\n"
    "  --prefix P       strip P from the start of tensor names; names without P are\n"
    "                   exported unchanged\n"
    "  --max-file-gb N  the most tensor bytes per file, in GB of 10^9 bytes (default 5;\n"
    "                   a fraction such as 0.5 is allowed); a tensor larger than that gets\n"
    "                   a file of its own\n"
    "  --dtype bf16     convert floating tensors (f64, f32, f16) to bf16, rounding to\n"
    "                   nearest even; others are written as saved. Without it every tensor\n"
    "                   keeps its saved dtype\n"
    "  --quiet          no progress line (it is shown only when stderr is a terminal)\n"
    "\n"
    "Memory stays bounded whatever the model size: tensors are loaded in windows of at\n"
    "most 64 MiB (flat element ranges of the tensor) into one reused buffer. Every\n"
    "checksum is verified while reading: a corrupt or incomplete checkpoint exits 3 and\n"
    "leaves no output file (files are written as NAME.partial and renamed at the end).\n";

/* One exported tensor. */
typedef struct {
    size_t idx;           /* in the checkpoint */
    const char *src_name; /* the checkpoint's name */
    const char *out_name; /* stripped of the prefix */
    strata_dtype src, dst;
    int ndim;
    const uint64_t *shape;
    uint64_t numel, src_sz, dst_sz;
    int file;
    uint64_t begin; /* data offset inside its file's data section */
} ex_tensor;

/* A window queued for one load. */
typedef struct {
    ex_tensor *t;
    uint64_t start, count; /* element range */
    size_t off;            /* in the buffer */
} ex_piece;

typedef struct {
    const char *ckpt;
    ex_tensor *ts;
    size_t nts;
    int nfiles;
    char **paths;     /* final file paths (nfiles + 1: the index last) */
    char **tmp_paths; /* NAME.partial */
    unsigned char *buf;
    ex_piece pieces[EXPORT_MAX_PIECES];
    int npieces;
    size_t used;
    int fd;
    uint64_t data_start; /* where the data section begins in the current file */
    /* progress */
    int progress;
    uint64_t total_bytes, done_bytes;
    double t0, last_print;
} ex_ctx;

static const char *st_dtype_name(strata_dtype dt)
{
    static const char *const names[STRATA_DTYPE_COUNT] = {
        [STRATA_F64] = "F64",       [STRATA_F32] = "F32",         [STRATA_F16] = "F16",
        [STRATA_BF16] = "BF16",     [STRATA_FP8_E4M3] = "F8_E4M3", [STRATA_FP8_E5M2] = "F8_E5M2",
        [STRATA_I64] = "I64",       [STRATA_I32] = "I32",         [STRATA_I16] = "I16",
        [STRATA_I8] = "I8",         [STRATA_U8] = "U8",           [STRATA_BOOL] = "BOOL",
    };
    return (unsigned)dt < STRATA_DTYPE_COUNT ? names[dt] : NULL;
}

/* ---- bf16 conversion (round to nearest even; NaN stays a quiet NaN of the same sign) ---- */

static uint16_t f32_bits_to_bf16(uint32_t u)
{
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        float v = ldexpf((float)man, -24); /* exact */
        return sign ? -v : v;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* double -> float rounding to odd (exact for the later rounding to bf16, which has far
 * fewer bits), so that f64 -> bf16 rounds once, to nearest even. */
static uint32_t f64_to_f32_odd_bits(double d)
{
    float f = (float)d;
    if (isnan(d))
        return f32_bits(f);
    if (fabs((double)f) > fabs(d))
        f = nextafterf(f, 0.0f);
    uint32_t u = f32_bits(f);
    if ((double)f != d)
        u |= 1;
    return u;
}

/* Converts n elements of src dtype at p to bf16, in place (the output is never larger). */
static void to_bf16(unsigned char *p, strata_dtype src, uint64_t n)
{
    uint16_t *o = (uint16_t *)p;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t u;
        if (src == STRATA_F32) {
            memcpy(&u, p + 4 * i, 4);
        } else if (src == STRATA_F64) {
            double d;
            memcpy(&d, p + 8 * i, 8);
            u = f64_to_f32_odd_bits(d);
        } else { /* F16 */
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            u = f32_bits(f16_to_f32(h));
        }
        uint16_t b = f32_bits_to_bf16(u);
        memcpy(&o[i], &b, 2);
    }
}

/* ---- writing --------------------------------------------------------------------------- */

static int pwrite_all(int fd, const void *p, size_t n, uint64_t off, const char *path)
{
    const unsigned char *c = p;
    while (n) {
        ssize_t w = pwrite(fd, c, n, (off_t)off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int e = errno;
            return strata_error_set(e == ENOSPC || e == EDQUOT ? STRATA_ENOSPC : STRATA_EIO,
                                    "writing %s: %s", path, strerror(e));
        }
        c += w, n -= (size_t)w, off += (uint64_t)w;
    }
    return 0;
}

static void fmt_bytes(char *out, size_t n, double b)
{
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024 && i < 4)
        b /= 1024, i++;
    snprintf(out, n, "%.1f %s", b, u[i]);
}

static void progress(ex_ctx *c, int final)
{
    if (!c->progress)
        return;
    double now = cli_now();
    if (!final && now - c->last_print < 0.2)
        return;
    c->last_print = now;
    double el = now - c->t0, rate = el > 0 ? (double)c->done_bytes / el : 0;
    char d[32], t[32], r[32], eta[32] = "?";
    fmt_bytes(d, sizeof d, (double)c->done_bytes);
    fmt_bytes(t, sizeof t, (double)c->total_bytes);
    fmt_bytes(r, sizeof r, rate);
    if (rate > 0)
        snprintf(eta, sizeof eta, "%.0f s", (double)(c->total_bytes - c->done_bytes) / rate);
    fprintf(stderr, "\r\033[Kexport: %s / %s  %s/s  %s left", d, t, r, eta);
    if (final)
        fputc('\n', stderr);
    fflush(stderr);
}

/* Loads the queued pieces, converts them and writes them to the current file. */
static int flush(ex_ctx *c)
{
    if (!c->npieces)
        return 0;
    strata_state *st;
    int rc = strata_state_new(&st);
    if (rc)
        return rc;
    for (int i = 0; i < c->npieces && !rc; i++) {
        ex_piece *p = &c->pieces[i];
        strata_shard sh = {0};
        sh.name = p->t->src_name;
        sh.dtype = p->t->src;
        sh.ndim = p->t->ndim;
        sh.global_shape = p->t->shape;
        if (p->count != p->t->numel) {
            sh.flat = 1;
            sh.flat_start = p->start;
            sh.flat_end = p->start + p->count;
        }
        sh.data = c->buf + p->off;
        rc = strata_state_add_shard(st, &sh);
    }
    if (!rc) {
        const char *uri = c->ckpt;
        strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
        rc = strata_load(NULL, NULL, &uri, 1, &st, 1, &lo);
    }
    strata_state_free(st);
    for (int i = 0; i < c->npieces && !rc; i++) {
        ex_piece *p = &c->pieces[i];
        if (p->t->dst != p->t->src)
            to_bf16(c->buf + p->off, p->t->src, p->count);
        uint64_t n = p->count * p->t->dst_sz;
        rc = pwrite_all(c->fd, c->buf + p->off, n,
                        c->data_start + p->t->begin + p->start * p->t->dst_sz,
                        c->tmp_paths[p->t->file]);
        c->done_bytes += n;
    }
    c->npieces = 0;
    c->used = 0;
    progress(c, 0);
    return rc;
}

/* Queues tensor t's windows, flushing whenever the buffer is full. */
static int queue_tensor(ex_ctx *c, ex_tensor *t)
{
    uint64_t pos = 0;
    while (pos < t->numel) {
        size_t off = (c->used + EXPORT_ALIGN - 1) / EXPORT_ALIGN * EXPORT_ALIGN;
        uint64_t space = off < EXPORT_BUF ? (EXPORT_BUF - off) / t->src_sz : 0;
        if (space == 0 || c->npieces == EXPORT_MAX_PIECES) {
            int rc = flush(c);
            if (rc)
                return rc;
            continue;
        }
        uint64_t take = t->numel - pos < space ? t->numel - pos : space;
        if (take < t->numel && t->ndim == 0) { /* a scalar is never split */
            int rc = flush(c);
            if (rc)
                return rc;
            continue;
        }
        c->pieces[c->npieces++] = (ex_piece){t, pos, take, off};
        c->used = off + take * t->src_sz;
        pos += take;
    }
    return 0;
}

/* Writes file f (tensors ts[lo..hi)) under its temporary name. */
static int write_file(ex_ctx *c, int f, size_t lo, size_t hi)
{
    char *hdr = NULL;
    size_t hlen = 0;
    FILE *m = open_memstream(&hdr, &hlen);
    if (!m)
        return strata_error_set(STRATA_ENOMEM, "out of memory for a header");
    fputs("{\"__metadata__\":{\"format\":\"pt\"}", m);
    for (size_t i = lo; i < hi; i++) {
        ex_tensor *t = &c->ts[i];
        fputc(',', m);
        cli_json_str(m, t->out_name);
        fprintf(m, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype_name(t->dst));
        for (int d = 0; d < t->ndim; d++)
            fprintf(m, d ? ",%llu" : "%llu", (unsigned long long)t->shape[d]);
        fprintf(m, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)t->begin,
                (unsigned long long)(t->begin + t->numel * t->dst_sz));
    }
    fputc('}', m);
    while ((ftell(m) % 8) != 0)
        fputc(' ', m);
    if (fclose(m)) {
        free(hdr);
        return strata_error_set(STRATA_ENOMEM, "out of memory for a header");
    }
    const char *path = c->tmp_paths[f];
    c->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (c->fd < 0) {
        int e = errno;
        free(hdr);
        return strata_error_set(STRATA_EIO, "creating %s: %s", path, strerror(e));
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    int rc = pwrite_all(c->fd, len8, 8, 0, path);
    if (!rc)
        rc = pwrite_all(c->fd, hdr, hlen, 8, path);
    free(hdr);
    c->data_start = 8 + hlen;
    for (size_t i = lo; i < hi && !rc; i++)
        rc = queue_tensor(c, &c->ts[i]);
    if (!rc)
        rc = flush(c);
    c->npieces = 0;
    c->used = 0;
    if (!rc && fsync(c->fd))
        rc = strata_error_set(STRATA_EIO, "fsync %s: %s", path, strerror(errno));
    if (close(c->fd) && !rc)
        rc = strata_error_set(STRATA_EIO, "closing %s: %s", path, strerror(errno));
    c->fd = -1;
    return rc;
}

static int write_index(ex_ctx *c, uint64_t total)
{
    const char *path = c->tmp_paths[c->nfiles];
    FILE *f = fopen(path, "w");
    if (!f)
        return strata_error_set(STRATA_EIO, "creating %s: %s", path, strerror(errno));
    fprintf(f, "{\n  \"metadata\": {\"total_size\": %llu},\n  \"weight_map\": {",
            (unsigned long long)total);
    for (size_t i = 0; i < c->nts; i++) {
        fputs(i ? ",\n    " : "\n    ", f);
        cli_json_str(f, c->ts[i].out_name);
        fputs(": ", f);
        const char *base = strrchr(c->paths[c->ts[i].file], '/');
        cli_json_str(f, base ? base + 1 : c->paths[c->ts[i].file]);
    }
    fputs("\n  }\n}\n", f);
    int bad = ferror(f) | fflush(f) | fsync(fileno(f));
    if (fclose(f) || bad)
        return strata_error_set(STRATA_EIO, "writing %s: %s", path, strerror(errno));
    return 0;
}

static int cmp_out_name(const void *a, const void *b)
{
    return strcmp((*(ex_tensor *const *)a)->out_name, (*(ex_tensor *const *)b)->out_name);
}

int cmd_export(int argc, char **argv)
{
    const char *ckpt = NULL, *out = NULL, *prefix = NULL, *dtype = NULL;
    double max_gb = 5;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(EXPORT_HELP, stdout);
            return 0;
        } else if (strcmp(a, "--quiet") == 0 || strcmp(a, "-q") == 0) {
            quiet = 1;
        } else if (strcmp(a, "--format") == 0 && has_val) {
            if (strcmp(argv[++i], "safetensors") != 0) {
                fprintf(stderr, "strata export: unknown --format '%s' (only safetensors)\n",
                        argv[i]);
                return EXIT_USAGE;
            }
        } else if (strcmp(a, "--prefix") == 0 && has_val) {
            prefix = argv[++i];
        } else if (strcmp(a, "--dtype") == 0 && has_val) {
            dtype = argv[++i];
            if (strcmp(dtype, "bf16") != 0) {
                fprintf(stderr, "strata export: unsupported --dtype '%s' (only bf16)\n", dtype);
                return EXIT_USAGE;
            }
        } else if (strcmp(a, "--max-file-gb") == 0 && has_val) {
            char *end;
            max_gb = strtod(argv[++i], &end);
            if (*end || !(max_gb > 0) || max_gb > 1e9) {
                fprintf(stderr, "strata export: bad --max-file-gb '%s' (a number > 0)\n",
                        argv[i]);
                return EXIT_USAGE;
            }
        } else if (a[0] != '-' && !ckpt) {
            ckpt = a;
        } else if (a[0] != '-' && !out) {
            out = a;
        } else {
            fprintf(stderr, "strata export: unexpected argument '%s' (see --help)\n", a);
            return EXIT_USAGE;
        }
    }
    if (!ckpt || !out) {
        fputs(EXPORT_HELP, stderr);
        return EXIT_USAGE;
    }
    uint64_t max_bytes = (uint64_t)(max_gb * 1e9);
    if (max_bytes == 0)
        max_bytes = 1;

    strata_ckpt *ck;
    int rc = strata_ckpt_open(&ck, ckpt, 0);
    if (rc)
        return cli_fail("export", rc);

    ex_ctx *c = calloc(1, sizeof *c);
    size_t nt = strata_ckpt_ntensors(ck);
    size_t plen = prefix ? strlen(prefix) : 0;
    int made_dir = 0;
    ex_tensor **sorted = NULL;
    if (!c || !(c->ts = calloc(nt ? nt : 1, sizeof *c->ts)) ||
        !(sorted = calloc(nt ? nt : 1, sizeof *sorted))) {
        rc = strata_error_set(STRATA_ENOMEM, "out of memory");
        goto done;
    }
    c->ckpt = ckpt;
    c->nts = nt;
    c->fd = -1;

    /* layout: names, dtypes, sizes, files, offsets */
    uint64_t file_used = 0, total = 0;
    int file = 0;
    for (size_t i = 0; i < nt; i++) {
        strata_tensor_info ti;
        strata_ckpt_tensor(&ti, ck, i);
        ex_tensor *t = &c->ts[i];
        t->idx = i;
        t->src_name = ti.name;
        t->out_name = ti.name;
        if (plen && strncmp(ti.name, prefix, plen) == 0 && ti.name[plen])
            t->out_name = ti.name + plen;
        t->src = t->dst = ti.dtype;
        if (dtype && (ti.dtype == STRATA_F32 || ti.dtype == STRATA_F64 || ti.dtype == STRATA_F16))
            t->dst = STRATA_BF16;
        t->ndim = ti.ndim;
        t->shape = ti.shape;
        t->numel = 1;
        for (int d = 0; d < ti.ndim; d++)
            t->numel *= ti.shape[d];
        t->src_sz = strata_dtype_size(t->src);
        t->dst_sz = strata_dtype_size(t->dst);
        if (!st_dtype_name(t->dst) || !t->src_sz) {
            rc = strata_error_set(STRATA_EFORMAT, "tensor '%s': unknown dtype %d", ti.name,
                                  (int)ti.dtype);
            goto done;
        }
        uint64_t bytes = t->numel * t->dst_sz;
        if (file_used > 0 && file_used + bytes > max_bytes)
            file++, file_used = 0;
        t->file = file;
        t->begin = file_used;
        file_used += bytes;
        total += bytes;
        sorted[i] = t;
    }
    c->nfiles = file + 1;
    c->total_bytes = total;
    qsort(sorted, nt, sizeof *sorted, cmp_out_name);
    for (size_t i = 1; i < nt; i++)
        if (strcmp(sorted[i - 1]->out_name, sorted[i]->out_name) == 0) {
            rc = strata_error_set(STRATA_EINVAL,
                                  "tensors '%s' and '%s' have the same name '%s' once the "
                                  "prefix is stripped",
                                  sorted[i - 1]->src_name, sorted[i]->src_name,
                                  sorted[i]->out_name);
            goto done;
        }

    /* output paths */
    struct stat sb;
    if (stat(out, &sb) != 0) {
        if (mkdir(out, 0755) != 0) {
            rc = strata_error_set(STRATA_EIO, "creating %s: %s", out, strerror(errno));
            goto done;
        }
        made_dir = 1;
    } else if (!S_ISDIR(sb.st_mode)) {
        rc = strata_error_set(STRATA_EIO, "%s exists and is not a directory", out);
        goto done;
    }
    c->paths = calloc((size_t)c->nfiles + 1, sizeof *c->paths);
    c->tmp_paths = calloc((size_t)c->nfiles + 1, sizeof *c->tmp_paths);
    if (!c->paths || !c->tmp_paths) {
        rc = strata_error_set(STRATA_ENOMEM, "out of memory");
        goto done;
    }
    for (int f = 0; f <= c->nfiles; f++) {
        char *p, *tp;
        int ok = f < c->nfiles
                     ? asprintf(&p, "%s/model-%05d-of-%05d.safetensors", out, f + 1, c->nfiles)
                     : asprintf(&p, "%s/model.safetensors.index.json", out);
        if (ok < 0) {
            rc = strata_error_set(STRATA_ENOMEM, "out of memory");
            goto done;
        }
        c->paths[f] = p;
        if (asprintf(&tp, "%s.partial", p) < 0) {
            rc = strata_error_set(STRATA_ENOMEM, "out of memory");
            goto done;
        }
        c->tmp_paths[f] = tp;
    }

    c->buf = malloc(EXPORT_BUF);
    if (!c->buf) {
        rc = strata_error_set(STRATA_ENOMEM, "out of memory for the %u-byte buffer", EXPORT_BUF);
        goto done;
    }
    c->progress = !quiet && isatty(2);
    c->t0 = c->last_print = cli_now();
    size_t lo = 0;
    for (int f = 0; f < c->nfiles && !rc; f++) {
        size_t hi = lo;
        while (hi < nt && c->ts[hi].file == f)
            hi++;
        rc = write_file(c, f, lo, hi);
        lo = hi;
    }
    if (!rc)
        rc = write_index(c, total);
    int renamed = 0;
    for (; renamed <= c->nfiles && !rc; renamed++)
        if (rename(c->tmp_paths[renamed], c->paths[renamed]) != 0)
            rc = strata_error_set(STRATA_EIO, "renaming %s: %s", c->tmp_paths[renamed],
                                  strerror(errno));
    if (rc) /* undo the renames that were done */
        for (int f = 0; f < renamed - 1; f++)
            unlink(c->paths[f]);
    if (!rc) {
        int dfd = open(out, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            fsync(dfd);
            close(dfd);
        }
        progress(c, 1);
        if (!quiet)
            printf("exported %zu tensors, %llu bytes, to %d file%s in %s\n", nt,
                   (unsigned long long)total, c->nfiles, c->nfiles == 1 ? "" : "s", out);
    } else if (c->progress) {
        fputc('\n', stderr);
    }

done:
    if (c && c->paths) {
        for (int f = 0; f <= c->nfiles; f++) {
            if (rc && c->tmp_paths[f]) /* remove everything this export wrote */
                unlink(c->tmp_paths[f]);
            free(c->paths[f]);
            free(c->tmp_paths[f]);
        }
        free(c->paths);
        free(c->tmp_paths);
    }
    if (rc && made_dir)
        rmdir(out);
    if (c) {
        free(c->buf);
        free(c->ts);
    }
    free(c);
    free(sorted);
    int ret = rc ? cli_fail("export", rc) : 0;
    strata_ckpt_free(ck);
    return ret;
}
