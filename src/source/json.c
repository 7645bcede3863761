/* json.c - the strict, bounded JSON reader the formats share (json.h): what safetensors.c
 * and megatron.c each had. */
#include "json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../core/utf8.h"

int st_json_init(st_json *j, const unsigned char *b, size_t n, const char *file,
                 const char *kind)
{
    *j = (st_json){b, b, b + n, file, kind, malloc(n + 1), 0, NULL, 0};
    if (!j->str)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    j->str[0] = 0;
    return 0;
}

void st_json_free(st_json *j)
{
    free(j->str);
    j->str = NULL;
}

int st_json_fail(st_json *j, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return st_fail(STRATA_EFORMAT, "%s: bad %s at byte %zu of its JSON: %s", j->file, j->kind,
                   (size_t)(j->p - j->s), msg);
}

const char *st_json_show(const char *s, size_t n, char out[72])
{
    size_t k = 0;
    for (size_t i = 0; i < n && k < 64; i++) {
        unsigned char c = (unsigned char)s[i];
        out[k++] = c < 0x20 || c == 0x7f ? '?' : (char)c;
    }
    if (n > 64)
        out[k++] = '.', out[k++] = '.', out[k++] = '.';
    out[k] = 0;
    return out;
}

void st_json_ws(st_json *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

int st_json_eat(st_json *j, unsigned char c)
{
    st_json_ws(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return 1;
    }
    return 0;
}

int st_json_expect(st_json *j, unsigned char c, const char *where)
{
    if (st_json_eat(j, c))
        return 0;
    if (j->p >= j->end)
        return st_json_fail(j, "the JSON ends early (expected '%c' %s)", c, where);
    return st_json_fail(j, "expected '%c' %s", c, where);
}

static int hex4(const unsigned char *p, unsigned *v)
{
    unsigned x = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i], d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else
            return -1;
        x = x << 4 | d;
    }
    *v = x;
    return 0;
}

static void put_utf8(char *o, size_t *k, unsigned cp)
{
    if (cp < 0x80) {
        o[(*k)++] = (char)cp;
    } else if (cp < 0x800) {
        o[(*k)++] = (char)(0xC0 | cp >> 6);
        o[(*k)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        o[(*k)++] = (char)(0xE0 | cp >> 12);
        o[(*k)++] = (char)(0x80 | (cp >> 6 & 0x3F));
        o[(*k)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        o[(*k)++] = (char)(0xF0 | cp >> 18);
        o[(*k)++] = (char)(0x80 | (cp >> 12 & 0x3F));
        o[(*k)++] = (char)(0x80 | (cp >> 6 & 0x3F));
        o[(*k)++] = (char)(0x80 | (cp & 0x3F));
    }
}

int st_json_string(st_json *j, const char *what)
{
    if (!st_json_eat(j, '"'))
        return j->p >= j->end ? st_json_fail(j, "the JSON ends early (expected %s)", what)
                              : st_json_fail(j, "expected a string (%s)", what);
    size_t k = 0;
    const unsigned char *raw = j->p;
    for (;;) {
        if (j->p >= j->end)
            return st_json_fail(j, "unterminated string");
        unsigned c = *j->p;
        if (c == '"') {
            j->raw = raw;
            j->rawlen = (size_t)(j->p - raw);
            j->p++;
            break;
        }
        if (c < 0x20)
            return st_json_fail(j, "control character 0x%02x in a string", c);
        if (c >= 0x80) {
            int ok;
            size_t n = st_utf8_seq(j->p, (size_t)(j->end - j->p), &ok);
            if (!ok)
                return st_json_fail(j, "invalid UTF-8 in a string");
            memcpy(j->str + k, j->p, n);
            k += n;
            j->p += n;
            continue;
        }
        if (c != '\\') {
            j->str[k++] = (char)c;
            j->p++;
            continue;
        }
        if (j->end - j->p < 2)
            return st_json_fail(j, "unterminated string");
        unsigned e = j->p[1];
        const char *simple = strchr("\"\\/bfnrt", (int)e);
        if (e && simple) {
            static const char to[] = "\"\\/\b\f\n\r\t";
            j->str[k++] = to[simple - "\"\\/bfnrt"];
            j->p += 2;
            continue;
        }
        if (e != 'u')
            return st_json_fail(j, "bad escape '\\%c' in a string", e >= 0x20 && e < 0x7f ? e : '?');
        unsigned cp, lo;
        if (j->end - j->p < 6 || hex4(j->p + 2, &cp))
            return st_json_fail(j, "bad \\u escape in a string");
        if (cp >= 0xDC00 && cp <= 0xDFFF)
            return st_json_fail(j, "a lone low surrogate \\u%04X in a string", cp);
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (j->end - j->p < 12 || j->p[6] != '\\' || j->p[7] != 'u' ||
                hex4(j->p + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                return st_json_fail(j, "a high surrogate \\u%04X not followed by a low one", cp);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            j->p += 12;
        } else
            j->p += 6;
        put_utf8(j->str, &k, cp);
    }
    j->str[k] = 0;
    j->slen = k;
    return 0;
}

int st_json_is(const st_json *j, const char *lit)
{
    return j->slen == strlen(lit) && memcmp(j->str, lit, j->slen) == 0;
}

int st_json_uint(st_json *j, uint64_t *v, const char *what)
{
    st_json_ws(j);
    if (j->p >= j->end)
        return st_json_fail(j, "the JSON ends early (expected %s)", what);
    if (*j->p == '-')
        return st_json_fail(j, "negative number for %s", what);
    if (*j->p < '0' || *j->p > '9')
        return st_json_fail(j, "expected a number for %s", what);
    if (*j->p == '0' && j->end - j->p > 1 && j->p[1] >= '0' && j->p[1] <= '9')
        return st_json_fail(j, "number with a leading zero for %s", what);
    uint64_t x = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        if (__builtin_mul_overflow(x, 10, &x) || __builtin_add_overflow(x, *j->p - '0', &x))
            return st_json_fail(j, "number too large for %s", what);
        j->p++;
    }
    if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
        return st_json_fail(j, "non-integer number for %s", what);
    *v = x;
    return 0;
}

/* A number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?; *is_int when it has neither
 * fraction nor exponent and fits int64 (then *v). what: for a refusal ("expected a number
 * for <what>"), NULL where any value could be (a skip). */
static int number(st_json *j, int *is_int, int64_t *v, const char *what)
{
    const unsigned char *q = j->p;
    int neg = 0, over = 0;
    uint64_t x = 0;
    if (q < j->end && *q == '-')
        q++, neg = 1;
    if (q >= j->end || *q < '0' || *q > '9')
        return what ? st_json_fail(j, "expected a number for %s", what)
                    : st_json_fail(j, "expected a JSON value");
    if (*q == '0')
        q++;
    else
        while (q < j->end && *q >= '0' && *q <= '9') {
            over |= __builtin_mul_overflow(x, 10, &x) || __builtin_add_overflow(x, *q - '0', &x);
            q++;
        }
    *is_int = !over && x <= (uint64_t)INT64_MAX + neg;
    if (q < j->end && *q == '.') {
        q++, *is_int = 0;
        if (q >= j->end || *q < '0' || *q > '9')
            return st_json_fail(j, "bad number");
        while (q < j->end && *q >= '0' && *q <= '9')
            q++;
    }
    if (q < j->end && (*q == 'e' || *q == 'E')) {
        q++, *is_int = 0;
        if (q < j->end && (*q == '+' || *q == '-'))
            q++;
        if (q >= j->end || *q < '0' || *q > '9')
            return st_json_fail(j, "bad number");
        while (q < j->end && *q >= '0' && *q <= '9')
            q++;
    }
    if (*is_int)
        *v = neg ? (int64_t)(0 - x) : (int64_t)x;
    j->p = q;
    return 0;
}

int st_json_number(st_json *j, int *is_int, int64_t *v, const char *what)
{
    st_json_ws(j);
    if (j->p >= j->end)
        return st_json_fail(j, "the JSON ends early (expected %s)", what);
    return number(j, is_int, v, what);
}

int st_json_skip(st_json *j, int depth)
{
    if (depth > ST_JSON_MAX_DEPTH)
        return st_json_fail(j, "JSON nested deeper than %d", ST_JSON_MAX_DEPTH);
    st_json_ws(j);
    if (j->p >= j->end)
        return st_json_fail(j, "the JSON ends early (expected a value)");
    unsigned c = *j->p;
    int rc;
    if (c == '"')
        return st_json_string(j, "a string");
    if (c == '{' || c == '[') {
        unsigned close = c == '{' ? '}' : ']';
        j->p++;
        if (st_json_eat(j, (unsigned char)close))
            return 0;
        do {
            if (c == '{') {
                if ((rc = st_json_string(j, "a key")) || (rc = st_json_expect(j, ':', "after a key")))
                    return rc;
            }
            if ((rc = st_json_skip(j, depth + 1)))
                return rc;
        } while (st_json_eat(j, ','));
        return st_json_expect(j, (unsigned char)close, c == '{' ? "to close an object"
                                                            : "to close an array");
    }
    static const char *const words[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(words[i]);
        if ((size_t)(j->end - j->p) >= n && memcmp(j->p, words[i], n) == 0) {
            j->p += n;
            return 0;
        }
    }
    int is_int;
    int64_t v;
    return number(j, &is_int, &v, NULL);
}
