/* _strata_pickle.c - restricted pickles as Python values, never executing pickle: unpickle
 * (a bare pickle: a torch.save archive's data.pkl) and unpickle_archive (a whole torch.save
 * archive in memory, e.g. a DCP non-tensor item). Both parse with strata's restricted reader
 * (src/source/pickle.h) and build only: None, bool, int (any size), float, str, bytes, tuple,
 * list, dict, collections.OrderedDict; torch.Size becomes a tuple, an io.BytesIO (DCP
 * saves one as torch.save of it) an io.BytesIO at its position. A tensor (a
 * _rebuild_tensor_v2/_v3 or _rebuild_parameter call) becomes whatever the caller's
 * tensor(name, dtype, shape, data) returns: name its keys joined with "." (strata's tensor
 * name), dtype strata's name ("f32"), shape a tuple, data the tensor's bytes (unpickle_archive)
 * or None (unpickle: the bytes are the load's). A global used as a value (a torch dtype) is
 * glob(module, name) if given. Anything else (another call, a persistent id used as a value,
 * a dict with two equal keys) is FormatError. The argument's structure is shared as the
 * pickle shares it (a list or dict referenced twice is one object). Uses libstrata's internal
 * headers (setup.py compiles src/ into the extension): the pickle reader has no public API. */
#include "_strata.h"

#include "core/error.h"
#include "source/torchsave.h"

typedef struct {
    PyObject *tensor, *glob; /* callables or NULL */
    PyObject *memo;          /* dict: id of a list / dict node -> its object */
    const st_ts_archive *a;  /* unpickle_archive: the tensors' bytes */
    const unsigned char *data;
    char name[STRATA_MAX_NAME + 2];
} conv;

static PyObject *value(conv *c, const pk_val *v, size_t len);

static PyObject *tensor(conv *c, const pk_val *call, size_t len)
{
    c->name[len] = 0;
    PyObject *data = Py_None, *shape = NULL, *r = NULL;
    Py_INCREF(Py_None);
    const st_ts_tensor *t = c->a ? st_ts_find(&c->a->doc, c->name) : NULL;
    if (c->a && !t) /* the archive's rules refused it already; kept for safety */
        return Py_DECREF(data), raise_fmt(STRATA_EFORMAT, "tensor '%s' not found", c->name);
    if (!c->tensor)
        return Py_DECREF(data), raise_fmt(STRATA_EINVAL, "tensor '%s': no tensor callback "
                                          "given", c->name);
    if (t) {
        Py_DECREF(data);
        data = PyBytes_FromStringAndSize((const char *)c->data + t->at, (Py_ssize_t)t->bytes);
        if (!data)
            return NULL;
    }
    st_ts_tensor u;
    uint64_t sbytes;
    int rc = st_ts_tensor_info(&u, &sbytes, call, c->name, "pickle");
    if (rc) {
        Py_DECREF(data);
        return raise_last(rc);
    }
    if ((shape = PyTuple_New(u.ndim)))
        for (int i = 0; i < u.ndim; i++)
            PyTuple_SET_ITEM(shape, i, PyLong_FromUnsignedLongLong(u.shape[i]));
    if (shape && !PyErr_Occurred())
        r = PyObject_CallFunction(c->tensor, "ssOO", c->name, strata_dtype_name(u.dtype),
                                  shape, data);
    Py_XDECREF(shape);
    Py_DECREF(data);
    return r;
}

static PyObject *bigint(const pk_val *v)
{
    PyObject *b = PyBytes_FromStringAndSize((const char *)v->s, (Py_ssize_t)v->len);
    PyObject *r = b ? PyObject_CallMethod((PyObject *)&PyLong_Type, "from_bytes", "Os", b,
                                          "little")
                    : NULL;
    Py_XDECREF(b);
    if (!r || !v->len || !(v->s[v->len - 1] & 0x80))
        return r;
    /* two's complement: subtract 2 ** (8 * len) */
    PyObject *one = PyLong_FromLong(1), *bits = PyLong_FromSize_t(8 * v->len);
    PyObject *p = one && bits ? PyNumber_Lshift(one, bits) : NULL;
    PyObject *n = p ? PyNumber_Subtract(r, p) : NULL;
    Py_XDECREF(one);
    Py_XDECREF(bits);
    Py_XDECREF(p);
    Py_DECREF(r);
    return n;
}

static PyObject *container(conv *c, const pk_val *v, size_t len)
{
    PyObject *id = PyLong_FromVoidPtr((void *)v), *o;
    if (!id)
        return NULL;
    if ((o = PyDict_GetItemWithError(c->memo, id))) {
        Py_DECREF(id);
        Py_INCREF(o);
        return o;
    }
    if (PyErr_Occurred())
        return Py_DECREF(id), NULL;
    if (v->kind == PK_LIST) {
        o = PyList_New(0);
    } else if (!v->ordered) {
        o = PyDict_New();
    } else {
        PyObject *mod = PyImport_ImportModule("collections");
        o = mod ? PyObject_CallMethod(mod, "OrderedDict", NULL) : NULL;
        Py_XDECREF(mod);
    }
    if (!o || PyDict_SetItem(c->memo, id, o)) { /* before the children: no cycles anyway */
        Py_DECREF(id);
        Py_XDECREF(o);
        return NULL;
    }
    Py_DECREF(id);
    for (size_t i = 0; i < v->n; i++) {
        char part[STRATA_MAX_NAME + 2];
        const pk_val *key = v->kind == PK_DICT ? v->items[2 * i] : NULL;
        const pk_val *child = v->kind == PK_DICT ? v->items[2 * i + 1] : v->items[i];
        int n = key ? st_ts_key_part(key, part, sizeof part)
                    : snprintf(part, sizeof part, "%zu", i);
        size_t at = len ? len + 1 : 0, nl = STRATA_MAX_NAME + 1; /* nl: no name */
        if (n >= 0 && at + (size_t)n <= STRATA_MAX_NAME) {
            if (len)
                c->name[len] = '.';
            memcpy(c->name + at, part, (size_t)n);
            nl = at + (size_t)n;
        }
        PyObject *k = key ? value(c, key, STRATA_MAX_NAME + 1) : NULL;
        PyObject *x = (!key || k) ? value(c, child, nl) : NULL;
        c->name[len] = 0;
        int bad = !x;
        if (!bad && v->kind == PK_LIST) {
            bad = PyList_Append(o, x);
        } else if (!bad) {
            Py_ssize_t before = PyObject_Length(o);
            bad = before < 0 || PyObject_SetItem(o, k, x);
            if (!bad && PyObject_Length(o) == before) {
                PyObject *r = PyObject_Repr(k);
                raise_fmt(STRATA_EFORMAT, "the dict at '%s' holds the key %s twice",
                          len ? c->name : "<root>", r ? PyUnicode_AsUTF8(r) : "?");
                Py_XDECREF(r);
                bad = 1;
            } else if (bad && PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                raise_fmt(STRATA_EFORMAT, "the dict at '%s' has an unhashable key",
                          len ? c->name : "<root>");
            }
        }
        Py_XDECREF(k);
        Py_XDECREF(x);
        if (bad) {
            Py_DECREF(o);
            return NULL;
        }
    }
    return o;
}

/* io.BytesIO: a REDUCE with no arguments, its BUILD state (bytes, position, dict or None). */
static PyObject *bytes_io(const pk_val *v)
{
    const pk_val *st = v->state;
    int64_t pos = 0;
    if (v->args->kind != PK_TUPLE || v->args->n != 0 || !st || st->kind != PK_TUPLE ||
        st->n != 3 || st->items[0]->kind != PK_BYTES || pk_int64(st->items[1], &pos) ||
        pos < 0 || (st->items[2]->kind != PK_NONE && st->items[2]->kind != PK_DICT) ||
        (st->items[2]->kind == PK_DICT && st->items[2]->n))
        return st_clear_error(), raise_fmt(STRATA_EFORMAT, "an io.BytesIO whose state is not "
                                           "(bytes, position, None or {})");
    PyObject *io = PyImport_ImportModule("io");
    PyObject *b = PyBytes_FromStringAndSize((const char *)st->items[0]->s,
                                            (Py_ssize_t)st->items[0]->len);
    PyObject *r = io && b ? PyObject_CallMethod(io, "BytesIO", "O", b) : NULL;
    PyObject *ok = r ? PyObject_CallMethod(r, "seek", "L", (long long)pos) : NULL;
    Py_XDECREF(io);
    Py_XDECREF(b);
    if (!ok)
        Py_CLEAR(r);
    Py_XDECREF(ok);
    return r;
}

/* v at the name c->name[0..len) (len > STRATA_MAX_NAME: no name, e.g. a dict's key). */
static PyObject *value(conv *c, const pk_val *v, size_t len)
{
    const pk_val *call = st_ts_tensor_call(v);
    if (call) {
        if (len > STRATA_MAX_NAME || !len)
            return raise_fmt(STRATA_EFORMAT, "a tensor %s", !len ? "as the root" :
                             "under a key that cannot name it (not a str or int, or too long)");
        return tensor(c, call, len);
    }
    switch (v->kind) {
    case PK_NONE: Py_RETURN_NONE;
    case PK_BOOL: return PyBool_FromLong((long)v->i);
    case PK_INT: return PyLong_FromLongLong(v->i);
    case PK_BIGINT: return bigint(v);
    case PK_FLOAT: return PyFloat_FromDouble(v->f);
    case PK_STR: return PyUnicode_DecodeUTF8((const char *)v->s, (Py_ssize_t)v->len, "strict");
    case PK_BYTES: return PyBytes_FromStringAndSize((const char *)v->s, (Py_ssize_t)v->len);
    case PK_LIST: case PK_DICT: return container(c, v, len);
    case PK_TUPLE: {
        PyObject *t = PyTuple_New((Py_ssize_t)v->n);
        for (size_t i = 0; t && i < v->n; i++) {
            char part[24];
            int n = snprintf(part, sizeof part, "%zu", i);
            size_t at = len ? len + 1 : 0, nl = STRATA_MAX_NAME + 1;
            if (len <= STRATA_MAX_NAME && at + (size_t)n <= STRATA_MAX_NAME) {
                if (len)
                    c->name[len] = '.';
                memcpy(c->name + at, part, (size_t)n);
                nl = at + (size_t)n;
            }
            PyObject *x = value(c, v->items[i], nl);
            if (len <= STRATA_MAX_NAME)
                c->name[len] = 0;
            if (!x) {
                Py_DECREF(t);
                return NULL;
            }
            PyTuple_SET_ITEM(t, (Py_ssize_t)i, x);
        }
        return t;
    }
    case PK_GLOBAL:
        if (c->glob)
            return PyObject_CallFunction(c->glob, "ss", pk_global_module(v->g),
                                         pk_global_name(v->g));
        return raise_fmt(STRATA_EFORMAT, "a value %s.%s (a global): no glob callback given",
                         pk_global_module(v->g), pk_global_name(v->g));
    case PK_CALL:
        if (v->g == PK_G_BYTES_IO)
            return bytes_io(v);
        if (v->g == PK_G_TORCH_SIZE && v->args->kind == PK_TUPLE && v->args->n == 1 &&
            v->args->items[0]->kind == PK_TUPLE)
            return value(c, v->args->items[0], STRATA_MAX_NAME + 1);
        return raise_fmt(STRATA_EFORMAT, "a value built by %s.%s, which strata does not "
                         "convert", pk_global_module(v->g), pk_global_name(v->g));
    case PK_PID:
        return raise_fmt(STRATA_EFORMAT, "a persistent id used as a value");
    }
    return raise_fmt(STRATA_EFORMAT, "an unknown value");
}

static PyObject *convert(conv *c, const pk_val *root)
{
    c->memo = PyDict_New();
    if (!c->memo)
        return NULL;
    PyObject *r = value(c, root, 0);
    Py_CLEAR(c->memo);
    return r;
}

static int callables(conv *c, PyObject *tensor, PyObject *glob)
{
    c->tensor = tensor == Py_None ? NULL : tensor;
    c->glob = glob == Py_None ? NULL : glob;
    if ((c->tensor && !PyCallable_Check(c->tensor)) || (c->glob && !PyCallable_Check(c->glob))) {
        PyErr_SetString(PyExc_TypeError, "tensor and glob are callables or None");
        return -1;
    }
    return 0;
}

/* The arguments both calls take: (data, tensor=None, glob=None, name=<name>). On success
 * buf holds data (the caller releases it) and c the callables. */
static int unpickle_args(PyObject *args, PyObject *kw, Py_buffer *buf, conv *c,
                         const char **name)
{
    static char *kwlist[] = {"data", "tensor", "glob", "name", NULL};
    PyObject *tensor = Py_None, *glob = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|OOs", kwlist, buf, &tensor, &glob, name))
        return -1;
    if (callables(c, tensor, glob)) {
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

PyObject *mod_unpickle(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    Py_buffer buf;
    const char *name = "pickle";
    conv c = {0};
    if (unpickle_args(args, kw, &buf, &c, &name))
        return NULL;
    pk_doc doc;
    PyObject *r = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pk_parse(&doc, buf.buf, (size_t)buf.len, name);
    Py_END_ALLOW_THREADS
    if (rc)
        raise_last(rc);
    else
        r = convert(&c, doc.root);
    pk_free(&doc);
    PyBuffer_Release(&buf);
    return r;
}

typedef struct {
    const unsigned char *p;
    uint64_t n;
} mem_src;

static int rd_mem(void *ctx, void *out, size_t len, uint64_t off)
{
    const mem_src *s = ctx;
    if (off > s->n || len > s->n - off)
        return st_fail(STRATA_EFORMAT, "torch.save archive: truncated (%zu bytes wanted at "
                       "%llu of %llu)", len, (unsigned long long)off, (unsigned long long)s->n);
    memcpy(out, s->p + off, len);
    return 0;
}

PyObject *mod_unpickle_archive(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    Py_buffer buf;
    const char *name = "torch.save archive";
    conv c = {0};
    if (unpickle_args(args, kw, &buf, &c, &name))
        return NULL;
    st_ts_archive a;
    PyObject *r = NULL;
    int rc;
    mem_src s = {buf.buf, (uint64_t)buf.len};
    Py_BEGIN_ALLOW_THREADS
    rc = st_ts_open(&a, s.n, rd_mem, &s, name);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_last(rc);
    } else {
        c.a = &a;
        c.data = buf.buf;
        r = convert(&c, a.doc.pk.root);
    }
    st_ts_close(&a);
    PyBuffer_Release(&buf);
    return r;
}
