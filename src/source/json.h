/* json.h - the strict, bounded JSON reader the formats share: a safetensors file's header and
 * a sharded set's index (safetensors.c), Megatron's metadata.json (megatron.c). A pull
 * reader over a buffer: the caller walks the structure it expects and skips (checking) what
 * it does not read. Pure; no I/O. Not thread-safe per reader.
 *
 * Strict: objects, arrays, strings (escapes, \u with surrogate pairs, valid UTF-8, no raw
 * control characters), numbers as JSON writes them, true / false / null; nesting at most
 * ST_JSON_MAX_DEPTH. Every refusal is STRATA_EFORMAT naming the input, what it is, the byte
 * and the problem. Memory: one scratch buffer of the input's size plus one (a decoded
 * string is never longer than its source); no count read from the input sizes anything. */
#ifndef STRATA_JSON_H
#define STRATA_JSON_H
#include <stddef.h>
#include <stdint.h>

#define ST_JSON_MAX_DEPTH 64 /* nesting of arrays and objects */

typedef struct st_json {
    const unsigned char *s, *p, *end; /* the text, the cursor */
    const char *file;                 /* names the input in messages */
    const char *kind;                 /* what it is, in messages: "safetensors header" */
    char *str;  /* the last string read, decoded, NUL-terminated (it may hold NULs) */
    size_t slen;
    const unsigned char *raw; /* that string as written, between its quotes */
    size_t rawlen;
} st_json;

/* A reader of the n bytes at b. STRATA_ENOMEM (naming file) when its scratch cannot be
 * allocated. Free with st_json_free (harmless on a failed init). */
int st_json_init(st_json *j, const unsigned char *b, size_t n, const char *file,
                 const char *kind);
void st_json_free(st_json *j);

/* STRATA_EFORMAT: "<file>: bad <kind> at byte <at> of its JSON: <message>". */
__attribute__((format(printf, 2, 3))) int st_json_fail(st_json *j, const char *fmt, ...);
/* A printable excerpt of a decoded string for messages (control characters as '?', at most
 * 64 bytes then "..."). */
const char *st_json_show(const char *s, size_t n, char out[72]);

/* Skips white space. */
void st_json_ws(st_json *j);
/* After white space: is the next byte c? (consumed if so) */
int st_json_eat(st_json *j, unsigned char c);
/* The next byte must be c; where says what it is for ("after a key"). */
int st_json_expect(st_json *j, unsigned char c, const char *where);
/* A string into j->str, j->slen (and j->raw, j->rawlen); what names it in a refusal. */
int st_json_string(st_json *j, const char *what);
/* Does the string just read equal lit? */
int st_json_is(const st_json *j, const char *lit);
/* A non-negative integer below 2^64 (no sign, fraction, exponent or leading zero). */
int st_json_uint(st_json *j, uint64_t *v, const char *what);
/* Any number: *is_int set when it is an integer (no fraction, no exponent) that fits int64,
 * and then *v holds it. */
int st_json_number(st_json *j, int *is_int, int64_t *v, const char *what);
/* Skips one value of any kind, checking it; depth: the value's (the top level's is 1). */
int st_json_skip(st_json *j, int depth);

#endif
