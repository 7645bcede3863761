/* unpickle.c - the restricted pickle reader's public entry (strata.h, "restricted pickles"):
 * a pickle or a torch.save archive held in memory, read by src/source/pickle.c and
 * torchsave.c, its values handed out one at a time with torch.save's own calls (tensors,
 * torch.Size, io.BytesIO) interpreted, never run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../source/torchsave.h"
#include "strata.h"

struct strata_pickle {
    int archive;              /* 1: a (the archive's data.pkl), else doc */
    pk_doc doc;
    st_ts_archive a;
    const unsigned char *data; /* an archive's bytes (the caller's) */
    uint64_t size;
    char name[256];
};

/* strata_pickle_value is pk_val: its pointer is the value's identity. */
static const pk_val *pv(const strata_pickle_value *v) { return (const pk_val *)v; }
static const strata_pickle_value *vp(const pk_val *v) { return (const strata_pickle_value *)v; }

static int make(strata_pickle **out, const char *name, const char *dflt)
{
    *out = calloc(1, sizeof **out);
    if (!*out)
        return st_fail(STRATA_ENOMEM, "out of memory");
    snprintf((*out)->name, sizeof (*out)->name, "%s", name ? name : dflt);
    return 0;
}

int strata_pickle_parse(strata_pickle **out, const void *data, size_t len, const char *name)
{
    st_clear_error();
    if (!out || (!data && len))
        return st_fail(STRATA_EINVAL, "strata_pickle_parse: %s is NULL", out ? "data" : "out");
    int rc = make(out, name, "pickle");
    if (!rc && (rc = pk_parse(&(*out)->doc, data, len, (*out)->name))) {
        free(*out);
        *out = NULL;
    }
    return rc;
}

static int rd_mem(void *ctx, void *buf, size_t len, uint64_t off)
{
    const strata_pickle *pk = ctx;
    if (off > pk->size || len > pk->size - off)
        return st_fail(STRATA_EFORMAT, "%s: truncated (%zu bytes wanted at %llu of %llu)",
                       pk->name, len, (unsigned long long)off, (unsigned long long)pk->size);
    memcpy(buf, pk->data + off, len);
    return 0;
}

int strata_pickle_open_archive(strata_pickle **out, const void *data, size_t len,
                               const char *name)
{
    st_clear_error();
    if (!out || (!data && len))
        return st_fail(STRATA_EINVAL, "strata_pickle_open_archive: %s is NULL",
                       out ? "data" : "out");
    int rc = make(out, name, "torch.save archive");
    if (rc)
        return rc;
    strata_pickle *pk = *out;
    pk->archive = 1;
    pk->data = data;
    pk->size = len;
    if ((rc = st_ts_open(&pk->a, len, rd_mem, pk, pk->name))) {
        free(pk);
        *out = NULL;
    }
    return rc;
}

void strata_pickle_free(strata_pickle *pk)
{
    if (!pk)
        return;
    if (pk->archive)
        st_ts_close(&pk->a);
    else
        pk_free(&pk->doc);
    free(pk);
}

const strata_pickle_value *strata_pickle_root(const strata_pickle *pk)
{
    return vp(pk->archive ? pk->a.doc.pk.root : pk->doc.root);
}

/* torch.Size(t): a REDUCE of torch.Size on a tuple holding one tuple, t. */
static const pk_val *torch_size(const pk_val *v)
{
    return v->kind == PK_CALL && v->g == PK_G_TORCH_SIZE && v->args->kind == PK_TUPLE &&
                   v->args->n == 1 && v->args->items[0]->kind == PK_TUPLE
               ? v->args->items[0]
               : NULL;
}

/* io.BytesIO: a REDUCE with no arguments, its BUILD state (bytes, position, None or {}). */
static int bytes_io(strata_pickle_value_info *o, const pk_val *v)
{
    const pk_val *st = v->state;
    int64_t pos = 0;
    if (v->args->kind != PK_TUPLE || v->args->n != 0 || !st || st->kind != PK_TUPLE ||
        st->n != 3 || st->items[0]->kind != PK_BYTES || pk_int64(st->items[1], &pos) ||
        pos < 0 || (st->items[2]->kind != PK_NONE && st->items[2]->kind != PK_DICT) ||
        (st->items[2]->kind == PK_DICT && st->items[2]->n)) {
        st_clear_error();
        return 0;
    }
    o->kind = STRATA_PICKLE_BYTES_IO;
    o->bytes = st->items[0]->s;
    o->len = st->items[0]->len;
    o->i = pos;
    return 1;
}

void strata_pickle_get(strata_pickle_value_info *out, const strata_pickle_value *value)
{
    const pk_val *v = pv(value), *t;
    memset(out, 0, sizeof *out);
    if (st_ts_tensor_call(v)) {
        out->kind = STRATA_PICKLE_TENSOR;
        return;
    }
    switch (v->kind) {
    case PK_NONE: out->kind = STRATA_PICKLE_NONE; return;
    case PK_BOOL: out->kind = STRATA_PICKLE_BOOL, out->i = v->i; return;
    case PK_INT: out->kind = STRATA_PICKLE_INT, out->i = v->i; return;
    case PK_BIGINT: out->kind = STRATA_PICKLE_BIGINT; break;
    case PK_FLOAT: out->kind = STRATA_PICKLE_FLOAT, out->f = v->f; return;
    case PK_STR: out->kind = STRATA_PICKLE_STR; break;
    case PK_BYTES: out->kind = STRATA_PICKLE_BYTES; break;
    case PK_TUPLE: out->kind = STRATA_PICKLE_TUPLE, out->n = v->n; return;
    case PK_LIST: out->kind = STRATA_PICKLE_LIST, out->n = v->n; return;
    case PK_DICT:
        out->kind = STRATA_PICKLE_DICT, out->n = v->n, out->ordered = v->ordered;
        return;
    case PK_GLOBAL:
        out->kind = STRATA_PICKLE_GLOBAL;
        out->module = pk_global_module(v->g);
        out->name = pk_global_name(v->g);
        return;
    case PK_CALL:
        if ((t = torch_size(v))) {
            out->kind = STRATA_PICKLE_TUPLE, out->n = t->n;
            return;
        }
        if (v->g == PK_G_BYTES_IO && bytes_io(out, v))
            return;
        out->kind = STRATA_PICKLE_OTHER;
        out->module = pk_global_module(v->g);
        out->name = pk_global_name(v->g);
        if (v->g == PK_G_BYTES_IO)
            snprintf(out->why, sizeof out->why, "an io.BytesIO whose state is not (bytes, "
                     "position, None or {})");
        else
            snprintf(out->why, sizeof out->why, "a value built by %s.%s, which strata does "
                     "not convert", out->module, out->name);
        return;
    case PK_PID:
        out->kind = STRATA_PICKLE_OTHER;
        snprintf(out->why, sizeof out->why, "a persistent id used as a value");
        return;
    }
    out->bytes = v->s;
    out->len = v->len;
}

const strata_pickle_value *strata_pickle_item(const strata_pickle_value *value, size_t i)
{
    const pk_val *v = pv(value), *t = torch_size(v);
    if (t)
        v = t;
    if (v->kind == PK_TUPLE || v->kind == PK_LIST)
        return i < v->n ? vp(v->items[i]) : NULL;
    if (v->kind == PK_DICT)
        return i / 2 < v->n ? vp(v->items[i]) : NULL;
    return NULL;
}

int strata_pickle_key(char *buf, size_t cap, const strata_pickle_value *key)
{
    return st_ts_key_part(pv(key), buf, cap);
}

int strata_pickle_tensor(strata_pickle_tensor_info *out, const strata_pickle *pk,
                         const strata_pickle_value *v, const char *name)
{
    st_clear_error();
    memset(out, 0, sizeof *out);
    const pk_val *call = st_ts_tensor_call(pv(v));
    if (!call)
        return st_fail(STRATA_EINVAL, "%s: '%s' is not a tensor", pk->name, name);
    st_ts_tensor u;
    uint64_t sbytes;
    int rc = st_ts_tensor_info(&u, &sbytes, call, name, pk->name);
    if (rc)
        return rc;
    out->dtype = u.dtype;
    out->ndim = u.ndim;
    memcpy(out->shape, u.shape, sizeof out->shape);
    if (pk->archive) {
        const st_ts_tensor *t = st_ts_find(&pk->a.doc, name);
        if (!t) /* the archive's rules refused such a tensor already: kept for safety */
            return st_fail(STRATA_EFORMAT, "%s: tensor '%s' not found", pk->name, name);
        out->data = pk->data + t->at;
        out->bytes = t->bytes;
    }
    return 0;
}
