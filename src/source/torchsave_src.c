/* torchsave_src.c - the torch.save source (source.h): one torch.save file (the zip format of
 * torch >= 1.6: .pt, .pth, .bin), or a Hugging Face directory holding pytorch_model.bin or
 * the files named by pytorch_model.bin.index.json. Each file's central directory and
 * data.pkl are read and its tensors placed (torchsave.h); the metadata built is encoded
 * once (st_index_take), which is also its description for other ranks.
 *
 * here: by content - a file that is a zip archive with a <dir>/data.pkl entry (or a zip
 * whose structure is broken: open names the problem), or that begins as torch.save's
 * legacy format (then refused by open with STRATA_ENOTSUP); a
 * directory without strata's metadata or commit record holding one of the two files above.
 * open: STRATA_EFORMAT, STRATA_ENOTSUP, STRATA_ECHECKSUM (data.pkl), STRATA_ENOENT (a file
 * the index names is missing), STRATA_EIO, STRATA_ENOMEM. verify: the CRC-32 of every
 * stored entry of every file (zip's own check; torch.save has no other). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <zlib.h>

#include "../core/error.h"
#include "torchsave.h"
#include "readers.h"

typedef struct {
    const st_vfs *v;
    st_file *f;
    const char *path;
} rd_ctx;

static int rd_vfs(void *ctx, void *buf, size_t len, uint64_t off)
{
    rd_ctx *c = ctx;
    int64_t got = st_vfs_read_full(c->v, c->f, buf, len, off);
    if (got < 0)
        return st_fail(st_from_errno((int)-got), "reading '%s': %s", c->path,
                       strerror((int)-got));
    if ((uint64_t)got != len)
        return st_fail(STRATA_EFORMAT, "'%s': truncated (%llu bytes wanted at %llu)", c->path,
                       (unsigned long long)len, (unsigned long long)off);
    return 0;
}

int st_source_zip_open(const st_vfs *v, st_file *f, const char *path, uint64_t size, st_zip *z)
{
    rd_ctx c = {v, f, path};
    return st_zip_open(z, size, rd_vfs, &c, path);
}

int st_ts_kind(const st_vfs *v, const char *dir, const char *name)
{
    char p[PATH_MAX];
    st_file *f;
    unsigned char b[ST_TS_LEGACY_MAGIC_LEN];
    if ((name ? st_path_join(p, dir, name) : snprintf(p, sizeof p, "%s", dir) >= PATH_MAX) ||
        v->open(v, p, ST_O_READ | ST_O_FOLLOW, &f)) {
        st_clear_error();
        return 0;
    }
    int64_t got = st_vfs_read_full(v, f, b, sizeof b, 0);
    v->close(f);
    if (got >= 4 && memcmp(b, "PK\x03\x04", 4) == 0)
        return 1;
    return got == (int64_t)sizeof b && memcmp(b, ST_TS_LEGACY_MAGIC, sizeof b) == 0 ? 2 : 0;
}

/* A zip archive with an entry <dir>/data.pkl, or one whose zip structure is broken (a
 * truncated torch.save file: open names what is wrong with it)? */
static int has_pkl(const st_vfs *v, const char *path)
{
    st_file *f;
    st_file_id id;
    st_zip z;
    int yes = 0;
    if (v->open(v, path, ST_O_READ | ST_O_FOLLOW, &f)) {
        st_clear_error();
        return 0;
    }
    rd_ctx c = {v, f, path};
    if (v->ident(f, &id) == 0) {
        int rc = st_zip_open(&z, id.size, rd_vfs, &c, path);
        yes = rc == STRATA_EFORMAT;
        for (size_t i = 0; !rc && i < z.n && !yes; i++) {
            const char *slash = strchr(z.e[i].name, '/');
            yes = slash && strcmp(slash, "/data.pkl") == 0;
        }
        if (!rc)
            st_zip_free(&z);
    }
    v->close(f);
    st_clear_error();
    return yes;
}

static int ts_here(const st_vfs *v, const char *path, int kind)
{
    if (kind != 1) {
        int k = st_ts_kind(v, path, NULL);
        return k == 2 || (k == 1 && has_pkl(v, path));
    }
    return !st_source_has_file(v, path, ST_META_FILE) &&
           !st_source_has_file(v, path, ST_COMMIT_FILE) &&
           (st_source_has_file(v, path, ST_TS_INDEX_FILE) ||
            (st_source_has_file(v, path, ST_TS_SINGLE_FILE) &&
             st_ts_kind(v, path, ST_TS_SINGLE_FILE)));
}

int st_ts_open_file(const st_vfs *v, const char *dir, const char *name, st_ts_archive *a,
                    st_ts_file *tf)
{
    char p[PATH_MAX];
    st_file *f;
    st_file_id id;
    int rc = st_path_join(p, dir, name);
    if (!rc)
        rc = st_source_open_file(v, dir, name, "torch.save file", &f, &id);
    if (rc)
        return rc;
    unsigned char b[ST_TS_LEGACY_MAGIC_LEN];
    if (st_vfs_read_full(v, f, b, sizeof b, 0) == (int64_t)sizeof b &&
        memcmp(b, ST_TS_LEGACY_MAGIC, sizeof b) == 0)
        rc = st_fail(STRATA_ENOTSUP, "'%s' is in torch.save's legacy format (torch before 1.6, "
                     "or _use_new_zipfile_serialization=False), which strata does not read: "
                     "torch.load it and torch.save it again with the default format", p);
    rd_ctx c = {v, f, p};
    if (!rc)
        rc = st_ts_open(a, id.size, rd_vfs, &c, p);
    v->close(f);
    if (!rc)
        *tf = (st_ts_file){name, id.size, {id.ino, id.mtime_ns, id.ctime_ns}, a};
    return rc;
}

static int read_index(const st_vfs *v, const char *dir, st_st_map *map)
{
    char shown[PATH_MAX + 300];
    snprintf(shown, sizeof shown, "%s/%s", dir, ST_TS_INDEX_FILE);
    unsigned char *json = NULL;
    size_t len = 0;
    int rc, e = st_vfs_read_all(v, shown, ST_ST_MAX_HEADER, ST_O_FOLLOW, &json, &len);
    if (e == -EFBIG)
        rc = st_fail(STRATA_EFORMAT, "%s: over the limit of %llu bytes for an index", shown,
                     ST_ST_MAX_HEADER);
    else if (e)
        rc = st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e), "index '%s': %s", shown,
                     e == -ST_ENOTREG ? "is not a regular file" : strerror(-e));
    else
        rc = st_st_parse_index(map, json, len, shown);
    free(json);
    if (!rc && !map->nfiles)
        rc = st_fail(STRATA_EFORMAT, "%s: its weight_map is empty", shown);
    return rc;
}

static int ts_open(st_index *ix, int allow_incomplete, unsigned char **desc, size_t *desclen)
{
    (void)allow_incomplete;
    const st_vfs *v = ix->vfs;
    st_st_map map = {0};
    char single[PATH_MAX] = ST_TS_SINGLE_FILE;
    const char *one = single;
    const char *const *names = &one;
    size_t n = 1;
    int rc = 0;
    if (!st_index_to_dir(ix, single) && st_source_has_file(v, ix->path, ST_TS_INDEX_FILE)) {
        if ((rc = read_index(v, ix->path, &map)))
            goto out;
        names = (const char *const *)map.files;
        n = map.nfiles;
    }
    st_ts_archive *a = calloc(n, sizeof *a);
    st_ts_file *tf = calloc(n, sizeof *tf);
    st_meta *m = NULL;
    if (!a || !tf)
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < n && !rc; i++)
        rc = st_ts_open_file(v, ix->path, names[i], &a[i], &tf[i]);
    if (!rc)
        rc = st_ts_meta(&m, tf, n, map.n ? &map : NULL, ix->path);
    for (size_t i = 0; a && i < n; i++)
        st_ts_close(&a[i]);
    free(a);
    free(tf);
    if (!rc)
        rc = st_index_take(ix, m, "torch.save source", desc, desclen);
    if (m)
        st_meta_free(m);
out:
    st_st_map_free(&map);
    return rc;
}

static int ts_adopt(st_index *ix, const unsigned char *desc, size_t len)
{
    char name[PATH_MAX];
    st_index_to_dir(ix, name);
    return st_index_adopt_meta(ix, desc, len);
}

/* Checks the CRC-32 of every stored entry of file i of d. */
static int verify_file(const st_index *ix, uint32_t i, st_report_fn report, void *ctx,
                       unsigned char *buf, size_t cap)
{
    const st_vfs *v = ix->vfs;
    const st_mfile *mf = &ix->meta->files[i];
    char p[PATH_MAX];
    st_file *f;
    st_file_id id;
    st_zip z;
    int rc = st_path_join(p, ix->path, mf->name), bad = 0;
    if (rc || (rc = st_source_open_file(v, ix->path, mf->name, "torch.save file", &f, &id)))
        return rc;
    rd_ctx c = {v, f, p};
    if ((rc = st_check_same_file(ix, mf, &ix->meta->idents[i], f)) ||
        (rc = st_zip_open(&z, id.size, rd_vfs, &c, p))) {
        v->close(f);
        return rc;
    }
    for (size_t k = 0; k < z.n && !rc; k++) {
        const st_zip_entry *e = &z.e[k];
        char msg[160];
        if (e->method != 0) {
            report(ctx, e->name, mf->name, "compressed: its CRC-32 is not checked");
            continue;
        }
        uLong crc = crc32(0L, Z_NULL, 0);
        for (uint64_t at = 0; at < e->usize && !rc;) {
            size_t k2 = e->usize - at < cap ? (size_t)(e->usize - at) : cap;
            if (!(rc = rd_vfs(&c, buf, k2, e->data_off + at)))
                crc = crc32(crc, buf, (uInt)k2);
            at += k2;
        }
        if (!rc && (uint32_t)crc != e->crc) {
            snprintf(msg, sizeof msg, "CRC-32 %08x, the archive says %08x", (unsigned)crc,
                     (unsigned)e->crc);
            report(ctx, e->name, mf->name, msg);
            bad = 1;
        }
    }
    st_zip_free(&z);
    v->close(f);
    return rc ? rc : bad ? STRATA_ECHECKSUM : 0;
}

static int ts_verify(const st_index *ix, st_report_fn report, void *ctx)
{
    size_t cap = 4u << 20;
    unsigned char *buf = malloc(cap);
    if (!buf)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = 0;
    for (uint32_t i = 0; i < ix->meta->nfiles; i++) {
        int r = verify_file(ix, i, report, ctx, buf, cap);
        if (r == STRATA_ECHECKSUM && !rc)
            rc = r;
        else if (r && r != STRATA_ECHECKSUM) {
            rc = r;
            break;
        }
    }
    free(buf);
    if (rc == STRATA_ECHECKSUM)
        st_fail(rc, "torch.save source '%s': an entry's CRC-32 differs", ix->path);
    return rc;
}

const st_source st_source_torchsave = {"torch.save", STRATA_FORMAT_TORCH_SAVE, ts_here,
                                       ts_open, ts_adopt, ts_verify};
