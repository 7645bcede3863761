/* dcp_src.c - the PyTorch DCP source (source.h): a torch.distributed.checkpoint directory
 * (.metadata + *.distcp). The .metadata pickle is parsed by the restricted reader and
 * interpreted (src/source/dcp.h); each tensor item's torch.save archive inside its .distcp file
 * is opened through a ranged read (its zip end records, central directory and local headers,
 * and its data.pkl: one or two small reads per item, src/source/zip.h) to find where the
 * tensor's bytes lie. Non-tensor items are blobs of their whole stored bytes (a torch.save
 * archive of the object). The zip entries holding those bytes are the index's checks
 * (checks.h: their CRC-32s). The description for other ranks is the foreign metadata as
 * st_index_take encoded it. docs/FORMAT.md, "DCP as strata reads it".
 *
 * here: a directory without strata's metadata or commit record (nor Megatron's
 * metadata.json) holding a .metadata whose first bytes are a pickle protocol 2..5 header. open: errors STRATA_EFORMAT, STRATA_ENOTSUP
 * (transformed items, complex dtypes, non-contiguous or big-endian tensors), STRATA_ENOENT
 * (a .distcp file missing), STRATA_EIO, STRATA_ENOMEM. No threads. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <zlib.h>

#include "../core/error.h"
#include "../meta/checks.h"
#include "dcp.h"
#include "zip.h"
#include "readers.h"

#define HEAD_WINDOW 4096u

static int st_dcp_here(const st_vfs *v, const char *path, int kind)
{
    char p[PATH_MAX];
    st_file *f;
    unsigned char b[2];
    /* metadata.json beside it: Megatron torch_dist, a DCP directory its own source reads */
    if (kind != 1 || st_source_has_file(v, path, ST_META_FILE) ||
        st_source_has_file(v, path, ST_COMMIT_FILE) ||
        st_source_has_file(v, path, "metadata.json") ||
        st_path_join(p, path, ST_DCP_METADATA) ||
        v->open(v, p, ST_O_READ | ST_O_FOLLOW, &f) != 0) {
        st_clear_error();
        return 0;
    }
    int64_t got = st_vfs_read_full(v, f, b, 2, 0);
    v->close(f);
    return got == 2 && b[0] == 0x80 && b[1] >= 2 && b[1] <= 5;
}

/* ---- a ranged reader of one item ------------------------------------------------------ */

/* Reads [base, base + len) of an open file for the zip reader, keeping the first read (the
 * zip end records: the item's last 64 KiB, or all of a smaller item) and the item's first
 * HEAD_WINDOW bytes (local headers, data.pkl) so that opening an item costs one or two
 * reads. */
typedef struct item_rd {
    const st_vfs *v;
    st_file *f;
    const char *shown; /* dir/file for messages */
    uint64_t base, len;
    unsigned char *tail; /* [tail_off, tail_off + tail_n) of the item */
    uint64_t tail_off;
    size_t tail_n;
    unsigned char head[HEAD_WINDOW];
    size_t head_n; /* 0: not read */
    unsigned reads;
} item_rd;

static int raw_read(item_rd *r, void *buf, size_t len, uint64_t off)
{
    r->reads++;
    int64_t got = st_vfs_read_full(r->v, r->f, buf, len, r->base + off);
    if (got < 0)
        return st_fail(st_from_errno((int)-got), "reading '%s': %s", r->shown,
                       strerror((int)-got));
    if ((uint64_t)got != len)
        return st_fail(STRATA_EFORMAT, "'%s' is truncated: %llu bytes at %llu read, %llu "
                       "expected", r->shown, (unsigned long long)got,
                       (unsigned long long)(r->base + off), (unsigned long long)len);
    return 0;
}

static int item_read(void *ctx, void *buf, size_t len, uint64_t off)
{
    item_rd *r = ctx;
    if (off > r->len || len > r->len - off)
        return st_fail(STRATA_EFORMAT, "'%s': the zip archive at %llu reaches past its item's "
                       "%llu bytes", r->shown, (unsigned long long)r->base,
                       (unsigned long long)r->len);
    if (r->tail && off >= r->tail_off && off + len <= r->tail_off + r->tail_n) {
        memcpy(buf, r->tail + (off - r->tail_off), len);
        return 0;
    }
    if (!r->tail) { /* the first read: the end records */
        if (!(r->tail = malloc(len ? len : 1)))
            return st_fail(STRATA_ENOMEM, "out of memory");
        int rc = raw_read(r, r->tail, len, off);
        if (rc)
            return rc;
        r->tail_off = off;
        r->tail_n = len;
        memcpy(buf, r->tail, len);
        return 0;
    }
    uint64_t hn = ST_MIN((uint64_t)HEAD_WINDOW, r->len);
    if (off + len <= hn) {
        if (!r->head_n) {
            int rc = raw_read(r, r->head, (size_t)hn, 0);
            if (rc)
                return rc;
            r->head_n = (size_t)hn;
        }
        memcpy(buf, r->head + off, len);
        return 0;
    }
    return raw_read(r, buf, len, off);
}

/* ---- opening ------------------------------------------------------------------------- */

typedef struct dcp_files {
    st_file **f;
    st_file_id *id;
    size_t n;
} dcp_files;

static void files_close(const st_vfs *v, dcp_files *fs)
{
    for (size_t i = 0; i < fs->n; i++)
        if (fs->f[i])
            v->close(fs->f[i]);
    free(fs->f);
    free(fs->id);
    memset(fs, 0, sizeof *fs);
}

static int files_open(const st_vfs *v, const char *dir, const st_dcp *dc, dcp_files *fs)
{
    fs->f = calloc(dc->nfiles ? dc->nfiles : 1, sizeof *fs->f);
    fs->id = calloc(dc->nfiles ? dc->nfiles : 1, sizeof *fs->id);
    if (!fs->f || !fs->id)
        return st_fail(STRATA_ENOMEM, "out of memory");
    fs->n = dc->nfiles;
    for (size_t i = 0; i < dc->nfiles; i++) {
        char p[PATH_MAX];
        int rc = st_path_join(p, dir, dc->files[i]);
        if (rc)
            return rc;
        /* never through a symlink, as strata's own data files: one could lead anywhere */
        int e = v->open(v, p, ST_O_READ, &fs->f[i]);
        if (!e)
            e = v->ident(fs->f[i], &fs->id[i]);
        if (e == -ENOENT)
            return st_fail(STRATA_ENOENT, "DCP data file '%s' is missing (.metadata names it)",
                           p);
        if (e == -ELOOP)
            return st_fail(STRATA_EFORMAT, "DCP data file '%s' is a symlink: not followed (a "
                           "checkpoint's files are its own, as in strata's format); copy "
                           "the file there", p);
        if (e)
            return st_fail(st_from_errno(-e), "DCP data file '%s': %s", p,
                           e == -ST_ENOTREG ? "not a regular file" : strerror(-e));
    }
    return 0;
}

/* Finds the bytes of tensor item it's chunk k in its torch.save archive: *off (in the file)
 * and checks dtype, shape, contiguity and the storage entry. */
static int locate(const st_vfs *v, const char *dir, const st_dcp *dc, const dcp_files *fs,
                  const st_dcp_item *it, const st_dcp_chunk *k, uint64_t *off,
                  st_check_set *cs)
{
    char shown[PATH_MAX + 300], what[PATH_MAX + 600], name[PATH_MAX + 1000];
    snprintf(shown, sizeof shown, "%s/%s", dir, dc->files[k->file]);
    snprintf(what, sizeof what, "%s: item '%.200s' at %llu", shown, it->fqn,
             (unsigned long long)k->offset);
    item_rd r = {v, fs->f[k->file], shown, k->offset, k->length, NULL, 0, 0, {0}, 0, 0};
    st_zip z;
    unsigned char *pkl = NULL;
    int rc = st_zip_open(&z, k->length, item_read, &r, what);
    if (rc)
        goto out;
    /* the archive's folder: what its first entry's name starts with */
    const char *slash = z.n ? strchr(z.e[0].name, '/') : NULL;

    int pn = slash ? (int)(slash - z.e[0].name) : 0;
    if (!slash || pn > 256) {
        rc = st_fail(STRATA_EFORMAT, "%s: not a torch.save archive (no <archive>/data.pkl)", what);
        goto out;
    }
    snprintf(name, sizeof name, "%.*s/data.pkl", pn, z.e[0].name);
    const st_zip_entry *pe = st_zip_find(&z, name);
    if (!pe || pe->usize > (16u << 20)) {
        rc = st_fail(STRATA_EFORMAT, "%s: not a torch.save archive (%s %s)", what, name,
                     pe ? "is over 16 MiB" : "is missing");
        goto out;
    }
    if (!(pkl = malloc(pe->usize ? pe->usize : 1))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = st_zip_read(&z, pe, pkl, item_read, &r, what)))
        goto out;
    snprintf(name, sizeof name, "%.*s/byteorder", pn, z.e[0].name);
    const st_zip_entry *bo = st_zip_find(&z, name);
    char order[8] = "little";
    if (bo && bo->usize < sizeof order && !bo->method &&
        !(rc = st_zip_read(&z, bo, order, item_read, &r, what)))
        order[bo->usize] = 0;
    if (rc)
        goto out;
    if (strcmp(order, "little") != 0) {
        rc = st_fail(STRATA_ENOTSUP, "%s: its bytes are not little-endian (byteorder '%s')",
                     what, order);
        goto out;
    }
    st_dcp_saved s;
    snprintf(name, sizeof name, "%s/%.*s/data.pkl", what, pn, z.e[0].name);
    if ((rc = st_dcp_saved_tensor(&s, pkl, pe->usize, name)))
        goto out;
    if (s.dtype != it->dtype || s.ndim != it->ndim ||
        memcmp(s.shape, k->len, (size_t)it->ndim * sizeof *s.shape) != 0) {
        rc = st_fail(STRATA_EFORMAT, "%s: the saved tensor (%s, %d dims) is not the chunk "
                     ".metadata describes (%s, %d dims, its sizes)", what,
                     strata_dtype_name(s.dtype), s.ndim, strata_dtype_name(it->dtype), it->ndim);
        goto out;
    }
    snprintf(name, sizeof name, "%.*s/data/%s", pn, z.e[0].name, s.key);
    const st_zip_entry *de = st_zip_find(&z, name);
    const uint64_t es = strata_dtype_size(s.dtype);
    if (!de) {
        rc = st_fail(STRATA_EFORMAT, "%s: its storage %s is missing", what, name);
        goto out;
    }
    if (de->method != 0) {
        rc = st_fail(STRATA_EFORMAT, "%s: its storage %s is compressed (zip method %u); "
                     "strata reads stored entries only", what, name, de->method);
        goto out;
    }
    if (s.storage_numel > de->usize / es) {
        rc = st_fail(STRATA_EFORMAT, "%s: its storage %s holds %llu bytes, fewer than %llu "
                     "elements of %s", what, name, (unsigned long long)de->usize,
                     (unsigned long long)s.storage_numel, strata_dtype_name(s.dtype));
        goto out;
    }
    *off = k->offset + de->data_off + s.storage_offset * es;
    rc = st_check_add_zip(cs, &z, k->file, k->offset);
out:
    free(pkl);
    free(r.tail);
    st_zip_free(&z);
    return rc;
}

/* The zip entries of a non-tensor item, whose value is a torch.save archive (or the bytes
 * of an io.BytesIO, which carry no check: then none), into cs. */
static int blob_checks(const st_vfs *v, const char *dir, const st_dcp *dc, const dcp_files *fs,
                       const st_dcp_item *it, st_check_set *cs)
{
    const st_dcp_chunk *k = &it->chunks[0];
    char shown[PATH_MAX + 300];
    snprintf(shown, sizeof shown, "%s/%s", dir, dc->files[k->file]);
    item_rd r = {v, fs->f[k->file], shown, k->offset, k->length, NULL, 0, 0, {0}, 0, 0};
    st_zip z;
    int rc = st_zip_open(&z, k->length, item_read, &r, shown);
    if (!rc)
        rc = st_check_add_zip(cs, &z, k->file, k->offset);
    else if (rc == STRATA_EFORMAT) /* not an archive: bytes without a check */
        rc = 0, st_clear_error();
    st_zip_free(&z);
    free(r.tail);
    return rc;
}

static int build(st_meta *m, const char *dir, const st_dcp *dc, const dcp_files *fs,
                 const st_vfs *v, st_check_set *cs)
{
    st_arena *a = &m->arena;
    m->foreign = 1;
    m->chunk = 1;
    m->nfiles = (uint32_t)dc->nfiles;
    size_t nt = 0, nb = 0;
    for (size_t i = 0; i < dc->nitems; i++)
        nt += dc->items[i].tensor, nb += !dc->items[i].tensor;
    if (!(m->files = st_arena_alloc(a, (dc->nfiles + 1) * sizeof *m->files)) ||
        !(m->idents = st_arena_alloc(a, (dc->nfiles + 1) * sizeof *m->idents)) ||
        !(m->tensors = st_arena_alloc(a, (nt + 1) * sizeof *m->tensors)) ||
        !(m->blobs = st_arena_alloc(a, (nb + 1) * sizeof *m->blobs)))
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t f = 0; f < dc->nfiles; f++) {
        m->files[f] = (st_mfile){dc->files[f], fs->id[f].size};
        m->idents[f] = (st_mident){fs->id[f].ino, fs->id[f].mtime_ns, fs->id[f].ctime_ns};
    }
    for (size_t i = 0; i < dc->nitems; i++) {
        const st_dcp_item *it = &dc->items[i];
        for (size_t c = 0; c < it->nchunks; c++) {
            const st_dcp_chunk *k = &it->chunks[c];
            if (k->offset > fs->id[k->file].size || k->length > fs->id[k->file].size - k->offset)
                return st_fail(STRATA_EFORMAT, "%s/%s: item '%.200s' at %llu (%llu bytes) runs "
                               "past the end of the file (%llu bytes)", dir, dc->files[k->file],
                               it->fqn, (unsigned long long)k->offset,
                               (unsigned long long)k->length,
                               (unsigned long long)fs->id[k->file].size);
        }
        if (!it->tensor) {
            const st_dcp_chunk *k = &it->chunks[0];
            m->blobs[m->nblobs++] = (st_mblob){it->fqn, -1, {k->file, k->offset, k->length, NULL}};
            m->data_bytes += k->length;
            int rc = k->length ? blob_checks(v, dir, dc, fs, it, cs) : 0;
            if (rc)
                return rc;
            continue;
        }
        st_mtensor *t = &m->tensors[m->ntensors++];
        memset(t, 0, sizeof *t);
        t->name = it->fqn;
        t->dtype = it->dtype;
        t->ndim = it->ndim;
        memcpy(t->shape, it->shape, sizeof t->shape);
        if (!(t->shards = st_arena_alloc(a, it->nchunks * sizeof *t->shards)))
            return st_fail(STRATA_ENOMEM, "out of memory");
        for (size_t c = 0; c < it->nchunks; c++) {
            const st_dcp_chunk *k = &it->chunks[c];
            uint64_t numel = 1, off = 0;
            for (int d = 0; d < it->ndim; d++)
                numel *= k->len[d]; /* bounded: the chunk lies inside the tensor */
            if (!numel)
                continue; /* an empty chunk holds no bytes */
            int rc = locate(v, dir, dc, fs, it, k, &off, cs);
            if (rc)
                return rc;
            st_mshard *s = &t->shards[t->nshards++];
            size_t dims = (size_t)(it->ndim ? it->ndim : 1) * sizeof(uint64_t);
            if (!(s->off = st_arena_alloc(a, dims)) || !(s->len = st_arena_alloc(a, dims)))
                return st_fail(STRATA_ENOMEM, "out of memory");
            memcpy(s->off, k->off, (size_t)it->ndim * sizeof(uint64_t));
            memcpy(s->len, k->len, (size_t)it->ndim * sizeof(uint64_t));
            s->fs = 0;
            s->fe = numel;
            s->flat = 0;
            s->ext = (st_extent){k->file, off, numel * strata_dtype_size(it->dtype), NULL};
            t->bytes += s->ext.bytes;
        }
        m->data_bytes += t->bytes;
    }
    return 0;
}

int st_dcp_build(const st_vfs *v, const char *dir, st_dcp *dc, st_meta **built)
{
    *built = NULL;
    memset(dc, 0, sizeof *dc);
    char p[PATH_MAX], shown[PATH_MAX + 16];
    int rc = st_path_join(p, dir, ST_DCP_METADATA);
    if (rc)
        return rc;
    snprintf(shown, sizeof shown, "%s", p);
    unsigned char *buf = NULL;
    size_t len = 0;
    int e = st_vfs_read_all(v, p, ST_DCP_MAX_METADATA, ST_O_FOLLOW, &buf, &len);
    if (e == -EFBIG)
        return st_fail(STRATA_EFORMAT, "%s: over the limit of %llu bytes for DCP metadata",
                       shown, ST_DCP_MAX_METADATA);
    if (e)
        return st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e), "DCP metadata '%s': %s",
                       shown, e == -ST_ENOTREG ? "is not a regular file" : strerror(-e));
    dcp_files fs = {0};
    st_meta *m = NULL;
    rc = st_dcp_parse(dc, buf, len, shown);
    free(buf);
    if (rc)
        return rc;
    st_check_set cs = {0};
    if (!(rc = files_open(v, dir, dc, &fs))) {
        if (!(m = calloc(1, sizeof *m)))
            rc = st_fail(STRATA_ENOMEM, "out of memory");
        else if (!(rc = build(m, dir, dc, &fs, v, &cs)))
            rc = st_meta_set_checks(m, &cs, dir);
    }
    st_check_set_free(&cs);
    files_close(v, &fs);
    if (rc) {
        if (m)
            st_meta_free(m);
        st_dcp_free(dc);
        return rc;
    }
    *built = m;
    return 0;
}

static int st_dcp_open(st_index *ix, int allow_incomplete, unsigned char **desc,
                       size_t *desclen)
{
    (void)allow_incomplete;
    st_dcp dc;
    st_meta *m;
    int rc = st_dcp_build(ix->vfs, ix->path, &dc, &m);
    if (rc)
        return rc;
    /* the metadata's strings live in dc's arena: encoded once, decoded as every rank will */
    rc = st_index_take(ix, m, "DCP checkpoint", desc, desclen);
    st_meta_free(m);
    st_dcp_free(&dc);
    return rc;
}

/* ---- verify -------------------------------------------------------------------------- */

#define VERIFY_WINDOW (4u << 20)

/* Reads every entry of the zip archive at [off, off + len) of f (shown: the file's path)
 * whole, in windows of buf, and checks its CRC-32; what is wrong is reported as item `name`
 * of `file`. 0, STRATA_ECHECKSUM (reported) or another error. */
static int verify_zip(const st_vfs *v, st_file *f, const char *shown, const char *name,
                      const char *file, uint64_t off, uint64_t len, unsigned char *buf,
                      st_report_fn report, void *ctx)
{
    char what[PATH_MAX + 600], msg[PATH_MAX + 1200];
    snprintf(what, sizeof what, "%s: item '%.200s' at %llu", shown, name,
             (unsigned long long)off);
    item_rd r = {v, f, shown, off, len, NULL, 0, 0, {0}, 0, 0};
    st_zip z;
    int rc = st_zip_open(&z, len, item_read, &r, what), bad = 0;
    for (size_t i = 0; !rc && i < z.n; i++) {
        const st_zip_entry *e = &z.e[i];
        if (e->method != 0) {
            snprintf(msg, sizeof msg, "%s: entry %s is compressed (zip method %u)", what,
                     e->name, e->method);
            report(ctx, name, file, msg);
            bad = 1;
            continue;
        }
        uLong crc = crc32(0L, Z_NULL, 0);
        for (uint64_t at = 0; at < e->usize && !rc;) {
            size_t n = (size_t)ST_MIN((uint64_t)VERIFY_WINDOW, e->usize - at);
            if (!(rc = item_read(&r, buf, n, e->data_off + at)))
                crc = crc32(crc, buf, (uInt)n);
            at += n;
        }
        if (!rc && (uint32_t)crc != e->crc) {
            snprintf(msg, sizeof msg, "%s: zip CRC-32 of %s is %08x, its archive says %08x",
                     what, e->name, (unsigned)crc, (unsigned)e->crc);
            report(ctx, name, file, msg);
            bad = 1;
        }
    }
    if (rc && rc != STRATA_ENOMEM && rc != STRATA_EIO) { /* a damaged archive: reported */
        report(ctx, name, file, strata_error_last());
        bad = 1;
        rc = 0;
    }
    free(r.tail);
    st_zip_free(&z);
    return rc ? rc : bad ? STRATA_ECHECKSUM : 0;
}

int st_dcp_verify_archive(const st_vfs *v, st_file *f, const char *shown, const char *name,
                          const char *file, uint64_t len, st_report_fn report, void *ctx)
{
    unsigned char *win = malloc(VERIFY_WINDOW);
    int rc = win ? verify_zip(v, f, shown, name, file, 0, len, win, report, ctx)
                 : st_fail(STRATA_ENOMEM, "out of memory");
    free(win);
    return rc;
}

int st_dcp_verify_files(const st_index *ix, uint32_t nfiles, st_report_fn report, void *ctx)
{
    const st_vfs *v = ix->vfs;
    const st_meta *m = ix->meta;
    char p[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    int rc = st_path_join(p, ix->path, ST_DCP_METADATA);
    if (rc)
        return rc;
    int e = st_vfs_read_all(v, p, ST_DCP_MAX_METADATA, ST_O_FOLLOW, &buf, &len);
    if (e)
        return st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e), "DCP metadata '%s': %s",
                       p, strerror(-e));
    st_dcp dc;
    dcp_files fs = {0};
    rc = st_dcp_parse(&dc, buf, len, p);
    free(buf);
    if (rc)
        return rc;
    if (!(rc = files_open(v, ix->path, &dc, &fs)) && dc.nfiles != nfiles)
        rc = st_fail(STRATA_ECHANGED, "DCP checkpoint '%s': its .metadata changed after it was "
                     "opened", ix->path);
    for (size_t f = 0; !rc && f < dc.nfiles; f++) {
        const st_mident *was = &m->idents[f];
        if (strcmp(dc.files[f], m->files[f].name) != 0 || fs.id[f].ino != was->ino ||
            fs.id[f].size != m->files[f].bytes || fs.id[f].mtime_ns != was->mtime_ns ||
            fs.id[f].ctime_ns != was->ctime_ns)
            rc = st_fail(STRATA_ECHANGED, "dcp file '%s' of '%s' changed after the checkpoint "
                         "was opened: verify it again", dc.files[f], ix->path);
    }
    unsigned char *win = rc ? NULL : malloc(VERIFY_WINDOW);
    if (!rc && !win)
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    int bad = 0;
    for (size_t i = 0; !rc && i < dc.nitems; i++)
        for (size_t c = 0; !rc && c < dc.items[i].nchunks; c++) {
            const st_dcp_chunk *k = &dc.items[i].chunks[c];
            char shown[PATH_MAX + 300];
            snprintf(shown, sizeof shown, "%s/%s", ix->path, dc.files[k->file]);
            int r = verify_zip(v, fs.f[k->file], shown, dc.items[i].fqn, dc.files[k->file],
                               k->offset, k->length, win, report, ctx);
            if (r == STRATA_ECHECKSUM)
                bad = 1;
            else
                rc = r;
        }
    free(win);
    files_close(v, &fs);
    st_dcp_free(&dc);
    if (!rc && bad)
        rc = st_fail(STRATA_ECHECKSUM, "DCP checkpoint '%s': items whose zip CRC-32 differs "
                     "(reported)", ix->path);
    return rc;
}

static int st_dcp_verify(const st_index *ix, st_report_fn report, void *ctx)
{
    return st_dcp_verify_files(ix, ix->meta->nfiles, report, ctx);
}

const st_source st_source_dcp = {"dcp",       STRATA_FORMAT_DCP,   st_dcp_here,
                                 st_dcp_open, st_index_adopt_meta, st_dcp_verify};
