/* synth.c - synthetic GPT-style state, Megatron-style layouts, deterministic values. */
#include "synth.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- layouts ---- */

int layout_parse(layout *out, const char *s, char *err, size_t errlen)
{
    layout l = {1, 1, 1, 0};
    const char *p = s;
    unsigned seen = 0;
    while (p && *p) {
        /* key=digits, strictly: no signs, spaces, repeats or empty pairs */
        char key[16];
        size_t k = 0;
        while (*p >= 'a' && *p <= 'z' && k < sizeof key - 1)
            key[k++] = *p++;
        key[k] = 0;
        long v = 0;
        int digits = 0;
        if (*p == '=')
            for (p++; *p >= '0' && *p <= '9' && v <= 4096; p++, digits++)
                v = v * 10 + (*p - '0');
        if (!k || !digits) {
            snprintf(err, errlen, "bad layout '%s': expected key=value pairs like tp=2,pp=2,dp=2", s);
            return -1;
        }
        if (v > 4096) {
            snprintf(err, errlen, "bad layout '%s': %s is out of range", s, key);
            return -1;
        }
        static const char *const keys[] = {"tp", "pp", "dp", "zero"};
        int which = -1;
        for (int i = 0; i < 4; i++)
            if (strcmp(key, keys[i]) == 0)
                which = i;
        if (which < 0 || (which == 3 && v > 1)) {
            snprintf(err, errlen, "bad layout '%s': unknown key or value '%s=%ld' (keys: tp, pp, dp, zero=0|1)", s, key, v);
            return -1;
        }
        if (seen & (1u << which)) {
            snprintf(err, errlen, "bad layout '%s': %s given twice", s, key);
            return -1;
        }
        seen |= 1u << which;
        int *field[] = {&l.tp, &l.pp, &l.dp, &l.zero};
        *field[which] = (int)v;
        if (*p == ',' && p[1])
            p++;
        else if (*p) {
            snprintf(err, errlen, "bad layout '%s': expected ',' and another pair after %s=%ld", s, key, v);
            return -1;
        }
    }
    if (l.tp < 1 || l.pp < 1 || l.dp < 1) {
        snprintf(err, errlen, "bad layout '%s': tp, pp and dp must be at least 1", s);
        return -1;
    }
    if ((long)l.tp * l.pp * l.dp > 4096) {
        snprintf(err, errlen, "bad layout '%s': more than 4096 ranks", s);
        return -1;
    }
    *out = l;
    return 0;
}

int layout_world(const layout *l) { return l->tp * l->pp * l->dp; }

void layout_format(const layout *l, char *out, size_t cap)
{
    snprintf(out, cap, "tp=%d,pp=%d,dp=%d%s", l->tp, l->pp, l->dp, l->zero ? ",zero=1" : "");
}

/* ---- model ---- */

static int add(synth_model *m, const char *name, strata_dtype dt, int ndim, uint64_t d0,
               uint64_t d1, int split, int layer)
{
    synth_tensor *t = &m->t[m->ntensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->split = split;
    t->layer = layer;
    t->param = m->ntensors - 1;
    return 0;
}

int synth_model_build(synth_model *m, uint64_t size_mb)
{
    return synth_model_build_layers(m, size_mb, size_mb >= 1024 ? 8 : size_mb >= 128 ? 4 : 2);
}

int synth_model_build_layers(synth_model *m, uint64_t size_mb, int layers)
{
    memset(m, 0, sizeof *m);
    double params = (double)size_mb * 1048576.0 / 14.0; /* bf16 + 3 x fp32 per parameter */
    m->layers = layers;
    m->vocab = size_mb >= 256 ? 32003 : 4093;
    double L = m->layers, V = (double)m->vocab;
    double h = (-V + sqrt(V * V + 48.0 * L * params)) / (24.0 * L);
    m->hidden = (uint64_t)(h < 9 ? 9 : h) | 1; /* odd */
    m->ffn = 4 * m->hidden + 3;
    int per_layer = 12, max = 3 + per_layer * m->layers;
    m->t = calloc((size_t)max * 4, sizeof *m->t);
    if (!m->t)
        return -1;
    uint64_t H = m->hidden, F = m->ffn;
    char n[128];
    add(m, "model.embed.weight", STRATA_BF16, 2, m->vocab, H, 0, -1);
    for (int i = 0; i < m->layers; i++) {
#define P(suffix, nd, a, b, sp)                                           \
    snprintf(n, sizeof n, "model.layers.%d.%s", i, suffix);           \
    add(m, n, STRATA_BF16, nd, a, b, sp, i)
        P("ln1.weight", 1, H, 0, -1);
        P("ln1.bias", 1, H, 0, -1);
        P("attn.qkv.weight", 2, 3 * H, H, 0);
        P("attn.qkv.bias", 1, 3 * H, 0, 0);
        P("attn.proj.weight", 2, H, H, 1);
        P("attn.proj.bias", 1, H, 0, -1);
        P("ln2.weight", 1, H, 0, -1);
        P("ln2.bias", 1, H, 0, -1);
        P("mlp.fc1.weight", 2, F, H, 0);
        P("mlp.fc1.bias", 1, F, 0, 0);
        P("mlp.fc2.weight", 2, H, F, 1);
        P("mlp.fc2.bias", 1, H, 0, -1);
#undef P
    }
    add(m, "model.final_ln.weight", STRATA_BF16, 1, H, 0, -1, m->layers);
    add(m, "model.final_ln.bias", STRATA_BF16, 1, H, 0, -1, m->layers);
    m->nparams = m->ntensors;
    static const char *opt[3] = {"optim.master.", "optim.exp_avg.", "optim.exp_avg_sq."};
    for (int k = 0; k < 3; k++)
        for (int p = 0; p < m->nparams; p++) {
            const synth_tensor *src = &m->t[p];
            snprintf(n, sizeof n, "%s%s", opt[k], src->name + strlen("model."));
            add(m, n, STRATA_F32, src->ndim, src->shape[0], src->shape[1], src->split, src->layer);
            m->t[m->ntensors - 1].param = p;
            m->t[m->ntensors - 1].is_optim = 1;
        }
    return 0;
}

void synth_model_free(synth_model *m)
{
    free(m->t);
    memset(m, 0, sizeof *m);
}

static uint64_t numel(const synth_tensor *t)
{
    return t->ndim == 1 ? t->shape[0] : t->shape[0] * t->shape[1];
}

uint64_t synth_model_bytes(const synth_model *m)
{
    uint64_t b = 0;
    for (int i = 0; i < m->ntensors; i++)
        b += numel(&m->t[i]) * strata_dtype_size(m->t[i].dtype);
    return b;
}

/* ---- layout into rank shards ---- */

static int stage_of(const synth_model *m, const synth_tensor *t, int pp)
{
    if (t->layer < 0)
        return 0;
    if (t->layer >= m->layers)
        return pp - 1;
    return (int)((int64_t)t->layer * pp / m->layers);
}

static void split(uint64_t n, int parts, int i, uint64_t *off, uint64_t *len)
{
    uint64_t a = n * (uint64_t)i / (uint64_t)parts, b = n * (uint64_t)(i + 1) / (uint64_t)parts;
    *off = a;
    *len = b - a;
}

/* The box of parameter p held by tensor-parallel rank ti. */
static void tp_box(const synth_tensor *t, int tp, int ti, uint64_t off[2], uint64_t len[2])
{
    off[0] = off[1] = 0;
    len[0] = t->shape[0];
    len[1] = t->shape[1];
    if (t->split >= 0)
        split(t->shape[t->split], tp, ti, &off[t->split], &len[t->split]);
}

/* Which copy is the main one (the others are registered STRATA_SHARD_REPLICA, as Megatron
 * marks replica_id != 0): a parameter (or, without ZeRO, its optimizer state) is held by
 * every data-parallel rank and, if not split, every tensor-parallel rank: data-parallel
 * rank 0 and tensor-parallel rank 0 hold the main copy. A ZeRO flat piece is its
 * data-parallel rank's own; a replicated tensor's pieces on tensor-parallel ranks other
 * than 0 are copies (cut elsewhere when the split of the others is uneven). */
static int is_replica(const synth_tensor *t, const layout *l, int ti, int di)
{
    int tp_copy = t->split < 0 && ti != 0;
    if (t->is_optim && l->zero)
        return tp_copy;
    return tp_copy || di != 0;
}

int synth_layout_rank(synth_shard *v, const synth_model *m, const layout *l, int r,
                      uint64_t *base)
{
    int ti = r % l->tp, di = (r / l->tp) % l->dp, pi = r / (l->tp * l->dp);
    int n = 0;
    /* model params on this stage: their tp boxes, in order; for zero=1 the concatenation
     * of their elements is split evenly over dp; base[p]: where param p's box starts in
     * the stage's concatenation */
    uint64_t total = 0;
    for (int p = 0; p < m->nparams; p++) {
        const synth_tensor *t = &m->t[p];
        base[p] = total;
        if (stage_of(m, t, l->pp) != pi)
            continue;
        uint64_t off[2], len[2];
        tp_box(t, l->tp, ti, off, len);
        total += t->ndim == 1 ? len[0] : len[0] * len[1];
    }
    uint64_t zlo, zlen;
    split(total, l->dp, di, &zlo, &zlen);
    for (int i = 0; i < m->ntensors; i++) {
        const synth_tensor *t = &m->t[i];
        if (stage_of(m, t, l->pp) != pi)
            continue;
        synth_shard s = {.tensor = i, .replica = is_replica(t, l, ti, di)};
        tp_box(t, l->tp, ti, s.off, s.len);
        s.fs = 0;
        s.fe = t->ndim == 1 ? s.len[0] : s.len[0] * s.len[1];
        if (t->is_optim && l->zero) {
            uint64_t bs = base[t->param];
            if (zlo + zlen <= bs)
                continue;
            uint64_t a = zlo > bs ? zlo - bs : 0;
            uint64_t b = zlo + zlen - bs < s.fe ? zlo + zlen - bs : s.fe;
            if (a >= s.fe || a >= b)
                continue;
            s.flat = 1;
            s.fs = a;
            s.fe = b;
        }
        v[n++] = s;
    }
    return n;
}

int synth_layout(synth_ranks *out, const synth_model *m, const layout *l)
{
    int W = layout_world(l);
    out->nranks = W;
    out->nshards = calloc((size_t)W, sizeof *out->nshards);
    out->shards = calloc((size_t)W, sizeof *out->shards);
    uint64_t *base = malloc(((size_t)m->nparams + 1) * sizeof *base);
    synth_shard *v = malloc(((size_t)m->ntensors + 1) * sizeof *v);
    int rc = out->nshards && out->shards && base && v ? 0 : -1;
    for (int r = 0; r < W && !rc; r++) {
        int n = synth_layout_rank(v, m, l, r, base);
        if (!(out->shards[r] = malloc(((size_t)n + 1) * sizeof *v)))
            rc = -1;
        else
            memcpy(out->shards[r], v, (size_t)n * sizeof *v);
        out->nshards[r] = n;
    }
    free(base);
    free(v);
    return rc;
}

void synth_ranks_free(synth_ranks *r)
{
    for (int i = 0; i < r->nranks; i++)
        free(r->shards ? r->shards[i] : NULL);
    free(r->shards);
    free(r->nshards);
    memset(r, 0, sizeof *r);
}

uint64_t synth_shard_bytes(const synth_model *m, const synth_shard *s)
{
    return (s->fe - s->fs) * strata_dtype_size(m->t[s->tensor].dtype);
}

/* ---- values ---- */

static uint64_t mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t name_seed(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    while (*s)
        h = (h ^ (unsigned char)*s++) * 1099511628211ULL;
    return mix(h);
}

/* A finite float in about [-2, 2] whose bits depend on (seed, global index). */
static uint32_t value_f32(uint64_t seed, uint64_t g)
{
    uint64_t x = mix(seed + g * 0x9e3779b97f4a7c15ULL);
    uint32_t exp = 120u + (uint32_t)(x >> 60) % 8u;
    return (uint32_t)(x & 0x80000000u) | exp << 23 | (uint32_t)(x >> 8 & 0x7fffffu);
}

/* Walks the global flat indices of a shard's elements in order: calls fn(ctx, k, g, n)
 * for each run of n elements starting at shard element k and global index g. */
typedef void (*walk_fn)(void *ctx, uint64_t k, uint64_t g, uint64_t n);

static void walk(const synth_model *m, const synth_shard *s, walk_fn fn, void *ctx)
{
    const synth_tensor *t = &m->t[s->tensor];
    uint64_t row = t->ndim == 1 ? s->len[0] : s->len[1];
    for (uint64_t k = s->fs; k < s->fe;) {
        uint64_t r = k / row, c = k % row, n = row - c;
        if (n > s->fe - k)
            n = s->fe - k;
        uint64_t g = t->ndim == 1 ? s->off[0] + c
                                  : (s->off[0] + r) * t->shape[1] + s->off[1] + c;
        fn(ctx, k - s->fs, g, n);
        k += n;
    }
}

typedef struct {
    const synth_shard *s;
    uint64_t seed;
    size_t esz;
    uint64_t bad, first;
} walk_ctx;

static void fill_run(void *p, uint64_t k, uint64_t g, uint64_t n)
{
    walk_ctx *c = p;
    if (c->esz == 4) {
        uint32_t *d = (uint32_t *)c->s->data + k;
        for (uint64_t i = 0; i < n; i++)
            d[i] = value_f32(c->seed, g + i);
    } else {
        uint16_t *d = (uint16_t *)c->s->data + k;
        for (uint64_t i = 0; i < n; i++)
            d[i] = (uint16_t)(value_f32(c->seed, g + i) >> 16);
    }
}

static void check_run(void *p, uint64_t k, uint64_t g, uint64_t n)
{
    walk_ctx *c = p;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t want = value_f32(c->seed, g + i), got;
        if (c->esz == 4) {
            got = ((const uint32_t *)c->s->data)[k + i];
        } else {
            want >>= 16;
            got = ((const uint16_t *)c->s->data)[k + i];
        }
        if (got != want && c->bad++ == 0)
            c->first = g + i;
    }
}

void synth_fill(const synth_model *m, const synth_shard *s)
{
    walk_ctx c = {s, name_seed(m->t[s->tensor].name), strata_dtype_size(m->t[s->tensor].dtype), 0, 0};
    walk(m, s, fill_run, &c);
}

uint64_t synth_check(const synth_model *m, const synth_shard *s, uint64_t *first)
{
    walk_ctx c = {s, name_seed(m->t[s->tensor].name), strata_dtype_size(m->t[s->tensor].dtype), 0, 0};
    walk(m, s, check_run, &c);
    *first = c.first;
    return c.bad;
}

int synth_register(strata_state *st, const synth_model *m, const synth_shard *sh, int n)
{
    for (int i = 0; i < n; i++) {
        const synth_tensor *t = &m->t[sh[i].tensor];
        strata_shard d = {t->name, t->dtype, t->ndim, t->shape, sh[i].off, sh[i].len,
                          sh[i].flat, sh[i].fs, sh[i].fe, sh[i].data, 0,
                          sh[i].replica ? STRATA_SHARD_REPLICA : 0};
        int rc = strata_state_add_shard(st, &d);
        if (rc)
            return rc;
    }
    return 0;
}

void synth_blob(const char *name, int owner, unsigned char *out, uint64_t n)
{
    uint64_t seed = name_seed(name) ^ mix((uint64_t)(owner + 2));
    for (uint64_t i = 0; i < n; i++)
        out[i] = (unsigned char)(mix(seed + i) >> 56);
}

void synth_config(const synth_model *m, char *out, size_t cap)
{
    snprintf(out, cap, "{\"model\":\"gpt\",\"layers\":%d,\"hidden\":%llu,\"ffn\":%llu,\"vocab\":%llu}",
             m->layers, (unsigned long long)m->hidden, (unsigned long long)m->ffn,
             (unsigned long long)m->vocab);
}
