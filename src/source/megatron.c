/* megatron.c - Megatron-Core torch_dist: metadata.json, legacy N-D flattened tensors
 * (megatron.h). Pure; no I/O. */
#include "megatron.h"

#include <stdio.h>
#include <string.h>

#include <stdlib.h>

#include "../core/error.h"

/* ---- metadata.json: strict JSON, bounded ----------------------------------------------- */

typedef struct mj {
    const unsigned char *p, *end, *start;
    const char *file;
} mj;

#define MJ_MAX_DEPTH 64

static int mj_bad(const mj *j, const char *what)
{
    return st_fail(STRATA_EFORMAT, "Megatron %s: %s (at byte %zu)", j->file, what,
                   (size_t)(j->p - j->start));
}

static void mj_ws(mj *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

/* The code unit of the \\u escape whose 'u' is at p (4 hex digits before end), or -1. */
static long mj_hex4(const unsigned char *p, const unsigned char *end)
{
    long cp = 0;
    for (int k = 1; k <= 4; k++) {
        if (p + k >= end || !p[k] || !strchr("0123456789abcdefABCDEF", p[k]))
            return -1;
        cp = cp * 16 + (p[k] <= '9' ? p[k] - '0' : (p[k] | 0x20) - 'a' + 10);
    }
    return cp;
}

/* A string: its raw bytes (between the quotes, escapes checked, not decoded) in *s, *n. A
 * \\u escape of a lone surrogate (no character: not UTF-8, as strata's own names must be)
 * is refused. */
static int mj_string(mj *j, const unsigned char **s, size_t *n)
{
    if (j->p >= j->end || *j->p != '"')
        return mj_bad(j, j->p >= j->end ? "truncated" : "a string was expected");
    const unsigned char *start = ++j->p;
    while (j->p < j->end && *j->p != '"') {
        if (*j->p < 0x20)
            return mj_bad(j, "a control character in a string");
        if (*j->p == '\\') {
            if (++j->p >= j->end)
                break;
            if (*j->p == 'u') {
                long cp = mj_hex4(j->p, j->end), lo = -1;
                if (cp < 0)
                    return mj_bad(j, "a bad \\u escape");
                if (cp >= 0xDC00 && cp <= 0xDFFF)
                    return mj_bad(j, "a lone low surrogate (\\uDC00..\\uDFFF) in a string");
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    if (j->p + 6 < j->end && j->p[5] == '\\' && j->p[6] == 'u')
                        lo = mj_hex4(j->p + 6, j->end);
                    if (lo < 0xDC00 || lo > 0xDFFF)
                        return mj_bad(j, "a high surrogate (\\uD800..\\uDBFF) not followed by "
                                      "a low one in a string");
                    j->p += 6;
                }
                j->p += 4;
            } else if (!*j->p || !strchr("\"\\/bfnrt", *j->p)) {
                return mj_bad(j, "a bad escape");
            }
        }
        j->p++;
    }
    if (j->p >= j->end)
        return mj_bad(j, "truncated inside a string");
    *s = start;
    *n = (size_t)(j->p - start);
    j->p++;
    return 0;
}

/* A number; *is_int and *v when it is an integer that fits int64. */
static int mj_number(mj *j, int *is_int, int64_t *v)
{
    int neg = 0, digits = 0, over = 0;
    uint64_t x = 0;
    if (j->p < j->end && *j->p == '-')
        neg = 1, j->p++;
    if (j->p < j->end && *j->p == '0') {
        j->p++, digits = 1;
    } else {
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
            over |= x > (UINT64_C(1) << 62);
            x = x * 10 + (uint64_t)(*j->p++ - '0');
            digits++;
        }
    }
    if (!digits)
        return mj_bad(j, "a value was expected");
    *is_int = !over;
    if (j->p < j->end && *j->p == '.') {
        j->p++, *is_int = 0;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9')
            return mj_bad(j, "a bad number");
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9')
            j->p++;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        j->p++, *is_int = 0;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-'))
            j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9')
            return mj_bad(j, "a bad number");
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9')
            j->p++;
    }
    *v = neg ? -(int64_t)x : (int64_t)x;
    return 0;
}

static int mj_lit(mj *j, const char *lit)
{
    size_t n = strlen(lit);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, lit, n) != 0)
        return mj_bad(j, (size_t)(j->end - j->p) < n ? "truncated" : "a value was expected");
    j->p += n;
    return 0;
}

/* Any value (checked, skipped). */
static int mj_skip(mj *j, int depth)
{
    const unsigned char *s;
    size_t n;
    int is_int;
    int64_t v;
    mj_ws(j);
    if (j->p >= j->end)
        return mj_bad(j, "truncated");
    switch (*j->p) {
    case '"':
        return mj_string(j, &s, &n);
    case 't':
        return mj_lit(j, "true");
    case 'f':
        return mj_lit(j, "false");
    case 'n':
        return mj_lit(j, "null");
    case '{':
    case '[': {
        const unsigned char close = *j->p == '{' ? '}' : ']';
        const int obj = close == '}';
        if (depth >= MJ_MAX_DEPTH)
            return mj_bad(j, "nested too deeply");
        j->p++;
        mj_ws(j);
        if (j->p < j->end && *j->p == close) {
            j->p++;
            return 0;
        }
        for (;;) {
            int rc;
            mj_ws(j);
            if (obj) {
                if ((rc = mj_string(j, &s, &n)))
                    return rc;
                mj_ws(j);
                if (j->p >= j->end || *j->p != ':')
                    return mj_bad(j, j->p >= j->end ? "truncated" : "':' was expected");
                j->p++;
            }
            if ((rc = mj_skip(j, depth + 1)))
                return rc;
            mj_ws(j);
            if (j->p >= j->end)
                return mj_bad(j, "truncated");
            if (*j->p == close) {
                j->p++;
                return 0;
            }
            if (*j->p != ',')
                return mj_bad(j, "',' or the end of a container was expected");
            j->p++;
        }
    }
    default:
        return mj_number(j, &is_int, &v);
    }
}

static int key_is(const unsigned char *s, size_t n, const char *k)
{
    return n == strlen(k) && memcmp(s, k, n) == 0;
}

/* A string value into out (cap bytes, NUL-terminated); EFORMAT if not a plain one. */
static int mj_field_str(mj *j, const char *key, char *out, size_t cap)
{
    const unsigned char *s;
    size_t n;
    mj_ws(j);
    if (j->p >= j->end || *j->p != '"')
        return st_fail(STRATA_EFORMAT, "Megatron %s: \"%s\" is not a string", j->file, key);
    int rc = mj_string(j, &s, &n);
    if (rc)
        return rc;
    if (n >= cap || memchr(s, '\\', n))
        return st_fail(STRATA_ENOTSUP, "Megatron %s: %s '%.*s' is not one strata reads "
                       "(it reads torch_dist checkpoints)", j->file, key, (int)(n > 64 ? 64 : n),
                       (const char *)s);
    memcpy(out, s, n);
    out[n] = 0;
    return 0;
}

int st_mg_parse_config(st_mg_config *out, const unsigned char *b, size_t n, const char *file)
{
    memset(out, 0, sizeof *out);
    out->sharded_backend_version = -1;
    mj j = {b, b + n, b, file};
    int rc, seen_sb = 0, seen_sv = 0, seen_cb = 0;
    mj_ws(&j);
    if (j.p >= j.end || *j.p != '{')
        return mj_bad(&j, j.p >= j.end ? "empty, not a JSON object" : "not a JSON object");
    j.p++;
    mj_ws(&j);
    /* keys seen, for duplicates: the raw bytes of each (at most n / 3 of them) */
    const unsigned char *keys[256];
    size_t klen[256], nkeys = 0;
    if (j.p < j.end && *j.p == '}') {
        j.p++;
    } else {
        for (;;) {
            const unsigned char *k;
            size_t kn;
            mj_ws(&j);
            if ((rc = mj_string(&j, &k, &kn)))
                return rc;
            for (size_t i = 0; i < nkeys; i++)
                if (klen[i] == kn && memcmp(keys[i], k, kn) == 0)
                    return st_fail(STRATA_EFORMAT, "Megatron %s: key \"%.*s\" is there twice",
                                   file, (int)(kn > 64 ? 64 : kn), (const char *)k);
            if (nkeys == 256)
                return mj_bad(&j, "over 256 keys");
            keys[nkeys] = k, klen[nkeys++] = kn;
            mj_ws(&j);
            if (j.p >= j.end || *j.p != ':')
                return mj_bad(&j, j.p >= j.end ? "truncated" : "':' was expected");
            j.p++;
            mj_ws(&j);
            if (key_is(k, kn, "sharded_backend")) {
                seen_sb = 1;
                rc = mj_field_str(&j, "sharded_backend", out->sharded_backend,
                                  sizeof out->sharded_backend);
            } else if (key_is(k, kn, "common_backend")) {
                seen_cb = 1;
                rc = mj_field_str(&j, "common_backend", out->common_backend,
                                  sizeof out->common_backend);
            } else if (key_is(k, kn, "sharded_backend_version")) {
                int is_int = 0;
                seen_sv = 1;
                rc = j.p < j.end && (*j.p == '-' || (*j.p >= '0' && *j.p <= '9'))
                         ? mj_number(&j, &is_int, &out->sharded_backend_version)
                         : mj_bad(&j, "sharded_backend_version is not a number");
                if (!rc && !is_int)
                    rc = st_fail(STRATA_EFORMAT, "Megatron %s: sharded_backend_version is not an "
                                 "integer", file);
            } else {
                rc = mj_skip(&j, 1);
            }
            if (rc)
                return rc;
            mj_ws(&j);
            if (j.p >= j.end)
                return mj_bad(&j, "truncated");
            if (*j.p == '}') {
                j.p++;
                break;
            }
            if (*j.p != ',')
                return mj_bad(&j, "',' or '}' was expected");
            j.p++;
        }
    }
    mj_ws(&j);
    if (j.p != j.end)
        return mj_bad(&j, "something follows the JSON object");
    if (!seen_sb)
        return st_fail(STRATA_EFORMAT, "Megatron %s: no \"sharded_backend\"", file);
    if (strcmp(out->sharded_backend, "torch_dist") != 0)
        return st_fail(STRATA_ENOTSUP, "Megatron %s: sharded_backend '%s' is not one strata "
                       "reads (it reads torch_dist checkpoints)", file, out->sharded_backend);
    if (seen_sv && out->sharded_backend_version != 1)
        return st_fail(STRATA_ENOTSUP, "Megatron %s: torch_dist version %lld is not one strata "
                       "reads (it reads version 1)", file,
                       (long long)out->sharded_backend_version);
    if (seen_cb && strcmp(out->common_backend, "torch") != 0)
        return st_fail(STRATA_ENOTSUP, "Megatron %s: common_backend '%s' is not one strata "
                       "reads (it reads torch)", file, out->common_backend);
    return 0;
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
