/* export.c - strata_export_safetensors: a checkpoint to Hugging Face safetensors files, with
 * bounded memory, through the engine's public calls (one strata_loader for every window).
 *
 * The layout is decided first (which file each tensor goes to, at which offset); then each
 * file is written header first and its tensors filled window by window: every window is a
 * flat element range of one tensor's row-major flattening (or several small whole tensors
 * packed together), loaded by strata_loader_load (which merges shards, flat pieces and replicas
 * and verifies every checksum it reads) into one of two window buffers of EXPORT_BUF bytes and
 * converted in place if asked. Window N+1 loads on a thread of its own while window N is
 * converted and written on the caller's thread (which alone writes, reports progress and
 * decides a stop), so reads and writes overlap. A file's bytes are produced in order (header, then its
 * tensors' data back to back), so they go through one aligned staging buffer of
 * EXPORT_STAGE bytes written with O_DIRECT at aligned offsets (the page cache is left
 * alone; buffered writes where O_DIRECT is refused or STRATA_EXPORT_NO_DIRECT asks); the
 * last partial block is padded and the file truncated to its size. The files are written
 * into a staging directory beside the output directory and fsynced; when all are complete
 * the staging set takes the output directory's place in one step (export_dir.c), so its
 * readers see the previous set or the new one, never a mix; on any failure the staging
 * directory is removed. Every file call goes through the storage layer (vfs.h), the fault
 * injector's included. The bf16 conversion is st_convert's (on bits, no libm; in place:
 * the output is never larger). */
#include <errno.h>
#include <fnmatch.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/convert.h"
#include "../core/error.h"
#include "../core/utf8.h"
#include "../io/pool.h"
#include "../io/vfs.h"
#include "../source/safetensors.h"
#include "../engine/engine.h"
#include "export.h"

#define EXPORT_ALIGN 64                /* pieces packed in the buffer start at multiples of this */
#define EXPORT_MAX_PIECES 4096         /* whole small tensors packed into one load */
#define EXPORT_DEFAULT_FILE 5000000000ull /* max_file_bytes 0: 5 GB */
#define EXPORT_STAGE (8u << 20)        /* the aligned staging buffer of the writes */
#define EXPORT_BLOCK 4096              /* O_DIRECT alignment of offsets, sizes, memory */
#define EXPORT_MAX_IO (4u << 20)       /* the loads' largest read (the default now too;
                                          16 MiB gave a peak RSS of 154-170 MiB, not 90, for
                                          a 1 GiB tensor) */

/* One exported tensor. */
typedef struct {
    const char *src_name; /* the checkpoint's name */
    const char *out_name; /* stripped of the prefix (or model_only's "P.") */
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

/* A window: pieces queued into its buffer, loaded at once. */
typedef struct {
    unsigned char *buf; /* EXPORT_BUF bytes */
    ex_piece *pieces;   /* EXPORT_MAX_PIECES */
    int npieces;
    size_t used;
} ex_win;

typedef struct {
    strata_loader *ld; /* the checkpoint, opened once for every window */
    const strata_export_opts *o;
    ex_tensor *ts;
    size_t nts;
    int nfiles;
    char **names; /* the files' names (nfiles + 1: the index last) */
    st_exdir dir; /* where they are written, and made visible at once */
    ex_win win[2]; /* win[cur] is being queued; the other, if pending, is loaded */
    int cur, pending;
    /* the file being written: bytes in order through the staging buffer */
    st_file *f;
    int direct;
    char path[PATH_MAX];
    unsigned char *stage; /* EXPORT_STAGE bytes, aligned to EXPORT_BLOCK */
    size_t fill;          /* bytes in stage */
    uint64_t stage_off;   /* the file offset of stage[0] */
    uint64_t data_start;  /* where the data section begins in the current file */
    uint64_t total_bytes, done_bytes, io_calls;
    uint64_t meta_reads; /* the loader's index reads so far (its last window's stats) */
    uint64_t crc_checked, crc_bytes; /* the zip CRC-32s (st_loader_crc_finish) */
    int crc_skipped;
} ex_ctx;

/* ---- writing --------------------------------------------------------------------------- */

/* The code of a failure to write the output: STRATA_ENOSPC when the disk or quota is full,
 * else STRATA_EIO (never STRATA_ENOENT, which means a missing checkpoint). */
static int out_err(int e)
{
    return e == ENOSPC || e == EDQUOT || e == EFBIG ? STRATA_ENOSPC : STRATA_EIO;
}

static int pwrite_all(ex_ctx *c, const void *p, size_t n, uint64_t off)
{
    const st_vfs *v = c->dir.v;
    const unsigned char *b = p;
    while (n) {
        int64_t w = v->pwrite(c->f, b, n, off);
        c->io_calls++;
        if (w == -EINVAL && c->direct && v->undirect(c->f) == 0) { /* O_DIRECT refused */
            c->direct = 0;
            continue;
        }
        if (w <= 0) {
            int e = w < 0 ? (int)-w : ENOSPC;
            return st_fail(out_err(e), "writing %s: %s", c->path, strerror(e));
        }
        b += w, n -= (size_t)w, off += (uint64_t)w;
    }
    return 0;
}

/* Writes the staged bytes at their offset: a full stage (aligned), or with last the file's
 * end (padded to a block under O_DIRECT, then the file truncated to its size). */
static int stage_write(ex_ctx *c, int last)
{
    size_t n = c->fill, wn = n;
    if (!n)
        return 0;
    if (last && c->direct) {
        wn = (n + EXPORT_BLOCK - 1) / EXPORT_BLOCK * EXPORT_BLOCK;
        memset(c->stage + n, 0, wn - n);
    }
    int rc = pwrite_all(c, c->stage, wn, c->stage_off);
    c->stage_off += n;
    c->fill = 0;
    int e;
    if (!rc && wn != n && (e = c->dir.v->truncate(c->f, c->stage_off)) != 0)
        rc = st_fail(out_err(-e), "truncating %s: %s", c->path, strerror(-e));
    return rc;
}

/* Appends n bytes to the file being written. */
static int out_put(ex_ctx *c, const void *p, uint64_t n)
{
    const unsigned char *b = p;
    while (n) {
        size_t k = EXPORT_STAGE - c->fill < n ? EXPORT_STAGE - c->fill : (size_t)n;
        memcpy(c->stage + c->fill, b, k);
        c->fill += k, b += k, n -= k;
        if (c->fill == EXPORT_STAGE) {
            int rc = stage_write(c, 0);
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* Tells the caller's callback; nonzero from it stops the export (STRATA_EABORTED). */
static int report(ex_ctx *c)
{
    if (!c->o->progress)
        return 0;
    st_clear_error();
    if (c->o->progress(c->o->progress_ctx, c->done_bytes, c->total_bytes) == 0)
        return 0;
    if (!strata_error_last()[0])
        st_fail(STRATA_EABORTED, "export stopped by the progress callback");
    return STRATA_EABORTED;
}

/* Loads window w's pieces (on the load thread, or the caller's); adds to *ls. */
static int load_window(ex_ctx *c, ex_win *w, strata_stats *ls)
{
    strata_state *st;
    int rc = strata_state_new(&st);
    if (rc)
        return rc;
    for (int i = 0; i < w->npieces && !rc; i++) {
        ex_piece *p = &w->pieces[i];
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
        sh.data = w->buf + p->off;
        rc = strata_state_add_shard(st, &sh);
    }
    if (!rc) {
        strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
        lo.io_threads = c->o->io_threads;
        lo.max_io_bytes = EXPORT_MAX_IO;
        if (c->o->flags & STRATA_EXPORT_NO_DIRECT)
            lo.flags |= STRATA_LOAD_NO_DIRECT;
        if (c->o->flags & STRATA_EXPORT_SKIP_CRC)
            lo.flags |= STRATA_LOAD_SKIP_CRC;
        rc = strata_loader_load(ls, c->ld, &st, 1, &lo);
    }
    strata_state_free(st);
    return rc;
}

/* A load on its own thread: its code and message come back through here. */
typedef struct {
    ex_ctx *c;
    ex_win *w;
    strata_stats ls;
    int rc;
    char msg[ST_ERR_BYTES];
} ex_load;

static void *load_main(void *p)
{
    ex_load *l = p;
    l->rc = load_window(l->c, l->w, &l->ls);
    if (l->rc)
        st_err_keep(l->msg, l->rc);
    return NULL;
}

/* Converts loaded window w's pieces and writes them to the current file; then reports. */
static int write_window(ex_ctx *c, ex_win *w)
{
    int rc = 0;
    for (int i = 0; i < w->npieces && !rc; i++) {
        ex_piece *p = &w->pieces[i];
        if (p->t->dst != p->t->src)
            st_convert(w->buf + p->off, p->t->dst, w->buf + p->off, p->t->src, p->count);
        uint64_t n = p->count * p->t->dst_sz;
        /* the pieces come in file order, back to back */
        if (c->stage_off + c->fill != c->data_start + p->t->begin + p->start * p->t->dst_sz)
            rc = st_fail(STRATA_EINVAL, "export: piece of '%s' out of order (a bug)",
                         p->t->src_name);
        if (!rc)
            rc = out_put(c, w->buf + p->off, n);
        c->done_bytes += n;
    }
    w->npieces = 0;
    w->used = 0;
    return rc ? rc : report(c);
}

/* Starts loading the queued window (win[cur]) on a thread, writes the pending one (loaded
 * before) meanwhile, and waits for the load: the queued window becomes the pending one. On
 * any failure nothing stays pending and the first failure's code and message are kept. */
static int flush(ex_ctx *c)
{
    ex_win *w = &c->win[c->cur], *prev = &c->win[1 - c->cur];
    if (!w->npieces)
        return 0;
    ex_load l = {.c = c, .w = w, .ls = STRATA_STATS_INIT};
    pthread_t th;
    int threaded = c->pending && pthread_create(&th, NULL, load_main, &l) == 0;
    int rc = 0;
    if (c->pending) { /* window N is written while window N+1 loads */
        rc = write_window(c, prev);
        c->pending = 0;
    }
    if (threaded)
        pthread_join(th, NULL);
    else if (!rc) /* nothing to overlap with (or no thread): load here */
        load_main(&l);
    c->io_calls += l.ls.io_calls;
    c->meta_reads = l.ls.meta_reads; /* the loader's, as of its last window */
    c->crc_skipped |= l.ls.crc_skipped;
    if (!rc && l.rc)
        rc = st_err_restore(l.rc, l.msg);
    if (rc) {
        w->npieces = 0;
        w->used = 0;
        return rc;
    }
    c->pending = 1;
    c->cur = 1 - c->cur;
    return 0;
}

/* Loads and writes whatever is queued or pending: the current file's last windows. */
static int drain(ex_ctx *c)
{
    int rc = flush(c);
    if (!rc && c->pending)
        rc = write_window(c, &c->win[1 - c->cur]);
    return rc; /* the windows are emptied by write_file, after a failure too */
}

/* Queues tensor t's windows, flushing whenever the buffer is full. */
static int queue_tensor(ex_ctx *c, ex_tensor *t)
{
    uint64_t pos = 0;
    while (pos < t->numel) {
        ex_win *w = &c->win[c->cur];
        size_t off = (w->used + EXPORT_ALIGN - 1) / EXPORT_ALIGN * EXPORT_ALIGN;
        uint64_t space = off < EXPORT_BUF ? (EXPORT_BUF - off) / t->src_sz : 0;
        uint64_t take = t->numel - pos < space ? t->numel - pos : space;
        /* no room, no piece left, or a scalar that would be split: load what is queued */
        if (take == 0 || w->npieces == EXPORT_MAX_PIECES || (take < t->numel && t->ndim == 0)) {
            int rc = flush(c);
            if (rc)
                return rc;
            continue;
        }
        w->pieces[w->npieces++] = (ex_piece){t, pos, take, off};
        w->used = off + take * t->src_sz;
        pos += take;
    }
    return 0;
}

/* Writes s as a JSON string. Names are valid UTF-8 (checked before): only '"', '\\' and
 * control characters need escapes. */
static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20 || *p == 0x7f)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

/* Creates the file `name` in the staging set (a new inode, never through a link). */
static int out_open(ex_ctx *c, const char *name, int direct)
{
    const st_vfs *v = c->dir.v;
    int rc = st_exdir_path(&c->dir, c->path, name);
    if (rc)
        return rc;
    int e = v->open(v, c->path, ST_O_WRITE | (direct ? ST_O_DIRECT : 0), &c->f);
    if (e) {
        c->f = NULL;
        return st_fail(out_err(-e), "creating %s: %s", c->path, strerror(-e));
    }
    c->direct = v->direct(c->f); /* no O_DIRECT on this file system (tmpfs): buffered */
    return 0;
}

/* fsyncs (unless rc) and closes the file being written. */
static int out_close(ex_ctx *c, int rc)
{
    const st_vfs *v = c->dir.v;
    int e;
    if (!rc && (e = v->sync(c->f)) != 0)
        rc = st_fail(out_err(-e), "fsync %s: %s", c->path, strerror(-e));
    if ((e = v->close(c->f)) != 0 && !rc)
        rc = st_fail(out_err(-e), "closing %s: %s", c->path, strerror(-e));
    c->f = NULL;
    return rc;
}

/* Writes file f (tensors ts[lo..hi)) into the staging set. */
static int write_file(ex_ctx *c, int f, size_t lo, size_t hi)
{
    char *hdr = NULL;
    size_t hlen = 0;
    FILE *m = open_memstream(&hdr, &hlen);
    if (!m)
        return st_fail(STRATA_ENOMEM, "out of memory for a header");
    fputs("{\"__metadata__\":{\"format\":\"pt\"}", m);
    for (size_t i = lo; i < hi; i++) {
        ex_tensor *t = &c->ts[i];
        fputc(',', m);
        json_str(m, t->out_name);
        fprintf(m, ":{\"dtype\":\"%s\",\"shape\":[", st_st_dtype_name(t->dst));
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
        return st_fail(STRATA_ENOMEM, "out of memory for a header");
    }
    int rc = out_open(c, c->names[f], !(c->o->flags & STRATA_EXPORT_NO_DIRECT));
    if (rc) {
        free(hdr);
        return rc;
    }
    c->fill = 0;
    c->stage_off = 0;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    rc = out_put(c, len8, 8);
    if (!rc)
        rc = out_put(c, hdr, hlen);
    free(hdr);
    c->data_start = 8 + hlen;
    for (size_t i = lo; i < hi && !rc; i++)
        rc = queue_tensor(c, &c->ts[i]);
    if (!rc)
        rc = drain(c);
    if (!rc)
        rc = stage_write(c, 1);
    c->pending = 0;
    c->win[0].npieces = c->win[1].npieces = 0;
    c->win[0].used = c->win[1].used = 0;
    return out_close(c, rc);
}

static int write_index(ex_ctx *c)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return st_fail(STRATA_ENOMEM, "out of memory for the index");
    fprintf(f, "{\n  \"metadata\": {\"total_size\": %llu},\n  \"weight_map\": {",
            (unsigned long long)c->total_bytes);
    for (size_t i = 0; i < c->nts; i++) {
        fputs(i ? ",\n    " : "\n    ", f);
        json_str(f, c->ts[i].out_name);
        fputs(": ", f);
        json_str(f, c->names[c->ts[i].file]);
    }
    fputs("\n  }\n}\n", f);
    if (fclose(f)) {
        free(buf);
        return st_fail(STRATA_ENOMEM, "out of memory for the index");
    }
    int rc = out_open(c, c->names[c->nfiles], 0), e;
    if (!rc && (e = st_vfs_write_full(c->dir.v, c->f, buf, len, 0)) != 0)
        rc = st_fail(out_err(-e), "writing %s: %s", c->path, strerror(-e));
    if (c->f)
        rc = out_close(c, rc);
    free(buf);
    return rc;
}

static int cmp_out_name(const void *a, const void *b)
{
    return strcmp((*(ex_tensor *const *)a)->out_name, (*(ex_tensor *const *)b)->out_name);
}

/* A text option (the i-th of a list, or i < 0): valid UTF-8. */
static int check_text(const char *t, const char *what, int i)
{
    size_t n = t ? strlen(t) : 0, bad = t ? st_utf8_invalid_at(t, n) : 0;
    if (bad >= n)
        return 0;
    char idx[24] = "";
    if (i >= 0)
        snprintf(idx, sizeof idx, "[%d]", i);
    return st_fail(STRATA_EINVAL, "strata_export_opts.%s%s is not valid UTF-8 (byte 0x%02x at "
                   "offset %zu)", what, idx, (unsigned char)t[bad], bad);
}

/* The caller's options (NULL: defaults; any version 1..current), checked, defaults filled. */
static int export_opts_get(strata_export_opts *out, const strata_export_opts *in)
{
    static const size_t size[] = {0, offsetof(strata_export_opts, include),
                                  sizeof(strata_export_opts)};
    *out = (strata_export_opts)STRATA_EXPORT_OPTS_INIT;
    if (in) {
        if (in->version < 1 || in->version > STRATA_EXPORT_OPTS_VERSION)
            return st_fail(STRATA_EINVAL, "strata_export_opts.version %d is not one of 1..%d",
                           in->version, STRATA_EXPORT_OPTS_VERSION);
        memcpy(out, in, size[in->version]);
        out->version = STRATA_EXPORT_OPTS_VERSION;
    }
    if (out->flags & ~(unsigned)(STRATA_EXPORT_BF16 | STRATA_EXPORT_NO_DIRECT |
                                 STRATA_EXPORT_SKIP_CRC))
        return st_fail(STRATA_EINVAL, "strata_export_opts.flags 0x%x has unknown bits", out->flags);
    if (out->io_threads < 0)
        return st_fail(STRATA_EINVAL, "strata_export_opts.io_threads %d is negative",
                       out->io_threads);
    if (!out->max_file_bytes)
        out->max_file_bytes = EXPORT_DEFAULT_FILE;
    if (out->prefix && !*out->prefix)
        out->prefix = NULL;
    if (out->model_only && !*out->model_only)
        return st_fail(STRATA_EINVAL, "strata_export_opts.model_only is empty (NULL: off; "
                       "else the key the model was saved under, such as \"model\")");
    if (out->model_only && out->prefix)
        return st_fail(STRATA_EINVAL, "strata_export_opts: model_only \"%s\" strips its own "
                       "prefix; prefix \"%s\" cannot be given with it", out->model_only,
                       out->prefix);
    int rc = check_text(out->prefix, "prefix", -1);
    if (!rc)
        rc = check_text(out->model_only, "model_only", -1);
    for (int i = 0; !rc && out->include && out->include[i]; i++)
        rc = check_text(out->include[i], "include", i);
    for (int i = 0; !rc && out->exclude && out->exclude[i]; i++)
        rc = check_text(out->exclude[i], "exclude", i);
    return rc;
}

/* Is `name` a DeepSpeed checkpoint's tensor that is not the model's (zero_to_fp32's):
 * an optimizer state (optim.state.<fqn>.<key>), or in a strata.deepspeed tag a tensor of
 * one of DeepSpeed's files as saved (<file>#<i>, <file> a blob of the tag)? */
static int ds_not_model(const strata_ckpt *ck, const char *name)
{
    if (strncmp(name, "optim.state.", 12) == 0)
        return 1;
    const char *h = strrchr(name, '#');
    if (strata_ckpt_format(ck) != STRATA_FORMAT_STRATA_DEEPSPEED || !h || !h[1] ||
        strspn(h + 1, "0123456789") != strlen(h + 1))
        return 0;
    for (size_t i = 0; i < strata_ckpt_nblobs(ck); i++) {
        strata_blob_info b;
        strata_ckpt_blob(&b, ck, i);
        if (strlen(b.name) == (size_t)(h - name) && memcmp(b.name, name, h - name) == 0)
            return 1;
    }
    return 0;
}

/* Is the tensor `name` selected (include, exclude, model_only)? *out_name gets the name
 * it is written under (model_only strips "P."). A DeepSpeed checkpoint's (ds): without
 * include, or with model_only, the model's tensors, named as they are. */
static int selected(const strata_export_opts *o, const strata_ckpt *ck, int ds, const char *name,
                    const char **out_name)
{
    *out_name = name;
    int in = !o->include;
    for (int i = 0; !in && o->include[i]; i++)
        in = fnmatch(o->include[i], name, 0) == 0;
    for (int i = 0; in && o->exclude && o->exclude[i]; i++)
        in = fnmatch(o->exclude[i], name, 0) != 0;
    if (in && ds && (!o->include || o->model_only))
        return !ds_not_model(ck, name);
    if (!in || !o->model_only)
        return in;
    size_t plen = strlen(o->model_only), n = strlen(name);
    if (strncmp(name, o->model_only, plen) != 0 || name[plen] != '.' || !name[plen + 1])
        return 0;
    /* a per-rank value strata.torch saved: key@rank<digits> */
    size_t d = n;
    while (d > 0 && name[d - 1] >= '0' && name[d - 1] <= '9')
        d--;
    if (d < n && d >= 5 && strncmp(name + d - 5, "@rank", 5) == 0)
        return 0;
    *out_name = name + plen + 1;
    return 1;
}

/* What the selection was, for the message when it keeps nothing. */
static void describe_selection(const strata_export_opts *o, int ds, char *buf, size_t n)
{
    FILE *m = fmemopen(buf, n, "w");
    if (!m) {
        snprintf(buf, n, "the selection");
        return;
    }
    const char *sep = "";
    for (int k = 0; k < 2; k++) {
        const char *const *l = k ? o->exclude : o->include;
        for (int i = 0; l && l[i]; i++, sep = ", ")
            fprintf(m, "%s%s \"%s\"", sep, k ? "exclude" : "include", l[i]);
    }
    if (o->model_only && ds)
        fprintf(m, "%smodel_only (a DeepSpeed checkpoint's model: zero_to_fp32's tensors)", sep);
    else if (o->model_only)
        fprintf(m, "%smodel_only \"%s\" (tensors named %s.<name>, not per-rank)", sep,
                o->model_only, o->model_only);
    fclose(m);
    buf[n - 1] = 0;
}

/* Lays the tensors out: names, dtypes, sizes, files, offsets. */
static int layout(ex_ctx *c, const strata_ckpt *ck)
{
    const strata_export_opts *o = c->o;
    size_t plen = o->prefix ? strlen(o->prefix) : 0;
    uint64_t file_used = 0;
    int file = 0;
    size_t nsel = 0, nall = c->nts;
    int ds = strata_ckpt_format(ck) == STRATA_FORMAT_DEEPSPEED ||
             strata_ckpt_format(ck) == STRATA_FORMAT_STRATA_DEEPSPEED;
    for (size_t i = 0; i < nall; i++) {
        strata_tensor_info ti;
        strata_ckpt_tensor(&ti, ck, i);
        ex_tensor *t = &c->ts[nsel];
        if (!selected(o, ck, ds, ti.name, &t->out_name))
            continue;
        nsel++;
        size_t nlen = strlen(ti.name), bad = st_utf8_invalid_at(ti.name, nlen);
        if (bad < nlen) /* strata_load would refuse it: say so before writing anything */
            return st_fail(STRATA_EINVAL,
                           "tensor name \"%s\" is not valid UTF-8 (byte 0x%02x at offset %zu); "
                           "it cannot be loaded, so cannot be exported",
                           ti.name, (unsigned char)ti.name[bad], bad);
        t->src_name = ti.name;
        if (plen && strncmp(ti.name, o->prefix, plen) == 0 && ti.name[plen])
            t->out_name = ti.name + plen;
        /* the key safetensors keeps for the file's metadata: a checkpoint's own name is
         * refused as data that safetensors cannot hold (not a bad request); one that the
         * prefix makes is the caller's choice of prefix */
        if (strcmp(t->out_name, "__metadata__") == 0 && t->out_name == ti.name)
            return st_fail(STRATA_EMISMATCH,
                           "tensor '__metadata__' cannot be exported: safetensors keeps that "
                           "key for the file's metadata (a checkpoint saved with another name "
                           "for it exports)");
        if (strcmp(t->out_name, "__metadata__") == 0)
            return st_fail(STRATA_EINVAL,
                           "tensor '%s' would be named __metadata__ once the prefix is stripped, "
                           "the key safetensors keeps for the file's metadata", ti.name);
        t->src = t->dst = ti.dtype;
        if ((o->flags & STRATA_EXPORT_BF16) &&
            (ti.dtype == STRATA_F32 || ti.dtype == STRATA_F64 || ti.dtype == STRATA_F16))
            t->dst = STRATA_BF16;
        t->ndim = ti.ndim;
        t->shape = ti.shape;
        t->src_sz = strata_dtype_size(t->src);
        t->dst_sz = strata_dtype_size(t->dst);
        if (!st_st_dtype_name(t->dst) || !t->src_sz)
            return st_fail(STRATA_EFORMAT, "tensor '%s': unknown dtype %d", ti.name,
                           (int)ti.dtype);
        t->numel = 1;
        for (int d = 0; d < ti.ndim; d++) {
            if (ti.shape[d] && t->numel > UINT64_MAX / 8 / ti.shape[d])
                return st_fail(STRATA_EFORMAT, "tensor '%s': its shape overflows", ti.name);
            t->numel *= ti.shape[d];
        }
        uint64_t bytes = t->numel * t->dst_sz;
        if (file_used > 0 && (bytes > o->max_file_bytes || file_used > o->max_file_bytes - bytes))
            file++, file_used = 0;
        t->file = file;
        t->begin = file_used;
        file_used += bytes;
        c->total_bytes += bytes;
    }
    c->nts = nsel;
    if (!nsel && (o->include || o->exclude || o->model_only)) {
        char sel[512];
        describe_selection(o, ds, sel, sizeof sel);
        return st_fail(STRATA_ENOTFOUND, "no tensor of the checkpoint's %zu is selected by %s: "
                       "nothing to export", nall, sel);
    }
    c->nfiles = file + 1;
    if (c->nfiles > 99999)
        return st_fail(STRATA_EINVAL,
                       "%d files (over 99999) with max_file_bytes %llu: ask for larger files",
                       c->nfiles, (unsigned long long)o->max_file_bytes);
    /* the names, once stripped, must stay distinct */
    ex_tensor **sorted = malloc((c->nts ? c->nts : 1) * sizeof *sorted);
    if (!sorted)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < c->nts; i++)
        sorted[i] = &c->ts[i];
    qsort(sorted, c->nts, sizeof *sorted, cmp_out_name);
    int rc = 0;
    for (size_t i = 1; i < c->nts && !rc; i++)
        if (strcmp(sorted[i - 1]->out_name, sorted[i]->out_name) == 0)
            rc = st_fail(STRATA_EINVAL,
                         "tensors '%s' and '%s' have the same name '%s' once the prefix is "
                         "stripped",
                         sorted[i - 1]->src_name, sorted[i]->src_name, sorted[i]->out_name);
    free(sorted);
    return rc;
}

/* The files' names: model-0000i-of-0000N.safetensors, then the index; one file is
 * model.safetensors, without an index (as Hugging Face writes them). */
static int out_names(ex_ctx *c)
{
    c->names = calloc((size_t)c->nfiles + 1, sizeof *c->names);
    if (!c->names)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (int f = 0; f <= c->nfiles; f++) {
        int ok = c->nfiles == 1 && f == 0 ? asprintf(&c->names[f], "%s", EXPORT_SINGLE)
                 : f < c->nfiles
                     ? asprintf(&c->names[f], "model-%05d-of-%05d.safetensors", f + 1, c->nfiles)
                     : asprintf(&c->names[f], "%s", EXPORT_INDEX);
        if (ok < 0) {
            c->names[f] = NULL;
            return st_fail(STRATA_ENOMEM, "out of memory");
        }
    }
    return 0;
}

/* Writes every file into the staging set, the index last, then puts the set in place. */
static int write_all(ex_ctx *c)
{
    int rc = report(c);
    size_t lo = 0;
    for (int f = 0; f < c->nfiles && !rc; f++) {
        size_t hi = lo;
        while (hi < c->nts && c->ts[hi].file == f)
            hi++;
        rc = write_file(c, f, lo, hi);
        lo = hi;
    }
    if (!rc && c->nfiles > 1)
        rc = write_index(c);
    /* the zip CRC-32s of the entries the windows read in part: their rest read and each
     * compared before anything is published */
    if (!rc && !(c->o->flags & STRATA_EXPORT_SKIP_CRC)) {
        uint64_t checked = 0, bytes = 0;
        rc = st_loader_crc_finish(c->ld, &checked, &bytes);
        c->crc_checked += checked;
        c->crc_bytes += bytes;
    }
    return rc ? rc : st_exdir_commit(&c->dir);
}

int strata_export_safetensors(strata_stats *stats, const char *ckpt_uri, const char *out_dir,
                              const strata_export_opts *opts)
{
    double t0 = st_now();
    strata_export_opts o;
    int rc = st_stats_check(stats);
    if (!rc)
        rc = export_opts_get(&o, opts);
    if (rc)
        return rc;
    if (!ckpt_uri || !out_dir)
        return st_fail(STRATA_EINVAL, "strata_export_safetensors: %s is NULL",
                       ckpt_uri ? "out_dir" : "ckpt_uri");
    strata_loader *ld;
    if ((rc = strata_loader_open(&ld, NULL, &ckpt_uri, 1, NULL)))
        return rc;
    const strata_ckpt *ck = strata_loader_index(ld);
    ex_ctx *c = calloc(1, sizeof *c);
    size_t nt = strata_ckpt_ntensors(ck);
    if (!c || !(c->ts = calloc(nt ? nt : 1, sizeof *c->ts)) ||
        !(c->win[0].pieces = malloc(EXPORT_MAX_PIECES * sizeof *c->win[0].pieces)) ||
        !(c->win[1].pieces = malloc(EXPORT_MAX_PIECES * sizeof *c->win[1].pieces))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto done;
    }
    c->ld = ld;
    c->o = &o;
    c->nts = nt;
    /* each window needs part of a zip entry: the loader keeps the CRC-32 of what each read
     * and the export compares every entry once (write_all), rather than every window
     * reading its entries whole */
    if (!(o.flags & STRATA_EXPORT_SKIP_CRC) && (rc = st_loader_crc_later(ld)))
        goto done;
    if ((rc = layout(c, ck)) || (rc = out_names(c)))
        goto done;
    if (!(c->win[0].buf = st_io_alloc(EXPORT_BUF)) || !(c->win[1].buf = st_io_alloc(EXPORT_BUF)) ||
        !(c->stage = st_io_alloc(EXPORT_STAGE))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory for the export's 2 x %u + %u bytes of "
                     "buffers", EXPORT_BUF, EXPORT_STAGE);
        goto done;
    }
    if ((rc = st_exdir_begin(&c->dir, out_dir)))
        goto done;
    rc = write_all(c);
    if (c->f) /* a failure while a file was open */
        c->dir.v->close(c->f);
    /* after a failure: this export's files; after the swap: OUT's previous ones */
    st_exdir_end(&c->dir);

done:
    if (!rc && stats) {
        strata_stats full = STRATA_STATS_INIT;
        full.data_bytes = 0;
        for (size_t i = 0; i < c->nts; i++) /* the selected ones */
            full.data_bytes += c->ts[i].numel * c->ts[i].src_sz;
        full.bytes = c->total_bytes;
        full.all_bytes = c->total_bytes;
        full.io_calls = c->io_calls;
        full.meta_reads = c->meta_reads;
        full.crc_checked = c->crc_checked;
        full.crc_bytes = c->crc_bytes;
        full.crc_skipped = c->crc_skipped;
        full.seconds = st_now() - t0;
        st_stats_put(stats, &full);
    }
    if (c) {
        for (int f = 0; c->names && f <= c->nfiles; f++)
            free(c->names[f]);
        free(c->names);
        for (int k = 0; k < 2; k++) {
            st_io_free(c->win[k].buf, EXPORT_BUF);
            free(c->win[k].pieces);
        }
        st_io_free(c->stage, EXPORT_STAGE);
        free(c->ts);
    }
    free(c);
    strata_loader_free(ld);
    return rc;
}
