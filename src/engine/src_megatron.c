/* src_megatron.c - the Megatron-Core torch_dist source (source.h): a DCP directory
 * (.metadata + *.distcp, read by the DCP source's st_dcp_read_meta) with Megatron's
 * metadata.json (its backends) and common.pt (the state every rank shares, a torch.save
 * file). metadata.json is parsed strictly (src/meta/megatron.h); a tensor that
 * megatron-core < 0.14 saved as N-D flattened pieces (distributed-optimizer state: flat
 * ranges of boxes, reformulated into an (N+1)-d DCP tensor, the original shape in the
 * Metadata's mcore_data) becomes its original shape again, each piece a flat range of its
 * box. The description for other ranks is the foreign metadata (st_source_describe).
 * docs/FORMAT.md, "Megatron torch_dist as strata reads it".
 *
 * here: a directory without strata's metadata or commit record holding a metadata.json that
 * mentions "sharded_backend" (or is over its 64 KiB limit, which open refuses). open: errors STRATA_EFORMAT, STRATA_ENOTSUP
 * (a backend other than torch_dist, named; what the DCP source does not read), STRATA_ENOENT
 * (.metadata or a .distcp file missing), STRATA_EIO, STRATA_ENOMEM. No threads. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "../meta/dcp.h"
#include "../meta/megatron.h"
#include "source.h"

static int has_file(const st_vfs *v, const char *dir, const char *name)
{
    char p[PATH_MAX];
    int kind;
    return st_path_join(p, dir, name) == 0 && v->stat(v, p, NULL, &kind) == 0 &&
           (kind == 0 || kind == 2);
}

/* Reads dir/name whole (at most max bytes); what names it in messages. */
static int read_whole(const st_vfs *v, const char *dir, const char *name, size_t max,
                      const char *what, unsigned char **buf, size_t *len, char *shown)
{
    int rc = st_path_join(shown, dir, name);
    if (rc)
        return rc;
    int e = st_vfs_read_all(v, shown, max, ST_O_FOLLOW, buf, len);
    if (e == -EFBIG)
        return st_fail(STRATA_EFORMAT, "Megatron %s '%s': over the limit of %zu bytes", what,
                       shown, max);
    if (e)
        return st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e), "Megatron %s '%s': %s",
                       what, shown,
                       e == -ENOENT        ? "is missing"
                       : e == -ST_ENOTREG ? "is not a regular file"
                                          : strerror(-e));
    return 0;
}

static int st_megatron_here(const st_vfs *v, const char *path, int kind)
{
    char p[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    int yes = 0;
    if (kind == 1 && !has_file(v, path, ST_META_FILE) && !has_file(v, path, ST_COMMIT_FILE) &&
        has_file(v, path, ST_MG_CONFIG) && st_path_join(p, path, ST_MG_CONFIG) == 0) {
        int e = st_vfs_read_all(v, p, ST_MG_MAX_CONFIG, ST_O_FOLLOW, &buf, &len);
        /* one over the limit is Megatron's to refuse (open says so), not unknown */
        yes = e == -EFBIG || (e == 0 && memmem(buf, len, "\"sharded_backend\"", 17) != NULL);
    }
    free(buf);
    st_clear_error();
    return yes;
}

/* The legacy N-D flattened tensors of the .metadata (a second, bounded read of it: the
 * DCP source keeps its pickle to itself) mapped back onto their original shapes. */
static int unflatten(const st_vfs *v, const char *dir, st_meta **meta)
{
    char shown[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    int rc = read_whole(v, dir, ST_DCP_METADATA, ST_DCP_MAX_METADATA, "DCP metadata", &buf,
                        &len, shown);
    if (rc)
        return rc;
    pk_doc doc;
    st_mg_reform *r = NULL;
    size_t n = 0;
    unsigned char *enc = NULL;
    size_t elen = 0;
    st_meta *m = NULL;
    rc = st_mg_reforms(&doc, &r, &n, buf, len, shown);
    free(buf);
    if (!rc && n && !(rc = st_mg_unflatten(*meta, r, n, shown)) &&
        !(rc = st_meta_encode(*meta, &enc, &elen))) {
        /* the shards changed: validated again as every other rank will */
        if ((rc = st_meta_decode_foreign(&m, enc, elen)) != 0) {
            rc = st_wrap(rc, "Megatron checkpoint '%s'", dir);
        } else {
            st_meta_free(*meta);
            *meta = m;
        }
    }
    free(enc);
    free(r);
    pk_free(&doc);
    return rc;
}

static int st_megatron_open(st_dir *d, unsigned char **desc, size_t *desclen)
{
    const st_vfs *v = d->vfs;
    char shown[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    st_mg_config cfg;
    int rc = read_whole(v, d->path, ST_MG_CONFIG, ST_MG_MAX_CONFIG, "metadata.json", &buf,
                        &len, shown);
    if (rc)
        return rc;
    rc = st_mg_parse_config(&cfg, buf, len, shown);
    free(buf);
    if (rc)
        return rc;
    if (!has_file(v, d->path, ST_DCP_METADATA))
        return st_fail(STRATA_ENOENT, "Megatron torch_dist checkpoint '%s': its DCP metadata "
                       "(%s) is missing", d->path, ST_DCP_METADATA);
    if ((rc = st_dcp_read_meta(v, d->path, &d->meta)) != 0 ||
        (rc = unflatten(v, d->path, &d->meta)) != 0) {
        if (d->meta)
            st_meta_free(d->meta);
        d->meta = NULL;
        return rc;
    }
    d->committed = 1;
    memset(&d->commit, 0, sizeof d->commit);
    if (desc && (rc = st_source_describe(d, desc, desclen)) != 0)
        return rc;
    return 0;
}

static int st_megatron_verify(const st_dir *d, strata_verify_cb report, void *ctx)
{
    return st_source_dcp.verify(d, report, ctx);
}

const st_source st_source_megatron = {"megatron", STRATA_FORMAT_MEGATRON, st_megatron_here,
                                      st_megatron_open, NULL, st_megatron_verify};
