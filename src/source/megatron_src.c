/* megatron_src.c - the Megatron-Core torch_dist source (source.h): a DCP directory
 * (.metadata + *.distcp, read by the DCP source's st_dcp_build) with Megatron's
 * metadata.json (its backends) and common.pt (the state every rank shares, a torch.save
 * file). metadata.json is parsed strictly (megatron.h); a tensor that
 * megatron-core < 0.14 saved as N-D flattened pieces (distributed-optimizer state: flat
 * ranges of boxes, reformulated into an (N+1)-d DCP tensor, the original shape in the
 * Metadata's mcore_data) becomes its original shape again, each piece a flat range of its
 * box; common.pt is a global blob of the index (the whole file), read by a load as any
 * blob. The description for other ranks is the foreign metadata, encoded once
 * (st_index_take) after Megatron completed what the DCP source built.
 * docs/FORMAT.md, "Megatron torch_dist as strata reads it".
 *
 * here: a directory without strata's metadata or commit record holding a metadata.json that
 * mentions "sharded_backend" (or is over its 64 KiB limit, which open refuses). open: errors STRATA_EFORMAT, STRATA_ENOTSUP
 * (a backend other than torch_dist, named; what the DCP source does not read), STRATA_ENOENT
 * (.metadata or a .distcp file missing), STRATA_EIO (also a common.pt that is not a regular
 * file), STRATA_ENOMEM. No threads. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "../meta/checks.h"
#include "dcp.h"
#include "megatron.h"
#include "readers.h"
#include "zip.h"

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
    if (kind == 1 && !st_source_has_file(v, path, ST_META_FILE) &&
        !st_source_has_file(v, path, ST_COMMIT_FILE) &&
        st_source_has_file(v, path, ST_MG_CONFIG) && st_path_join(p, path, ST_MG_CONFIG) == 0) {
        int e = st_vfs_read_all(v, p, ST_MG_MAX_CONFIG, ST_O_FOLLOW, &buf, &len);
        /* one over the limit is Megatron's to refuse (open says so), not unknown */
        yes = e == -EFBIG || (e == 0 && memmem(buf, len, "\"sharded_backend\"", 17) != NULL);
    }
    free(buf);
    st_clear_error();
    return yes;
}

/* The legacy N-D flattened tensors of the .metadata (a second, bounded read of it: the
 * DCP source keeps its pickle to itself) mapped back onto their original shapes; *changed
 * set when there were any. */
static int unflatten(const st_vfs *v, const char *dir, st_meta *meta, int *changed)
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
    rc = st_mg_reforms(&doc, &r, &n, buf, len, shown);
    free(buf);
    if (!rc && n && !(rc = st_mg_unflatten(meta, r, n, shown)))
        *changed = 1;
    free(r);
    pk_free(&doc);
    return rc;
}

/* Appends common.pt (identity id, archive z: empty if none) to m as its last file and a
 * global blob of all its bytes, with z's entries as checks. */
static int common_blob(st_meta *m, const st_file_id *id, const st_zip *z, const char *dir)
{
    st_arena *a = &m->arena;
    st_mfile *files = st_arena_alloc(a, (m->nfiles + 1) * sizeof *files);
    st_mident *ids = st_arena_alloc(a, (m->nfiles + 1) * sizeof *ids);
    st_mblob *blobs = st_arena_alloc(a, (m->nblobs + 1) * sizeof *blobs);
    char *name = st_arena_strndup(a, ST_MG_COMMON, strlen(ST_MG_COMMON));
    assert(m->idents || !m->nfiles); /* a DCP index: every file's identity */
    if (!files || !ids || !blobs || !name)
        return st_fail(STRATA_ENOMEM, "out of memory");
    if (m->nfiles) {
        memcpy(files, m->files, m->nfiles * sizeof *files);
        memcpy(ids, m->idents, m->nfiles * sizeof *ids);
    }
    if (m->nblobs)
        memcpy(blobs, m->blobs, m->nblobs * sizeof *blobs);
    files[m->nfiles] = (st_mfile){name, id->size};
    ids[m->nfiles] = (st_mident){id->ino, id->mtime_ns, id->ctime_ns};
    blobs[m->nblobs] = (st_mblob){name, -1, {m->nfiles, 0, id->size, NULL}};
    m->files = files;
    m->idents = ids;
    m->blobs = blobs;
    m->nfiles++;
    m->nblobs++;
    m->data_bytes += id->size;
    st_check_set cs = {0};
    int rc = st_check_add_zip(&cs, z, m->nfiles - 1, 0);
    if (!rc)
        rc = st_meta_set_checks(m, &cs, dir);
    st_check_set_free(&cs);
    return rc;
}

/* common.pt, the state every rank shares (a torch.save file), as the index's global blob
 * "common.pt": the whole file, which a load reads as any blob (its identity checked against
 * the one seen here; with a communicator read once and broadcast) and strata.torch parses
 * with the restricted torch.save reader. *changed set when there is one; nothing when there
 * is none. */
static int add_common(const st_vfs *v, const char *dir, st_meta *m, int *changed)
{
    st_file *f = NULL;
    st_file_id id;
    st_zip z = {0};
    char shown[PATH_MAX];
    int rc = st_source_open_file(v, dir, ST_MG_COMMON, "Megatron common.pt", &f, &id);
    if (rc == STRATA_ENOENT) /* none: the checkpoint holds no common state */
        return st_clear_error(), 0;
    if (rc)
        return rc;
    /* its zip entries' CRC-32s, checked as a load reads it (a file that is no zip has none:
     * strata.torch's reader refuses its keys) */
    if (!(rc = st_path_join(shown, dir, ST_MG_COMMON)) &&
        (rc = st_source_zip_open(v, f, shown, id.size, &z)) == STRATA_EFORMAT)
        rc = 0, st_clear_error();
    v->close(f);
    if (!rc)
        rc = common_blob(m, &id, &z, dir);
    st_zip_free(&z);
    if (!rc)
        *changed = 1;
    return rc;
}

static int st_megatron_open(st_index *ix, int allow_incomplete, unsigned char **desc,
                            size_t *desclen)
{
    (void)allow_incomplete;
    const st_vfs *v = ix->vfs;
    char shown[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    st_mg_config cfg;
    int rc = read_whole(v, ix->path, ST_MG_CONFIG, ST_MG_MAX_CONFIG, "metadata.json", &buf,
                        &len, shown);
    if (rc)
        return rc;
    rc = st_mg_parse_config(&cfg, buf, len, shown);
    free(buf);
    if (rc)
        return rc;
    if (strcmp(cfg.sharded_backend, "torch_dist") != 0) /* strata's: mgstrata_src.c */
        return st_fail(STRATA_ENOTSUP, "Megatron %s: sharded_backend '%s' is not torch_dist",
                       shown, cfg.sharded_backend);
    if (!st_source_has_file(v, ix->path, ST_DCP_METADATA))
        return st_fail(STRATA_ENOENT, "Megatron torch_dist checkpoint '%s': its DCP metadata "
                       "(%s) is missing", ix->path, ST_DCP_METADATA);
    /* the DCP index as Megatron completes it (legacy flattened tensors in their shapes,
     * common.pt a blob), then encoded once and validated as every other rank will */
    st_dcp dc;
    st_meta *m;
    int changed = 0;
    if ((rc = st_dcp_build(v, ix->path, &dc, &m)))
        return rc;
    if (!(rc = unflatten(v, ix->path, m, &changed)) &&
        !(rc = add_common(v, ix->path, m, &changed)))
        rc = st_index_take(ix, m, changed ? "Megatron checkpoint" : "DCP checkpoint", desc,
                           desclen);
    st_meta_free(m);
    st_dcp_free(&dc);
    return rc;
}

/* DCP's verify of the DCP files, then common.pt (the last file, when add_common found one):
 * still the file opened, and its zip CRC-32s. */
static int st_megatron_verify(const st_index *ix, st_report_fn report, void *ctx)
{
    const st_meta *m = ix->meta;
    uint32_t nf = m->nfiles;
    int common = nf && strcmp(m->files[nf - 1].name, ST_MG_COMMON) == 0;
    int rc = st_dcp_verify_files(ix, nf - (uint32_t)common, report, ctx);
    if (!common || (rc && rc != STRATA_ECHECKSUM))
        return rc;
    char shown[PATH_MAX];
    st_file *f = NULL;
    st_file_id id;
    int rc2 = st_source_open_file(ix->vfs, ix->path, ST_MG_COMMON, "Megatron common.pt", &f, &id);
    if (!rc2) {
        if (!(rc2 = st_check_same_file(ix, &m->files[nf - 1], &m->idents[nf - 1], f)) &&
            !(rc2 = st_path_join(shown, ix->path, ST_MG_COMMON)))
            rc2 = st_dcp_verify_archive(ix->vfs, f, shown, ST_MG_COMMON, ST_MG_COMMON,
                                        m->files[nf - 1].bytes, report, ctx);
        ix->vfs->close(f);
    }
    if (rc2 == STRATA_ECHECKSUM && !rc)
        return st_fail(rc2, "Megatron checkpoint '%s': its %s fails its zip CRC-32 "
                       "(reported)", ix->path, ST_MG_COMMON);
    return rc2 && rc2 != STRATA_ECHECKSUM ? rc2 : rc;
}

const st_source st_source_megatron = {"megatron",          STRATA_FORMAT_MEGATRON,
                                      st_megatron_here,    st_megatron_open,
                                      st_index_adopt_meta, st_megatron_verify};
