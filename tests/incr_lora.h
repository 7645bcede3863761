/* incr_lora.h - the LoRA-style state of the incremental-save tests (test_incr.c,
 * test_incr_mark.c): a frozen base weight, small adapters and their AdamW moments, with
 * saving, loading bitwise and verifying helpers. Include after testutil.h. */
#ifndef STRATA_TEST_INCR_LORA_H
#define STRATA_TEST_INCR_LORA_H

#define CHUNK 16384u
#define NT 5
/* frozen [96, 512] f32 (192 KiB, 12 chunks); adapters and moments [8, 512] (16 KiB) */
static const char *names[NT] = {"base.w", "lora.a", "lora.b", "opt.a.exp_avg", "opt.a.exp_avg_sq"};
static const uint64_t rows[NT] = {96, 8, 8, 8, 8};
#define COLS 512

typedef struct {
    float *t[NT];
    unsigned char blob[100];
    strata_state *st;
    int own0; /* t[0] is ours to free */
} lora;

static inline uint64_t tbytes(int i) { return rows[i] * COLS * 4; }

/* The state, its frozen weight (t[0]) registered with flags0 and held in t0 where given
 * (else allocated; either way filled from seed). */
static inline void lora_init_ex(lora *s, uint64_t seed, unsigned flags0, float *t0)
{
    memset(s, 0, sizeof *s);
    assert_ok(strata_state_new(&s->st));
    tu_rng r = {seed};
    s->own0 = !t0;
    for (int i = 0; i < NT; i++) {
        s->t[i] = i == 0 && t0 ? t0 : malloc(tbytes(i));
        for (uint64_t k = 0; k < rows[i] * COLS; k++)
            s->t[i][k] = (float)(tu_next(&r) % 1000) / 7.0f;
        uint64_t shape[2] = {rows[i], COLS};
        strata_shard sh = {.name = names[i], .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .data = s->t[i], .flags = i ? 0 : flags0};
        assert_ok(strata_state_add_shard(s->st, &sh));
    }
    assert_ok(strata_state_add_blob(s->st, "step", 0, -1, s->blob, sizeof s->blob));
}

static inline void lora_init(lora *s, uint64_t seed) { lora_init_ex(s, seed, 0, NULL); }

static inline void lora_free(lora *s)
{
    for (int i = !s->own0; i < NT; i++)
        free(s->t[i]);
    strata_state_free(s->st);
}

/* One training step: every tensor but those below `from` changes (from = 1: LoRA). */
static inline void lora_step(lora *s, int step, int from)
{
    tu_rng r = {(uint64_t)step * 7919};
    for (int i = from; i < NT; i++)
        for (uint64_t k = 0; k < rows[i] * COLS; k += 1 + tu_below(&r, 64))
            s->t[i][k] += 1.0f;
    memset(s->blob, step, sizeof s->blob);
}

/* A copy of the values, to compare loads with. */
typedef struct {
    float *t[NT];
    unsigned char blob[100];
} snap;

static inline void snap_take(snap *c, const lora *s)
{
    for (int i = 0; i < NT; i++) {
        c->t[i] = malloc(tbytes(i));
        memcpy(c->t[i], s->t[i], tbytes(i));
    }
    memcpy(c->blob, s->blob, sizeof c->blob);
}

static inline void snap_free(snap *c)
{
    for (int i = 0; i < NT; i++)
        free(c->t[i]);
}

/* Loads path and compares every byte with c. */
static inline void load_same(const char *path, const snap *c)
{
    lora d;
    lora_init(&d, 999);
    strata_state *st = d.st;
    assert_ok(strata_load(NULL, NULL, (const char *[]){path}, 1, &st, 1, NULL));
    for (int i = 0; i < NT; i++)
        if (memcmp(d.t[i], c->t[i], tbytes(i)) != 0)
            fail_msg("%s: tensor %s differs after load", path, names[i]);
    assert_memory_equal(d.blob, c->blob, sizeof c->blob);
    lora_free(&d);
}

static inline void verify_ok(const char *path)
{
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, path, 0));
    assert_ok(strata_ckpt_verify(ck, NULL, NULL));
    strata_ckpt_free(ck);
}

/* Bytes of the data files a save wrote itself (data-*.bin) in path, from the disk. */
static inline uint64_t written_on_disk(const char *path, int *nref)
{
    uint64_t n = 0;
    char p[1024];
    *nref = 0;
    for (int f = 0; f < 4; f++) {
        struct stat st;
        snprintf(p, sizeof p, "%s/data-%06d.bin", path, f);
        if (stat(p, &st) == 0)
            n += (uint64_t)st.st_size;
    }
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "ls %s | grep -c '^ref-' ", path);
    FILE *pf = popen(cmd, "r");
    assert_non_null(pf);
    assert_int_equal(fscanf(pf, "%d", nref), 1);
    pclose(pf);
    return n;
}

static inline int save(const char *path, lora *s, int step, const char *base, int async,
                strata_stats *stats)
{
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = CHUNK;
    o.step = (uint64_t)step;
    o.flags = STRATA_SAVE_INCREMENTAL | STRATA_SAVE_NO_SYNC;
    o.base = base;
    if (!async)
        return strata_save(stats, NULL, (const char *[]){path}, 1, &s->st, 1, &o);
    strata_handle *h;
    int rc = strata_save_start(&h, NULL, (const char *[]){path}, 1, &s->st, 1, &o);
    if (rc)
        return rc;
    rc = strata_wait_durable(stats, h);
    strata_handle_free(h);
    return rc;
}

#endif
