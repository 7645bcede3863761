/* _strata_pickle.c - restricted pickles as Python values, never executing pickle: unpickle
 * (a bare pickle: a torch.save archive's data.pkl) and unpickle_archive (a whole torch.save
 * archive in memory, e.g. a DCP non-tensor item). Both parse with strata's restricted reader
 * (strata.h: strata_pickle_*) and build only: None, bool, int (any size), float, str, bytes, tuple,
 * list, dict, collections.OrderedDict; torch.Size becomes a tuple, an io.BytesIO (DCP
 * saves one as torch.save of it) an io.BytesIO at its position. A tensor (a
 * _rebuild_tensor_v2/_v3 or _rebuild_parameter call) becomes whatever the caller's
 * tensor(name, dtype, shape, data) returns: name its keys joined with "." (strata's tensor
 * name), dtype strata's name ("f32"), shape a tuple, data the tensor's bytes (unpickle_archive)
 * or None (unpickle: the bytes are the load's). A global used as a value (a torch dtype) is
 * glob(module, name) if given. Anything else (another call, a persistent id used as a value,
 * a dict with two equal keys) is FormatError. The argument's structure is shared as the
 * pickle shares it (a list or dict referenced twice is one object). Through strata.h's
 * restricted pickle reader (strata_pickle_*), as every other file of the binding. */
#include "_strata.h"

typedef struct {
    PyObject *tensor, *glob; /* callables or NULL */
    PyObject *memo;          /* dict: id of a list / dict node -> its object */
    const strata_pickle *pk;
    char name[STRATA_MAX_NAME + 2];
} conv;

static PyObject *value(conv *c, const strata_pickle_value *v, size_t len);

static PyObject *tensor(conv *c, const strata_pickle_value *v, size_t len)
{
    c->name[len] = 0;
    PyObject *data = Py_None, *shape = NULL, *r = NULL;
    if (!c->tensor)
        return raise_fmt(STRATA_EINVAL, "tensor '%s': no tensor callback given", c->name);
    strata_pickle_tensor_info u;
    int rc = strata_pickle_tensor(&u, c->pk, v, c->name);
    if (rc)
        return raise_last(rc);
    if (u.data) { /* unpickle_archive: the bytes */
        data = PyBytes_FromStringAndSize((const char *)u.data, (Py_ssize_t)u.bytes);
        if (!data)
            return NULL;
    } else {
        Py_INCREF(Py_None);
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

static PyObject *bigint(const strata_pickle_value_info *v)
{
    PyObject *b = PyBytes_FromStringAndSize((const char *)v->bytes, (Py_ssize_t)v->len);
    PyObject *r = b ? PyObject_CallMethod((PyObject *)&PyLong_Type, "from_bytes", "Os", b,
                                          "little")
                    : NULL;
    Py_XDECREF(b);
    if (!r || !v->len || !(v->bytes[v->len - 1] & 0x80))
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

static PyObject *container(conv *c, const strata_pickle_value *v,
                           const strata_pickle_value_info *vi, size_t len)
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
    const int list = vi->kind == STRATA_PICKLE_LIST;
    if (list) {
        o = PyList_New(0);
    } else if (!vi->ordered) {
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
    for (size_t i = 0; i < vi->n; i++) {
        char part[STRATA_MAX_NAME + 2];
        const strata_pickle_value *key = list ? NULL : strata_pickle_item(v, 2 * i);
        const strata_pickle_value *child = strata_pickle_item(v, list ? i : 2 * i + 1);
        int n = key ? strata_pickle_key(part, sizeof part, key)
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
        if (!bad && list) {
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

/* io.BytesIO(bytes) at its position. */
static PyObject *bytes_io(const strata_pickle_value_info *v)
{
    PyObject *io = PyImport_ImportModule("io");
    PyObject *b = PyBytes_FromStringAndSize((const char *)v->bytes, (Py_ssize_t)v->len);
    PyObject *r = io && b ? PyObject_CallMethod(io, "BytesIO", "O", b) : NULL;
    PyObject *ok = r ? PyObject_CallMethod(r, "seek", "L", (long long)v->i) : NULL;
    Py_XDECREF(io);
    Py_XDECREF(b);
    if (!ok)
        Py_CLEAR(r);
    Py_XDECREF(ok);
    return r;
}

/* v at the name c->name[0..len) (len > STRATA_MAX_NAME: no name, e.g. a dict's key). */
static PyObject *value(conv *c, const strata_pickle_value *v, size_t len)
{
    strata_pickle_value_info vi;
    strata_pickle_get(&vi, v);
    switch (vi.kind) {
    case STRATA_PICKLE_TENSOR:
        if (len > STRATA_MAX_NAME || !len)
            return raise_fmt(STRATA_EFORMAT, "a tensor %s", !len ? "as the root" :
                             "under a key that cannot name it (not a str or int, or too long)");
        return tensor(c, v, len);
    case STRATA_PICKLE_NONE: Py_RETURN_NONE;
    case STRATA_PICKLE_BOOL: return PyBool_FromLong((long)vi.i);
    case STRATA_PICKLE_INT: return PyLong_FromLongLong(vi.i);
    case STRATA_PICKLE_BIGINT: return bigint(&vi);
    case STRATA_PICKLE_FLOAT: return PyFloat_FromDouble(vi.f);
    case STRATA_PICKLE_STR:
        return PyUnicode_DecodeUTF8((const char *)vi.bytes, (Py_ssize_t)vi.len, "strict");
    case STRATA_PICKLE_BYTES:
        return PyBytes_FromStringAndSize((const char *)vi.bytes, (Py_ssize_t)vi.len);
    case STRATA_PICKLE_LIST: case STRATA_PICKLE_DICT: return container(c, v, &vi, len);
    case STRATA_PICKLE_TUPLE: {
        PyObject *t = PyTuple_New((Py_ssize_t)vi.n);
        for (size_t i = 0; t && i < vi.n; i++) {
            char part[24];
            int n = snprintf(part, sizeof part, "%zu", i);
            size_t at = len ? len + 1 : 0, nl = STRATA_MAX_NAME + 1;
            if (len <= STRATA_MAX_NAME && at + (size_t)n <= STRATA_MAX_NAME) {
                if (len)
                    c->name[len] = '.';
                memcpy(c->name + at, part, (size_t)n);
                nl = at + (size_t)n;
            }
            PyObject *x = value(c, strata_pickle_item(v, i), nl);
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
    case STRATA_PICKLE_GLOBAL:
        if (c->glob)
            return PyObject_CallFunction(c->glob, "ss", vi.module, vi.name);
        return raise_fmt(STRATA_EFORMAT, "a value %s.%s (a global): no glob callback given",
                         vi.module, vi.name);
    case STRATA_PICKLE_BYTES_IO: return bytes_io(&vi);
    case STRATA_PICKLE_OTHER: return raise_fmt(STRATA_EFORMAT, "%s", vi.why);
    }
    return raise_fmt(STRATA_EFORMAT, "an unknown value");
}

static PyObject *convert(conv *c, const strata_pickle_value *root)
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

/* unpickle (archive 0) or unpickle_archive (1). */
static PyObject *unpickle(PyObject *args, PyObject *kw, int archive, const char *name)
{
    Py_buffer buf;
    conv c = {0};
    if (unpickle_args(args, kw, &buf, &c, &name))
        return NULL;
    strata_pickle *pk = NULL;
    PyObject *r = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = archive ? strata_pickle_open_archive(&pk, buf.buf, (size_t)buf.len, name)
                 : strata_pickle_parse(&pk, buf.buf, (size_t)buf.len, name);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_last(rc);
    } else {
        c.pk = pk;
        r = convert(&c, strata_pickle_root(pk));
    }
    strata_pickle_free(pk);
    PyBuffer_Release(&buf);
    return r;
}

PyObject *mod_unpickle(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    return unpickle(args, kw, 0, "pickle");
}

PyObject *mod_unpickle_archive(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    return unpickle(args, kw, 1, "torch.save archive");
}
