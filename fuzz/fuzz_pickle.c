/* fuzz_pickle.c - libFuzzer target for the restricted pickle reader (src/source/pickle.c).
 *
 * The input is parsed as a pickle. On success the value graph is held to the rules of
 * pickle.h and docs/FORMAT.md ("Reading pickle and zip"), walked recursively (which the
 * reader's bounds must keep finite): known kinds and globals, str valid UTF-8 and
 * NUL-terminated, bigints longer than 8 bytes and at most PK_MAX_INT_BYTES, calls of globals
 * the list allows to be called with a tuple of arguments, depth at most PK_MAX_DEPTH and the
 * walk at most PK_MAX_EXPANDED values. Any violation is abort(); a refusal must be
 * STRATA_EFORMAT naming the context (or STRATA_ENOMEM) and leave nothing behind. Also
 * replayed by tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/utf8.h"
#include "source/pickle.h"

#define FPK_FAIL(...)                                                                        \
    do {                                                                                     \
        fprintf(stderr, "fuzz_pickle: " __VA_ARGS__);                                       \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

static uint64_t fpk_walk(const pk_val *v, int depth)
{
    if (depth > PK_MAX_DEPTH)
        FPK_FAIL("a value nested deeper than %d accepted", PK_MAX_DEPTH);
    uint64_t n = 1;
    switch (v->kind) {
    case PK_NONE: case PK_FLOAT: case PK_INT:
        break;
    case PK_BOOL:
        if (v->i != 0 && v->i != 1)
            FPK_FAIL("bool %lld", (long long)v->i);
        break;
    case PK_BIGINT:
        if (v->len <= 8 || v->len > PK_MAX_INT_BYTES)
            FPK_FAIL("bigint of %zu bytes", v->len);
        break;
    case PK_STR:
        if (st_utf8_invalid_at((const char *)v->s, v->len) != v->len)
            FPK_FAIL("a str that is not UTF-8 accepted");
        /* fall through */
    case PK_BYTES:
        if (v->s[v->len] != 0)
            FPK_FAIL("a str or bytes not NUL-terminated");
        break;
    case PK_TUPLE: case PK_LIST:
        for (size_t i = 0; i < v->n; i++)
            n += fpk_walk(v->items[i], depth + 1);
        break;
    case PK_DICT:
        for (size_t i = 0; i < 2 * v->n; i++)
            n += fpk_walk(v->items[i], depth + 1);
        if (v->state) {
            if (!v->ordered)
                FPK_FAIL("state on a plain dict");
            n += fpk_walk(v->state, depth + 1);
        }
        break;
    case PK_GLOBAL:
        if (v->g >= PK_G_COUNT)
            FPK_FAIL("global %d", (int)v->g);
        break;
    case PK_CALL:
        if (v->g >= PK_G_COUNT || v->g == PK_G_ORDERED_DICT || v->g == PK_G_CODECS_ENCODE)
            FPK_FAIL("call of global %d kept", (int)v->g);
        if (!v->args || v->args->kind != PK_TUPLE)
            FPK_FAIL("call of %s.%s without an argument tuple", pk_global_module(v->g),
                     pk_global_name(v->g));
        n += fpk_walk(v->args, depth + 1);
        if (v->state)
            n += fpk_walk(v->state, depth + 1);
        break;
    case PK_PID:
        n += fpk_walk(v->args, depth + 1);
        break;
    default:
        FPK_FAIL("kind %d", (int)v->kind);
    }
    if (n > PK_MAX_EXPANDED)
        FPK_FAIL("a result expanding to more than %llu values accepted", PK_MAX_EXPANDED);
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    pk_doc d;
    int rc = pk_parse(&d, data, size, "fuzz.pkl");
    if (rc == 0) {
        if (!d.root || d.proto < 2 || d.proto > 5)
            FPK_FAIL("accepted without a root or with protocol %d", d.proto);
        fpk_walk(d.root, 1);
        pk_free(&d);
        return 0;
    }
    if (rc != STRATA_EFORMAT && rc != STRATA_ENOMEM)
        FPK_FAIL("refused with %s (%s), want STRATA_EFORMAT", strata_error_name(rc),
                 strata_error_last());
    if (rc == STRATA_EFORMAT && !strstr(strata_error_last(), "fuzz.pkl"))
        FPK_FAIL("message \"%s\" does not name the context", strata_error_last());
    if (d.root || d.arena.head)
        FPK_FAIL("a refused parse left a document behind");
    return 0;
}
