/* convert.c - element conversions between dtypes (convert.h). Floats go through the bits
 * of an f64, which holds every f32, f16 and bf16 exactly, so each conversion rounds once. */
#include <string.h>

#include "convert.h"

/* A floating format: exponent and explicit mantissa bits. */
typedef struct {
    int e, m;
} ffmt;

static int float_fmt(strata_dtype t, ffmt *f)
{
    switch (t) {
    case STRATA_F64: *f = (ffmt){11, 52}; return 1;
    case STRATA_F32: *f = (ffmt){8, 23}; return 1;
    case STRATA_F16: *f = (ffmt){5, 10}; return 1;
    case STRATA_BF16: *f = (ffmt){8, 7}; return 1;
    default: return 0;
    }
}

/* An integer type: the bits of its largest magnitude, and whether it has negatives. */
static int int_fmt(strata_dtype t, int *bits, int *is_signed)
{
    switch (t) {
    case STRATA_BOOL: *bits = 1, *is_signed = 0; return 1;
    case STRATA_U8: *bits = 8, *is_signed = 0; return 1;
    case STRATA_I8: *bits = 7, *is_signed = 1; return 1;
    case STRATA_I16: *bits = 15, *is_signed = 1; return 1;
    case STRATA_I32: *bits = 31, *is_signed = 1; return 1;
    case STRATA_I64: *bits = 63, *is_signed = 1; return 1;
    default: return 0;
    }
}

int st_convert_ok(strata_dtype from, strata_dtype to)
{
    if (from == to)
        return strata_dtype_size(from) != 0;
    ffmt ff, tf;
    int fb, fs, tb, ts;
    if (float_fmt(from, &ff))
        return float_fmt(to, &tf);
    if (!int_fmt(from, &fb, &fs) || from == STRATA_I64)
        return 0;
    if (float_fmt(to, &tf)) /* every value exact: magnitude within the significand */
        return fb <= tf.m + 1;
    return int_fmt(to, &tb, &ts) && fb <= tb && (ts || !fs);
}

int st_convert_exact(strata_dtype from, strata_dtype to)
{
    ffmt ff, tf;
    if (!st_convert_ok(from, to))
        return 0;
    if (float_fmt(from, &ff) && float_fmt(to, &tf))
        return tf.e >= ff.e && tf.m >= ff.m;
    return 1; /* integers: st_convert_ok converts only where exact */
}

/* ---- floats ---- */

/* The bits of a float of format f as f64 bits (exact). A NaN is made quiet. */
static uint64_t widen(uint64_t b, ffmt f)
{
    uint64_t sign = (b >> (f.e + f.m)) << 63, man = b & ((1ull << f.m) - 1);
    int64_t exp = (int64_t)(b >> f.m) & ((1 << f.e) - 1), bias = (1 << (f.e - 1)) - 1;
    if (exp == (1 << f.e) - 1) /* inf or NaN */
        return sign | 0x7ff0000000000000ull | man << (52 - f.m) | (man ? 1ull << 51 : 0);
    if (exp == 0) {
        if (!man)
            return sign;
        exp = 1; /* subnormal: normalise */
        while (!(man >> f.m))
            man <<= 1, exp--;
        man &= (1ull << f.m) - 1;
    }
    return sign | (uint64_t)(exp - bias + 1023) << 52 | man << (52 - f.m);
}

/* f64 bits rounded to the nearest float of format f (ties to even), as its bits. */
static uint64_t narrow(uint64_t b, ffmt f)
{
    uint64_t sign = (b >> 63) << (f.e + f.m), man = b & ((1ull << 52) - 1);
    int64_t exp = (int64_t)(b >> 52) & 0x7ff, bias = (1 << (f.e - 1)) - 1;
    uint64_t inf = ((1ull << f.e) - 1) << f.m;
    if (exp == 0x7ff) /* inf, or a quiet NaN keeping the payload's high bits */
        return sign | inf | (man ? man >> (52 - f.m) | 1ull << (f.m - 1) : 0);
    if (exp == 0) /* f64 subnormals are below half of every narrower format's least */
        return sign;
    int64_t e = exp - 1023, emin = 1 - bias;
    if (e > bias)
        return sign | inf;
    uint64_t sig = man | 1ull << 52;
    int64_t shift = 52 - f.m + (e < emin ? emin - e : 0);
    if (shift > 53)
        return sign;
    uint64_t q = sig >> shift, rem = sig & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    if (rem > half || (rem == half && (q & 1)))
        q++; /* a carry into the exponent is right, up to infinity */
    if (e < emin)
        return sign | q;
    return sign | (((uint64_t)(e + bias - 1) << f.m) + q);
}

static uint64_t load_bits(const unsigned char *p, size_t size)
{
    uint64_t v = 0;
    if (size == 8) {
        memcpy(&v, p, 8);
    } else if (size == 4) {
        uint32_t u;
        memcpy(&u, p, 4);
        v = u;
    } else if (size == 2) {
        uint16_t u;
        memcpy(&u, p, 2);
        v = u;
    } else {
        v = *p;
    }
    return v;
}

static void store_bits(unsigned char *p, size_t size, uint64_t v)
{
    if (size == 8) {
        memcpy(p, &v, 8);
    } else if (size == 4) {
        uint32_t u = (uint32_t)v;
        memcpy(p, &u, 4);
    } else if (size == 2) {
        uint16_t u = (uint16_t)v;
        memcpy(p, &u, 2);
    } else {
        *p = (unsigned char)v;
    }
}

/* f32 -> bf16, the common case: adding 0x7fff plus the lowest kept bit rounds to nearest
 * even, carrying into the exponent up to infinity (bf16 has f32's exponent range). */
static void f32_to_bf16(unsigned char *d, const unsigned char *s, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, s + 4 * i, 4);
        uint16_t h = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                                     : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
        memcpy(d + 2 * i, &h, 2);
    }
}

/* ---- integers ---- */

/* An integer element as int64 (bool: 0 or 1). */
static int64_t load_int(const unsigned char *p, strata_dtype t)
{
    uint64_t v = load_bits(p, strata_dtype_size(t));
    switch (t) {
    case STRATA_BOOL: return v != 0;
    case STRATA_I8: return (int8_t)(uint8_t)v;
    case STRATA_I16: return (int16_t)(uint16_t)v;
    case STRATA_I32: return (int32_t)(uint32_t)v;
    default: return (int64_t)v; /* u8 */
    }
}

/* An integer's f64 bits (exact: it has at most 31 significant bits). */
static uint64_t int_to_f64_bits(int64_t v)
{
    double d = (double)v;
    uint64_t b;
    memcpy(&b, &d, 8);
    return b;
}

void st_convert(void *dst, strata_dtype to, const void *src, strata_dtype from, uint64_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t ss = strata_dtype_size(from), ds = strata_dtype_size(to);
    ffmt ff, tf;
    int ffl = float_fmt(from, &ff), tfl = float_fmt(to, &tf);
    if (from == to) {
        memmove(d, s, n * ss);
    } else if (from == STRATA_F32 && to == STRATA_BF16) {
        f32_to_bf16(d, s, n);
    } else if (ffl) {
        for (uint64_t i = 0; i < n; i++) {
            uint64_t b = load_bits(s + i * ss, ss);
            if (from != STRATA_F64)
                b = widen(b, ff);
            store_bits(d + i * ds, ds, to == STRATA_F64 ? b : narrow(b, tf));
        }
    } else {
        for (uint64_t i = 0; i < n; i++) {
            int64_t v = load_int(s + i * ss, from);
            store_bits(d + i * ds, ds,
                       tfl ? (to == STRATA_F64 ? int_to_f64_bits(v)
                                               : narrow(int_to_f64_bits(v), tf))
                           : (uint64_t)v);
        }
    }
}
