/* pickle.c - the restricted pickle reader (pickle.h): a bounded stack machine with a memo
 * that builds plain values and never calls anything. */
#include "pickle.h"

#include <stdarg.h>

#include "../core/error.h"
#include "../core/utf8.h"

static const struct {
    const char *mod, *name;
    int flags;
} pk_table[] = {
#define PK_X_(id, mod, name, flags) {mod, name, flags},
    PK_GLOBALS(PK_X_)
#undef PK_X_
};

const char *pk_global_module(pk_global g) { return g < PK_G_COUNT ? pk_table[g].mod : "?"; }
const char *pk_global_name(pk_global g) { return g < PK_G_COUNT ? pk_table[g].name : "?"; }

int pk_global_find(const char *module, size_t mlen, const char *name, size_t nlen)
{
    for (int g = 0; g < PK_G_COUNT; g++)
        if (strlen(pk_table[g].mod) == mlen && memcmp(pk_table[g].mod, module, mlen) == 0 &&
            strlen(pk_table[g].name) == nlen && memcmp(pk_table[g].name, name, nlen) == 0)
            return g;
    return -1;
}

/* ---- the machine ---- */

typedef struct {
    pk_doc *doc;
    const unsigned char *b, *p, *end;
    const char *ctx;
    size_t op_at;     /* the offset of the opcode being run */
    pk_val **stack;
    size_t sp, scap;
    size_t marks[PK_MAX_DEPTH];
    int nmarks;
    pk_val **memo;
    size_t memo_cap, memo_count;
} pk_m;

__attribute__((format(printf, 2, 3))) static int pk_fail(pk_m *m, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return st_fail(STRATA_EFORMAT, "%s: pickle byte %zu: %s", m->ctx, m->op_at, msg);
}

static int pk_nomem(pk_m *m) { return st_fail(STRATA_ENOMEM, "%s: out of memory", m->ctx); }

static const char *kind_name(pk_kind k)
{
    static const char *const n[] = {"None", "bool", "int", "int", "float", "str", "bytes",
                                    "tuple", "list", "dict", "global", "call", "persistent id"};
    return k <= PK_PID ? n[k] : "?";
}

static pk_val *node(pk_m *m, pk_kind k)
{
    if (m->doc->nodes >= PK_MAX_NODES)
        return NULL;
    pk_val *v = st_arena_alloc(&m->doc->arena, sizeof *v);
    if (v) {
        memset(v, 0, sizeof *v);
        v->kind = k;
        m->doc->nodes++;
    }
    return v;
}

/* node() failing: the count limit or memory */
static int node_fail(pk_m *m)
{
    if (m->doc->nodes >= PK_MAX_NODES)
        return pk_fail(m, "more than %u values built", PK_MAX_NODES);
    return pk_nomem(m);
}

static int push(pk_m *m, pk_val *v)
{
    if (!v)
        return node_fail(m);
    if (m->sp >= PK_MAX_STACK)
        return pk_fail(m, "more than %u values on the stack", PK_MAX_STACK);
    if (st_grow(&m->stack, &m->scap, m->sp + 1, sizeof *m->stack))
        return pk_nomem(m);
    m->stack[m->sp++] = v;
    return 0;
}

/* The index of the first value above the innermost mark (which is removed). */
static int pop_mark(pk_m *m, size_t *base)
{
    if (m->nmarks == 0)
        return pk_fail(m, "no MARK open");
    *base = m->marks[--m->nmarks];
    return 0;
}

/* Values on the stack above the innermost mark: at least need of them. */
static int top(pk_m *m, size_t need, const char *op)
{
    size_t floor = m->nmarks ? m->marks[m->nmarks - 1] : 0;
    if (m->sp - floor < need)
        return pk_fail(m, "%s needs %zu values on the stack, there are %zu", op, need,
                       m->sp - floor);
    return 0;
}

static int add_item(pk_m *m, pk_val *c, pk_val *x)
{
    size_t need = c->n + 1;
    if (need > c->cap) {
        size_t nc = c->cap ? 2 * c->cap : 4;
        pk_val **ni = st_arena_alloc(&m->doc->arena, nc * sizeof *ni);
        if (!ni)
            return pk_nomem(m);
        if (c->n)
            memcpy(ni, c->items, c->n * sizeof *ni);
        c->items = ni;
        c->cap = nc;
    }
    c->items[c->n++] = x;
    return 0;
}

static int need_bytes(pk_m *m, uint64_t n, const char *what)
{
    if (n > (uint64_t)(m->end - m->p))
        return pk_fail(m, "%s of %llu bytes runs past the end (%zu bytes left)", what,
                       (unsigned long long)n, (size_t)(m->end - m->p));
    return 0;
}

static uint64_t rd_le(pk_m *m, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)m->p[i] << (8 * i);
    m->p += n;
    return v;
}

/* A length field of lb bytes, then that many bytes: *s and *n. */
static int counted(pk_m *m, int lb, const unsigned char **s, uint64_t *n, const char *what)
{
    int rc = need_bytes(m, (uint64_t)lb, what);
    if (rc)
        return rc;
    *n = rd_le(m, lb);
    if ((rc = need_bytes(m, *n, what)) != 0)
        return rc;
    *s = m->p;
    m->p += *n;
    return 0;
}

static pk_val *mk_str(pk_m *m, pk_kind k, const unsigned char *s, size_t n)
{
    pk_val *v = node(m, k);
    if (!v)
        return NULL;
    unsigned char *c = st_arena_alloc(&m->doc->arena, n + 1);
    if (!c)
        return NULL;
    if (n)
        memcpy(c, s, n);
    c[n] = 0;
    v->s = c;
    v->len = n;
    return v;
}

static int op_str(pk_m *m, int lb)
{
    const unsigned char *s;
    uint64_t n;
    int rc = counted(m, lb, &s, &n, "a str");
    if (rc)
        return rc;
    size_t bad = st_utf8_invalid_at((const char *)s, (size_t)n);
    if (bad != n)
        return pk_fail(m, "a str that is not valid UTF-8 (at its byte %zu)", bad);
    return push(m, mk_str(m, PK_STR, s, (size_t)n));
}

static int op_bytes(pk_m *m, int lb)
{
    const unsigned char *s;
    uint64_t n;
    int rc = counted(m, lb, &s, &n, "a bytes");
    return rc ? rc : push(m, mk_str(m, PK_BYTES, s, (size_t)n));
}

/* LONG1 / LONG4: little-endian two's complement of any length up to PK_MAX_INT_BYTES. */
static int op_long(pk_m *m, int lb)
{
    const unsigned char *s;
    int rc = need_bytes(m, (uint64_t)lb, "an int");
    if (rc)
        return rc;
    uint64_t n = rd_le(m, lb);
    if (lb == 4 && (n >> 31))
        return pk_fail(m, "LONG4 with a negative length");
    if (n > PK_MAX_INT_BYTES)
        return pk_fail(m, "an int of %llu bytes (the limit is %d)", (unsigned long long)n,
                       PK_MAX_INT_BYTES);
    if ((rc = need_bytes(m, n, "an int")) != 0)
        return rc;
    s = m->p;
    m->p += n;
    if (n <= 8) {
        pk_val *v = node(m, PK_INT);
        if (!v)
            return node_fail(m);
        uint64_t u = 0;
        for (uint64_t i = 0; i < n; i++)
            u |= (uint64_t)s[i] << (8 * i);
        if (n && n < 8 && (s[n - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * n);
        v->i = (int64_t)u;
        return push(m, v);
    }
    return push(m, mk_str(m, PK_BIGINT, s, (size_t)n));
}

static int op_global(pk_m *m, const char *mod, size_t ml, const char *name, size_t nl)
{
    int g = pk_global_find(mod, ml, name, nl);
    if (g < 0)
        return pk_fail(m, "global '%.*s.%.*s' is not allowed (the pickle is never executed; "
                       "only the globals of docs/FORMAT.md are read)",
                       (int)ST_MIN(ml, 200), mod, (int)ST_MIN(nl, 200), name);
    pk_val *v = node(m, PK_GLOBAL);
    if (!v)
        return node_fail(m);
    v->g = (pk_global)g;
    return push(m, v);
}

/* GLOBAL: "module\nname\n" */
static int op_text_global(pk_m *m)
{
    const unsigned char *nl1 = memchr(m->p, '\n', (size_t)(m->end - m->p));
    const unsigned char *nl2 = nl1 ? memchr(nl1 + 1, '\n', (size_t)(m->end - nl1 - 1)) : NULL;
    if (!nl2)
        return pk_fail(m, "GLOBAL without its two lines");
    const char *mod = (const char *)m->p, *name = (const char *)nl1 + 1;
    size_t ml = (size_t)(nl1 - m->p), nlen = (size_t)(nl2 - nl1 - 1);
    m->p = nl2 + 1;
    return op_global(m, mod, ml, name, nlen);
}

static int op_stack_global(pk_m *m)
{
    int rc = top(m, 2, "STACK_GLOBAL");
    if (rc)
        return rc;
    pk_val *mod = m->stack[m->sp - 2], *name = m->stack[m->sp - 1];
    if (mod->kind != PK_STR || name->kind != PK_STR)
        return pk_fail(m, "STACK_GLOBAL of a %s and a %s, not two str", kind_name(mod->kind),
                       kind_name(name->kind));
    m->sp -= 2;
    return op_global(m, (const char *)mod->s, mod->len, (const char *)name->s, name->len);
}

/* _codecs.encode(s, "latin1"): protocol 2's bytes */
static int fold_encode(pk_m *m, pk_val *args, pk_val **out)
{
    if (args->n != 2 || args->items[0]->kind != PK_STR || args->items[1]->kind != PK_STR ||
        (strcmp((const char *)args->items[1]->s, "latin1") != 0 &&
         strcmp((const char *)args->items[1]->s, "latin-1") != 0))
        return pk_fail(m, "_codecs.encode called other than as (str, 'latin1')");
    const pk_val *s = args->items[0];
    unsigned char *b = st_arena_alloc(&m->doc->arena, s->len + 1);
    pk_val *v = node(m, PK_BYTES);
    if (!b || !v)
        return node_fail(m);
    size_t k = 0;
    for (size_t i = 0; i < s->len;) {
        unsigned c = s->s[i];
        if (c < 0x80) {
            b[k++] = (unsigned char)c;
            i++;
        } else if ((c == 0xC2 || c == 0xC3) && i + 1 < s->len) {
            b[k++] = (unsigned char)(((c & 3) << 6) | (s->s[i + 1] & 0x3f));
            i += 2;
        } else {
            return pk_fail(m, "_codecs.encode of a character past U+00FF as latin1");
        }
    }
    b[k] = 0;
    v->s = b;
    v->len = k;
    *out = v;
    return 0;
}

/* REDUCE (newobj 0) and NEWOBJ (1): f called with args, as a tagged node. */
static int op_call(pk_m *m, pk_val *f, pk_val *args, int newobj)
{
    const char *op = newobj ? "NEWOBJ" : "REDUCE";
    if (f->kind != PK_GLOBAL)
        return pk_fail(m, "%s of a %s, not an allowed global", op, kind_name(f->kind));
    if (!(pk_table[f->g].flags & PK_G_CALL))
        return pk_fail(m, "%s of global '%s.%s', which is allowed as a value but never called",
                       op, pk_table[f->g].mod, pk_table[f->g].name);
    if (args->kind != PK_TUPLE)
        return pk_fail(m, "%s of '%s.%s' with a %s of arguments, not a tuple", op,
                       pk_table[f->g].mod, pk_table[f->g].name, kind_name(args->kind));
    pk_val *v = NULL;
    if (f->g == PK_G_ORDERED_DICT) {
        if (args->n != 0)
            return pk_fail(m, "collections.OrderedDict called with arguments");
        if (!(v = node(m, PK_DICT)))
            return node_fail(m);
        v->ordered = 1;
    } else if (f->g == PK_G_CODECS_ENCODE) {
        int rc = fold_encode(m, args, &v);
        if (rc)
            return rc;
    } else {
        if (!(v = node(m, PK_CALL)))
            return node_fail(m);
        v->g = f->g;
        v->args = args;
        v->newobj = (uint8_t)newobj;
    }
    return push(m, v);
}

static int memo_put(pk_m *m, uint64_t idx)
{
    if (idx >= PK_MAX_MEMO)
        return pk_fail(m, "memo index %llu (the limit is %u)", (unsigned long long)idx,
                       PK_MAX_MEMO);
    int rc = top(m, 1, "PUT");
    if (rc)
        return rc;
    if (idx >= m->memo_cap) {
        size_t old = m->memo_cap;
        if (st_grow(&m->memo, &m->memo_cap, (size_t)idx + 1, sizeof *m->memo))
            return pk_nomem(m);
        memset(m->memo + old, 0, (m->memo_cap - old) * sizeof *m->memo);
    }
    if (!m->memo[idx])
        m->memo_count++;
    m->memo[idx] = m->stack[m->sp - 1];
    return 0;
}

static int memo_get(pk_m *m, uint64_t idx)
{
    if (idx >= m->memo_cap || !m->memo[idx])
        return pk_fail(m, "memo index %llu was never stored", (unsigned long long)idx);
    return push(m, m->memo[idx]);
}

/* TUPLE, TUPLE1-3, EMPTY_TUPLE: the top k values (k < 0: down to the mark) as a tuple */
static int op_tuple(pk_m *m, int k)
{
    size_t base = 0;
    int rc;
    if (k < 0) {
        if ((rc = pop_mark(m, &base)) != 0)
            return rc;
    } else {
        if ((rc = top(m, (size_t)k, "TUPLE")) != 0)
            return rc;
        base = m->sp - (size_t)k;
    }
    pk_val *t = node(m, PK_TUPLE);
    if (!t)
        return node_fail(m);
    for (size_t i = base; i < m->sp; i++)
        if ((rc = add_item(m, t, m->stack[i])) != 0)
            return rc;
    m->sp = base;
    return push(m, t);
}

/* APPEND(S) (dict 0) and SETITEM(S) (dict 1); k < 0: down to the mark */
static int op_fill(pk_m *m, int dict, int k)
{
    size_t base = 0;
    int rc;
    const char *op = k < 0 ? (dict ? "SETITEMS" : "APPENDS") : (dict ? "SETITEM" : "APPEND");
    if (k < 0) {
        if ((rc = pop_mark(m, &base)) != 0)
            return rc;
    } else {
        if ((rc = top(m, (size_t)k, op)) != 0)
            return rc;
        base = m->sp - (size_t)k;
    }
    size_t floor = m->nmarks ? m->marks[m->nmarks - 1] : 0;
    if (base <= floor)
        return pk_fail(m, "%s with no container below its values", op);
    pk_val *c = m->stack[base - 1];
    if (c->kind != (dict ? PK_DICT : PK_LIST))
        return pk_fail(m, "%s to a %s (only %s are filled; anything else would call code)", op,
                       kind_name(c->kind), dict ? "dicts" : "lists");
    if (dict && (m->sp - base) % 2)
        return pk_fail(m, "SETITEMS with an odd number of values");
    if (dict)
        c->n *= 2; /* items while filling; n counts pairs */
    for (size_t i = base; i < m->sp && !rc; i++)
        rc = add_item(m, c, m->stack[i]);
    if (dict)
        c->n /= 2;
    m->sp = base;
    if (rc)
        return rc;
    return 0;
}

static int op_build(pk_m *m)
{
    int rc = top(m, 2, "BUILD");
    if (rc)
        return rc;
    pk_val *state = m->stack[--m->sp], *obj = m->stack[m->sp - 1];
    if (obj->kind != PK_CALL && !(obj->kind == PK_DICT && obj->ordered))
        return pk_fail(m, "BUILD on a %s (only on an object of an allowed class)",
                       kind_name(obj->kind));
    if (obj->state)
        return pk_fail(m, "BUILD on an object twice");
    obj->state = state;
    return 0;
}

static const char *refused_op(unsigned op)
{
    switch (op) {
    case 'F': return "FLOAT (protocol 0 text)";
    case 'I': return "INT (protocol 0 text)";
    case 'L': return "LONG (protocol 0 text)";
    case 'S': return "STRING (protocol 0 text)";
    case 'V': return "UNICODE (protocol 0 text)";
    case 'T': return "BINSTRING (a Python 2 str)";
    case 'U': return "SHORT_BINSTRING (a Python 2 str)";
    case 'P': return "PERSID (protocol 0 text)";
    case 'g': return "GET (protocol 0 text)";
    case 'p': return "PUT (protocol 0 text)";
    case 'd': return "DICT (protocol 0)";
    case 'l': return "LIST (protocol 0)";
    case 'i': return "INST (would call a class)";
    case 'o': return "OBJ (would call a class)";
    case 0x82: case 0x83: case 0x84: return "EXT (the extension registry)";
    case 0x8f: case 0x90: case 0x91: return "a set (not a value strata reads)";
    case 0x92: return "NEWOBJ_EX (keyword arguments)";
    case 0x97: case 0x98: return "an out-of-band buffer";
    default: return NULL;
    }
}

/* PROTO: the protocol, 2 to 5. */
static int op_proto(pk_m *m)
{
    int rc = need_bytes(m, 1, "PROTO");
    if (rc)
        return rc;
    m->doc->proto = *m->p++;
    if (m->doc->proto < 2 || m->doc->proto > 5)
        return pk_fail(m, "protocol %d (protocols 2 to 5 are read)", m->doc->proto);
    return 0;
}

/* BININT (J, signed 4 bytes), BININT1 (K) and BININT2 (M) (unsigned 1 and 2). */
static int op_int(pk_m *m, unsigned op)
{
    int n = op == 'J' ? 4 : op == 'K' ? 1 : 2, rc = need_bytes(m, (uint64_t)n, "an int");
    if (rc)
        return rc;
    uint64_t u = rd_le(m, n);
    pk_val *v = node(m, PK_INT);
    if (v)
        v->i = op == 'J' ? (int64_t)(int32_t)(uint32_t)u : (int64_t)u;
    return push(m, v);
}

/* BINFLOAT: 8 bytes, big-endian. */
static int op_float(pk_m *m)
{
    int rc = need_bytes(m, 8, "a float");
    if (rc)
        return rc;
    uint64_t u = 0;
    for (int i = 0; i < 8; i++)
        u = u << 8 | m->p[i];
    m->p += 8;
    pk_val *v = node(m, PK_FLOAT);
    if (v)
        memcpy(&v->f, &u, sizeof v->f);
    return push(m, v);
}

/* One opcode at m->p; *stop set by STOP. */
static int step(pk_m *m, int *stop)
{
    m->op_at = (size_t)(m->p - m->b);
    unsigned op = *m->p++;
    int rc;
    pk_val *v = NULL;
    switch (op) {
    case 0x80: return op_proto(m);
    case 0x95: /* FRAME: a length only; the frame's opcodes follow inline */
        if ((rc = need_bytes(m, 8, "FRAME")) != 0)
            return rc;
        return need_bytes(m, rd_le(m, 8), "a frame");
    case '.':
        if (m->nmarks || m->sp != 1)
            return pk_fail(m, "STOP with %zu values on the stack and %d marks open (want one "
                           "value, no mark)", m->sp, m->nmarks);
        *stop = 1;
        return 0;
    case '(':
        if (m->nmarks >= PK_MAX_DEPTH)
            return pk_fail(m, "more than %d MARKs open", PK_MAX_DEPTH);
        m->marks[m->nmarks++] = m->sp;
        return 0;
    case '0':
        if ((rc = top(m, 1, "POP")) != 0)
            return rc;
        m->sp--;
        return 0;
    case '1': {
        size_t base = 0;
        if ((rc = pop_mark(m, &base)) != 0)
            return rc;
        m->sp = base;
        return 0;
    }
    case '2':
        if ((rc = top(m, 1, "DUP")) != 0)
            return rc;
        return push(m, m->stack[m->sp - 1]);
    case 'N':
        return push(m, node(m, PK_NONE));
    case 0x88: case 0x89:
        if ((v = node(m, PK_BOOL)) != NULL)
            v->i = op == 0x88;
        return push(m, v);
    case 'J': case 'K': case 'M': return op_int(m, op);
    case 0x8a: return op_long(m, 1);
    case 0x8b: return op_long(m, 4);
    case 'G': return op_float(m);
    case 'X': return op_str(m, 4);
    case 0x8c: return op_str(m, 1);
    case 0x8d: return op_str(m, 8);
    case 'B': return op_bytes(m, 4);
    case 'C': return op_bytes(m, 1);
    case 0x8e: case 0x96: return op_bytes(m, 8);
    case ')': return op_tuple(m, 0);
    case 0x85: return op_tuple(m, 1);
    case 0x86: return op_tuple(m, 2);
    case 0x87: return op_tuple(m, 3);
    case 't': return op_tuple(m, -1);
    case ']': return push(m, node(m, PK_LIST));
    case '}': return push(m, node(m, PK_DICT));
    case 'a': return op_fill(m, 0, 1);
    case 'e': return op_fill(m, 0, -1);
    case 's': return op_fill(m, 1, 2);
    case 'u': return op_fill(m, 1, -1);
    case 'q': case 'r':
        if ((rc = need_bytes(m, op == 'q' ? 1 : 4, "PUT")) != 0)
            return rc;
        return memo_put(m, rd_le(m, op == 'q' ? 1 : 4));
    case 0x94: return memo_put(m, m->memo_count);
    case 'h': case 'j':
        if ((rc = need_bytes(m, op == 'h' ? 1 : 4, "GET")) != 0)
            return rc;
        return memo_get(m, rd_le(m, op == 'h' ? 1 : 4));
    case 'c': return op_text_global(m);
    case 0x93: return op_stack_global(m);
    case 'R': case 0x81:
        if ((rc = top(m, 2, op == 'R' ? "REDUCE" : "NEWOBJ")) != 0)
            return rc;
        m->sp -= 2;
        return op_call(m, m->stack[m->sp], m->stack[m->sp + 1], op == 0x81);
    case 'b': return op_build(m);
    case 'Q':
        if ((rc = top(m, 1, "BINPERSID")) != 0)
            return rc;
        if ((v = node(m, PK_PID)) == NULL)
            return node_fail(m);
        v->args = m->stack[m->sp - 1];
        m->stack[m->sp - 1] = v;
        return 0;
    default: {
        const char *what = refused_op(op);
        if (what)
            return pk_fail(m, "opcode %s is not read", what);
        return pk_fail(m, "unknown opcode 0x%02x", op);
    }
    }
}

/* ---- the finished graph: no cycles, depth and expanded size bounded ---- */

static size_t nchild(const pk_val *v)
{
    switch (v->kind) {
    case PK_TUPLE: case PK_LIST: return v->n;
    case PK_DICT: return 2 * v->n + (v->state != NULL);
    case PK_CALL: return 1 + (v->state != NULL);
    case PK_PID: return 1;
    default: return 0;
    }
}

static pk_val *child(const pk_val *v, size_t k)
{
    switch (v->kind) {
    case PK_TUPLE: case PK_LIST: return v->items[k];
    case PK_DICT: return k < 2 * v->n ? v->items[k] : v->state;
    case PK_CALL: return k == 0 ? v->args : v->state;
    default: return v->args;
    }
}

#define PK_GRAY UINT32_MAX

static int check_graph(pk_m *m, pk_val *root)
{
    struct {
        pk_val *v;
        size_t k;
    } path[PK_MAX_DEPTH + 1];
    int d = 0;
    path[0].v = root;
    path[0].k = 0;
    root->depth = PK_GRAY;
    root->exp = 1;
    while (d >= 0) {
        pk_val *v = path[d].v;
        if (path[d].k < nchild(v)) {
            pk_val *c = child(v, path[d].k++);
            if (c->depth == PK_GRAY)
                return pk_fail(m, "the result refers to itself (a cycle)");
            if (c->depth == 0) {
                if (d + 1 > PK_MAX_DEPTH)
                    return pk_fail(m, "the result is nested deeper than %d", PK_MAX_DEPTH);
                d++;
                path[d].v = c;
                path[d].k = 0;
                c->depth = PK_GRAY;
                c->exp = 1;
                continue;
            }
            v->exp += c->exp;
            if (v->exp > PK_MAX_EXPANDED)
                return pk_fail(m, "the result expands to more than %llu values (a pickle "
                               "bomb?)", PK_MAX_EXPANDED);
            continue;
        }
        uint32_t dep = 1;
        for (size_t k = 0; k < nchild(v); k++)
            dep = ST_MAX(dep, child(v, k)->depth + 1);
        v->depth = dep;
        if (d > 0) {
            pk_val *p = path[d - 1].v;
            p->exp += v->exp;
            if (p->exp > PK_MAX_EXPANDED)
                return pk_fail(m, "the result expands to more than %llu values (a pickle "
                               "bomb?)", PK_MAX_EXPANDED);
        }
        d--;
    }
    if (root->depth > PK_MAX_DEPTH)
        return pk_fail(m, "the result is nested deeper than %d", PK_MAX_DEPTH);
    return 0;
}

int pk_parse(pk_doc *doc, const unsigned char *b, size_t n, const char *ctx)
{
    memset(doc, 0, sizeof *doc);
    doc->proto = 2;
    pk_m m = {.doc = doc, .b = b, .p = b, .end = b + n, .ctx = ctx ? ctx : "pickle"};
    int rc = 0, stop = 0;
    if (n > PK_MAX_INPUT)
        rc = pk_fail(&m, "%zu bytes of pickle (the limit is %llu)", n, PK_MAX_INPUT);
    while (!rc && !stop) {
        if (m.p >= m.end) {
            m.op_at = n;
            rc = pk_fail(&m, "the pickle ends before STOP");
            break;
        }
        rc = step(&m, &stop);
    }
    if (!rc && m.p != m.end) {
        m.op_at = (size_t)(m.p - b);
        rc = pk_fail(&m, "%zu bytes after STOP", (size_t)(m.end - m.p));
    }
    if (!rc) {
        m.op_at = n;
        doc->root = m.stack[0];
        rc = check_graph(&m, doc->root);
    }
    free(m.stack);
    free(m.memo);
    if (rc)
        pk_free(doc);
    return rc;
}

void pk_free(pk_doc *doc)
{
    st_arena_free(&doc->arena);
    memset(doc, 0, sizeof *doc);
}

int pk_int64(const pk_val *v, int64_t *out)
{
    if (v->kind == PK_INT || v->kind == PK_BOOL) {
        *out = v->i;
        return 0;
    }
    if (v->kind != PK_BIGINT)
        return st_fail(STRATA_EFORMAT, "a %s where an int was expected", kind_name(v->kind));
    /* fits if every byte past the 8th is the sign extension of byte 7 */
    unsigned char sign = (v->s[7] & 0x80) ? 0xff : 0;
    for (size_t i = 8; i < v->len; i++)
        if (v->s[i] != sign)
            return st_fail(STRATA_EFORMAT, "an int of %zu bytes does not fit in 64 bits", v->len);
    uint64_t u = 0;
    for (int i = 0; i < 8; i++)
        u |= (uint64_t)v->s[i] << (8 * i);
    *out = (int64_t)u;
    return 0;
}

const pk_val *pk_dict_get(const pk_val *d, const char *key)
{
    if (d->kind != PK_DICT)
        return NULL;
    size_t kl = strlen(key);
    for (size_t i = d->n; i-- > 0;) {
        const pk_val *k = d->items[2 * i];
        if (k->kind == PK_STR && k->len == kl && memcmp(k->s, key, kl) == 0)
            return d->items[2 * i + 1];
    }
    return NULL;
}

int pk_torch_dtype(pk_global g, strata_dtype *dt)
{
    static const struct {
        pk_global g;
        int dt; /* -1: a dtype strata does not hold */
    } map[] = {
        {PK_G_DTYPE_F64, STRATA_F64},      {PK_G_DTYPE_F32, STRATA_F32},
        {PK_G_DTYPE_F16, STRATA_F16},      {PK_G_DTYPE_BF16, STRATA_BF16},
        {PK_G_DTYPE_F8E4M3, STRATA_FP8_E4M3}, {PK_G_DTYPE_F8E5M2, STRATA_FP8_E5M2},
        {PK_G_DTYPE_I64, STRATA_I64},      {PK_G_DTYPE_I32, STRATA_I32},
        {PK_G_DTYPE_I16, STRATA_I16},      {PK_G_DTYPE_I8, STRATA_I8},
        {PK_G_DTYPE_U8, STRATA_U8},        {PK_G_DTYPE_BOOL, STRATA_BOOL},
        {PK_G_DTYPE_C64, -1},              {PK_G_DTYPE_C128, -1},
        {PK_G_STORAGE_F64, STRATA_F64},    {PK_G_STORAGE_F32, STRATA_F32},
        {PK_G_STORAGE_F16, STRATA_F16},    {PK_G_STORAGE_BF16, STRATA_BF16},
        {PK_G_STORAGE_F8E4M3, STRATA_FP8_E4M3}, {PK_G_STORAGE_F8E5M2, STRATA_FP8_E5M2},
        {PK_G_STORAGE_I64, STRATA_I64},    {PK_G_STORAGE_I32, STRATA_I32},
        {PK_G_STORAGE_I16, STRATA_I16},    {PK_G_STORAGE_I8, STRATA_I8},
        {PK_G_STORAGE_U8, STRATA_U8},      {PK_G_STORAGE_BOOL, STRATA_BOOL},
        {PK_G_STORAGE_C64, -1},            {PK_G_STORAGE_C128, -1},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (map[i].g == g) {
            if (map[i].dt < 0)
                return 2;
            *dt = (strata_dtype)map[i].dt;
            return 0;
        }
    return 1;
}

int pk_is_storage(pk_global g)
{
    strata_dtype dt;
    if (g == PK_G_STORAGE_UNTYPED)
        return 1;
    /* a storage type maps to a dtype as its dtype global does; told apart by name */
    return pk_torch_dtype(g, &dt) != 1 && strstr(pk_global_name(g), "Storage") != NULL;
}
