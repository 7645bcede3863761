/* dcp.c - a DCP .metadata pickle and a DCP item's data.pkl, interpreted (dcp.h). */
#include "dcp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../meta/meta.h"

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    return b && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

static uint64_t add_sat(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

static int bad(const char *file, const char *fqn, const char *what)
{
    if (fqn)
        return st_fail(STRATA_EFORMAT, "%s: item '%.200s': %s", file, fqn, what);
    return st_fail(STRATA_EFORMAT, "%s: %s", file, what);
}

static int is_call(const pk_val *v, pk_global g)
{
    return v && v->kind == PK_CALL && v->g == g;
}

/* The state dict of a dataclass instance (NEWOBJ + BUILD with a dict), or NULL. A
 * (None, dict) state (slots) is accepted as its dict. */
static const pk_val *state_dict(const pk_val *v)
{
    const pk_val *s = v ? v->state : NULL;
    if (s && s->kind == PK_TUPLE && s->n == 2 && s->items[0]->kind == PK_NONE)
        s = s->items[1];
    return s && s->kind == PK_DICT ? s : NULL;
}

/* A non-negative int. */
static int get_u64(const pk_val *v, uint64_t *out)
{
    int64_t x;
    if (!v || (v->kind != PK_INT && v->kind != PK_BIGINT) || pk_int64(v, &x) || x < 0)
        return -1;
    *out = (uint64_t)x;
    return 0;
}

/* A torch.Size (or a plain tuple/list) of at most STRATA_MAX_DIMS non-negative ints. */
static int get_dims(const pk_val *v, uint64_t *out, int *ndim)
{
    if (is_call(v, PK_G_TORCH_SIZE)) {
        if (!v->args || v->args->kind != PK_TUPLE || v->args->n != 1)
            return -1;
        v = v->args->items[0];
    }
    if (!v || (v->kind != PK_TUPLE && v->kind != PK_LIST) || v->n > STRATA_MAX_DIMS)
        return -1;
    for (size_t i = 0; i < v->n; i++)
        if (get_u64(v->items[i], &out[i]))
            return -1;
    *ndim = (int)v->n;
    return 0;
}

/* The dtype of a torch dtype global: 0, 1 (not a dtype global), 2 (one strata does not hold,
 * *name set). */
static int dtype_of(pk_global g, strata_dtype *dt, const char **name)
{
    int r = pk_torch_dtype(g, dt);
    if (r == 2)
        *name = pk_global_name(g);
    return r;
}

/* ---- .metadata ------------------------------------------------------------------------ */

typedef struct sinfo {
    const char *fqn;
    int has_off;
    int ndim;
    uint64_t off[STRATA_MAX_DIMS];
    const char *path;
    uint64_t offset, length;
    int used;
} sinfo;

static int cmp_dims(const uint64_t *a, int an, const uint64_t *b, int bn)
{
    for (int i = 0; i < an && i < bn; i++)
        if (a[i] != b[i])
            return a[i] < b[i] ? -1 : 1;
    return an < bn ? -1 : an > bn;
}

static int cmp_sinfo(const void *pa, const void *pb)
{
    const sinfo *a = pa, *b = pb;
    int c = strcmp(a->fqn, b->fqn);
    if (c)
        return c;
    if (a->has_off != b->has_off)
        return a->has_off - b->has_off;
    return cmp_dims(a->off, a->ndim, b->off, b->ndim);
}

static int cmp_item(const void *pa, const void *pb)
{
    return strcmp(((const st_dcp_item *)pa)->fqn, ((const st_dcp_item *)pb)->fqn);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A str without a NUL byte inside (a name cut at one would name something else), or NULL. */
static const char *str_of(const pk_val *v)
{
    return v && v->kind == PK_STR && strlen((const char *)v->s) == v->len ? (const char *)v->s
                                                                          : NULL;
}

/* A _StorageInfo keyed by a MetadataIndex, into s. */
static int read_sinfo(const pk_val *key, const pk_val *val, sinfo *s, const char *file)
{
    const pk_val *k = state_dict(key), *v = state_dict(val);
    if (!is_call(key, PK_G_DCP_METADATA_INDEX) || !k)
        return bad(file, NULL, "a key of storage_data is not a MetadataIndex");
    memset(s, 0, sizeof *s);
    if (!(s->fqn = str_of(pk_dict_get(k, "fqn"))))
        return bad(file, NULL, "a MetadataIndex of storage_data has no str fqn");
    const pk_val *off = pk_dict_get(k, "offset");
    if (off && off->kind != PK_NONE) {
        if (get_dims(off, s->off, &s->ndim))
            return bad(file, s->fqn, "its MetadataIndex offset is not a torch.Size");
        s->has_off = 1;
    }
    if (!is_call(val, PK_G_DCP_STORAGE_INFO) || !v)
        return bad(file, s->fqn, "its storage_data value is not a _StorageInfo");
    const pk_val *td = pk_dict_get(v, "transform_descriptors");
    if (td && td->kind != PK_NONE && !((td->kind == PK_LIST || td->kind == PK_TUPLE) && !td->n))
        return st_fail(STRATA_ENOTSUP,
                       "%s: item '%.200s': compressed/transformed items are not read (its "
                       "_StorageInfo has transform_descriptors)",
                       file, s->fqn);
    const pk_val *rp = pk_dict_get(v, "relative_path");
    if (!(s->path = str_of(rp)))
        return bad(file, s->fqn, rp && rp->kind == PK_STR
                                     ? "its relative_path holds a NUL byte"
                                     : "its _StorageInfo has no str relative_path");
    if (get_u64(pk_dict_get(v, "offset"), &s->offset) ||
        get_u64(pk_dict_get(v, "length"), &s->length))
        return bad(file, s->fqn, "its _StorageInfo offset or length is not an int >= 0");
    if (s->offset > UINT64_MAX - s->length)
        return bad(file, s->fqn, "its _StorageInfo offset + length overflows");
    const char *p = s->path;
    size_t pl = strlen(p);
    if (p[0] == '/')
        return st_fail(STRATA_EFORMAT, "%s: item '%.200s': relative_path '%.200s' is absolute",
                       file, s->fqn, p);
    if (strstr(p, "..") && (strcmp(p, "..") == 0 || strncmp(p, "../", 3) == 0 ||
                            strstr(p, "/../") || (pl >= 3 && strcmp(p + pl - 3, "/..") == 0)))
        return st_fail(STRATA_EFORMAT,
                       "%s: item '%.200s': relative_path '%.200s' leaves the checkpoint "
                       "directory ('..')",
                       file, s->fqn, p);
    if (!st_plain_name(p, pl))
        return st_fail(STRATA_EFORMAT,
                       "%s: item '%.200s': relative_path '%.200s' is not a plain file name", file,
                       s->fqn, p);
    return 0;
}

/* The TensorStorageMetadata of item it (fqn set), from its state dict sd. */
static int read_tensor(st_dcp *d, st_dcp_item *it, const pk_val *sd, const char *file)
{
    const char *fqn = it->fqn;
    const pk_val *props = pk_dict_get(sd, "properties");
    const pk_val *ps = props ? props->state : NULL;
    const pk_val *dt = NULL, *layout = NULL;
    if (!is_call(props, PK_G_DCP_TENSOR_PROPERTIES) || !ps)
        return bad(file, fqn, "its properties are not a TensorProperties");
    if (ps->kind == PK_TUPLE && ps->n >= 2) {
        dt = ps->items[0];
        layout = ps->items[1];
    } else if (ps->kind == PK_DICT) {
        dt = pk_dict_get(ps, "dtype");
        layout = pk_dict_get(ps, "layout");
    }
    const char *dname = NULL;
    int r = dt && dt->kind == PK_GLOBAL ? dtype_of(dt->g, &it->dtype, &dname) : 1;
    if (r == 1 || pk_is_storage(dt->g))
        return bad(file, fqn, "its dtype is not a torch dtype");
    if (r == 2)
        return st_fail(STRATA_ENOTSUP, "%s: item '%.200s': dtype torch.%s is not one strata reads",
                       file, fqn, dname);
    /* torch.strided pickles as the global, or as torch.serialization._get_layout("torch.strided") */
    int strided = layout && ((layout->kind == PK_GLOBAL && layout->g == PK_G_LAYOUT_STRIDED) ||
                             (is_call(layout, PK_G_GET_LAYOUT) && layout->args &&
                              layout->args->kind == PK_TUPLE && layout->args->n == 1 &&
                              str_of(layout->args->items[0]) &&
                              strcmp(str_of(layout->args->items[0]), "torch.strided") == 0));
    if (layout && !strided)
        return st_fail(STRATA_ENOTSUP, "%s: item '%.200s': a layout other than torch.strided "
                       "(sparse) is not read", file, fqn);
    if (get_dims(pk_dict_get(sd, "size"), it->shape, &it->ndim))
        return bad(file, fqn, "its size is not a torch.Size of at most 8 dims");
    const pk_val *ch = pk_dict_get(sd, "chunks");
    if (!ch || ch->kind != PK_LIST || !ch->n)
        return bad(file, fqn, "its chunks are not a non-empty list");
    it->nchunks = ch->n;
    if (!(it->chunks = st_arena_alloc(&d->arena, ch->n * sizeof *it->chunks)))
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    for (size_t c = 0; c < ch->n; c++) {
        st_dcp_chunk *k = &it->chunks[c];
        const pk_val *cs = state_dict(ch->items[c]);
        int no, nl;
        memset(k, 0, sizeof *k);
        if (!is_call(ch->items[c], PK_G_DCP_CHUNK_STORAGE_METADATA) || !cs ||
            get_dims(pk_dict_get(cs, "offsets"), k->off, &no) ||
            get_dims(pk_dict_get(cs, "sizes"), k->len, &nl) || no != it->ndim || nl != it->ndim)
            return bad(file, fqn, "a chunk is not a ChunkStorageMetadata of the tensor's dims");
        for (int i = 0; i < it->ndim; i++)
            if (k->off[i] > it->shape[i] || k->len[i] > it->shape[i] - k->off[i]) {
                char m[128];
                snprintf(m, sizeof m, "chunk %zu lies outside the tensor in dim %d", c, i);
                return bad(file, fqn, m);
            }
    }
    return 0;
}

/* Do the chunks of it cover the tensor exactly (inside it, no overlap, volumes sum to numel)? */
static int check_cover(st_dcp_item *it, const char *file)
{
    uint64_t numel = 1, sum = 0;
    for (int i = 0; i < it->ndim; i++)
        numel = mul_sat(numel, it->shape[i]);
    size_t ns = 0;
    st_mshard *sh = calloc(it->nchunks, sizeof *sh);
    if (!sh)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    for (size_t c = 0; c < it->nchunks; c++) {
        uint64_t v = 1;
        for (int i = 0; i < it->ndim; i++)
            v = mul_sat(v, it->chunks[c].len[i]);
        sum = add_sat(sum, v);
        if (!v)
            continue; /* an empty chunk (an FSDP rank without rows) holds nothing */
        sh[ns].off = it->chunks[c].off;
        sh[ns].len = it->chunks[c].len;
        sh[ns].fe = v;
        ns++;
    }
    st_mtensor t = {.name = it->fqn, .ndim = it->ndim, .nshards = ns, .shards = sh};
    memcpy(t.shape, it->shape, sizeof t.shape);
    int rc = st_meta_check_overlap(&t);
    free(sh);
    if (rc)
        return bad(file, it->fqn, "two of its chunks overlap");
    if (sum != numel) {
        char m[160];
        snprintf(m, sizeof m, "its chunks hold %llu of its %llu elements: they do not cover it",
                 (unsigned long long)sum, (unsigned long long)numel);
        return bad(file, it->fqn, m);
    }
    return 0;
}

/* The storage entry of chunk k of item it (key (fqn, offsets) or (fqn) for bytes). */
static int bind(st_dcp *d, st_dcp_item *it, st_dcp_chunk *k, sinfo *all, size_t n,
                const char *file)
{
    sinfo key = {.fqn = it->fqn, .has_off = it->tensor, .ndim = it->ndim};
    memcpy(key.off, k->off, sizeof key.off);
    sinfo *s = bsearch(&key, all, n, sizeof *all, cmp_sinfo);
    if (!s) {
        if (it->tensor) {
            char m[64 + 21 * STRATA_MAX_DIMS] = "its chunk at offsets (";
            for (int i = 0; i < it->ndim; i++)
                snprintf(m + strlen(m), sizeof m - strlen(m), "%s%llu", i ? ", " : "",
                         (unsigned long long)k->off[i]);
            strcat(m, ") has no storage_data entry");
            return bad(file, it->fqn, m);
        }
        return bad(file, it->fqn, "it has no storage_data entry");
    }
    if (s->used)
        return bad(file, it->fqn, "two of its chunks have the same offsets");
    s->used = 1;
    char **f = bsearch(&s->path, d->files, d->nfiles, sizeof *d->files, cmp_str);
    k->file = (uint32_t)(f - d->files);
    k->offset = s->offset;
    k->length = s->length;
    return 0;
}

static int interpret(st_dcp *d, const pk_val *root, const char *file)
{
    const pk_val *st = state_dict(root);
    if (!is_call(root, PK_G_DCP_METADATA) || !st)
        return bad(file, NULL, "not a DCP Metadata (torch.distributed.checkpoint.metadata)");
    const pk_val *sdm = pk_dict_get(st, "state_dict_metadata");
    const pk_val *sdata = pk_dict_get(st, "storage_data");
    if (!sdm || sdm->kind != PK_DICT)
        return bad(file, NULL, "its state_dict_metadata is not a dict");
    if (!sdata || sdata->kind != PK_DICT)
        return bad(file, NULL, "its storage_data is not a dict (a storage other than the "
                               "file system's wrote it)");
    /* storage_data: sorted, unique keys */
    sinfo *all = calloc(sdata->n ? sdata->n : 1, sizeof *all);
    char **paths = calloc(sdata->n ? sdata->n : 1, sizeof *paths);
    int rc = 0;
    if (!all || !paths) {
        rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
        goto out;
    }
    for (size_t i = 0; i < sdata->n && !rc; i++) {
        rc = read_sinfo(sdata->items[2 * i], sdata->items[2 * i + 1], &all[i], file);
        paths[i] = (char *)all[i].path;
    }
    if (rc)
        goto out;
    qsort(all, sdata->n, sizeof *all, cmp_sinfo);
    for (size_t i = 1; i < sdata->n; i++)
        if (cmp_sinfo(&all[i - 1], &all[i]) == 0) {
            rc = bad(file, all[i].fqn, "storage_data holds its key twice");
            goto out;
        }
    qsort(paths, sdata->n, sizeof *paths, cmp_str);
    for (size_t i = 0; i < sdata->n; i++)
        if (!d->nfiles || strcmp(d->files[d->nfiles - 1], paths[i]) != 0) {
            if (d->nfiles >= ST_DCP_MAX_FILES) {
                rc = bad(file, NULL, "storage_data names too many files");
                goto out;
            }
            if (!d->files)
                d->files = st_arena_alloc(&d->arena, sdata->n * sizeof *d->files);
            if (!d->files || !(d->files[d->nfiles] =
                                   st_arena_strndup(&d->arena, paths[i], strlen(paths[i])))) {
                rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
                goto out;
            }
            d->nfiles++;
        }
    /* state_dict_metadata */
    d->nitems = sdm->n;
    d->items = st_arena_alloc(&d->arena, (sdm->n ? sdm->n : 1) * sizeof *d->items);
    if (!d->items) {
        rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
        goto out;
    }
    for (size_t i = 0; i < sdm->n && !rc; i++) {
        st_dcp_item *it = &d->items[i];
        const pk_val *k = sdm->items[2 * i], *v = sdm->items[2 * i + 1];
        memset(it, 0, sizeof *it);
        if (!str_of(k) || !k->len || k->len > STRATA_MAX_NAME) {
            rc = bad(file, NULL, "a key of state_dict_metadata is not a str of 1..1024 bytes");
            break;
        }
        it->fqn = (char *)k->s;
        if (is_call(v, PK_G_DCP_BYTES_STORAGE_METADATA)) {
            it->nchunks = 1;
            if (!(it->chunks = st_arena_alloc(&d->arena, sizeof *it->chunks)))
                rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
            else
                memset(it->chunks, 0, sizeof *it->chunks);
        } else if (is_call(v, PK_G_DCP_TENSOR_STORAGE_METADATA) && state_dict(v)) {
            it->tensor = 1;
            rc = read_tensor(d, it, state_dict(v), file);
        } else {
            rc = bad(file, it->fqn, "not a TensorStorageMetadata or BytesStorageMetadata");
        }
    }
    if (rc)
        goto out;
    qsort(d->items, d->nitems, sizeof *d->items, cmp_item);
    for (size_t i = 1; i < d->nitems; i++)
        if (strcmp(d->items[i - 1].fqn, d->items[i].fqn) == 0) {
            rc = bad(file, d->items[i].fqn, "state_dict_metadata holds it twice");
            goto out;
        }
    for (size_t i = 0; i < d->nitems && !rc; i++) {
        st_dcp_item *it = &d->items[i];
        if (it->tensor)
            rc = check_cover(it, file);
        for (size_t c = 0; c < it->nchunks && !rc; c++)
            rc = bind(d, it, &it->chunks[c], all, sdata->n, file);
    }
    for (size_t i = 0; i < sdata->n && !rc; i++)
        if (!all[i].used)
            rc = bad(file, all[i].fqn, "storage_data holds an entry that no chunk of "
                                       "state_dict_metadata names");
out:
    free(all);
    free(paths);
    return rc;
}

int st_dcp_parse(st_dcp *out, const unsigned char *b, size_t n, const char *file)
{
    memset(out, 0, sizeof *out);
    pk_doc doc;
    int rc = pk_parse(&doc, b, n, file);
    if (rc)
        return rc;
    /* strings point into doc's arena: copy the FQNs into out's */
    rc = interpret(out, doc.root, file);
    for (size_t i = 0; i < out->nitems && !rc; i++)
        if (!(out->items[i].fqn = st_arena_strndup(&out->arena, out->items[i].fqn,
                                                   strlen(out->items[i].fqn))))
            rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    pk_free(&doc);
    if (rc)
        st_dcp_free(out);
    return rc;
}

void st_dcp_free(st_dcp *d)
{
    st_arena_free(&d->arena);
    memset(d, 0, sizeof *d);
}

/* ---- one item's data.pkl -------------------------------------------------------------- */

int st_dcp_saved_tensor(st_dcp_saved *out, const unsigned char *b, size_t n, const char *what)
{
    memset(out, 0, sizeof *out);
    pk_doc doc;
    int rc = pk_parse(&doc, b, n, what);
    if (rc)
        return rc;
    const pk_val *r = doc.root, *a = r ? r->args : NULL;
    const pk_val *pid, *ps;
    uint64_t stride[STRATA_MAX_DIMS];
    int sn = 0;
    const char *dname = NULL;
    if (!(is_call(r, PK_G_REBUILD_TENSOR_V2) || is_call(r, PK_G_REBUILD_TENSOR_V3)) || !a ||
        a->kind != PK_TUPLE || a->n < 4) {
        rc = st_fail(STRATA_EFORMAT, "%s: not a torch.save of one tensor "
                     "(torch._utils._rebuild_tensor_v2 of a storage)", what);
        goto out;
    }
    pid = a->items[0];
    ps = pid->kind == PK_PID ? pid->args : NULL;
    /* ('storage', storage type, key, location, numel) */
    if (!ps || ps->kind != PK_TUPLE || ps->n != 5 || !str_of(ps->items[0]) ||
        strcmp(str_of(ps->items[0]), "storage") != 0 || ps->items[1]->kind != PK_GLOBAL ||
        !str_of(ps->items[2]) || ps->items[2]->len >= sizeof out->key ||
        !st_plain_name((const char *)ps->items[2]->s, ps->items[2]->len) ||
        get_u64(ps->items[4], &out->storage_numel)) {
        rc = st_fail(STRATA_EFORMAT, "%s: its tensor's storage is not a persistent "
                     "('storage', type, key, location, numel)", what);
        goto out;
    }
    memcpy(out->key, ps->items[2]->s, ps->items[2]->len + 1);
    pk_global sg = ps->items[1]->g;
    if (sg == PK_G_STORAGE_UNTYPED) { /* _rebuild_tensor_v3: the dtype is its 7th argument */
        if (!is_call(r, PK_G_REBUILD_TENSOR_V3) || a->n < 7 || a->items[6]->kind != PK_GLOBAL) {
            rc = st_fail(STRATA_EFORMAT, "%s: an untyped storage without a dtype", what);
            goto out;
        }
        sg = a->items[6]->g;
    }
    int dr = dtype_of(sg, &out->dtype, &dname);
    if (dr == 1) {
        rc = st_fail(STRATA_EFORMAT, "%s: its storage type %s.%s is not a torch storage", what,
                     pk_global_module(sg), pk_global_name(sg));
        goto out;
    }
    if (dr == 2) {
        rc = st_fail(STRATA_ENOTSUP, "%s: dtype %s is not one strata reads", what, dname);
        goto out;
    }
    if (sg != ps->items[1]->g && ps->items[1]->g != PK_G_STORAGE_UNTYPED) {
        rc = st_fail(STRATA_EFORMAT, "%s: its storage type and dtype differ", what);
        goto out;
    }
    if (get_u64(a->items[1], &out->storage_offset) ||
        get_dims(a->items[2], out->shape, &out->ndim) || get_dims(a->items[3], stride, &sn) ||
        sn != out->ndim) {
        rc = st_fail(STRATA_EFORMAT, "%s: its storage offset, size or stride is malformed",
                     what);
        goto out;
    }
    uint64_t expect = 1, numel = 1;
    for (int i = 0; i < out->ndim; i++)
        numel = mul_sat(numel, out->shape[i]);
    for (int i = out->ndim; i-- > 0;) {
        if (out->shape[i] > 1 && stride[i] != expect && numel) {
            rc = st_fail(STRATA_ENOTSUP, "%s: its tensor is not contiguous (stride %llu in dim "
                         "%d where %llu would be)", what, (unsigned long long)stride[i], i,
                         (unsigned long long)expect);
            goto out;
        }
        expect = mul_sat(expect, out->shape[i]);
    }
    if (numel && (out->storage_offset > out->storage_numel ||
                  numel > out->storage_numel - out->storage_offset)) {
        rc = st_fail(STRATA_EFORMAT, "%s: its tensor runs past the end of its storage (offset "
                     "%llu + %llu elements > %llu)", what,
                     (unsigned long long)out->storage_offset, (unsigned long long)numel,
                     (unsigned long long)out->storage_numel);
        goto out;
    }
out:
    pk_free(&doc);
    return rc;
}
