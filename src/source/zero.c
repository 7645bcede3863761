/* zero.c - DeepSpeed ZeRO checkpoints as named full tensors of flat pieces (zero.h). */
#include "zero.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"

typedef struct zpiece {
    uint32_t file;
    uint64_t fs, fe, at; /* elements [fs, fe) of the tensor at byte `at` of file */
} zpiece;

typedef struct ztensor {
    char *name; /* malloc'd */
    strata_dtype dtype;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS], numel;
    size_t n, cap;
    zpiece *p;
} ztensor;

typedef struct zctx {
    const st_ts_file *files;
    size_t nmodel;
    uint32_t ranks;
    const char *where;
    ztensor *t;
    size_t n, cap;
} zctx;

#define OOM(c) st_fail(STRATA_ENOMEM, "%s: out of memory", (c)->where)

/* ---- the pickle's values ---- */

static const pk_val *root_of(const zctx *c, size_t f)
{
    const pk_val *r = c->files[f].a->doc.pk.root;
    return r && r->kind == PK_DICT ? r : NULL;
}

static const pk_val *get(const pk_val *d, const char *key)
{
    return d && d->kind == PK_DICT ? pk_dict_get(d, key) : NULL;
}

static const pk_val *get_int(const pk_val *d, int64_t key)
{
    const pk_val *r = NULL;
    for (size_t i = 0; d && d->kind == PK_DICT && i < d->n; i++)
        if (d->items[2 * i]->kind == PK_INT && d->items[2 * i]->i == key)
            r = d->items[2 * i + 1];
    return r;
}

static int is_seq(const pk_val *v)
{
    return v && (v->kind == PK_LIST || v->kind == PK_TUPLE);
}

static int missing(const zctx *c, size_t f, const char *what)
{
    return st_fail(STRATA_EFORMAT, "%s: '%s': %s is missing or not what DeepSpeed writes",
                   c->where, c->files[f].name, what);
}

/* A parameter's shape: torch.Size((d, ...)) or a tuple / list of ints. */
static int shape_of(const pk_val *v, int *ndim, uint64_t *shape, uint64_t *numel)
{
    if (v && v->kind == PK_CALL && v->g == PK_G_TORCH_SIZE && v->args->kind == PK_TUPLE &&
        v->args->n == 1)
        v = v->args->items[0];
    if (!is_seq(v) || v->n > STRATA_MAX_DIMS)
        return -1;
    uint64_t n = 1;
    for (size_t d = 0; d < v->n; d++) {
        int64_t x;
        if (pk_int64(v->items[d], &x) || x < 0 || __builtin_mul_overflow(n, (uint64_t)x, &n))
            return st_clear_error(), -1;
        shape[d] = (uint64_t)x;
    }
    if (n > (UINT64_MAX >> 4))
        return -1;
    *ndim = (int)v->n;
    *numel = n;
    return 0;
}

/* The placed tensor of file f at the joined keys fmt..., or NULL. */
static const st_ts_tensor *tensor_at(const zctx *c, size_t f, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static const st_ts_tensor *tensor_at(const zctx *c, size_t f, const char *fmt, ...)
{
    char name[STRATA_MAX_NAME + 64];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    return k > 0 && (size_t)k < sizeof name ? st_ts_find(&c->files[f].a->doc, name) : NULL;
}

static uint64_t numel_of(const st_ts_tensor *t)
{
    return t->bytes / strata_dtype_size(t->dtype);
}

/* ---- the tensors built ---- */

static ztensor *add(zctx *c, const char *name, strata_dtype dt, int ndim, const uint64_t *shape,
                    uint64_t numel)
{
    if (st_grow(&c->t, &c->cap, c->n + 1, sizeof *c->t))
        return NULL;
    ztensor *t = &c->t[c->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name)))
        return NULL;
    c->n++;
    t->dtype = dt;
    t->ndim = ndim;
    memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    t->numel = numel;
    return t;
}

static int piece(zctx *c, ztensor *t, uint32_t file, uint64_t fs, uint64_t fe, uint64_t at)
{
    if (fs == fe)
        return 0;
    if (st_grow(&t->p, &t->cap, t->n + 1, sizeof *t->p))
        return OOM(c);
    t->p[t->n++] = (zpiece){file, fs, fe, at};
    return 0;
}

static void zfree(zctx *c)
{
    for (size_t i = 0; i < c->n; i++) {
        free(c->t[i].name);
        free(c->t[i].p);
    }
    free(c->t);
}

/* ---- the optimizer's per-element state of one group on one rank ---- */

typedef struct zmom {
    const char *key;
    const st_ts_tensor *t[1]; /* per rank: ranks entries (allocated with the struct) */
} zmom;

/* The state dict (key -> tensor) of group g in the base optimizer's state dict, the value of
 * `key` in DeepSpeed's optimizer_state_dict osd, and the joined name prefix of its tensors
 * into pfx. */
static const pk_val *group_state(const pk_val *osd, const char *key, size_t g, char *pfx,
                                 size_t cap)
{
    osd = get(osd, key);
    const pk_val *groups = get(osd, "param_groups");
    if (!is_seq(groups) || g >= groups->n)
        return NULL;
    const pk_val *ps = get(groups->items[g], "params");
    int64_t idx;
    if (!is_seq(ps) || ps->n != 1 || pk_int64(ps->items[0], &idx))
        return st_clear_error(), NULL;
    const pk_val *st = get_int(get(osd, "state"), idx);
    if (!st || st->kind != PK_DICT)
        return NULL;
    snprintf(pfx, cap, "optimizer_state_dict.%s.state.%lld", key, (long long)idx);
    return st;
}

/* The per-element moments of group g: for each key of rank 0's state whose tensor has 1+
 * dims and lo0..hi0 elements (the partition, with its padding), the tensor of every rank r
 * (lo[r]..hi[r] elements). Fills *out (malloc'd, *nout). */
static int moments(zctx *c, const pk_val *const *osd, const char *key, size_t g,
                   const uint64_t *lo, const uint64_t *hi, zmom ***out, size_t *nout)
{
    size_t f0 = c->nmodel;
    char pfx[256], pfx_r[256];
    *out = NULL;
    *nout = 0;
    const pk_val *st = group_state(osd[0], key, g, pfx, sizeof pfx);
    if (!st)
        return 0; /* no state yet (an optimizer before its first step) */
    zmom **m = calloc(st->n ? st->n : 1, sizeof *m);
    if (!m)
        return OOM(c);
    int rc = 0;
    size_t n = 0;
    for (size_t i = 0; i < st->n && !rc; i++) {
        const pk_val *k = st->items[2 * i];
        if (k->kind != PK_STR)
            continue;
        const st_ts_tensor *t0 = tensor_at(c, f0, "%s.%s", pfx, (const char *)k->s);
        if (!t0 || t0->ndim < 1 || numel_of(t0) < lo[0] || numel_of(t0) > hi[0])
            continue; /* a scalar (step) or not per element */
        zmom *z = calloc(1, sizeof *z + c->ranks * sizeof z->t[0]);
        if (!z) {
            rc = OOM(c);
            break;
        }
        m[n++] = z;
        z->key = (const char *)k->s;
        for (uint32_t r = 0; r < c->ranks && !rc; r++) {
            size_t f = c->nmodel + r;
            const pk_val *sr = r ? group_state(osd[r], key, g, pfx_r, sizeof pfx_r) : st;
            const st_ts_tensor *t = sr ? tensor_at(c, f, "%s.%s", r ? pfx_r : pfx, z->key) : NULL;
            if (!t || t->ndim < 1 || numel_of(t) < lo[r] || numel_of(t) > hi[r] ||
                t->dtype != t0->dtype)
                rc = st_fail(STRATA_EMISMATCH, "%s: '%s': the optimizer state '%s' of group %zu "
                             "is %s there, where rank 0 holds it for each of its %llu "
                             "elements (%s)", c->where, c->files[f].name, z->key, g,
                             t ? "of another size or dtype" : "missing", (unsigned long long)lo[0],
                             strata_dtype_name(t0->dtype));
            z->t[r] = t;
        }
    }
    *out = m;
    *nout = n;
    return rc;
}

static void moments_free(zmom **m, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(m[i]);
    free(m);
}

/* Adds the fp32 parameter `name` as c->t[*pi], followed by its optimizer state tensors
 * "optim.state.<name>.<key>" (c->t[*pi + 1 + k] for moment k of m). */
static int add_param(zctx *c, const char *name, int ndim, const uint64_t *shape, uint64_t numel,
                     zmom *const *m, size_t nm, size_t *pi)
{
    char mname[STRATA_MAX_NAME + 256];
    *pi = c->n;
    if (!add(c, name, STRATA_F32, ndim, shape, numel))
        return OOM(c);
    for (size_t k = 0; k < nm; k++) {
        snprintf(mname, sizeof mname, "optim.state.%s.%s", name, m[k]->key);
        if (strlen(mname) > STRATA_MAX_NAME)
            return st_fail(STRATA_EFORMAT, "%s: the name '%s' is over %d bytes", c->where, mname,
                           STRATA_MAX_NAME);
        if (!add(c, mname, m[k]->t[0]->dtype, ndim, shape, numel))
            return OOM(c);
    }
    return 0;
}

/* Elements [fs, fe) of parameter c->t[pi] and of its nm moments after it, held by rank r
 * (file c->nmodel + r) from element `off` of its partition: the fp32 master weights in
 * `part`, moment j in m[j]->t[r]. */
static int place(zctx *c, size_t pi, uint32_t r, uint64_t fs, uint64_t fe,
                 const st_ts_tensor *part, uint64_t off, zmom *const *m, size_t nm)
{
    uint32_t f = (uint32_t)(c->nmodel + r);
    int rc = piece(c, &c->t[pi], f, fs, fe, part->at + off * 4);
    for (size_t j = 0; j < nm && !rc; j++) {
        const st_ts_tensor *t = m[j]->t[r];
        rc = piece(c, &c->t[pi + 1 + j], f, fs, fe, t->at + off * strata_dtype_size(t->dtype));
    }
    return rc;
}

/* ---- stage 1 and 2 ---- */

static int stage12(zctx *c, const pk_val *shapes, const pk_val *const *osd)
{
    size_t ng = shapes->n;
    uint32_t R = c->ranks;
    const pk_val *pads = get(osd[0], "param_alignment_paddings");
    if (pads && pads->kind == PK_NONE)
        pads = NULL;
    uint64_t *len = calloc(3 * (size_t)R, sizeof *len), *start = len + R, *hi = len + 2 * (size_t)R;
    const st_ts_tensor **part = calloc(R, sizeof *part);
    int rc = !len || !part ? OOM(c) : 0;
    for (size_t g = 0; g < ng && !rc; g++) {
        const pk_val *sh = shapes->items[g];
        if (!sh || sh->kind != PK_DICT) {
            rc = missing(c, 0, "param_shapes (a list of dicts)");
            break;
        }
        const pk_val *gp = pads ? (is_seq(pads) && g < pads->n ? pads->items[g] : NULL) : NULL;
        if (pads && (!is_seq(gp) || gp->n != sh->n)) {
            rc = st_fail(STRATA_EMISMATCH, "%s: '%s': param_alignment_paddings of group %zu "
                         "does not have one entry per parameter of param_shapes (%zu)", c->where,
                         c->files[c->nmodel].name, g, sh->n);
            break;
        }
        uint64_t total = 0;
        for (uint32_t r = 0; r < R && !rc; r++) {
            size_t f = c->nmodel + r;
            const pk_val *parts = get(osd[r], "single_partition_of_fp32_groups");
            if (!is_seq(parts) || parts->n != ng) {
                rc = st_fail(STRATA_EMISMATCH, "%s: '%s': single_partition_of_fp32_groups has "
                             "%zu groups, param_shapes %zu", c->where, c->files[f].name,
                             is_seq(parts) ? parts->n : 0, ng);
                break;
            }
            part[r] = tensor_at(c, f, "optimizer_state_dict.single_partition_of_fp32_groups.%zu", g);
            if (!part[r]) {
                rc = missing(c, f, "single_partition_of_fp32_groups (tensors)");
                break;
            }
            if (part[r]->dtype != STRATA_F32) {
                rc = st_fail(STRATA_ENOTSUP, "%s: '%s': the partition of group %zu is %s, not "
                             "fp32 (DeepSpeed's master weights are fp32)", c->where,
                             c->files[f].name, g, strata_dtype_name(part[r]->dtype));
                break;
            }
            len[r] = numel_of(part[r]);
            start[r] = total;
            total += len[r];
            int64_t pad = 0;
            const pk_val *gpad = get(osd[r], "group_paddings");
            if (is_seq(gpad) && g < gpad->n && (pk_int64(gpad->items[g], &pad) || pad < 0))
                pad = 0, st_clear_error();
            hi[r] = len[r] + (uint64_t)pad;
        }
        zmom **m = NULL;
        size_t nm = 0;
        if (!rc)
            rc = moments(c, osd, "base_optimizer_state", g, len, hi, &m, &nm);
        uint64_t o = 0;
        for (size_t i = 0; i < sh->n && !rc; i++) {
            const pk_val *k = sh->items[2 * i];
            int nd;
            uint64_t shp[STRATA_MAX_DIMS], n;
            int64_t pad = 0;
            if (k->kind != PK_STR || shape_of(sh->items[2 * i + 1], &nd, shp, &n) ||
                (gp && (pk_int64(gp->items[i], &pad) || pad < 0))) {
                st_clear_error();
                rc = missing(c, 0, "param_shapes (names and shapes)");
                break;
            }
            if (n > total || o > total - n) {
                rc = st_fail(STRATA_EUNFILLED, "%s: parameter '%s' (%llu elements at %llu of "
                             "group %zu) is not covered by the ranks' partitions (%llu elements "
                             "in all, in '%s' and the other optim files)", c->where,
                             (const char *)k->s, (unsigned long long)n, (unsigned long long)o, g,
                             (unsigned long long)total, c->files[c->nmodel].name);
                break;
            }
            if (n == 0)
                continue;
            size_t pi;
            rc = add_param(c, (const char *)k->s, nd, shp, n, m, nm, &pi);
            for (uint32_t r = 0; r < R && !rc; r++) {
                uint64_t a = o > start[r] ? o : start[r];
                uint64_t b = o + n < start[r] + len[r] ? o + n : start[r] + len[r];
                if (a < b)
                    rc = place(c, pi, r, a - o, b - o, part[r], a - start[r], m, nm);
            }
            o += n;
            if (__builtin_add_overflow(o, (uint64_t)pad, &o))
                o = UINT64_MAX;
        }
        moments_free(m, nm);
        uint64_t al = 2 * (uint64_t)R;
        if (!rc && (o + al - 1) / al != (total + al - 1) / al)
            rc = st_fail(STRATA_EMISMATCH, "%s: param_shapes of group %zu account for %llu "
                         "elements, the ranks' partitions hold %llu (aligned to %llu): they "
                         "disagree ('%s' and the other optim files)", c->where, g,
                         (unsigned long long)o, (unsigned long long)total,
                         (unsigned long long)al, c->files[c->nmodel].name);
    }
    free(len);
    free(part);
    return rc;
}

/* ---- stage 3 ---- */

/* Stage 3: each rank's fp32_flat_groups (ng tensors, every rank's of rank 0's sizes) into
 * gt[r * ng + k]; group k's size into gs[k], their sum into *S. */
static int flat_groups(zctx *c, const pk_val *const *osd, size_t ng, const st_ts_tensor **gt,
                       uint64_t *gs, uint64_t *S)
{
    int rc = 0;
    for (uint32_t r = 0; r < c->ranks && !rc; r++) {
        size_t f = c->nmodel + r;
        const pk_val *gr = get(osd[r], "fp32_flat_groups");
        if (!is_seq(gr) || gr->n != ng) {
            rc = st_fail(STRATA_EMISMATCH, "%s: '%s': fp32_flat_groups has %zu groups, rank "
                         "0's %zu", c->where, c->files[f].name, is_seq(gr) ? gr->n : 0, ng);
            break;
        }
        for (size_t k = 0; k < ng && !rc; k++) {
            const st_ts_tensor *t = tensor_at(c, f, "optimizer_state_dict.fp32_flat_groups.%zu", k);
            uint64_t n = t ? numel_of(t) : 0;
            if (!t)
                rc = missing(c, f, "fp32_flat_groups (tensors)");
            else if (t->dtype != STRATA_F32)
                rc = st_fail(STRATA_ENOTSUP, "%s: '%s': the partition of group %zu is %s, not "
                             "fp32 (DeepSpeed's master weights are fp32)", c->where,
                             c->files[f].name, k, strata_dtype_name(t->dtype));
            else if (r && n != gs[k])
                rc = st_fail(STRATA_EMISMATCH, "%s: '%s': group %zu's partition holds %llu "
                             "elements, rank 0's %llu", c->where, c->files[f].name, k,
                             (unsigned long long)n, (unsigned long long)gs[k]);
            gt[(size_t)r * ng + k] = t;
            if (!r) {
                gs[k] = n;
                *S += n;
            }
        }
    }
    return rc;
}

static int stage3(zctx *c, const pk_val *shapes, const pk_val *const *osd)
{
    uint32_t R = c->ranks;
    const pk_val *g0 = get(osd[0], "fp32_flat_groups");
    if (!is_seq(g0))
        return missing(c, c->nmodel, "fp32_flat_groups");
    size_t ng = g0->n;
    const st_ts_tensor **gt = calloc((size_t)R * (ng ? ng : 1), sizeof *gt);
    uint64_t *gs = calloc(2 * (ng ? ng : 1) + 2 * (size_t)R, sizeof *gs);
    zmom ***m = calloc(ng ? ng : 1, sizeof *m);
    size_t *nm = calloc(ng ? ng : 1, sizeof *nm);
    int rc = !gt || !gs || !m || !nm ? OOM(c) : 0;
    uint64_t S = 0, *lo = gs + 2 * (ng ? ng : 1), *hi = lo + R;
    if (!rc)
        rc = flat_groups(c, osd, ng, gt, gs, &S);
    /* group k covers [gs[ng + k], gs[ng + k] + gs[k]) of each rank's flat state */
    for (size_t k = 0, at = 0; k < ng && !rc; k++) {
        gs[ng + k] = at;
        at += gs[k];
        for (uint32_t r = 0; r < R; r++)
            lo[r] = hi[r] = gs[k];
        rc = moments(c, osd, "optimizer_state_dict", k, lo, hi, &m[k], &nm[k]);
    }
    /* the parameters, each ceil(numel / R) elements of each rank's flat state from O on */
    uint64_t O = 0;
    for (size_t g = 0; g < shapes->n && !rc; g++) {
        const pk_val *sh = shapes->items[g];
        if (!sh || sh->kind != PK_DICT) {
            rc = missing(c, 0, "param_shapes (a list of dicts)");
            break;
        }
        for (size_t i = 0; i < sh->n && !rc; i++) {
            const pk_val *kv = sh->items[2 * i];
            int nd;
            uint64_t shp[STRATA_MAX_DIMS], n;
            if (kv->kind != PK_STR || shape_of(sh->items[2 * i + 1], &nd, shp, &n)) {
                rc = missing(c, 0, "param_shapes (names and shapes)");
                break;
            }
            uint64_t pn = n / R + (n % R != 0);
            if (pn > S || O > S - pn) {
                rc = st_fail(STRATA_EUNFILLED, "%s: parameter '%s' (%llu elements on each rank "
                             "from %llu) is not covered by the ranks' fp32_flat_groups (%llu "
                             "elements each, '%s' and the other optim files)", c->where,
                             (const char *)kv->s, (unsigned long long)pn, (unsigned long long)O,
                             (unsigned long long)S, c->files[c->nmodel].name);
                break;
            }
            if (!n)
                continue;
            /* the group holding O decides the moments' keys (a parameter in one group) */
            size_t k0 = 0;
            while (k0 + 1 < ng && gs[ng + k0 + 1] <= O)
                k0++;
            size_t pi;
            rc = add_param(c, (const char *)kv->s, nd, shp, n, m[k0], nm[k0], &pi);
            for (uint32_t r = 0; r < R && !rc; r++) {
                uint64_t el = (uint64_t)r * pn;
                if (el >= n)
                    break;
                uint64_t cnt = n - el < pn ? n - el : pn;
                for (size_t k = 0; k < ng && !rc; k++) {
                    uint64_t gb = gs[ng + k], ge = gb + gs[k];
                    uint64_t a = O > gb ? O : gb, b = O + cnt < ge ? O + cnt : ge;
                    if (a >= b)
                        continue;
                    for (size_t j = 0; k != k0 && j < nm[k0] && !rc; j++)
                        if (nm[k] <= j || strcmp(m[k][j]->key, m[k0][j]->key))
                            rc = st_fail(STRATA_EMISMATCH, "%s: parameter '%s' spans groups "
                                         "%zu and %zu, whose optimizer states differ",
                                         c->where, (const char *)kv->s, k0, k);
                    if (!rc)
                        rc = place(c, pi, r, el + a - O, el + b - O, gt[(size_t)r * ng + k],
                                   a - gb, m[k], nm[k0]);
                }
            }
            O += pn;
        }
    }
    if (!rc && O != S)
        rc = st_fail(STRATA_EMISMATCH, "%s: param_shapes account for %llu elements of each "
                     "rank's fp32_flat_groups, which hold %llu: they disagree ('%s' and the "
                     "other optim files)", c->where, (unsigned long long)O,
                     (unsigned long long)S, c->files[c->nmodel].name);
    for (size_t k = 0; m && k < ng; k++)
        moments_free(m[k], nm[k]);
    free(m);
    free(nm);
    free(gt);
    free(gs);
    return rc;
}

/* ---- what the model-states files add: buffers, frozen parameters, aliases ---- */

static int find(const zctx *c, const char *name)
{
    for (size_t i = c->n; i-- > 0;)
        if (strcmp(c->t[i].name, name) == 0)
            return (int)i;
    return -1;
}

static int buffers(zctx *c)
{
    const pk_val *names = get(root_of(c, 0), "buffer_names");
    if (!is_seq(names))
        return missing(c, 0, "buffer_names");
    for (size_t i = 0; i < names->n; i++) {
        const pk_val *b = names->items[i];
        if (b->kind != PK_STR)
            return missing(c, 0, "buffer_names (str)");
        const st_ts_tensor *t = tensor_at(c, 0, "module.%s", (const char *)b->s);
        if (!t || !t->bytes)
            continue; /* not in the module (zero_to_fp32 takes only what is), or empty */
        ztensor *z = add(c, (const char *)b->s, t->dtype, t->ndim, t->shape, numel_of(t));
        int rc = z ? piece(c, z, 0, 0, z->numel, t->at) : OOM(c);
        if (rc)
            return rc;
    }
    return 0;
}

static int frozen(zctx *c, int stage)
{
    const pk_val *shapes = get(root_of(c, 0), "frozen_param_shapes");
    if (!shapes || shapes->kind == PK_NONE)
        return 0;
    if (shapes->kind != PK_DICT)
        return missing(c, 0, "frozen_param_shapes (a dict)");
    size_t nf = stage == 3 ? c->nmodel : 1;
    for (size_t i = 0; i < shapes->n; i++) {
        const pk_val *k = shapes->items[2 * i];
        int nd;
        uint64_t shp[STRATA_MAX_DIMS], n, at = 0;
        if (k->kind != PK_STR || shape_of(shapes->items[2 * i + 1], &nd, shp, &n))
            return missing(c, 0, "frozen_param_shapes (names and shapes)");
        if (!n)
            continue;
        ztensor *z = NULL;
        int rc = 0;
        for (size_t f = 0; f < nf && !rc && at < n; f++) {
            const st_ts_tensor *t = tensor_at(c, f, "frozen_param_fragments.%s", (const char *)k->s);
            uint64_t tn = t ? numel_of(t) : 0;
            if (!z && t && !(z = add(c, (const char *)k->s, t->dtype, nd, shp, n)))
                return OOM(c);
            if (t && t->dtype != z->dtype)
                return st_fail(STRATA_EMISMATCH, "%s: '%s': frozen parameter '%s' is %s there, "
                               "%s in '%s'", c->where, c->files[f].name, (const char *)k->s,
                               strata_dtype_name(t->dtype), strata_dtype_name(z->dtype),
                               c->files[0].name);
            if (stage != 3 && t && tn != n)
                return st_fail(tn < n ? STRATA_EUNFILLED : STRATA_EMISMATCH, "%s: '%s': frozen "
                               "parameter '%s' has %llu elements, its shape in "
                               "frozen_param_shapes %llu", c->where, c->files[f].name,
                               (const char *)k->s, (unsigned long long)tn,
                               (unsigned long long)n);
            if (t)
                rc = piece(c, z, (uint32_t)f, at, at + tn < n ? at + tn : n, t->at);
            at += tn;
        }
        if (rc)
            return rc;
        if (at < n)
            return st_fail(STRATA_EUNFILLED, "%s: frozen parameter '%s' (%llu elements) is not "
                           "covered by the frozen_param_fragments of '%s'%s (%llu elements)",
                           c->where, (const char *)k->s, (unsigned long long)n,
                           c->files[0].name, nf > 1 ? " and the other ranks' files" : "",
                           (unsigned long long)at);
    }
    return 0;
}

static int shared(zctx *c)
{
    const pk_val *sp = get(root_of(c, 0), "shared_params");
    if (!sp || sp->kind == PK_NONE)
        return 0;
    if (sp->kind != PK_DICT)
        return missing(c, 0, "shared_params (a dict)");
    for (size_t i = 0; i < sp->n; i++) {
        const pk_val *a = sp->items[2 * i], *b = sp->items[2 * i + 1];
        if (a->kind != PK_STR || b->kind != PK_STR)
            return missing(c, 0, "shared_params (names)");
        int to = find(c, (const char *)b->s);
        if (to < 0)
            continue; /* as zero_to_fp32: only an alias of a tensor it has */
        int was = find(c, (const char *)a->s);
        if (was >= 0 && was != to) { /* replaced, as a dict assignment does */
            free(c->t[was].name);
            free(c->t[was].p);
            c->t[was] = c->t[--c->n];
            if (to == (int)c->n)
                to = was;
        } else if (was == to)
            continue;
        ztensor src = c->t[to]; /* a copy: add may move the array (src.p stays) */
        ztensor *z = add(c, (const char *)a->s, src.dtype, src.ndim, src.shape, src.numel);
        if (!z || !(z->p = malloc((src.n ? src.n : 1) * sizeof *z->p)))
            return OOM(c);
        memcpy(z->p, src.p, src.n * sizeof *z->p);
        z->n = z->cap = src.n;
    }
    return 0;
}

/* ---- the metadata ---- */

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const ztensor *)a)->name, ((const ztensor *)b)->name);
}

static int to_meta(zctx *c, st_meta **out, size_t nfiles)
{
    st_meta *m = calloc(1, sizeof *m);
    if (!m)
        return OOM(c);
    m->foreign = 1;
    m->chunk = 1;
    m->nfiles = (uint32_t)nfiles;
    m->files = st_arena_alloc(&m->arena, nfiles * sizeof *m->files);
    m->idents = st_arena_alloc(&m->arena, nfiles * sizeof *m->idents);
    m->blobs = st_arena_alloc(&m->arena, sizeof *m->blobs);
    m->tensors = st_arena_alloc(&m->arena, (c->n ? c->n : 1) * sizeof *m->tensors);
    if (!m->files || !m->idents || !m->blobs || !m->tensors)
        goto oom;
    for (size_t f = 0; f < nfiles; f++) {
        char *nm = st_arena_strndup(&m->arena, c->files[f].name, strlen(c->files[f].name));
        if (!nm)
            goto oom;
        m->files[f] = (st_mfile){nm, c->files[f].size};
        m->idents[f] = c->files[f].id;
    }
    for (size_t i = 0; i < c->n; i++) {
        const ztensor *z = &c->t[i];
        st_mtensor *mt = &m->tensors[m->ntensors++];
        size_t esz = strata_dtype_size(z->dtype), dl = (size_t)(z->ndim ? z->ndim : 1) * 8;
        memset(mt, 0, sizeof *mt);
        mt->name = st_arena_strndup(&m->arena, z->name, strlen(z->name));
        mt->dtype = z->dtype;
        mt->ndim = z->ndim;
        memcpy(mt->shape, z->shape, (size_t)z->ndim * sizeof *z->shape);
        mt->shards = st_arena_alloc(&m->arena, (z->n ? z->n : 1) * sizeof *mt->shards);
        uint64_t *box = st_arena_alloc(&m->arena, 2 * dl);
        if (!mt->name || !mt->shards || !box)
            goto oom;
        for (int d = 0; d < z->ndim; d++) {
            box[d] = 0;
            box[z->ndim + d] = z->shape[d];
        }
        for (size_t k = 0; k < z->n; k++) {
            const zpiece *p = &z->p[k];
            int whole = p->fs == 0 && p->fe == z->numel;
            mt->shards[k] = (st_mshard){box, box + z->ndim, p->fs, p->fe, !whole,
                                        {p->file, p->at, (p->fe - p->fs) * esz, NULL}, 0};
            mt->bytes += (p->fe - p->fs) * esz;
        }
        mt->nshards = z->n;
        m->data_bytes += mt->bytes;
    }
    int64_t step;
    const pk_val *gsv = get(root_of(c, 0), "global_steps");
    if (gsv && !pk_int64(gsv, &step) && step >= 0)
        m->step = (uint64_t)step;
    st_clear_error();
    *out = m;
    return 0;
oom:
    st_meta_free(m);
    return OOM(c);
}

int st_zero_optim_info(const st_ts_archive *a, int *stage, uint32_t *ranks, const char *file)
{
    const pk_val *osd = get(a->doc.pk.root, "optimizer_state_dict");
    const pk_val *zs = get(osd, "zero_stage"), *pc = get(osd, "partition_count");
    int64_t s = -1, n = 0, x;
    if (zs && zs->kind == PK_CALL && zs->g == PK_G_DS_ZERO_STAGE && zs->args->kind == PK_TUPLE &&
        zs->args->n == 1)
        zs = zs->args->items[0];
    if (!zs || pk_int64(zs, &s))
        return st_clear_error(), st_fail(STRATA_EFORMAT, "'%s': not a DeepSpeed ZeRO optimizer "
                                         "state (no optimizer_state_dict.zero_stage)", file);
    if (s < 1 || s > 3)
        return st_fail(STRATA_ENOTSUP, "'%s': ZeRO stage %lld: strata reads stages 1, 2 and 3",
                       file, (long long)s);
    if (pc && pc->kind == PK_INT)
        n = pc->i;
    for (size_t i = 0; is_seq(pc) && i < pc->n; i++)
        if (!pk_int64(pc->items[i], &x) && x > n)
            n = x;
    st_clear_error();
    if (n < 1 || n > ST_ZERO_MAX_RANKS)
        return st_fail(STRATA_EFORMAT, "'%s': partition_count is missing or out of range "
                       "(1..%d)", file, ST_ZERO_MAX_RANKS);
    *stage = (int)s;
    *ranks = (uint32_t)n;
    return 0;
}

int st_zero_meta(st_meta **out, const st_ts_file *files, size_t nmodel, int stage,
                 uint32_t ranks, const char *where)
{
    *out = NULL;
    zctx c = {files, nmodel, ranks, where, NULL, 0, 0};
    const pk_val **osd = calloc(ranks, sizeof *osd);
    if (!osd)
        return OOM(&c);
    int rc = 0;
    int64_t mp = 1;
    const pk_val *mpv = get(root_of(&c, 0), "mp_world_size");
    if (mpv && !pk_int64(mpv, &mp) && mp != 1)
        rc = st_fail(STRATA_ENOTSUP, "%s: '%s': mp_world_size %lld: strata reads ZeRO "
                     "checkpoints of one model-parallel rank only", where, files[0].name,
                     (long long)mp);
    st_clear_error();
    const pk_val *shapes = get(root_of(&c, 0), "param_shapes");
    if (!rc && !is_seq(shapes))
        rc = missing(&c, 0, "param_shapes");
    for (uint32_t r = 0; r < ranks && !rc; r++) {
        osd[r] = get(root_of(&c, nmodel + r), "optimizer_state_dict");
        if (!osd[r] || osd[r]->kind != PK_DICT)
            rc = missing(&c, nmodel + r, "optimizer_state_dict");
    }
    if (!rc)
        rc = buffers(&c);
    if (!rc)
        rc = frozen(&c, stage);
    if (!rc)
        rc = stage == 3 ? stage3(&c, shapes, osd) : stage12(&c, shapes, osd);
    if (!rc)
        rc = shared(&c);
    if (!rc && c.n > 1) {
        qsort(c.t, c.n, sizeof *c.t, cmp_name);
        for (size_t i = 1; i < c.n && !rc; i++)
            if (strcmp(c.t[i - 1].name, c.t[i].name) == 0)
                rc = st_fail(STRATA_EFORMAT, "%s: '%s' is named twice (a parameter, buffer or "
                             "frozen parameter of one name)", where, c.t[i].name);
    }
    if (!rc)
        rc = to_meta(&c, out, nmodel + ranks);
    if (!rc && (rc = st_ts_zip_checks(*out, files, nmodel + ranks, where))) {
        st_meta_free(*out);
        *out = NULL;
    }
    zfree(&c);
    free(osd);
    return rc;
}
