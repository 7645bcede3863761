/* megatron.c - Megatron-Core torch_dist: metadata.json, legacy N-D flattened tensors
 * (megatron.h). Pure; no I/O. */
#include "megatron.h"

#include <stdio.h>
#include <string.h>

#include <stdlib.h>

#include "../core/error.h"
#include "json.h"

/* ---- metadata.json: strict JSON, bounded (json.h) ------------------------------------- */

/* A string value into out (cap bytes, NUL-terminated): EFORMAT if it is not a string,
 * ENOTSUP if it is not one strata could read (too long, a NUL inside). */
static int field_str(st_json *j, const char *key, char *out, size_t cap)
{
    st_json_ws(j);
    if (j->p >= j->end || *j->p != '"')
        return st_fail(STRATA_EFORMAT, "Megatron %s: \"%s\" is not a string", j->file, key);
    int rc = st_json_string(j, key);
    if (rc)
        return rc;
    if (j->slen >= cap || memchr(j->str, 0, j->slen)) {
        char show[72];
        return st_fail(STRATA_ENOTSUP, "Megatron %s: %s '%s' is not one strata reads (it "
                       "reads torch_dist checkpoints)", j->file, key,
                       st_json_show(j->str, j->slen, show));
    }
    memcpy(out, j->str, j->slen + 1);
    return 0;
}

/* One member of the top-level object: its key just read. */
static int member(st_json *j, st_mg_config *out, int *seen_sb, int *seen_sv, int *seen_cb)
{
    if (st_json_is(j, "sharded_backend")) {
        *seen_sb = 1;
        return field_str(j, "sharded_backend", out->sharded_backend,
                         sizeof out->sharded_backend);
    }
    if (st_json_is(j, "common_backend")) {
        *seen_cb = 1;
        return field_str(j, "common_backend", out->common_backend, sizeof out->common_backend);
    }
    if (st_json_is(j, "sharded_backend_version")) {
        int is_int = 0;
        *seen_sv = 1;
        int rc = st_json_number(j, &is_int, &out->sharded_backend_version,
                                "sharded_backend_version");
        if (!rc && !is_int)
            rc = st_fail(STRATA_EFORMAT, "Megatron %s: sharded_backend_version is not an "
                         "integer", j->file);
        return rc;
    }
    return st_json_skip(j, 2);
}

static int parse_config(st_json *j, st_mg_config *out)
{
    int rc, seen_sb = 0, seen_sv = 0, seen_cb = 0;
    /* keys seen, for duplicates: their bytes as written */
    const unsigned char *keys[256];
    size_t klen[256], nkeys = 0;
    if ((rc = st_json_expect(j, '{', "to open the object")))
        return rc;
    if (!st_json_eat(j, '}')) {
        do {
            if ((rc = st_json_string(j, "a key")))
                return rc;
            for (size_t i = 0; i < nkeys; i++)
                if (klen[i] == j->rawlen && memcmp(keys[i], j->raw, j->rawlen) == 0) {
                    char show[72];
                    return st_fail(STRATA_EFORMAT, "Megatron %s: key \"%s\" is there twice",
                                   j->file, st_json_show(j->str, j->slen, show));
                }
            if (nkeys == 256)
                return st_json_fail(j, "over 256 keys");
            keys[nkeys] = j->raw, klen[nkeys++] = j->rawlen;
            if ((rc = st_json_expect(j, ':', "after a key")) ||
                (rc = member(j, out, &seen_sb, &seen_sv, &seen_cb)))
                return rc;
        } while (st_json_eat(j, ','));
        if ((rc = st_json_expect(j, '}', "to close the object")))
            return rc;
    }
    st_json_ws(j);
    if (j->p != j->end)
        return st_json_fail(j, "something follows the JSON object");
    if (!seen_sb)
        return st_fail(STRATA_EFORMAT, "Megatron %s: no \"sharded_backend\"", j->file);
    if (strcmp(out->sharded_backend, "torch_dist") != 0 &&
        strcmp(out->sharded_backend, ST_MG_STRATA) != 0)
        return st_fail(STRATA_ENOTSUP, "Megatron %s: sharded_backend '%s' is not one strata "
                       "reads (it reads torch_dist checkpoints and those saved through "
                       "strata.megatron)", j->file, out->sharded_backend);
    if (seen_sv && out->sharded_backend_version != 1)
        return st_fail(STRATA_ENOTSUP, "Megatron %s: %s version %lld is not one strata "
                       "reads (it reads version 1)", j->file, out->sharded_backend,
                       (long long)out->sharded_backend_version);
    if (seen_cb && strcmp(out->common_backend, "torch") != 0)
        return st_fail(STRATA_ENOTSUP, "Megatron %s: common_backend '%s' is not one strata "
                       "reads (it reads torch)", j->file, out->common_backend);
    return 0;
}

int st_mg_parse_config(st_mg_config *out, const unsigned char *b, size_t n, const char *file)
{
    memset(out, 0, sizeof *out);
    out->sharded_backend_version = -1;
    st_json j;
    int rc = st_json_init(&j, b, n, file, "Megatron metadata.json");
    if (!rc)
        rc = parse_config(&j, out);
    st_json_free(&j);
    return rc;
}

/* ---- legacy N-D flattened tensors ------------------------------------------------------ */

static st_mtensor *find(st_meta *m, const char *name)
{
    for (size_t i = 0; i < m->ntensors; i++)
        if (strcmp(m->tensors[i].name, name) == 0)
            return &m->tensors[i];
    return NULL;
}

int st_mg_unflatten(st_meta *m, const st_mg_reform *r, size_t n, const char *file)
{
    for (size_t i = 0; i < n; i++) {
        st_mtensor *t = find(m, r[i].name);
        const int nd = r[i].ndim;
        if (!t)
            return st_fail(STRATA_EFORMAT, "Megatron %s: mcore_data names '%s', which is not a "
                           "tensor of the checkpoint", file, r[i].name);
        if (nd < 1 || nd >= STRATA_MAX_DIMS || t->ndim != nd + 1)
            return st_fail(STRATA_EFORMAT, "Megatron %s: '%s': a flattened tensor of %d dims "
                           "saved with %d (expected %d)", file, r[i].name, nd, t->ndim, nd + 1);
        uint64_t box[STRATA_MAX_DIMS], numel = 1;
        for (int d = 0; d < nd; d++) {
            if (!t->shape[d] || r[i].orig[d] % t->shape[d])
                return st_fail(STRATA_EFORMAT, "Megatron %s: '%s': dim %d of %llu is not cut "
                               "into %llu equal parts", file, r[i].name, d,
                               (unsigned long long)r[i].orig[d],
                               (unsigned long long)t->shape[d]);
            box[d] = r[i].orig[d] / t->shape[d];
            if (box[d] && numel > UINT64_MAX / box[d])
                return st_fail(STRATA_EFORMAT, "Megatron %s: '%s': too large", file, r[i].name);
            numel *= box[d];
        }
        if (t->shape[nd] != numel)
            return st_fail(STRATA_EFORMAT, "Megatron %s: '%s': its flat dim holds %llu elements, "
                           "its boxes %llu", file, r[i].name,
                           (unsigned long long)t->shape[nd], (unsigned long long)numel);
        for (size_t k = 0; k < t->nshards; k++) {
            st_mshard *s = &t->shards[k];
            for (int d = 0; d < nd; d++)
                if (s->len[d] != 1 || s->flat)
                    return st_fail(STRATA_EFORMAT, "Megatron %s: '%s': chunk %zu spans more "
                                   "than one box", file, r[i].name, k);
            const uint64_t fs = s->off[nd], fe = fs + s->len[nd];
            for (int d = 0; d < nd; d++) {
                s->off[d] *= box[d];
                s->len[d] = box[d];
            }
            s->flat = !(fs == 0 && fe == numel);
            s->fs = fs;
            s->fe = fe;
        }
        t->ndim = nd;
        for (int d = 0; d < nd; d++)
            t->shape[d] = r[i].orig[d];
        t->shape[nd] = 0;
    }
    return 0;
}

/* ---- mcore_data in the DCP metadata ---------------------------------------------------- */

/* A tuple or list of 1..STRATA_MAX_DIMS-1 non-negative ints (or a torch.Size of one). */
static int shape_of(const pk_val *v, st_mg_reform *r)
{
    if (v && v->kind == PK_CALL && v->g == PK_G_TORCH_SIZE && v->args && v->args->n == 1)
        v = v->args->items[0];
    if (!v || (v->kind != PK_TUPLE && v->kind != PK_LIST) || v->n < 1 ||
        v->n >= STRATA_MAX_DIMS)
        return -1;
    for (size_t i = 0; i < v->n; i++) {
        int64_t x;
        if (v->items[i]->kind != PK_INT || pk_int64(v->items[i], &x) || x < 0)
            return -1;
        r->orig[i] = (uint64_t)x;
    }
    r->ndim = (int)v->n;
    return 0;
}

int st_mg_reforms(pk_doc *doc, st_mg_reform **out, size_t *n, const unsigned char *b,
                  size_t len, const char *file)
{
    *out = NULL;
    *n = 0;
    int rc = pk_parse(doc, b, len, file);
    if (rc)
        return rc;
    const pk_val *root = doc->root, *st = root ? root->state : NULL;
    if (st && st->kind == PK_TUPLE && st->n == 2 && st->items[0]->kind == PK_NONE)
        st = st->items[1];
    if (!root || root->kind != PK_CALL || root->g != PK_G_DCP_METADATA || !st ||
        st->kind != PK_DICT)
        return st_fail(STRATA_EFORMAT, "%s: not a DCP Metadata", file);
    const pk_val *md = pk_dict_get(st, "mcore_data");
    if (!md || md->kind == PK_NONE)
        return 0;
    if (md->kind != PK_DICT)
        return st_fail(STRATA_EFORMAT, "%s: its mcore_data is not a dict", file);
    st_mg_reform *r = calloc(md->n ? md->n : 1, sizeof *r);
    if (!r)
        return st_fail(STRATA_ENOMEM, "out of memory");
    size_t k = 0;
    for (size_t i = 0; i < md->n; i++) {
        const pk_val *key = md->items[2 * i], *val = md->items[2 * i + 1];
        if (key->kind != PK_STR || val->kind != PK_DICT) {
            free(r);
            return st_fail(STRATA_EFORMAT, "%s: an entry of mcore_data is not str: dict", file);
        }
        const pk_val *shape = pk_dict_get(val, "nd_reformulated_orig_global_shape");
        if (!shape)
            continue; /* nothing Megatron recorded for this tensor */
        r[k].name = (const char *)key->s;
        if (shape_of(shape, &r[k])) {
            free(r);
            return st_fail(STRATA_EFORMAT, "%s: mcore_data['%s']: its "
                           "nd_reformulated_orig_global_shape is not a shape", file,
                           (const char *)key->s);
        }
        for (size_t q = 0; q < k; q++)
            if (strcmp(r[q].name, r[k].name) == 0) {
                free(r);
                return st_fail(STRATA_EFORMAT, "%s: mcore_data names '%s' twice", file,
                               (const char *)key->s);
            }
        k++;
    }
    *out = r;
    *n = k;
    return 0;
}
