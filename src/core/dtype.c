/* dtype.c - element types: sizes and names. */
#include <string.h>

#include "strata_types.h"

static const struct {
    const char *name;
    size_t size;
} dtypes[STRATA_DTYPE_COUNT] = {
    [STRATA_F64] = {"f64", 8},           [STRATA_F32] = {"f32", 4},
    [STRATA_F16] = {"f16", 2},           [STRATA_BF16] = {"bf16", 2},
    [STRATA_FP8_E4M3] = {"fp8_e4m3", 1}, [STRATA_FP8_E5M2] = {"fp8_e5m2", 1},
    [STRATA_I64] = {"i64", 8},           [STRATA_I32] = {"i32", 4},
    [STRATA_I16] = {"i16", 2},           [STRATA_I8] = {"i8", 1},
    [STRATA_U8] = {"u8", 1},             [STRATA_BOOL] = {"bool", 1},
};

size_t strata_dtype_size(strata_dtype dt)
{
    return (unsigned)dt < STRATA_DTYPE_COUNT ? dtypes[dt].size : 0;
}

const char *strata_dtype_name(strata_dtype dt)
{
    return (unsigned)dt < STRATA_DTYPE_COUNT ? dtypes[dt].name : NULL;
}

int strata_dtype_parse(strata_dtype *out, const char *name)
{
    for (int i = 0; i < STRATA_DTYPE_COUNT; i++)
        if (name && strcmp(name, dtypes[i].name) == 0) {
            *out = (strata_dtype)i;
            return 0;
        }
    return STRATA_EINVAL;
}
