/* test_pickle.c - the restricted pickle reader (src/source/pickle.c) on hand-built pickles:
 * the values it builds, and each refusal's exact code and message (forbidden globals, calls
 * of values, refused opcodes, truncation, bombs: deep nesting, huge memo indices, giant ints,
 * exponential sharing, cycles). Real torch.save / DCP files: tests/python/test_pickle_reader.py. */
#include "testutil.h"

#include "source/pickle.h"

#define CTX "ctx.pkl"

typedef struct {
    unsigned char b[1 << 16];
    size_t n;
} pb;

static void put(pb *p, const void *s, size_t n)
{
    assert_true(p->n + n <= sizeof p->b);
    memcpy(p->b + p->n, s, n);
    p->n += n;
}
static void op(pb *p, unsigned c) { p->b[p->n++] = (unsigned char)c; }
static void ustr(pb *p, const char *s) /* SHORT_BINUNICODE */
{
    op(p, 0x8c);
    op(p, (unsigned)strlen(s));
    put(p, s, strlen(s));
}
static void proto(pb *p, unsigned v)
{
    op(p, 0x80);
    op(p, v);
}

/* parses p, expecting STRATA_EFORMAT with msg in the message (and the context) */
static void refused(const pb *p, const char *msg)
{
    pk_doc d;
    int rc = pk_parse(&d, p->b, p->n, CTX);
    if (rc == 0) {
        pk_free(&d);
        fail_msg("a pickle that must be refused (%s) was accepted", msg);
    }
    assert_int_equal(rc, STRATA_EFORMAT);
    assert_msg_has(msg);
    assert_msg_has(CTX);
    assert_null(d.root);
    assert_null(d.arena.head);
}

static void test_values(void **state)
{
    (void)state;
    pb p = {.n = 0};
    proto(&p, 2);
    op(&p, '}');                      /* dict */
    op(&p, 'q'); op(&p, 0);           /* memo 0 */
    op(&p, '(');
    ustr(&p, "i");  op(&p, 'J'); put(&p, "\xfe\xff\xff\xff", 4);           /* -2 */
    ustr(&p, "big"); op(&p, 0x8a); op(&p, 9); put(&p, "\x01\0\0\0\0\0\0\0\x01", 9);
    ustr(&p, "fit"); op(&p, 0x8a); op(&p, 9); put(&p, "\xff\xff\xff\xff\xff\xff\xff\xff\xff", 9);
    ustr(&p, "f"); op(&p, 'G'); put(&p, "\x3f\xf8\0\0\0\0\0\0", 8);        /* 1.5 */
    ustr(&p, "t"); op(&p, 'N'); op(&p, 0x88); op(&p, 0x86);                /* (None, True) */
    ustr(&p, "b"); op(&p, 'c'); put(&p, "_codecs\nencode\n", 15);
    ustr(&p, "a\xc3\xbf"); ustr(&p, "latin1"); op(&p, 0x86); op(&p, 'R'); /* b"a\xff" */
    ustr(&p, "self"); op(&p, ']'); op(&p, 'h'); op(&p, 0); op(&p, 'a');    /* [the dict] */
    op(&p, 'u');
    op(&p, '.');
    /* "self" refers to the dict that holds it: a cycle, refused */
    refused(&p, "cycle");
    p.n -= 1 + 1 + 2 + 1 + 1 + 1 + 5; /* drop '.', 'u', 'a', h 0, ']', "self" */
    op(&p, 'u');
    op(&p, '.');
    pk_doc d;
    assert_ok(pk_parse(&d, p.b, p.n, CTX));
    assert_int_equal(d.proto, 2);
    const pk_val *r = d.root;
    assert_int_equal(r->kind, PK_DICT);
    assert_int_equal(r->n, 6);
    assert_int_equal(pk_dict_get(r, "i")->i, -2);
    const pk_val *big = pk_dict_get(r, "big");
    assert_int_equal(big->kind, PK_BIGINT);
    assert_int_equal(big->len, 9);
    int64_t v;
    assert_rc(pk_int64(big, &v), STRATA_EFORMAT);
    assert_msg_has("does not fit in 64 bits");
    assert_ok(pk_int64(pk_dict_get(r, "fit"), &v));
    assert_int_equal(v, -1);
    assert_true(pk_dict_get(r, "f")->f == 1.5);
    const pk_val *t = pk_dict_get(r, "t");
    assert_int_equal(t->kind, PK_TUPLE);
    assert_int_equal(t->n, 2);
    assert_int_equal(t->items[0]->kind, PK_NONE);
    assert_int_equal(t->items[1]->kind, PK_BOOL);
    assert_int_equal(t->items[1]->i, 1);
    const pk_val *b = pk_dict_get(r, "b");
    assert_int_equal(b->kind, PK_BYTES);
    assert_int_equal(b->len, 2);
    assert_memory_equal(b->s, "a\xff", 2);
    pk_free(&d);
}

/* A torch.save-shaped tensor: _rebuild_tensor_v2(pid(('storage', FloatStorage, '0', 'cpu',
 * 6)), 0, (2, 3), (3, 1), False, OrderedDict()) inside an OrderedDict with state */
static void test_tensor_shape(void **state)
{
    (void)state;
    pb p = {.n = 0};
    proto(&p, 2);
    op(&p, 'c'); put(&p, "collections\nOrderedDict\n", 24); op(&p, ')'); op(&p, 'R');
    op(&p, '(');
    ustr(&p, "w");
    op(&p, 'c'); put(&p, "torch._utils\n_rebuild_tensor_v2\n", 32);
    op(&p, '(');
    op(&p, '('); ustr(&p, "storage"); op(&p, 'c'); put(&p, "torch\nFloatStorage\n", 19);
    ustr(&p, "0"); ustr(&p, "cpu"); op(&p, 'K'); op(&p, 6); op(&p, 't'); op(&p, 'Q');
    op(&p, 'K'); op(&p, 0);
    op(&p, 'K'); op(&p, 2); op(&p, 'K'); op(&p, 3); op(&p, 0x86);
    op(&p, 'K'); op(&p, 3); op(&p, 'K'); op(&p, 1); op(&p, 0x86);
    op(&p, 0x89);
    op(&p, 'c'); put(&p, "collections\nOrderedDict\n", 24); op(&p, ')'); op(&p, 'R');
    op(&p, 't'); op(&p, 'R');
    op(&p, 'u');
    op(&p, '}'); ustr(&p, "_metadata"); op(&p, '}'); op(&p, 's'); op(&p, 'b');
    op(&p, '.');
    pk_doc d;
    assert_ok(pk_parse(&d, p.b, p.n, CTX));
    const pk_val *r = d.root;
    assert_int_equal(r->kind, PK_DICT);
    assert_true(r->ordered);
    assert_non_null(r->state);
    assert_non_null(pk_dict_get(r->state, "_metadata"));
    const pk_val *w = pk_dict_get(r, "w");
    assert_int_equal(w->kind, PK_CALL);
    assert_int_equal(w->g, PK_G_REBUILD_TENSOR_V2);
    assert_int_equal(w->args->n, 6);
    const pk_val *pid = w->args->items[0];
    assert_int_equal(pid->kind, PK_PID);
    assert_int_equal(pid->args->n, 5);
    assert_string_equal((const char *)pid->args->items[0]->s, "storage");
    assert_int_equal(pid->args->items[1]->kind, PK_GLOBAL);
    assert_int_equal(pid->args->items[1]->g, PK_G_STORAGE_F32);
    assert_int_equal(w->args->items[2]->items[1]->i, 3);
    pk_free(&d);
}

static void test_forbidden_globals(void **state)
{
    (void)state;
    pb p = {.n = 0};
    proto(&p, 2);
    op(&p, 'c'); put(&p, "posix\nsystem\n", 13);
    ustr(&p, "touch /tmp/x"); op(&p, 0x85); op(&p, 'R'); op(&p, '.');
    refused(&p, "global 'posix.system' is not allowed");
    p.n = 0;
    proto(&p, 4);
    ustr(&p, "builtins"); ustr(&p, "eval"); op(&p, 0x93);
    refused(&p, "global 'builtins.eval' is not allowed");
    /* a value on the list is never called */
    p.n = 0;
    proto(&p, 2);
    op(&p, 'c'); put(&p, "torch\nfloat32\n", 14); op(&p, ')'); op(&p, 'R'); op(&p, '.');
    refused(&p, "global 'torch.float32', which is allowed as a value but never called");
    /* NEWOBJ of something not a global */
    p.n = 0;
    proto(&p, 2);
    op(&p, ']'); op(&p, ')'); op(&p, 0x81); op(&p, '.');
    refused(&p, "NEWOBJ of a list");
    /* STACK_GLOBAL of non-strings */
    p.n = 0;
    proto(&p, 4);
    op(&p, 'N'); op(&p, 'N'); op(&p, 0x93); op(&p, '.');
    refused(&p, "STACK_GLOBAL of a None and a None");
}

static void test_refused_opcodes(void **state)
{
    (void)state;
    static const struct {
        unsigned op;
        const char *msg;
    } ops[] = {
        {0x82, "EXT"}, {0x83, "EXT"}, {0x84, "EXT"}, {'i', "INST"}, {'o', "OBJ"},
        {'I', "INT (protocol 0 text)"}, {'S', "STRING"}, {'P', "PERSID"}, {'g', "GET"},
        {'p', "PUT"}, {'d', "DICT"}, {'l', "LIST"}, {'T', "BINSTRING"}, {0x8f, "a set"},
        {0x91, "a set"}, {0x92, "NEWOBJ_EX"}, {0x97, "out-of-band"}, {0xff, "unknown opcode 0xff"},
    };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        pb p = {.n = 0};
        proto(&p, 2);
        op(&p, ops[i].op);
        put(&p, "\0\0\0\0\0\0\0\0.", 9);
        refused(&p, ops[i].msg);
    }
    pb p = {.n = 0};
    proto(&p, 1);
    refused(&p, "protocol 1");
    p.n = 0;
    proto(&p, 6);
    refused(&p, "protocol 6");
}

static void test_truncated_and_malformed(void **state)
{
    (void)state;
    pb p = {.n = 0};
    refused(&p, "ends before STOP");
    proto(&p, 2);
    op(&p, 'X'); put(&p, "\x10\0\0\0abc", 7); /* a str of 16 bytes, 3 there */
    refused(&p, "runs past the end");
    p.n = 0;
    proto(&p, 2);
    op(&p, ']'); op(&p, '.'); op(&p, 'N');
    refused(&p, "1 bytes after STOP");
    p.n = 0;
    proto(&p, 2);
    op(&p, 'N'); op(&p, 'N'); op(&p, '.');
    refused(&p, "STOP with 2 values");
    p.n = 0;
    proto(&p, 2);
    ustr(&p, "x"); p.b[p.n - 1] = 0xff; op(&p, '.');
    refused(&p, "not valid UTF-8");
    p.n = 0;
    proto(&p, 2);
    op(&p, 'e');
    refused(&p, "no MARK open");
    p.n = 0;
    proto(&p, 2);
    op(&p, 'R');
    refused(&p, "REDUCE needs 2 values");
    /* filling something that is not a list or dict would call code */
    p.n = 0;
    proto(&p, 2);
    op(&p, 'c'); put(&p, "torch\nSize\n", 11); op(&p, ')'); op(&p, 'R'); op(&p, 'N'); op(&p, 'a');
    refused(&p, "APPEND to a call");
    p.n = 0;
    proto(&p, 2);
    op(&p, ']'); op(&p, 'N'); op(&p, 's');
    refused(&p, "SETITEM with no container below its values");
    p.n = 0;
    proto(&p, 2);
    op(&p, ']'); op(&p, '}'); op(&p, 'b');
    refused(&p, "BUILD on a list");
    p.n = 0;
    proto(&p, 2);
    op(&p, 'c'); put(&p, "torch\nSize\n", 11); op(&p, ')'); op(&p, 'R');
    op(&p, '}'); op(&p, 'b'); op(&p, '}'); op(&p, 'b');
    refused(&p, "BUILD on an object twice");
}

static void test_bombs(void **state)
{
    (void)state;
    pb p = {.n = 0};
    /* marks */
    proto(&p, 2);
    for (int i = 0; i <= PK_MAX_DEPTH; i++)
        op(&p, '(');
    refused(&p, "more than 64 MARKs open");
    /* nesting without marks: 70 lists, each appended into the one below */
    p.n = 0;
    proto(&p, 2);
    for (int i = 0; i < 70; i++)
        op(&p, ']');
    for (int i = 0; i < 69; i++)
        op(&p, 'a');
    op(&p, '.');
    refused(&p, "nested deeper than 64");
    /* the same 64 deep is fine */
    p.n = 0;
    proto(&p, 2);
    for (int i = 0; i < PK_MAX_DEPTH; i++)
        op(&p, ']');
    for (int i = 0; i < PK_MAX_DEPTH - 1; i++)
        op(&p, 'a');
    op(&p, '.');
    pk_doc d;
    assert_ok(pk_parse(&d, p.b, p.n, CTX));
    pk_free(&d);
    /* memo */
    p.n = 0;
    proto(&p, 2);
    op(&p, 'N'); op(&p, 'r'); put(&p, "\xff\xff\xff\xff", 4);
    refused(&p, "memo index 4294967295");
    p.n = 0;
    proto(&p, 2);
    op(&p, 'j'); put(&p, "\x07\0\0\0", 4);
    refused(&p, "memo index 7 was never stored");
    /* giant int */
    p.n = 0;
    proto(&p, 2);
    op(&p, 0x8b); put(&p, "\xd0\x07\0\0", 4); /* 2000 bytes */
    for (int i = 0; i < 2000; i++)
        op(&p, 0x11);
    op(&p, '.');
    refused(&p, "an int of 2000 bytes");
    /* billion laughs: level i is [level i-1, level i-1], 40 levels */
    p.n = 0;
    proto(&p, 2);
    op(&p, 'N'); op(&p, 'q'); op(&p, 0);
    for (int i = 1; i <= 40; i++) {
        op(&p, '0'); /* pop the previous level (it stays in the memo) */
        op(&p, ']'); op(&p, '('); op(&p, 'h'); op(&p, (unsigned)i - 1); op(&p, 'h');
        op(&p, (unsigned)i - 1); op(&p, 'e'); op(&p, 'q'); op(&p, (unsigned)i);
    }
    op(&p, '.');
    refused(&p, "expands to more than");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_values),
        cmocka_unit_test(test_tensor_shape),
        cmocka_unit_test(test_forbidden_globals),
        cmocka_unit_test(test_refused_opcodes),
        cmocka_unit_test(test_truncated_and_malformed),
        cmocka_unit_test(test_bombs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
