/* safetensors_src.c - the safetensors source (source.h): a Hugging Face safetensors directory (or
 * one .safetensors file). The index and every file's header are read, and the metadata is
 * built from them (safetensors.h). Its description for the other ranks is the
 * headers themselves (safetensors.h's source description).
 *
 * here: a file named *.safetensors, or a directory without strata's metadata or commit
 * record that holds model.safetensors.index.json or model.safetensors. open: errors
 * STRATA_EFORMAT, STRATA_ENOENT (a file the index names is missing), STRATA_EIO,
 * STRATA_ENOMEM. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "safetensors.h"
#include "readers.h"

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n > k && strcmp(s + n - k, suffix) == 0;
}

static int st_foreign_here(const st_vfs *v, const char *path, int kind)
{
    if (kind != 1) /* a file, or a link to one */
        return ends_with(path, ".safetensors");
    return !st_source_has_file(v, path, ST_META_FILE) &&
           !st_source_has_file(v, path, ST_COMMIT_FILE) &&
           (st_source_has_file(v, path, ST_ST_INDEX_FILE) ||
            st_source_has_file(v, path, ST_ST_SINGLE_FILE));
}

/* Appends the first 8 + N bytes of dir/name to the source description. */
static int put_header(const st_vfs *v, const char *dir, const char *name, st_buf *b)
{
    st_file *f;
    st_file_id id;
    uint64_t n;
    int rc = st_source_open_file(v, dir, name, "safetensors file", &f, &id);
    if (rc)
        return rc;
    /* taken before the header is read: a later change shows when the data is opened */
    const uint64_t size = id.size;
    unsigned char first[8] = {0};
    unsigned char *head = NULL;
    int64_t got = size >= 8 ? st_vfs_read_full(v, f, first, 8, 0) : 0;
    if (got < 0)
        rc = st_fail(st_from_errno((int)-got), "reading '%s/%s': %s", dir, name,
                     strerror((int)-got));
    else if ((rc = st_st_header_len(first, size < 8 || got < 8 ? (uint64_t)got : size, &n)))
        rc = st_wrap(rc, "%s/%s", dir, name);
    else if (!(head = malloc(8 + n)))
        rc = st_fail(STRATA_ENOMEM, "out of memory for the header of '%s/%s'", dir, name);
    else if ((got = st_vfs_read_full(v, f, head, 8 + n, 0)) != (int64_t)(8 + n))
        rc = got < 0 ? st_fail(st_from_errno((int)-got), "reading '%s/%s': %s", dir, name,
                               strerror((int)-got))
                     : st_fail(STRATA_EFORMAT, "%s/%s: truncated while its header was read",
                               dir, name);
    else
        st_st_src_put(b, name, size, &(st_mident){id.ino, id.mtime_ns, id.ctime_ns}, head, 8 + n);
    free(head);
    v->close(f);
    return rc;
}

static int st_foreign_open(st_index *ix, int allow_incomplete, unsigned char **raw,
                           size_t *rawlen)
{
    (void)allow_incomplete;
    const st_vfs *v = ix->vfs;
    int rc = 0;
    st_buf b = {0};
    st_st_map map = {0};
    char single[PATH_MAX] = ST_ST_SINGLE_FILE;
    if (st_index_to_dir(ix, single)) {
        st_st_src_begin(&b, 1);
        rc = put_header(v, ix->path, single, &b);
    } else if (st_source_has_file(v, ix->path, ST_ST_INDEX_FILE)) {
        char shown[PATH_MAX + 300];
        snprintf(shown, sizeof shown, "%s/%s", ix->path, ST_ST_INDEX_FILE);
        unsigned char *json = NULL;
        size_t len = 0;
        int e = st_vfs_read_all(v, shown, ST_ST_MAX_HEADER, ST_O_FOLLOW, &json, &len);
        if (e == -EFBIG)
            rc = st_fail(STRATA_EFORMAT, "%s: over the limit of %llu bytes for an index", shown,
                         ST_ST_MAX_HEADER);
        else if (e)
            rc = st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e),
                         "safetensors index '%s': %s", shown,
                         e == -ST_ENOTREG ? "is not a regular file" : strerror(-e));
        else
            rc = st_st_parse_index(&map, json, len, shown);
        free(json);
        if (!rc && !map.nfiles)
            rc = st_fail(STRATA_EFORMAT, "%s: its weight_map is empty", shown);
        if (rc)
            goto out;
        st_st_src_begin(&b, (uint32_t)map.nfiles);
        for (size_t i = 0; i < map.nfiles && !rc; i++)
            rc = put_header(v, ix->path, map.files[i], &b);
    } else {
        st_st_src_begin(&b, 1);
        rc = put_header(v, ix->path, single, &b);
    }
    if (!rc && b.oom)
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    if (!rc)
        rc = st_st_meta(&ix->meta, b.p, b.n, map.n ? &map : NULL, ix->path);
out:
    st_st_map_free(&map);
    if (rc) {
        free(b.p);
        return rc;
    }
    ix->committed = 1;
    if (raw) {
        *raw = b.p;
        *rawlen = b.n;
    } else {
        free(b.p);
    }
    return 0;
}

static int st_foreign_adopt(st_index *ix, const unsigned char *raw, size_t len)
{
    char name[PATH_MAX];
    st_index_to_dir(ix, name);
    int rc = st_st_meta(&ix->meta, raw, len, NULL, ix->path);
    if (!rc)
        ix->committed = 1;
    return rc;
}

const st_source st_source_safetensors = {"safetensors", STRATA_FORMAT_SAFETENSORS,
                                         st_foreign_here, st_foreign_open, st_foreign_adopt,
                                         NULL};
