/* utf8.h - UTF-8 validation. Tensor and blob names are UTF-8: registration refuses
 * anything else (docs/FORMAT.md). Header-only. */
#ifndef STRATA_UTF8_H
#define STRATA_UTF8_H
#include <stddef.h>

/* The UTF-8 sequence at s (left > 0 bytes available): returns its length with *ok = 1 if
 * it is one valid character (shortest form, not a surrogate, at most U+10FFFF); else
 * *ok = 0 and the length of the maximal prefix of a valid sequence there (at least 1),
 * which Unicode recommends replacing by one U+FFFD. */
static inline size_t st_utf8_seq(const unsigned char *s, size_t left, int *ok)
{
    unsigned c = s[0], lo = 0x80, hi = 0xBF;
    size_t need;
    *ok = 0;
    if (c < 0x80) {
        *ok = 1;
        return 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 2;
        if (c == 0xE0)
            lo = 0xA0; /* no overlong forms */
        else if (c == 0xED)
            hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 3;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F; /* nothing above U+10FFFF */
    } else {
        return 1; /* a continuation byte alone, C0, C1, F5..FF */
    }
    for (size_t i = 1; i <= need; i++) {
        if (i >= left || s[i] < lo || s[i] > hi)
            return i;
        lo = 0x80;
        hi = 0xBF;
    }
    *ok = 1;
    return need + 1;
}

/* The offset of the first byte of s[0..n) that does not start a valid UTF-8 character,
 * or n if all of it is valid UTF-8. */
static inline size_t st_utf8_invalid_at(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        int ok;
        size_t k = st_utf8_seq(p + i, n - i, &ok);
        if (!ok)
            return i;
        i += k;
    }
    return n;
}

#endif
