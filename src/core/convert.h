/* convert.h - element conversions between dtypes, on bits (no libm, no FP environment):
 * every floating type to every other (f64, f32, f16, bf16), rounded once to nearest even,
 * and the conversions of integers and bool that are exact. Used by the loader
 * (STRATA_LOAD_CAST) and by export (bf16). Pure functions; thread-safe. */
#ifndef STRATA_CONVERT_H
#define STRATA_CONVERT_H
#include <stdint.h>

#include "strata_types.h"

/* 1 if st_convert converts `from` to `to` (equal dtypes included), else 0:
 *  - f64, f32, f16, bf16 to one another: round to nearest, ties to even; a value beyond
 *    the target's largest finite rounds to an infinity of its sign (as IEEE 754 does);
 *    one too small for its smallest subnormal rounds to a zero of its sign; infinities
 *    stay infinities; a NaN stays a NaN of its sign, quiet, keeping its payload's high
 *    bits;
 *  - bool, u8, i8, i16, i32 to an integer or float type that holds every value of the
 *    source exactly (bool to every integer; u8 to i16, i32, i64; i8 to i16, i32, i64;
 *    i16 to i32, i64; i32 to i64; bool, u8, i8 to every float; i16 to f32, f64; i32 to
 *    f64); a bool byte other than 0 is 1;
 *  - nothing else: narrowing integers, float to integer, i64 to anything, fp8 (none of
 *    which has one obvious meaning). */
int st_convert_ok(strata_dtype from, strata_dtype to);

/* 1 if st_convert_ok(from, to) and every value of `from` is exact in `to` (a widening:
 * nothing rounds): equal dtypes, every integer and bool conversion above, and floats to a
 * float with at least as many exponent and mantissa bits (f16, bf16 to f32, f64; f32 to
 * f64). Else 0 (f64 to f32, f32 to f16 or bf16, f16 and bf16 to one another: they round). */
int st_convert_exact(strata_dtype from, strata_dtype to);

/* Converts n elements of dtype `from` at src to dtype `to` at dst. Both may be unaligned.
 * st_convert_ok(from, to) must hold. dst == src is allowed when `to` is no wider than
 * `from` (elements are converted in order, each read before it is written). */
void st_convert(void *dst, strata_dtype to, const void *src, strata_dtype from, uint64_t n);

#endif
