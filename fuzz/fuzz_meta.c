/* fuzz_meta.c - libFuzzer target for the metadata decoder (src/meta/meta.c).
 *
 * The input goes to st_meta_decode_unchecked (no trailer checksum, so mutations reach deep
 * into the parser) and to st_meta_decode. A decoded st_meta is then held to the rules of
 * docs/FORMAT.md ("What a reader checks") by an independent checker, including a
 * brute-force overlap test of small tensors and a foreign index's check table, and
 * re-encoded: the encoding must decode (with
 * its checksum) to an equal st_meta and re-encode to the same bytes. Any violation is
 * abort(). Also replayed by tests/test_fuzz_replay.c (the entry point is renamed there).
 *
 * Inputs that start with "OVLP" instead describe, compactly, a large crafted shard set of
 * one tensor (fm_overlap_gen: up to 16,384 shards from a few bytes), to hunt for inputs on
 * which the overlap check is wrong or slow: its answer is held to a brute-force one, and
 * its work (st_overlap_work) to a near-linear bound, so a superlinear case aborts
 * here even where it would not yet hit libFuzzer's -timeout. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/checksum.h"
#include "core/geom.h"
#include "core/overlap.h"
#include "meta/checks.h"
#include "meta/meta.h"

#define FM_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_meta: " __VA_ARGS__);                                         \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

static volatile uint64_t fm_sink;

static int fm_name_ok(const char *s)
{
    size_t n = strlen(s);
    return n >= 1 && n <= STRATA_MAX_NAME;
}

static int fm_extent_ok(const st_meta *m, const st_extent *e)
{
    if (e->file >= m->nfiles || (!m->foreign && e->offset % ST_ALIGN != 0))
        return 0;
    uint64_t fb = m->files[e->file].bytes;
    if (e->offset > fb || e->bytes > fb - e->offset)
        return 0;
    if (m->foreign) /* a foreign index has no checksums */
        return e->sums == NULL;
    uint64_t x = 0, n = st_nchunks(e->bytes, m->chunk);
    for (uint64_t i = 0; i < n; i++) /* reads every checksum: ASan checks the array */
        x ^= e->sums[i];
    fm_sink ^= x;
    return 1;
}

/* Brute force: marks every element each shard holds in a bitmap of the tensor; a second
 * mark is an overlap. Only for small tensors. Returns 1 if two shards overlap. */
static int fm_overlap_brute(const st_mtensor *t, uint64_t numel)
{
    unsigned char *seen = calloc(numel ? numel : 1, 1);
    if (!seen)
        return 0;
    int bad = 0;
    for (size_t s = 0; s < t->nshards && !bad; s++) {
        const st_mshard *sh = &t->shards[s];
        uint64_t idx[STRATA_MAX_DIMS] = {0}, k = sh->fs, r = sh->fs;
        for (int d = t->ndim - 1; d >= 0; d--) { /* multi-index of box element fs */
            idx[d] = r % sh->len[d];
            r /= sh->len[d];
        }
        /* an odometer over [fs, fe) of the box; each element marked once, so the work is
         * at most numel + 1 marks before an overlap shows */
        for (; k < sh->fe; k++) {
            uint64_t g = 0;
            for (int d = 0; d < t->ndim; d++)
                g = g * t->shape[d] + sh->off[d] + idx[d];
            if (seen[g]++) {
                bad = 1;
                break;
            }
            for (int d = t->ndim - 1; d >= 0; d--) {
                if (++idx[d] < sh->len[d])
                    break;
                idx[d] = 0;
            }
        }
    }
    free(seen);
    return bad;
}

/* ---- "OVLP" inputs: crafted shard sets for the overlap check ----
 *   u8 ndim (mod 9); per dim: u8 a, u8 b: shape 1 + a, shifted left b % 41 bits (or less,
 *   or 1, to keep numel below 2^56); then records until the input ends or 16,384 shards:
 *   u8 n1, u8 n2; per dim six i16 (little-endian) ob o1 o2 lb l1 l2:
 *   off = ob*u + i1*o1 + i2*o2 mod shape, len = 1 + (lb*u + i1*l1 + i2*l2 mod
 *   (shape - off)), u = max(1, shape / 65536); u8 flat (bit 0), six i16 fb f1 f2 cb c1 c2:
 *   fs = fb*v + i1*f1 + i2*f2 mod numel(box), count = 1 + (cb*v + i1*c1 + i2*c2 mod
 *   (numel(box) - fs)), v = max(1, numel(box) / 65536); one shard for each i1 <= n1,
 *   i2 <= n2. So a family such as issue 10's (n one-element pieces of n distinct boxes that
 *   all intersect) takes one record. The seeds seed-ovlp-* hold that family, sticks woven
 *   along 3 dims, and a pinwheel with sliced arms. */
#define FM_GEN_MAX 16384

typedef struct {
    const uint8_t *p, *end;
} fm_in;

static int fm_u8(fm_in *in, unsigned *v)
{
    if (in->p >= in->end)
        return 0;
    *v = *in->p++;
    return 1;
}

static int fm_i16(fm_in *in, int64_t *v)
{
    if (in->end - in->p < 2)
        return 0;
    *v = (int16_t)(uint16_t)(in->p[0] | in->p[1] << 8);
    in->p += 2;
    return 1;
}

/* base*unit + i1*s1 + i2*s2 modulo m (m >= 1); every term stays below 2^62 */
static uint64_t fm_mod(int64_t base, uint64_t unit, uint64_t i1, int64_t s1, uint64_t i2,
                       int64_t s2, uint64_t m)
{
    __int128 x = (__int128)base * (__int128)unit + (__int128)i1 * s1 + (__int128)i2 * s2;
    x %= (__int128)m;
    return (uint64_t)(x < 0 ? x + m : x);
}

static int fm_stop(void *ctx, uint64_t a, uint64_t b, uint64_t n)
{
    (void)ctx, (void)a, (void)b, (void)n;
    return 1;
}

static void fm_overlap_gen(const uint8_t *data, size_t size)
{
    fm_in in = {data, data + size};
    unsigned nd, a, b;
    if (!fm_u8(&in, &nd))
        return;
    static st_mshard sh[FM_GEN_MAX];
    static uint64_t dims[FM_GEN_MAX][2 * STRATA_MAX_DIMS];
    st_mtensor t = {.name = "gen", .dtype = STRATA_U8, .ndim = (int)(nd % 9), .shards = sh};
    unsigned bits = 0; /* numel < 2^bits <= 2^56 */
    for (int d = 0; d < t.ndim; d++) {
        if (!fm_u8(&in, &a) || !fm_u8(&in, &b))
            return;
        unsigned ab = 32 - (unsigned)__builtin_clz(1 + a), sft = b % 41;
        if (bits + ab > 56) {
            t.shape[d] = 1;
            continue;
        }
        sft = sft < 56 - bits - ab ? sft : 56 - bits - ab;
        t.shape[d] = (uint64_t)(1 + a) << sft;
        bits += ab + sft;
    }
    uint64_t numel = 1;
    for (int d = 0; d < t.ndim; d++)
        numel *= t.shape[d];
    int ok = 1;
    while (ok && t.nshards < FM_GEN_MAX) {
        unsigned n1, n2, fl;
        int64_t g[STRATA_MAX_DIMS][6], f[6];
        ok = fm_u8(&in, &n1) && fm_u8(&in, &n2);
        for (int d = 0; ok && d < t.ndim; d++)
            for (int k = 0; ok && k < 6; k++)
                ok = fm_i16(&in, &g[d][k]);
        ok = ok && fm_u8(&in, &fl);
        for (int k = 0; ok && k < 6; k++)
            ok = fm_i16(&in, &f[k]);
        if (!ok)
            break;
        for (uint64_t i1 = 0; i1 <= n1 && t.nshards < FM_GEN_MAX; i1++)
            for (uint64_t i2 = 0; i2 <= n2 && t.nshards < FM_GEN_MAX; i2++) {
                st_mshard *s = &sh[t.nshards];
                uint64_t *off = dims[t.nshards], *len = off + STRATA_MAX_DIMS, bn = 1;
                for (int d = 0; d < t.ndim; d++) {
                    uint64_t u = t.shape[d] / 65536 ? t.shape[d] / 65536 : 1;
                    off[d] = fm_mod(g[d][0], u, i1, g[d][1], i2, g[d][2], t.shape[d]);
                    len[d] = 1 + fm_mod(g[d][3], u, i1, g[d][4], i2, g[d][5],
                                        t.shape[d] - off[d]);
                    bn *= len[d];
                }
                uint64_t fs = 0, fe = bn;
                if (fl & 1) {
                    uint64_t v = bn / 65536 ? bn / 65536 : 1;
                    fs = fm_mod(f[0], v, i1, f[1], i2, f[2], bn);
                    fe = fs + 1 + fm_mod(f[3], v, i1, f[4], i2, f[5], bn - fs);
                }
                *s = (st_mshard){off, len, fs, fe, (int)(fl & 1), {0}, 0};
                t.nshards++;
            }
    }
    int rc = st_meta_check_overlap(&t);
    uint64_t work = st_overlap_work();
    if (rc == STRATA_ENOMEM)
        return;
    if (rc != 0 && rc != STRATA_EOVERLAP)
        FM_FAIL("overlap check of a crafted set returned %s", strata_error_name(rc));
    /* near-linear: work within 32 m (log2 m + 1)^2, for m shards */
    double m = (double)t.nshards, lg = 1;
    for (size_t x = t.nshards; x > 1; x >>= 1)
        lg++;
    if ((double)work > 32.0 * m * lg * lg + 65536.0)
        FM_FAIL("slow input: the overlap check of %zu shards in %d dims took %llu work units",
                t.nshards, t.ndim, (unsigned long long)work);
    int want = -1;
    if (numel <= (1u << 20))
        want = fm_overlap_brute(&t, numel);
    else if (t.nshards <= 256) {
        want = 0;
        for (size_t i = 0; i < t.nshards && !want; i++)
            for (size_t j = i + 1; j < t.nshards && !want; j++) {
                st_region x = {t.ndim, sh[i].off, sh[i].len, sh[i].fs, sh[i].fe};
                st_region y = {t.ndim, sh[j].off, sh[j].len, sh[j].fs, sh[j].fe};
                want = st_region_runs(&x, &y, fm_stop, NULL) > 0;
            }
    }
    if (want >= 0 && (rc == STRATA_EOVERLAP) != want)
        FM_FAIL("overlap check of %zu crafted shards in %d dims says %s, brute force %s",
                t.nshards, t.ndim, rc ? "overlap" : "disjoint", want ? "overlap" : "disjoint");
}

/* Checks everything FORMAT.md says a decoded metadata satisfies. */
static void fm_check(const st_meta *m)
{
    if (m->foreign ? m->chunk != 1
                   : m->chunk < 4096 || m->chunk > (64u << 20) || (m->chunk & (m->chunk - 1)))
        FM_FAIL("bad chunk size %u accepted", m->chunk);
    for (uint32_t i = 0; i < m->nfiles; i++) {
        const char *n = m->files[i].name;
        if (!fm_name_ok(n) || !st_plain_name(n, strlen(n)))
            FM_FAIL("bad file name accepted");
        for (uint32_t j = 0; j < i && m->nfiles <= 2048; j++) /* quadratic: modest counts */
            if (strcmp(n, m->files[j].name) == 0)
                FM_FAIL("duplicate file name '%s' accepted", n);
    }
    uint64_t total = 0, brute = 0; /* brute: elements checked by fm_overlap_brute */
    for (size_t i = 0; i < m->ntensors; i++) {
        const st_mtensor *t = &m->tensors[i];
        if (!fm_name_ok(t->name))
            FM_FAIL("bad tensor name accepted");
        if ((unsigned)t->dtype >= STRATA_DTYPE_COUNT || t->ndim < 0 || t->ndim > STRATA_MAX_DIMS)
            FM_FAIL("tensor '%s': bad dtype or ndim accepted", t->name);
        uint64_t numel = 1, esz = strata_dtype_size(t->dtype), tb;
        for (int d = 0; d < t->ndim; d++)
            if (__builtin_mul_overflow(numel, t->shape[d], &numel))
                FM_FAIL("tensor '%s': shape overflows", t->name);
        if (__builtin_mul_overflow(numel, esz, &tb) || tb > (UINT64_MAX >> 2))
            FM_FAIL("tensor '%s': size overflows", t->name);
        uint64_t sum = 0, held = 0;
        for (size_t s = 0; s < t->nshards; s++) {
            const st_mshard *sh = &t->shards[s];
            uint64_t bn = 1;
            for (int d = 0; d < t->ndim; d++) {
                if (sh->len[d] == 0 || sh->off[d] > t->shape[d] ||
                    sh->len[d] > t->shape[d] - sh->off[d])
                    FM_FAIL("tensor '%s' shard %zu: box outside the tensor", t->name, s);
                bn *= sh->len[d];
            }
            if (sh->flat != 0 && sh->flat != 1)
                FM_FAIL("tensor '%s' shard %zu: flat = %d", t->name, s, sh->flat);
            if (sh->fs >= sh->fe || sh->fe > bn || (!sh->flat && (sh->fs != 0 || sh->fe != bn)))
                FM_FAIL("tensor '%s' shard %zu: bad flat range", t->name, s);
            if (sh->ext.bytes != (sh->fe - sh->fs) * esz)
                FM_FAIL("tensor '%s' shard %zu: extent bytes do not match", t->name, s);
            if (!fm_extent_ok(m, &sh->ext))
                FM_FAIL("tensor '%s' shard %zu: extent outside its file", t->name, s);
            sum += sh->ext.bytes;
            held += sh->fe - sh->fs;
        }
        if (sum != t->bytes)
            FM_FAIL("tensor '%s': bytes %llu, shards sum to %llu", t->name,
                    (unsigned long long)t->bytes, (unsigned long long)sum);
        if (held > numel)
            FM_FAIL("tensor '%s': shards hold more elements than the tensor", t->name);
        if (t->nshards > 1 && numel <= (1u << 16) && (brute += numel) <= (1u << 18) &&
            fm_overlap_brute(t, numel))
            FM_FAIL("tensor '%s': overlapping shards accepted", t->name);
        total += t->bytes;
    }
    for (size_t i = 0; i < m->nblobs; i++) {
        const st_mblob *b = &m->blobs[i];
        if (!fm_name_ok(b->name) || b->owner < -1 || b->owner > INT32_MAX)
            FM_FAIL("bad blob name or owner accepted");
        if (!fm_extent_ok(m, &b->ext))
            FM_FAIL("blob '%s': extent outside its file", b->name);
        total += b->ext.bytes;
    }
    if (total != m->data_bytes)
        FM_FAIL("data_bytes %llu, objects sum to %llu", (unsigned long long)m->data_bytes,
                (unsigned long long)total);
    /* the check table (foreign only): inside its files, non-empty, sorted and disjoint */
    if (m->nchecks && !m->foreign)
        FM_FAIL("strata's own metadata with %zu check ranges", m->nchecks);
    for (size_t i = 0; i < m->nchecks; i++) {
        const st_mcheck *c = &m->checks[i], *p = i ? &m->checks[i - 1] : NULL;
        size_t nl = strlen(c->name);
        if (c->file >= m->nfiles || c->bytes == 0 || c->offset > m->files[c->file].bytes ||
            c->bytes > m->files[c->file].bytes - c->offset || nl < 1 || nl > ST_CHECK_MAX_NAME)
            FM_FAIL("check range %zu outside its file (or a bad name) accepted", i);
        if (p && (p->file > c->file || (p->file == c->file && p->offset + p->bytes > c->offset)))
            FM_FAIL("check ranges %zu and %zu out of order or overlapping accepted", i - 1, i);
        if (st_check_find(m, c->file, c->offset) != i)
            FM_FAIL("st_check_find does not find check range %zu", i);
    }
    /* unique names (quadratic: only for modest counts) */
    if (m->ntensors + m->nblobs <= 4096) {
        for (size_t i = 0; i < m->ntensors; i++)
            for (size_t j = 0; j < i; j++)
                if (strcmp(m->tensors[i].name, m->tensors[j].name) == 0)
                    FM_FAIL("duplicate tensor name '%s' accepted", m->tensors[i].name);
        for (size_t i = 0; i < m->nblobs; i++)
            for (size_t j = 0; j < i; j++)
                if (m->blobs[i].owner == m->blobs[j].owner &&
                    strcmp(m->blobs[i].name, m->blobs[j].name) == 0)
                    FM_FAIL("duplicate blob '%s' accepted", m->blobs[i].name);
    }
}

static int fm_ext_eq(const st_extent *a, const st_extent *b, uint32_t chunk)
{
    return a->file == b->file && a->offset == b->offset && a->bytes == b->bytes &&
           (a->sums == NULL ? b->sums == NULL
                            : memcmp(a->sums, b->sums, st_nchunks(a->bytes, chunk) * 8) == 0);
}

static int fm_equal(const st_meta *a, const st_meta *b)
{
    if (a->foreign != b->foreign || (a->idents == NULL) != (b->idents == NULL) ||
        (a->idents && memcmp(a->idents, b->idents, a->nfiles * sizeof *a->idents)))
        return 0;
    if (a->step != b->step || a->chunk != b->chunk || a->nfiles != b->nfiles ||
        a->ntensors != b->ntensors || a->nblobs != b->nblobs || a->data_bytes != b->data_bytes)
        return 0;
    for (uint32_t i = 0; i < a->nfiles; i++)
        if (strcmp(a->files[i].name, b->files[i].name) || a->files[i].bytes != b->files[i].bytes)
            return 0;
    if (a->nchecks != b->nchecks)
        return 0;
    for (size_t i = 0; i < a->nchecks; i++) {
        const st_mcheck *x = &a->checks[i], *y = &b->checks[i];
        if (x->file != y->file || x->offset != y->offset || x->bytes != y->bytes ||
            x->crc != y->crc || strcmp(x->name, y->name))
            return 0;
    }
    for (size_t i = 0; i < a->ntensors; i++) {
        const st_mtensor *x = &a->tensors[i], *y = &b->tensors[i];
        if (strcmp(x->name, y->name) || x->dtype != y->dtype || x->ndim != y->ndim ||
            x->nshards != y->nshards || x->bytes != y->bytes ||
            memcmp(x->shape, y->shape, (size_t)x->ndim * 8))
            return 0;
        for (size_t s = 0; s < x->nshards; s++) {
            const st_mshard *p = &x->shards[s], *q = &y->shards[s];
            if (p->flat != q->flat || p->fs != q->fs || p->fe != q->fe ||
                memcmp(p->off, q->off, (size_t)x->ndim * 8) ||
                memcmp(p->len, q->len, (size_t)x->ndim * 8) || !fm_ext_eq(&p->ext, &q->ext, a->chunk))
                return 0;
        }
    }
    for (size_t i = 0; i < a->nblobs; i++) {
        const st_mblob *x = &a->blobs[i], *y = &b->blobs[i];
        if (strcmp(x->name, y->name) || x->owner != y->owner || !fm_ext_eq(&x->ext, &y->ext, a->chunk))
            return 0;
    }
    return 1;
}

/* Re-encodes m: the bytes must decode (checksum included) to an equal st_meta, and that
 * must encode to the same bytes. */
static void fm_roundtrip(const st_meta *m)
{
    unsigned char *b1 = NULL, *b2 = NULL;
    size_t n1 = 0, n2 = 0;
    st_meta *m2 = NULL;
    if (st_meta_encode(m, &b1, &n1) != 0)
        return; /* out of memory */
    int rc = m->foreign ? st_meta_decode_foreign(&m2, b1, n1) : st_meta_decode(&m2, b1, n1);
    if (rc == STRATA_ENOMEM) {
        free(b1);
        return;
    }
    if (rc != 0)
        FM_FAIL("re-encoded metadata does not decode: %s", strata_error_last());
    if (!fm_equal(m, m2))
        FM_FAIL("re-encoded metadata decodes to something else");
    if (st_meta_encode(m2, &b2, &n2) == 0) {
        if (n1 != n2 || memcmp(b1, b2, n1) != 0)
            FM_FAIL("encoding is not stable (%zu vs %zu bytes)", n1, n2);
        free(b2);
    }
    st_meta_free(m2);
    free(b1);
}

static void fm_rc_ok(int rc, st_meta *m)
{
    if (rc != 0 && rc != STRATA_EFORMAT && rc != STRATA_ENOMEM)
        FM_FAIL("decoder returned %s", strata_error_name(rc));
    if (rc != 0 && (m != NULL || strata_error_last()[0] == 0))
        FM_FAIL("failed decode left an output or no message");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= 4 && memcmp(data, "OVLP", 4) == 0) {
        fm_overlap_gen(data + 4, size - 4);
        return 0;
    }
    st_meta *mu = (st_meta *)1, *mc = (st_meta *)1;
    int ru = st_meta_decode_unchecked(&mu, data, size);
    fm_rc_ok(ru, mu);
    if (ru == 0) {
        fm_check(mu);
        fm_roundtrip(mu);
    }
    /* the checked decoder of the header's kind: metadata.bin, or a foreign index */
    int foreign = size >= 16 && st_get_u32(data + 12) == ST_META_FOREIGN;
    st_meta *other = (st_meta *)1;
    int ro = foreign ? st_meta_decode(&other, data, size)
                     : st_meta_decode_foreign(&other, data, size);
    if (ro != STRATA_EFORMAT || other != NULL) /* never both kinds */
        FM_FAIL("the decoder of the other kind returned %d", ro);
    int rc = foreign ? st_meta_decode_foreign(&mc, data, size) : st_meta_decode(&mc, data, size);
    fm_rc_ok(rc, mc);
    int sum_ok = size >= ST_META_HEADER + ST_META_TRAILER &&
                 st_hash(data, size - ST_META_TRAILER) == st_get_u64(data + size - ST_META_TRAILER);
    if ((rc == 0) != (ru == 0 && sum_ok) && rc != STRATA_ENOMEM && ru != STRATA_ENOMEM)
        FM_FAIL("checked decode (%d) disagrees with unchecked decode (%d) + checksum (%d)", rc,
                ru, sum_ok);
    if (rc == 0) {
        fm_check(mc);
        if (ru == 0 && !fm_equal(mu, mc))
            FM_FAIL("checked and unchecked decodes differ");
        fm_roundtrip(mc);
    }
    st_meta_free(mu);
    st_meta_free(mc);
    return 0;
}
