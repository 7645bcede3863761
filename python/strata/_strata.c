/* _strata.c - strata._strata, the CPython binding of libstrata (layer 1 of the Python package,
 * docs/DESIGN.md "Python package"). Written against the CPython C API and include/strata.h
 * alone; the extension carries libstrata statically (setup.py compiles src/ into it).
 *
 * Rules kept throughout:
 *  - the GIL is released around every call that may block (save, start, the waits, close,
 *    load, open, verify, probe, retain, hash_bytes, export_safetensors, pool allocation);
 *    strata's own threads touch Python objects only through the host communicator's
 *    callbacks and the export's progress callback, which take the GIL (PyGILState_Ensure)
 *    for the time of the call: they run on the thread that called into strata, except the
 *    callbacks of a communicator's duplicate (Comm.host's dup), which a saver's commit
 *    thread calls;
 *  - every C error is raised as the class of its code (one per STRATA_ERRNO_MAP entry, all
 *    under strata.Error) with strata_error_last() as its text and attributes code / name;
 *  - lifetimes: a State holds the objects given as `keep` (the tensors owning the memory it
 *    points at); a Handle holds its States and its Saver until close(); a Saver holds its
 *    Comm and Pool; so nothing a save reads is freed before the save has ended, and
 *    strata_saver_free runs only once every handle of the saver is freed.
 *
 * GC: State, Comm and Saver take part in cycle collection (a Comm's callables are often
 * bound methods of an object that holds the Comm). A Handle does not, on purpose: what it
 * holds is then always reachable while it lives, so a save in flight never loses its
 * States to the collector; a Handle left in a cycle is not collected. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

#include "strata.h"

#define MSG_BYTES 1024 /* strata_error_last()'s capacity */

/* ---- errors --------------------------------------------------------------------------- */

static PyObject *Error; /* strata.Error */

/* One entry per code of STRATA_ERRNO_MAP, so that a code added there gets a class here. */
typedef struct {
    const char *name; /* "ECHECKSUM" */
    int code;
    const char *msg;
    PyObject *cls; /* NULL for OK */
} err_entry;

static err_entry errs[] = {
#define X(name, val, msg) {#name, val, msg, NULL},
    STRATA_ERRNO_MAP(X)
#undef X
};
#define NERRS (sizeof errs / sizeof errs[0])

/* The Python class name of each code; a code missing here is "<NAME>Error" (EFOOError). */
static const struct {
    const char *name, *cls;
} err_class_names[] = {
    {"EINVAL", "InvalidArgumentError"}, {"ENOMEM", "OutOfMemoryError"},
    {"EIO", "StorageError"},            {"ENOSPC", "NoSpaceError"},
    {"EFORMAT", "FormatError"},         {"ECHECKSUM", "ChecksumError"},
    {"EINCOMPLETE", "IncompleteError"}, {"EMISMATCH", "MismatchError"},
    {"ENOTFOUND", "NotFoundError"},     {"EUNFILLED", "UnfilledError"},
    {"EEXIST", "ExistsError"},          {"ESCHEME", "SchemeError"},
    {"ENOENT", "MissingError"},         {"EOVERLAP", "OverlapError"},
    {"EABORTED", "AbortedError"},       {"EDEVICE", "DeviceError"},
    {"EBUSY", "BusyError"},             {"ECHANGED", "ChangedError"},
    {"ENOTSUP", "UnsupportedError"},
};

static PyObject *class_for(int code)
{
    for (size_t i = 0; i < NERRS; i++)
        if (errs[i].code == code && errs[i].cls)
            return errs[i].cls;
    return Error;
}

/* The exception being raised, taken (normalised, with its traceback; NULL if none), and
 * raised again: PyErr_Fetch / PyErr_Restore before 3.12, which deprecates them. */
static PyObject *err_take(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!t)
        return NULL;
    PyErr_NormalizeException(&t, &v, &tb);
    if (v && tb)
        PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
#endif
}

static void err_give(PyObject *v) /* reference stolen; NULL: nothing is raised */
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(v);
#else
    if (v) {
        Py_INCREF(Py_TYPE(v));
        PyErr_Restore((PyObject *)Py_TYPE(v), v, PyException_GetTraceback(v));
    }
#endif
}

/* Raises the class of code with msg (strata_error_str(code) when empty); returns NULL. */
static PyObject *raise_msg(int code, const char *msg)
{
    PyObject *cls = class_for(code);
    if (!msg || !*msg)
        msg = strata_error_str(code);
    PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
    if (!text)
        return NULL;
    PyObject *exc = PyObject_CallOneArg(cls, text);
    Py_DECREF(text);
    if (!exc)
        return NULL;
    PyObject *c = PyLong_FromLong(code), *n = PyUnicode_FromString(strata_error_name(code));
    if (!c || !n || PyObject_SetAttrString(exc, "code", c) < 0 ||
        PyObject_SetAttrString(exc, "name", n) < 0) {
        Py_XDECREF(c);
        Py_XDECREF(n);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(c);
    Py_DECREF(n);
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

/* Raises code with this thread's last strata message. */
static PyObject *raise_last(int code)
{
    char msg[MSG_BYTES];
    snprintf(msg, sizeof msg, "%s", strata_error_last());
    return raise_msg(code, msg);
}

/* Raises code with a message of the binding's own (printf-style). */
static PyObject *raise_fmt(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static PyObject *raise_fmt(int code, const char *fmt, ...)
{
    char msg[MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return raise_msg(code, msg);
}

/* The exception being raised gets cause as its __cause__ (a reference taken). */
static void set_cause(PyObject *cause)
{
    if (!cause || !PyErr_Occurred())
        return;
    PyObject *v = err_take();
    if (v) {
        Py_INCREF(cause);
        PyException_SetCause(v, cause);
    }
    err_give(v);
}

/* ---- argument helpers ------------------------------------------------------------------ */

/* A non-negative integer into *out; what names it in the InvalidArgumentError. */
static int get_u64(PyObject *o, const char *what, uint64_t *out)
{
    PyObject *i = PyNumber_Index(o);
    if (!i)
        return -1;
    int overflow = 0;
    long long sv = PyLong_AsLongLongAndOverflow(i, &overflow);
    if (sv == -1 && PyErr_Occurred()) {
        Py_DECREF(i);
        return -1;
    }
    if (overflow < 0 || (!overflow && sv < 0)) {
        Py_DECREF(i);
        raise_fmt(STRATA_EINVAL, "%s must not be negative", what);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        raise_fmt(STRATA_EINVAL, "%s does not fit in 64 bits", what);
        return -1;
    }
    *out = v;
    return 0;
}

static int get_int(PyObject *o, const char *what, long lo, long hi, long *out)
{
    PyObject *i = PyNumber_Index(o);
    if (!i)
        return -1;
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < lo || v > hi) {
        raise_fmt(STRATA_EINVAL, "%s must be in %ld..%ld", what, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

/* A path or URI (str, bytes or os.PathLike) as UTF-8 / bytes kept alive by *keep. */
static const char *get_path(PyObject *o, PyObject **keep)
{
    *keep = NULL;
    PyObject *p = PyOS_FSPath(o);
    if (!p)
        return NULL;
    const char *s;
    Py_ssize_t n;
    if (PyUnicode_Check(p)) {
        s = PyUnicode_AsUTF8AndSize(p, &n);
    } else {
        s = PyBytes_AsString(p);
        n = s ? PyBytes_GET_SIZE(p) : 0;
    }
    if (!s) {
        Py_DECREF(p);
        return NULL;
    }
    if ((size_t)n != strlen(s)) {
        Py_DECREF(p);
        raise_fmt(STRATA_EINVAL, "a URI must not contain a NUL character");
        return NULL;
    }
    *keep = p;
    return s;
}

/* A list of URIs (or a single one), as C strings for the duration of a call. */
typedef struct {
    int n;
    const char **p;
    PyObject **keep;
} uri_list;

static void uris_free(uri_list *u)
{
    for (int i = 0; i < u->n; i++)
        Py_XDECREF(u->keep[i]);
    PyMem_Free(u->p);
    PyMem_Free(u->keep);
    memset(u, 0, sizeof *u);
}

static int is_single_path(PyObject *o)
{
    return PyUnicode_Check(o) || PyBytes_Check(o) || PyObject_HasAttrString(o, "__fspath__");
}

static int uris_get(uri_list *u, PyObject *arg)
{
    memset(u, 0, sizeof *u);
    PyObject *t = is_single_path(arg) ? PyTuple_Pack(1, arg) : PySequence_Tuple(arg);
    if (!t)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    if (n > 1024) {
        Py_DECREF(t);
        raise_fmt(STRATA_EINVAL, "%zd URIs (at most %d tiers)", n, STRATA_MAX_TIERS);
        return -1;
    }
    u->p = PyMem_Calloc((size_t)n + 1, sizeof *u->p);
    u->keep = PyMem_Calloc((size_t)n + 1, sizeof *u->keep);
    if (!u->p || !u->keep) {
        Py_DECREF(t);
        uris_free(u);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        u->p[i] = get_path(PyTuple_GET_ITEM(t, i), &u->keep[i]);
        u->n = (int)i + (u->p[i] != NULL);
        if (!u->p[i]) {
            Py_DECREF(t);
            uris_free(u);
            return -1;
        }
    }
    Py_DECREF(t);
    return 0;
}

/* ---- State ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    strata_state *st;
    PyObject *keep;   /* list: the objects that own the registered memory */
    Py_ssize_t users; /* open save handles and calls in flight that use this state */
    PyObject *weakrefs;
} StateObject;

static PyTypeObject StateType;

static PyObject *State_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, ":State", kwlist))
        return NULL;
    StateObject *self = (StateObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->keep = PyList_New(0);
    if (!self->keep) {
        Py_DECREF(self);
        return NULL;
    }
    int rc = strata_state_new(&self->st);
    if (rc) {
        Py_DECREF(self);
        return raise_last(rc);
    }
    return (PyObject *)self;
}

static int State_traverse(StateObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->keep);
    return 0;
}

static int State_clear_refs(StateObject *self)
{
    Py_CLEAR(self->keep);
    return 0;
}

static void State_dealloc(StateObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    strata_state_free(self->st); /* before the kept objects: nothing points at them after */
    self->st = NULL;
    Py_CLEAR(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int state_writable(StateObject *self)
{
    if (self->users > 0) {
        raise_fmt(STRATA_EINVAL, "this State is in use by a save that is not closed yet "
                  "(Handle.close) or by a call in flight; it cannot change until then");
        return -1;
    }
    if (!self->keep && !(self->keep = PyList_New(0)))
        return -1;
    return 0;
}

static int state_keep(StateObject *self, PyObject *keep)
{
    return keep && keep != Py_None ? PyList_Append(self->keep, keep) : 0;
}

/* Parses a shape-like sequence of up to STRATA_MAX_DIMS non-negative ints. */
static int get_dims(PyObject *o, const char *tensor, const char *what, uint64_t *out, int *ndim)
{
    PyObject *t = PySequence_Tuple(o);
    if (!t)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    if (n > STRATA_MAX_DIMS) {
        Py_DECREF(t);
        raise_fmt(STRATA_EINVAL, "tensor '%s': %s has %zd dims (at most %d)", tensor, what, n,
                  STRATA_MAX_DIMS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        char w[160];
        snprintf(w, sizeof w, "tensor '%s': %s[%zd]", tensor, what, i);
        if (get_u64(PyTuple_GET_ITEM(t, i), w, &out[i]) < 0) {
            Py_DECREF(t);
            return -1;
        }
    }
    Py_DECREF(t);
    *ndim = (int)n;
    return 0;
}

/* A name as UTF-8 without NUL (strata checks the rest). */
static const char *get_name(PyObject *o, const char *what)
{
    if (!PyUnicode_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s name must be str, not %.100s", what,
                     Py_TYPE(o)->tp_name);
        return NULL;
    }
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(o, &n);
    if (!s) {
        PyErr_Clear();
        raise_fmt(STRATA_EINVAL, "%s name is not valid UTF-8 (a lone surrogate): names must be "
                  "UTF-8", what);
        return NULL;
    }
    if ((size_t)n != strlen(s)) {
        raise_fmt(STRATA_EINVAL, "%s name contains a NUL character", what);
        return NULL;
    }
    return s;
}

static PyObject *State_add_shard(StateObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name",   "dtype",  "global_shape", "offsets", "lengths", "data_ptr",
                             "nbytes", "flat",   "device",       "keep",    NULL};
    PyObject *oname, *odtype, *oshape, *ooff = Py_None, *olen = Py_None, *optr = NULL,
                                            *onbytes = NULL, *oflat = Py_None, *keep = Py_None;
    int device = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OO$OOOpO:add_shard", kwlist, &oname, &odtype,
                                     &oshape, &ooff, &olen, &optr, &onbytes, &oflat, &device,
                                     &keep))
        return NULL;
    if (!optr || !onbytes) {
        PyErr_Format(PyExc_TypeError, "add_shard() missing required keyword argument '%s'",
                     optr ? "nbytes" : "data_ptr");
        return NULL;
    }
    if (state_writable(self) < 0)
        return NULL;
    const char *name = get_name(oname, "tensor");
    if (!name)
        return NULL;
    if (!PyUnicode_Check(odtype)) {
        PyErr_Format(PyExc_TypeError, "tensor '%s': dtype must be a str (one of strata.DTYPES)",
                     name);
        return NULL;
    }
    const char *dtname = PyUnicode_AsUTF8(odtype);
    if (!dtname)
        return NULL;
    strata_dtype dt;
    if (strata_dtype_parse(&dt, dtname))
        return raise_fmt(STRATA_EINVAL, "tensor '%s': strata has no dtype '%s' (it has f64, f32, "
                         "f16, bf16, fp8_e4m3, fp8_e5m2, i64, i32, i16, i8, u8, bool)", name,
                         dtname);
    uint64_t shape[STRATA_MAX_DIMS], off[STRATA_MAX_DIMS], len[STRATA_MAX_DIMS];
    int ndim, n2;
    if (get_dims(oshape, name, "global_shape", shape, &ndim) < 0)
        return NULL;
    if (ooff != Py_None) {
        if (get_dims(ooff, name, "offsets", off, &n2) < 0)
            return NULL;
        if (n2 != ndim)
            return raise_fmt(STRATA_EINVAL, "tensor '%s': %d offsets for %d dims", name, n2, ndim);
    }
    if (olen != Py_None) {
        if (get_dims(olen, name, "lengths", len, &n2) < 0)
            return NULL;
        if (n2 != ndim)
            return raise_fmt(STRATA_EINVAL, "tensor '%s': %d lengths for %d dims", name, n2, ndim);
    }
    uint64_t ptr, nbytes, fs = 0, fe = 0;
    if (get_u64(optr, "data_ptr", &ptr) < 0 || get_u64(onbytes, "nbytes", &nbytes) < 0)
        return NULL;
    if (oflat != Py_None) {
        PyObject *t = PySequence_Tuple(oflat);
        if (!t)
            return NULL;
        int ok = PyTuple_GET_SIZE(t) == 2 &&
                 get_u64(PyTuple_GET_ITEM(t, 0), "flat start", &fs) == 0 &&
                 get_u64(PyTuple_GET_ITEM(t, 1), "flat end", &fe) == 0;
        Py_DECREF(t);
        if (!ok) {
            if (!PyErr_Occurred())
                raise_fmt(STRATA_EINVAL, "tensor '%s': flat must be (start, end) or None", name);
            return NULL;
        }
    }
    strata_shard s = {name,
                      dt,
                      ndim,
                      shape,
                      ooff != Py_None ? off : NULL,
                      olen != Py_None ? len : NULL,
                      oflat != Py_None,
                      fs,
                      fe,
                      (void *)(uintptr_t)ptr,
                      device};
    uint64_t numel = strata_shard_numel(&s);
    if (numel == 0) { /* empty, or invalid: a state of its own says which, changing nothing */
        strata_state *tmp;
        int rc = strata_state_new(&tmp);
        if (!rc) {
            rc = strata_state_add_shard(tmp, &s);
            strata_state_free(tmp);
        }
        if (rc)
            return raise_last(rc);
    }
    size_t esz = strata_dtype_size(dt);
    if (nbytes != numel * esz)
        return raise_fmt(STRATA_EINVAL, "tensor '%s': nbytes is %llu but the shard holds %llu "
                         "elements of %zu bytes (%llu bytes)", name, (unsigned long long)nbytes,
                         (unsigned long long)numel, esz, (unsigned long long)(numel * esz));
    int rc = strata_state_add_shard(self->st, &s);
    if (rc)
        return raise_last(rc);
    if (state_keep(self, keep) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *State_add_blob(StateObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name", "data_ptr", "nbytes", "rank_local", "owner", "keep", NULL};
    PyObject *oname, *optr = NULL, *onbytes = NULL, *keep = Py_None;
    int rank_local = 0, owner = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OOpiO:add_blob", kwlist, &oname, &optr,
                                     &onbytes, &rank_local, &owner, &keep))
        return NULL;
    if (!optr || !onbytes) {
        PyErr_Format(PyExc_TypeError, "add_blob() missing required keyword argument '%s'",
                     optr ? "nbytes" : "data_ptr");
        return NULL;
    }
    if (state_writable(self) < 0)
        return NULL;
    const char *name = get_name(oname, "blob");
    uint64_t ptr, nbytes;
    if (!name || get_u64(optr, "data_ptr", &ptr) < 0 || get_u64(onbytes, "nbytes", &nbytes) < 0)
        return NULL;
    int rc = strata_state_add_blob(self->st, name, rank_local ? STRATA_BLOB_RANK_LOCAL : 0, owner,
                                   (void *)(uintptr_t)ptr, nbytes);
    if (rc)
        return raise_last(rc);
    if (state_keep(self, keep) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *State_clear(StateObject *self, PyObject *unused)
{
    (void)unused;
    if (state_writable(self) < 0)
        return NULL;
    strata_state *fresh;
    int rc = strata_state_new(&fresh);
    if (rc)
        return raise_last(rc);
    strata_state_free(self->st);
    self->st = fresh;
    if (PyList_SetSlice(self->keep, 0, PY_SSIZE_T_MAX, NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef State_methods[] = {
    {"add_shard", (PyCFunction)(void (*)(void))State_add_shard, METH_VARARGS | METH_KEYWORDS,
     "add_shard(name, dtype, global_shape, offsets=None, lengths=None, *, data_ptr, nbytes, "
     "flat=None, device=False, keep=None)\n\nRegisters a shard (strata_state_add_shard). nbytes "
     "must be the shard's numel times the dtype's size; keep is held until clear()."},
    {"add_blob", (PyCFunction)(void (*)(void))State_add_blob, METH_VARARGS | METH_KEYWORDS,
     "add_blob(name, *, data_ptr, nbytes, rank_local=False, owner=-1, keep=None)"},
    {"clear", (PyCFunction)State_clear, METH_NOARGS,
     "Drops every registration and kept reference; the State can be filled again."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata.State",
    .tp_basicsize = sizeof(StateObject),
    .tp_weaklistoffset = offsetof(StateObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "State()\n\nOne rank's registered shards and blobs (strata_state).",
    .tp_new = State_new,
    .tp_dealloc = (destructor)State_dealloc,
    .tp_traverse = (traverseproc)State_traverse,
    .tp_clear = (inquiry)State_clear_refs,
    .tp_methods = State_methods,
    .tp_free = PyObject_GC_Del,
};

/* The states of a call, each held and marked in use for its duration. */
typedef struct {
    PyObject *tuple;
    strata_state **p;
    int n;
} state_list;

static void states_release(state_list *l)
{
    if (l->tuple)
        for (int i = 0; i < l->n; i++)
            ((StateObject *)PyTuple_GET_ITEM(l->tuple, i))->users--;
    Py_CLEAR(l->tuple);
    PyMem_Free(l->p);
    l->p = NULL;
    l->n = 0;
}

static int states_get(state_list *l, PyObject *arg)
{
    memset(l, 0, sizeof *l);
    PyObject *t = PyObject_TypeCheck(arg, &StateType) ? PyTuple_Pack(1, arg)
                                                       : PySequence_Tuple(arg);
    if (!t)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    if (n > INT_MAX) {
        Py_DECREF(t);
        raise_fmt(STRATA_EINVAL, "too many states");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(t, i), &StateType)) {
            PyErr_Format(PyExc_TypeError, "states[%zd] is %.100s, not a strata.State", i,
                         Py_TYPE(PyTuple_GET_ITEM(t, i))->tp_name);
            Py_DECREF(t);
            return -1;
        }
    l->p = PyMem_Calloc((size_t)n + 1, sizeof *l->p);
    if (!l->p) {
        Py_DECREF(t);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        StateObject *s = (StateObject *)PyTuple_GET_ITEM(t, i);
        l->p[i] = s->st;
        s->users++;
    }
    l->tuple = t;
    l->n = (int)n;
    return 0;
}

/* ---- Pool ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    strata_pool *pool; /* NULL once closed */
    int savers;        /* Savers holding it: close() refuses while any does */
    PyObject *weakrefs;
} PoolObject;

static PyTypeObject PoolType;

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"nbytes", NULL};
    PyObject *on;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O:Pool", kwlist, &on))
        return NULL;
    uint64_t n;
    if (get_u64(on, "nbytes", &n) < 0)
        return NULL;
    PoolObject *self = (PoolObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    int rc;
    char msg[MSG_BYTES];
    Py_BEGIN_ALLOW_THREADS /* allocates and pre-faults */
    rc = strata_pool_new(&self->pool, n);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_DECREF(self);
        return raise_msg(rc, msg);
    }
    return (PyObject *)self;
}

static void Pool_dealloc(PoolObject *self)
{
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    if (self->pool) {
        strata_pool *p = self->pool;
        Py_BEGIN_ALLOW_THREADS
        strata_pool_free(p);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pool_nbytes(PoolObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->pool ? strata_pool_bytes(self->pool) : 0);
}

static PyObject *Pool_close(PoolObject *self, PyObject *unused)
{
    (void)unused;
    if (self->savers)
        return raise_fmt(STRATA_EBUSY,
                         "strata.Pool.close: %d strata.Saver(s) hold this pool (a saver is "
                         "freed after its last save's handle): drop them first",
                         self->savers);
    strata_pool *p = self->pool;
    self->pool = NULL;
    if (p) {
        Py_BEGIN_ALLOW_THREADS
        strata_pool_free(p);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Pool_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    Py_INCREF(self);
    return self;
}

static PyObject *Pool_exit(PoolObject *self, PyObject *args)
{
    (void)args;
    return Pool_close(self, NULL);
}

static PyMethodDef Pool_methods[] = {
    {"close", (PyCFunction)Pool_close, METH_NOARGS,
     "close(): frees the pool's memory now (else it goes with the last reference); "
     "BusyError while a Saver holds it. nbytes is 0 after, and no Saver takes it."},
    {"__enter__", (PyCFunction)Pool_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Pool_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"nbytes", (getter)Pool_nbytes, NULL, "the pool's size in bytes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_weaklistoffset = offsetof(PoolObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(nbytes)\n\nA fixed pool of aligned host memory reused by saves "
              "(strata_pool); allocated and pre-faulted here.",
    .tp_new = Pool_new,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

/* ---- Comm: host collectives ------------------------------------------------------------ */

/* The context of a host communicator: the Python callables, and the exception the last
 * failing one raised (becomes the __cause__ of the AbortedError the caller sees). */
typedef struct {
    PyObject *fn[4]; /* allgather, alltoallv, bcast, dup (or NULL); NULL once cleared */
    int rank, size;
    PyObject *pending;
} host_ctx;

static char empty_buf[1];

static PyObject *view(const void *p, size_t n, int flags)
{
    if (n > (size_t)PY_SSIZE_T_MAX)
        return PyErr_Format(PyExc_OverflowError, "a buffer of %zu bytes", n);
    return PyMemoryView_FromMemory(p && n ? (char *)(uintptr_t)p : empty_buf, (Py_ssize_t)n,
                                   flags);
}

/* The views are valid only during the callback: released after it (a callback that kept
 * an export of one leaves it unreleased, and must not use it later). */
static void unview(PyObject *v)
{
    if (!v)
        return;
    PyObject *r = PyObject_CallMethod(v, "release", NULL);
    if (r)
        Py_DECREF(r);
    else
        PyErr_Clear();
    Py_DECREF(v);
}

/* str(v) into text (cap bytes; "" if v is NULL or has no string). */
static void exc_text(PyObject *v, char *text, size_t cap)
{
    text[0] = 0;
    PyObject *s = v ? PyObject_Str(v) : NULL;
    const char *u = s ? PyUnicode_AsUTF8(s) : NULL;
    if (u)
        snprintf(text, cap, "%s", u);
    else
        PyErr_Clear();
    Py_XDECREF(s);
}

/* The Python error set now becomes STRATA_EABORTED with its text (thread-local message). */
static int cb_error(host_ctx *x, const char *what)
{
    PyObject *v = err_take();
    char text[768];
    exc_text(v, text, sizeof text);
    char tname[128];
    snprintf(tname, sizeof tname, "%s", v ? Py_TYPE(v)->tp_name : "an error");
    Py_XSETREF(x->pending, v);
    return strata_error_set(STRATA_EABORTED, "the %s callback raised %s%s%s", what, tname,
                            text[0] ? ": " : "", text);
}

/* Calls callable i with args (references stolen, NULL: a Python error is set). */
static int invoke(host_ctx *x, int i, const char *what, PyObject **args, int nargs)
{
    int rc = 0, ok = 1;
    for (int a = 0; a < nargs; a++)
        ok &= args[a] != NULL;
    if (!ok) {
        rc = cb_error(x, what);
    } else if (!x->fn[i]) {
        rc = strata_error_set(STRATA_EABORTED, "the communicator's callables were released");
    } else {
        PyObject *r = PyObject_Vectorcall(x->fn[i], args, (size_t)nargs, NULL);
        if (r)
            Py_DECREF(r);
        else
            rc = cb_error(x, what);
    }
    for (int a = 0; a < nargs; a++)
        if (args[a] && PyMemoryView_Check(args[a]))
            unview(args[a]);
        else
            Py_XDECREF(args[a]);
    return rc;
}

static int host_allgather(void *ctx, const void *send, size_t n, void *recv)
{
    host_ctx *x = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *saved = err_take(); /* none expected: kept as it was */
    PyObject *a[2] = {view(send, n, PyBUF_READ), NULL};
    if (a[0]) {
        if (x->size > 0 && n > SIZE_MAX / (size_t)x->size)
            PyErr_SetString(PyExc_OverflowError, "allgather: receive size overflows");
        else
            a[1] = view(recv, n * (size_t)x->size, PyBUF_WRITE);
    }
    int rc = invoke(x, 0, "allgather", a, 2);
    err_give(saved);
    PyGILState_Release(g);
    return rc;
}

static PyObject *counts_list(const size_t *c, int size, size_t *total)
{
    PyObject *l = PyList_New(size);
    *total = 0;
    for (int i = 0; l && i < size; i++) {
        PyObject *v = PyLong_FromSize_t(c[i]);
        if (!v) {
            Py_CLEAR(l);
            break;
        }
        PyList_SET_ITEM(l, i, v);
        *total += c[i];
    }
    return l;
}

static int host_alltoallv(void *ctx, const void *send, const size_t *scounts, void *recv,
                          const size_t *rcounts)
{
    host_ctx *x = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *saved = err_take(); /* none expected: kept as it was */
    size_t sn = 0, rn = 0;
    PyObject *a[4] = {NULL, NULL, NULL, NULL};
    if ((a[1] = counts_list(scounts, x->size, &sn)) && (a[3] = counts_list(rcounts, x->size, &rn)))
        if ((a[0] = view(send, sn, PyBUF_READ)))
            a[2] = view(recv, rn, PyBUF_WRITE);
    int rc = invoke(x, 1, "alltoallv", a, 4);
    err_give(saved);
    PyGILState_Release(g);
    return rc;
}

static int host_bcast(void *ctx, void *buf, size_t n, int root)
{
    host_ctx *x = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *saved = err_take(); /* none expected: kept as it was */
    PyObject *a[2] = {view(buf, n, PyBUF_WRITE), NULL};
    if (a[0])
        a[1] = PyLong_FromLong(root);
    int rc = invoke(x, 2, "bcast", a, 2);
    err_give(saved);
    PyGILState_Release(g);
    return rc;
}

static void host_destroy(void *ctx)
{
    host_ctx *x = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    for (int i = 0; i < 4; i++)
        Py_CLEAR(x->fn[i]);
    Py_CLEAR(x->pending);
    PyGILState_Release(g);
    PyMem_RawFree(x);
}

static int host_dup(void *ctx, strata_comm **out);

static const strata_comm_ops host_ops = {STRATA_COMM_OPS_VERSION, host_allgather, host_alltoallv,
                                         host_bcast, host_destroy, host_dup};

/* A communicator over the callables fn[0..3) (new references taken); *xout (may be NULL)
 * its context. GIL held. */
static int host_make(strata_comm **out, PyObject *const *fn, int rank, int size,
                     host_ctx **xout)
{
    host_ctx *x = PyMem_RawCalloc(1, sizeof *x);
    if (!x)
        return strata_error_set(STRATA_ENOMEM, "out of memory");
    x->rank = rank;
    x->size = size;
    int rc = strata_comm_host(out, &host_ops, x, rank, size);
    if (rc) {
        PyMem_RawFree(x); /* not taken: destroy is not called */
        return rc;
    }
    for (int i = 0; i < 3; i++) {
        Py_INCREF(fn[i]);
        x->fn[i] = fn[i];
    }
    if (xout)
        *xout = x;
    return 0;
}

/* The duplicate a saver asks for its commit thread: dup() returns the callables
 * (allgather, alltoallv, bcast) of a channel of their own (DESIGN.md). A failure is
 * strata's to report (the commits then stay on the caller's thread): the exception's text
 * goes into the message, and the exception is dropped. */
static int host_dup(void *ctx, strata_comm **out)
{
    host_ctx *x = ctx;
    *out = NULL;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *saved = err_take(); /* none expected: kept as it was */
    int rc;
    PyObject *r = NULL;
    if (!x->fn[3]) {
        rc = strata_error_set(STRATA_EINVAL, "Comm.host was given no dup callable");
    } else if (!(r = PyObject_CallNoArgs(x->fn[3]))) {
        PyObject *v = err_take();
        char text[768];
        exc_text(v, text, sizeof text);
        rc = strata_error_set(STRATA_EINVAL, "the dup callback raised %s%s%s",
                              v ? Py_TYPE(v)->tp_name : "an error", text[0] ? ": " : "", text);
        Py_XDECREF(v);
    } else if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3 ||
               !PyCallable_Check(PyTuple_GET_ITEM(r, 0)) ||
               !PyCallable_Check(PyTuple_GET_ITEM(r, 1)) ||
               !PyCallable_Check(PyTuple_GET_ITEM(r, 2))) {
        rc = strata_error_set(STRATA_EINVAL, "the dup callback must return a tuple of three "
                              "callables (allgather, alltoallv, bcast)");
    } else {
        PyObject *fn[3] = {PyTuple_GET_ITEM(r, 0), PyTuple_GET_ITEM(r, 1),
                           PyTuple_GET_ITEM(r, 2)};
        rc = host_make(out, fn, x->rank, x->size, NULL);
    }
    Py_XDECREF(r);
    err_give(saved);
    PyGILState_Release(g);
    return rc;
}

typedef struct {
    PyObject_HEAD
    strata_comm *c;
    host_ctx *ctx; /* NULL for Comm.self(); owned by c (released by host_destroy) */
    PyObject *weakrefs;
} CommObject;

static PyTypeObject CommType;

/* Before a call that may run the callbacks: forget an older callback's exception. */
static void comm_begin(CommObject *c)
{
    if (c && c->ctx)
        Py_CLEAR(c->ctx->pending);
}

/* After a failed call: the exception a callback raised becomes the __cause__. */
static PyObject *comm_take_pending(CommObject *c)
{
    if (!c || !c->ctx || !c->ctx->pending)
        return NULL;
    PyObject *p = c->ctx->pending;
    c->ctx->pending = NULL;
    return p;
}

static PyObject *Comm_host(PyObject *unused, PyObject *args, PyObject *kw)
{
    (void)unused;
    static char *kwlist[] = {"rank", "size", "allgather", "alltoallv", "bcast", "dup", NULL};
    int rank, size;
    PyObject *fn[4] = {NULL, NULL, NULL, Py_None};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiOOO|$O:host", kwlist, &rank, &size, &fn[0],
                                     &fn[1], &fn[2], &fn[3]))
        return NULL;
    static const char *names[4] = {"allgather", "alltoallv", "bcast", "dup"};
    for (int i = 0; i < 4; i++)
        if (!PyCallable_Check(fn[i]) && !(i == 3 && fn[i] == Py_None))
            return PyErr_Format(PyExc_TypeError, "Comm.host: %s must be callable", names[i]);
    CommObject *self = (CommObject *)CommType.tp_alloc(&CommType, 0);
    if (!self)
        return NULL;
    int rc = host_make(&self->c, fn, rank, size, &self->ctx);
    if (rc) {
        Py_DECREF(self);
        return raise_last(rc);
    }
    if (fn[3] != Py_None) {
        Py_INCREF(fn[3]);
        self->ctx->fn[3] = fn[3];
    }
    return (PyObject *)self;
}

static PyObject *Comm_self(PyObject *unused, PyObject *noargs)
{
    (void)unused, (void)noargs;
    CommObject *self = (CommObject *)CommType.tp_alloc(&CommType, 0);
    if (!self)
        return NULL;
    int rc = strata_comm_self(&self->c);
    if (rc) {
        Py_DECREF(self);
        return raise_last(rc);
    }
    return (PyObject *)self;
}

static int Comm_traverse(CommObject *self, visitproc visit, void *arg)
{
    if (self->ctx) {
        for (int i = 0; i < 4; i++)
            Py_VISIT(self->ctx->fn[i]);
        Py_VISIT(self->ctx->pending);
    }
    return 0;
}

static int Comm_clear_refs(CommObject *self)
{
    if (self->ctx) {
        for (int i = 0; i < 4; i++)
            Py_CLEAR(self->ctx->fn[i]);
        Py_CLEAR(self->ctx->pending);
    }
    return 0;
}

static void Comm_dealloc(CommObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    strata_comm_free(self->c); /* host_destroy drops the callables */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Comm_set_timeout(CommObject *self, PyObject *arg)
{
    long ms;
    if (get_int(arg, "timeout (ms)", 0, INT_MAX, &ms) < 0)
        return NULL;
    strata_comm_set_timeout(self->c, (int)ms);
    Py_RETURN_NONE;
}

static PyObject *Comm_rank(CommObject *self, void *c)
{
    (void)c;
    return PyLong_FromLong(strata_comm_rank(self->c));
}

static PyObject *Comm_size(CommObject *self, void *c)
{
    (void)c;
    return PyLong_FromLong(strata_comm_size(self->c));
}

static PyObject *Comm_timeout(CommObject *self, void *c)
{
    (void)c;
    return PyLong_FromLong(strata_comm_timeout(self->c));
}

static PyObject *Comm_repr(CommObject *self)
{
    return PyUnicode_FromFormat("<strata.Comm %s rank %d of %d>", self->ctx ? "host" : "self",
                                strata_comm_rank(self->c), strata_comm_size(self->c));
}

static PyMethodDef Comm_methods[] = {
    {"host", (PyCFunction)(void (*)(void))Comm_host, METH_VARARGS | METH_KEYWORDS | METH_STATIC,
     "host(rank, size, allgather, alltoallv, bcast, *, dup=None) -> Comm\n\n"
     "A communicator over Python collectives, called on the thread that called save/load:\n"
     "  allgather(send, recv): send a read-only memoryview of n bytes, recv writable, size*n\n"
     "  alltoallv(send, scounts, recv, rcounts): counts are lists of size ints\n"
     "  bcast(buf, root): buf writable\n"
     "  dup(): the (allgather, alltoallv, bcast) of a channel of their own (e.g. another\n"
     "    process group), for a Saver's commit thread, which calls them while this\n"
     "    thread may call the others. Called on every rank at a Saver's first start().\n"
     "    Without dup, a Saver's asynchronous saves commit in wait_durable().\n"
     "The memoryviews are valid only during the call. A callback that raises makes the "
     "collective fail with AbortedError carrying its text (the exception as __cause__); the "
     "communicator is not usable after that."},
    {"self", (PyCFunction)Comm_self, METH_NOARGS | METH_STATIC,
     "self() -> Comm\n\nThe single-process communicator (rank 0 of 1)."},
    {"set_timeout", (PyCFunction)Comm_set_timeout, METH_O,
     "set_timeout(ms): time limit of each collective, for communicators that keep one."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Comm_getset[] = {
    {"rank", (getter)Comm_rank, NULL, "this rank", NULL},
    {"size", (getter)Comm_size, NULL, "number of ranks", NULL},
    {"timeout", (getter)Comm_timeout, NULL, "time limit of a collective in ms (0: none)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CommType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata.Comm",
    .tp_basicsize = sizeof(CommObject),
    .tp_weaklistoffset = offsetof(CommObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A communicator (strata_comm): Comm.host(...) or Comm.self().",
    .tp_dealloc = (destructor)Comm_dealloc,
    .tp_traverse = (traverseproc)Comm_traverse,
    .tp_clear = (inquiry)Comm_clear_refs,
    .tp_methods = Comm_methods,
    .tp_getset = Comm_getset,
    .tp_repr = (reprfunc)Comm_repr,
    .tp_free = PyObject_GC_Del,
};

/* ---- stats ------------------------------------------------------------------------------ */

static PyObject *stats_dict(const strata_stats *s)
{
    return Py_BuildValue("{s:K,s:K,s:K,s:d,s:K,s:K,s:K,s:K,s:O,s:i}", "data_bytes",
                         (unsigned long long)s->data_bytes, "bytes", (unsigned long long)s->bytes,
                         "io_calls", (unsigned long long)s->io_calls, "seconds", s->seconds,
                         "max_writer_bytes", (unsigned long long)s->max_writer_bytes, "writers",
                         (unsigned long long)s->writers, "balance_bound",
                         (unsigned long long)s->balance_bound, "all_bytes",
                         (unsigned long long)s->all_bytes, "plan_cached",
                         s->plan_cached ? Py_True : Py_False, "tier", s->tier);
}

/* ---- Saver and Handle ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    strata_saver *sv;
    CommObject *comm; /* or NULL */
    PoolObject *pool; /* or NULL */
    int busy;         /* a save or start in flight (one thread at a time) */
    PyObject *weakrefs;
} SaverObject;

static PyTypeObject SaverType, HandleType;

static PyObject *Saver_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"comm", "pool", NULL};
    PyObject *comm = Py_None, *pool = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OO:Saver", kwlist, &comm, &pool))
        return NULL;
    if (comm != Py_None && !PyObject_TypeCheck(comm, &CommType))
        return PyErr_Format(PyExc_TypeError, "comm must be a strata.Comm or None");
    if (pool != Py_None && !PyObject_TypeCheck(pool, &PoolType))
        return PyErr_Format(PyExc_TypeError, "pool must be a strata.Pool or None");
    if (pool != Py_None && !((PoolObject *)pool)->pool)
        return raise_fmt(STRATA_EINVAL, "strata.Saver: the pool is closed");
    SaverObject *self = (SaverObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    if (comm != Py_None) {
        Py_INCREF(comm);
        self->comm = (CommObject *)comm;
    }
    if (pool != Py_None) {
        Py_INCREF(pool);
        self->pool = (PoolObject *)pool;
        self->pool->savers++;
    }
    int rc = strata_saver_new(&self->sv, self->comm ? self->comm->c : NULL,
                              self->pool ? self->pool->pool : NULL);
    if (rc) {
        Py_DECREF(self);
        return raise_last(rc);
    }
    return (PyObject *)self;
}

static int Saver_traverse(SaverObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->comm);
    Py_VISIT(self->pool);
    return 0;
}

static void Saver_dealloc(SaverObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    /* every handle holds the saver: none is left when this runs */
    strata_saver_free(self->sv);
    Py_CLEAR(self->comm);
    if (self->pool)
        self->pool->savers--;
    Py_CLEAR(self->pool);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int save_opts_get(strata_save_opts *o, PyObject *step, PyObject *chunk, PyObject *threads,
                         int sync, int direct, PyObject *nice)
{
    *o = (strata_save_opts)STRATA_SAVE_OPTS_INIT;
    uint64_t v;
    long l;
    if (step) {
        if (get_u64(step, "step", &v) < 0)
            return -1;
        o->step = v;
    }
    if (chunk) {
        if (get_u64(chunk, "chunk_bytes", &v) < 0)
            return -1;
        if (v > UINT32_MAX) {
            raise_fmt(STRATA_EINVAL, "chunk_bytes %llu is over 64 MiB", (unsigned long long)v);
            return -1;
        }
        o->chunk_bytes = (uint32_t)v;
    }
    if (threads) {
        if (get_int(threads, "io_threads", 0, INT_MAX, &l) < 0)
            return -1;
        o->io_threads = (int)l;
    }
    if (nice) {
        if (get_int(nice, "bg_nice", -1, 40, &l) < 0)
            return -1;
        o->bg_nice = (int)l;
    }
    o->flags = (sync ? 0 : STRATA_SAVE_NO_SYNC) | (direct ? 0 : STRATA_SAVE_NO_DIRECT);
    return 0;
}

/* Parses (uris, states, *, step, chunk_bytes, io_threads, sync, direct, bg_nice,
 * replace). */
static int save_args(PyObject *args, PyObject *kw, const char *fname, uri_list *u, state_list *l,
                     strata_save_opts *o)
{
    static char *kwlist[] = {"uris",   "states", "step",    "chunk_bytes", "io_threads",
                             "sync",   "direct", "bg_nice", "replace",     NULL};
    PyObject *ouris, *ostates, *step = NULL, *chunk = NULL, *threads = NULL, *nice = NULL;
    int sync = 1, direct = 1, replace = 0;
    char fmt[64];
    snprintf(fmt, sizeof fmt, "OO|$OOOppOp:%s", fname);
    if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &ouris, &ostates, &step, &chunk,
                                     &threads, &sync, &direct, &nice, &replace))
        return -1;
    if (save_opts_get(o, step, chunk, threads, sync, direct, nice) < 0)
        return -1;
    if (replace) /* STRATA_SAVE_REPLACE: swap the new checkpoint in atomically */
        o->flags |= STRATA_SAVE_REPLACE;
    if (uris_get(u, ouris) < 0)
        return -1;
    if (states_get(l, ostates) < 0) {
        uris_free(u);
        return -1;
    }
    return 0;
}

static int saver_enter(SaverObject *self)
{
    if (self->busy) {
        raise_fmt(STRATA_EINVAL, "this Saver is in use by another thread (a saver is used by "
                  "one thread at a time)");
        return -1;
    }
    self->busy = 1;
    comm_begin(self->comm);
    return 0;
}

/* Raises rc with msg, the exception of a failing callback of comm as its __cause__. */
static PyObject *raise_comm(int rc, const char *msg, CommObject *comm)
{
    PyObject *cause = comm_take_pending(comm);
    raise_msg(rc, msg);
    set_cause(cause);
    Py_XDECREF(cause);
    return NULL;
}

static PyObject *Saver_save(SaverObject *self, PyObject *args, PyObject *kw)
{
    uri_list u;
    state_list l;
    strata_save_opts o;
    if (save_args(args, kw, "save", &u, &l, &o) < 0)
        return NULL;
    if (saver_enter(self) < 0) {
        uris_free(&u);
        states_release(&l);
        return NULL;
    }
    strata_stats s = STRATA_STATS_INIT;
    char msg[MSG_BYTES];
    int rc;
    strata_saver *sv = self->sv;
    Py_BEGIN_ALLOW_THREADS
    if (u.n > 1) {
        /* strata_save's own way to several tiers, but the message is read before
         * strata_handle_free (strata_save reads it after, when the free has cleared it) */
        strata_handle *h;
        rc = strata_save_start(&h, sv, u.p, u.n, l.p, l.n, &o);
        if (!rc) {
            rc = strata_wait_durable(&s, h);
            snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
            strata_handle_free(h);
        } else {
            snprintf(msg, sizeof msg, "%s", strata_error_last());
        }
    } else {
        rc = strata_save(&s, sv, u.p, u.n, l.p, l.n, &o);
        snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    uris_free(&u);
    states_release(&l);
    if (rc)
        return raise_comm(rc, msg, self->comm);
    return stats_dict(&s);
}

typedef struct {
    PyObject_HEAD
    strata_handle *h;        /* NULL once closed */
    int collective;          /* the commit is wait_durable's collective (a communicator
                                without background commits) */
    SaverObject *saver;      /* held until close */
    PyObject *states;        /* tuple of State, marked in use until close */
    PyThread_type_lock lock; /* wait_durable and close, one at a time */
    Py_ssize_t users;        /* wait_snapshot / status calls in flight on h */
    int finished, final_rc;  /* the save's outcome, once wait_durable or close has run */
    PyObject *final_msg, *final_stats, *final_cause;
    PyObject *weakrefs;
} HandleObject;

static PyObject *Saver_start(SaverObject *self, PyObject *args, PyObject *kw)
{
    uri_list u;
    state_list l;
    strata_save_opts o;
    if (save_args(args, kw, "start", &u, &l, &o) < 0)
        return NULL;
    HandleObject *ho = PyObject_New(HandleObject, &HandleType);
    if (!ho) {
        uris_free(&u);
        states_release(&l);
        return NULL;
    }
    ho->h = NULL;
    ho->collective = self->comm != NULL;
    ho->saver = NULL;
    ho->states = NULL;
    ho->users = 0;
    ho->finished = ho->final_rc = 0;
    ho->final_msg = ho->final_stats = ho->final_cause = NULL;
    ho->weakrefs = NULL;
    ho->lock = PyThread_allocate_lock();
    if (!ho->lock || saver_enter(self) < 0) {
        if (!ho->lock)
            PyErr_NoMemory();
        Py_DECREF(ho);
        uris_free(&u);
        states_release(&l);
        return NULL;
    }
    strata_handle *h = NULL;
    char msg[MSG_BYTES];
    int rc;
    strata_saver *sv = self->sv;
    Py_BEGIN_ALLOW_THREADS
    rc = strata_save_start(&h, sv, u.p, u.n, l.p, l.n, &o);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    self->busy = 0;
    uris_free(&u);
    if (rc) {
        states_release(&l);
        Py_DECREF(ho);
        return raise_comm(rc, msg, self->comm);
    }
    ho->h = h;
    ho->collective = self->comm && strata_saver_background(NULL, sv) != 1;
    Py_INCREF(self);
    ho->saver = self;
    ho->states = l.tuple; /* the states stay marked in use until close */
    l.tuple = NULL;
    PyMem_Free(l.p);
    return (PyObject *)ho;
}

static PyMethodDef Saver_methods[] = {
    {"save", (PyCFunction)(void (*)(void))Saver_save, METH_VARARGS | METH_KEYWORDS,
     "save(uris, states, *, step=0, chunk_bytes=0, io_threads=0, sync=True, direct=True, "
     "bg_nice=0, replace=False) -> dict\n\nstrata_save: returns once committed (the stats) "
     "or raises. replace=True: STRATA_SAVE_REPLACE, an existing checkpoint at each path is "
     "swapped for the new one atomically (else it is never overwritten: ExistsError)."},
    {"start", (PyCFunction)(void (*)(void))Saver_start, METH_VARARGS | METH_KEYWORDS,
     "start(uris, states, *, same options as save) -> Handle\n\nstrata_save_start: returns "
     "once the plan is made. The states (and what they keep) are held until Handle.close()."},
    {NULL, NULL, 0, NULL},
};

static PyObject *Saver_get_comm(SaverObject *self, void *c)
{
    (void)c;
    PyObject *r = self->comm ? (PyObject *)self->comm : Py_None;
    Py_INCREF(r);
    return r;
}

static PyObject *Saver_get_pool(SaverObject *self, void *c)
{
    (void)c;
    PyObject *r = self->pool ? (PyObject *)self->pool : Py_None;
    Py_INCREF(r);
    return r;
}

static PyObject *Saver_get_background(SaverObject *self, void *c)
{
    (void)c;
    const char *why = NULL;
    int b = strata_saver_background(&why, self->sv);
    return Py_BuildValue("(Os)", b < 0 ? Py_None : b ? Py_True : Py_False, why ? why : "");
}

static PyGetSetDef Saver_getset[] = {
    {"comm", (getter)Saver_get_comm, NULL, "the communicator, or None", NULL},
    {"background", (getter)Saver_get_background, NULL,
     "(committed in the background, why not): True (also without a communicator), False "
     "(commits in wait_durable: the Comm has no dup, or it failed on some rank), or None "
     "before the first start() decides (strata_saver_background)", NULL},
    {"pool", (getter)Saver_get_pool, NULL, "the pool given, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SaverType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata.Saver",
    .tp_basicsize = sizeof(SaverObject),
    .tp_weaklistoffset = offsetof(SaverObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Saver(comm=None, pool=None)\n\nWhat repeated saves share (strata_saver): the "
              "communicator, the pool, the last plan. One thread at a time.",
    .tp_new = Saver_new,
    .tp_dealloc = (destructor)Saver_dealloc,
    .tp_traverse = (traverseproc)Saver_traverse,
    .tp_methods = Saver_methods,
    .tp_getset = Saver_getset,
    .tp_free = PyObject_GC_Del,
};

static void lock_acquire(PyThread_type_lock lk)
{
    if (!PyThread_acquire_lock(lk, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(lk, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
}

/* Waits for the save's outcome once and keeps it (lock held). -1: a Python error. */
static int handle_finish(HandleObject *self)
{
    if (self->finished)
        return 0;
    strata_stats s = STRATA_STATS_INIT;
    char msg[MSG_BYTES];
    int rc;
    strata_handle *h = self->h;
    CommObject *comm = self->saver ? self->saver->comm : NULL;
    comm_begin(comm);
    Py_BEGIN_ALLOW_THREADS
    rc = strata_wait_durable(&s, h);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    self->finished = 1;
    self->final_rc = rc;
    self->final_cause = comm_take_pending(comm);
    if (rc && !msg[0])
        snprintf(msg, sizeof msg, "%s", strata_error_str(rc));
    self->final_msg = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
    if (!self->final_msg)
        return -1;
    if (!rc && !(self->final_stats = stats_dict(&s)))
        return -1;
    return 0;
}

static PyObject *handle_raise(HandleObject *self)
{
    const char *m = self->final_msg ? PyUnicode_AsUTF8(self->final_msg) : NULL;
    if (!m)
        PyErr_Clear();
    raise_msg(self->final_rc, m ? m : "");
    set_cause(self->final_cause);
    return NULL;
}

/* Waits (wait_durable's outcome kept), then frees the C handle and lets go of the states
 * and the saver. GIL held; no Python error pending. */
static void handle_close(HandleObject *self)
{
    lock_acquire(self->lock);
    if (self->h) {
        if (handle_finish(self) < 0)
            PyErr_Clear();
        while (self->users > 0) { /* a wait_snapshot returning (the save has ended) */
            Py_BEGIN_ALLOW_THREADS
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
            Py_END_ALLOW_THREADS
        }
        strata_handle *h = self->h;
        self->h = NULL;
        Py_BEGIN_ALLOW_THREADS
        strata_handle_free(h);
        Py_END_ALLOW_THREADS
        if (self->states)
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->states); i++)
                ((StateObject *)PyTuple_GET_ITEM(self->states, i))->users--;
        Py_CLEAR(self->states);
        Py_CLEAR(self->saver);
    }
    PyThread_release_lock(self->lock);
}

static void Handle_dealloc(HandleObject *self)
{
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    if (self->h && self->lock) { /* not closed: close (waits, collective included) */
        PyObject *saved = err_take();
        handle_close(self);
        err_give(saved);
    }
    Py_CLEAR(self->final_msg);
    Py_CLEAR(self->final_stats);
    Py_CLEAR(self->final_cause);
    Py_CLEAR(self->states);
    Py_CLEAR(self->saver);
    if (self->lock)
        PyThread_free_lock(self->lock);
    PyObject_Free(self);
}

static PyObject *Handle_wait_snapshot(HandleObject *self, PyObject *unused)
{
    (void)unused;
    if (!self->h) { /* closed: the save has ended */
        if (self->final_rc)
            return handle_raise(self);
        Py_RETURN_NONE;
    }
    strata_handle *h = self->h;
    char msg[MSG_BYTES];
    int rc;
    self->users++;
    Py_BEGIN_ALLOW_THREADS
    rc = strata_wait_snapshot(h);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    self->users--;
    if (rc)
        return raise_msg(rc, msg);
    Py_RETURN_NONE;
}

static PyObject *Handle_wait_durable(HandleObject *self, PyObject *unused)
{
    (void)unused;
    lock_acquire(self->lock);
    int r = self->finished ? 0 : handle_finish(self);
    PyThread_release_lock(self->lock);
    if (r < 0)
        return NULL;
    if (self->final_rc)
        return handle_raise(self);
    return PyDict_Copy(self->final_stats);
}

static PyObject *Handle_status(HandleObject *self, PyObject *unused)
{
    (void)unused;
    if (!self->h || self->finished)
        return Py_BuildValue("(iO)", self->final_rc,
                             self->final_msg ? self->final_msg : Py_None);
    const char *m = NULL;
    int rc = strata_handle_status(&m, self->h); /* does not block */
    return Py_BuildValue("(iN)", rc,
                         PyUnicode_DecodeUTF8(m ? m : "", (Py_ssize_t)strlen(m ? m : ""),
                                              "replace"));
}

static PyObject *Handle_done(HandleObject *self, PyObject *unused)
{
    (void)unused;
    if (!self->h || self->finished)
        Py_RETURN_TRUE;
    /* the save's end is its outcome, except where the commit is still wait_durable's
     * collective (a communicator without background commits): then only a failure is */
    int d = (!self->collective && strata_handle_done(self->h)) ||
            strata_handle_status(NULL, self->h) != 0;
    return PyBool_FromLong(d);
}

static PyObject *Handle_close(HandleObject *self, PyObject *unused)
{
    (void)unused;
    handle_close(self);
    Py_RETURN_NONE;
}

static PyObject *Handle_enter(HandleObject *self, PyObject *unused)
{
    (void)unused;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Handle_exit(HandleObject *self, PyObject *args)
{
    (void)args;
    handle_close(self);
    Py_RETURN_FALSE;
}

static PyObject *Handle_get_closed(HandleObject *self, void *c)
{
    (void)c;
    return PyBool_FromLong(self->h == NULL);
}

static PyMethodDef Handle_methods[] = {
    {"wait_snapshot", (PyCFunction)Handle_wait_snapshot, METH_NOARGS,
     "Returns once every byte is copied out of the caller's buffers (or raises the save's "
     "error so far)."},
    {"wait_durable", (PyCFunction)Handle_wait_durable, METH_NOARGS,
     "Returns the stats once every destination is committed, or raises the save's error. "
     "With a communicator, the collective that commits: every rank calls it."},
    {"status", (PyCFunction)Handle_status, METH_NOARGS,
     "(code, message) of the save's error so far; (0, '') if none. Does not wait."},
    {"done", (PyCFunction)Handle_done, METH_NOARGS,
     "True once the save is durable or failed, without waiting (with a communicator, once "
     "the Saver's commit thread committed it). Where the commit is wait_durable's "
     "(Saver.background False): True once it failed or wait_durable/close has returned."},
    {"close", (PyCFunction)Handle_close, METH_NOARGS,
     "Waits for the save to end (the commit's collective included), frees it, lets go of its "
     "states and saver. Idempotent; does not raise the save's error (wait_durable does)."},
    {"__enter__", (PyCFunction)Handle_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Handle_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Handle_getset[] = {
    {"closed", (getter)Handle_get_closed, NULL, "True once close() has run", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata.Handle",
    .tp_basicsize = sizeof(HandleObject),
    .tp_weaklistoffset = offsetof(HandleObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A save in flight (strata_handle), from Saver.start().",
    .tp_dealloc = (destructor)Handle_dealloc,
    .tp_methods = Handle_methods,
    .tp_getset = Handle_getset,
};

/* ---- load ------------------------------------------------------------------------------ */

static PyObject *mod_load(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"uris", "states", "comm", "io_threads", "max_io_bytes", "direct",
                             "cast", NULL};
    PyObject *ouris, *ostates, *ocomm = Py_None, *othreads = NULL, *omax = NULL;
    int direct = 1, cast = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OOpp:load", kwlist, &ouris, &ostates, &ocomm,
                                     &othreads, &omax, &direct, &cast))
        return NULL;
    if (ocomm != Py_None && !PyObject_TypeCheck(ocomm, &CommType))
        return PyErr_Format(PyExc_TypeError, "comm must be a strata.Comm or None");
    CommObject *comm = ocomm == Py_None ? NULL : (CommObject *)ocomm;
    strata_load_opts o = STRATA_LOAD_OPTS_INIT;
    long l;
    uint64_t v;
    if (othreads) {
        if (get_int(othreads, "io_threads", 0, INT_MAX, &l) < 0)
            return NULL;
        o.io_threads = (int)l;
    }
    if (omax) {
        if (get_u64(omax, "max_io_bytes", &v) < 0)
            return NULL;
        if (v > UINT32_MAX)
            return raise_fmt(STRATA_EINVAL, "max_io_bytes %llu does not fit in 32 bits",
                             (unsigned long long)v);
        o.max_io_bytes = (uint32_t)v;
    }
    if (!direct)
        o.flags |= STRATA_LOAD_NO_DIRECT;
    if (cast)
        o.flags |= STRATA_LOAD_CAST;
    uri_list u;
    state_list sl;
    if (uris_get(&u, ouris) < 0)
        return NULL;
    if (states_get(&sl, ostates) < 0) {
        uris_free(&u);
        return NULL;
    }
    Py_XINCREF(comm);
    comm_begin(comm);
    strata_stats s = STRATA_STATS_INIT;
    char msg[MSG_BYTES];
    int rc;
    strata_comm *c = comm ? comm->c : NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = strata_load(&s, c, u.p, u.n, sl.p, sl.n, &o);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    uris_free(&u);
    states_release(&sl);
    PyObject *r = rc ? raise_comm(rc, msg, comm) : stats_dict(&s);
    Py_XDECREF(comm);
    return r;
}

/* ---- Checkpoint ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    strata_ckpt *ck;
    PyObject *uri, *tensors, *blobs, *files, *format;
    unsigned long long step, data_bytes;
    unsigned int chunk_bytes;
    char committed;
    PyObject *weakrefs;
} CkptObject;

static PyObject *u64_tuple(const uint64_t *v, int n)
{
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *x = PyLong_FromUnsignedLongLong(v[i]);
        if (!x) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* A name or file name of a checkpoint: UTF-8, and bytes that are not (older checkpoints may
 * hold such names) as lone surrogates, as os.fsdecode does. */
static PyObject *name_str(const char *s)
{
    s = s ? s : "";
    return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "surrogateescape");
}

static PyObject *ckpt_tensors(const strata_ckpt *ck)
{
    size_t n = strata_ckpt_ntensors(ck);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        strata_tensor_info ti;
        strata_ckpt_tensor(&ti, ck, i);
        PyObject *shards = PyList_New((Py_ssize_t)ti.nshards);
        for (size_t j = 0; shards && j < ti.nshards; j++) {
            strata_shard_info si;
            strata_ckpt_shard(&si, ck, i, j);
            PyObject *flat = si.flat ? Py_BuildValue("(KK)", (unsigned long long)si.flat_start,
                                                     (unsigned long long)si.flat_end)
                                     : (Py_INCREF(Py_None), Py_None);
            PyObject *d = flat ? Py_BuildValue("{s:N,s:N,s:N,s:N,s:K,s:K}", "offsets",
                                               u64_tuple(si.offsets, ti.ndim), "lengths",
                                               u64_tuple(si.lengths, ti.ndim), "flat", flat,
                                               "file", name_str(si.file), "file_offset",
                                               (unsigned long long)si.file_offset, "bytes",
                                               (unsigned long long)si.bytes)
                               : NULL;
            if (!d) {
                Py_CLEAR(shards);
                break;
            }
            PyList_SET_ITEM(shards, (Py_ssize_t)j, d);
        }
        PyObject *t = shards ? Py_BuildValue("{s:N,s:s,s:N,s:K,s:N}", "name", name_str(ti.name),
                                             "dtype", strata_dtype_name(ti.dtype), "shape",
                                             u64_tuple(ti.shape, ti.ndim), "bytes",
                                             (unsigned long long)ti.bytes, "shards", shards)
                             : NULL;
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    return list;
}

static PyObject *ckpt_blobs(const strata_ckpt *ck)
{
    size_t n = strata_ckpt_nblobs(ck);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        strata_blob_info bi;
        strata_ckpt_blob(&bi, ck, i);
        PyObject *b = Py_BuildValue("{s:N,s:i,s:K,s:N,s:K}", "name", name_str(bi.name), "owner",
                                    bi.owner, "bytes", (unsigned long long)bi.bytes, "file",
                                    name_str(bi.file),
                                    "file_offset", (unsigned long long)bi.file_offset);
        if (!b) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, b);
    }
    return list;
}

static PyObject *ckpt_files(const strata_ckpt *ck)
{
    size_t n = strata_ckpt_nfiles(ck);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        strata_file_info fi;
        strata_ckpt_file(&fi, ck, i);
        PyObject *f = Py_BuildValue("{s:N,s:K}", "name", name_str(fi.name), "bytes",
                                    (unsigned long long)fi.bytes);
        if (!f) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, f);
    }
    return list;
}

static PyObject *Ckpt_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"uri", "incomplete", NULL};
    PyObject *ouri;
    int incomplete = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p:Checkpoint", kwlist, &ouri, &incomplete))
        return NULL;
    PyObject *keep;
    const char *uri = get_path(ouri, &keep);
    if (!uri)
        return NULL;
    CkptObject *self = (CkptObject *)type->tp_alloc(type, 0);
    if (!self) {
        Py_DECREF(keep);
        return NULL;
    }
    int rc;
    char msg[MSG_BYTES];
    Py_BEGIN_ALLOW_THREADS
    rc = strata_ckpt_open(&self->ck, uri, incomplete ? STRATA_OPEN_INCOMPLETE : 0);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_DECREF(keep);
        Py_DECREF(self);
        return raise_msg(rc, msg);
    }
    self->uri = PyUnicode_Check(keep) ? keep : PyUnicode_DecodeFSDefault(uri);
    if (self->uri != keep)
        Py_DECREF(keep);
    self->step = strata_ckpt_step(self->ck);
    self->committed = (char)(strata_ckpt_committed(self->ck) != 0);
    self->chunk_bytes = strata_ckpt_chunk_bytes(self->ck);
    self->data_bytes = strata_ckpt_data_bytes(self->ck);
    self->format = PyUnicode_FromString(
        strata_ckpt_format(self->ck) == STRATA_FORMAT_SAFETENSORS ? "safetensors" : "strata");
    if (!self->uri || !self->format || !(self->tensors = ckpt_tensors(self->ck)) ||
        !(self->blobs = ckpt_blobs(self->ck)) || !(self->files = ckpt_files(self->ck))) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void Ckpt_dealloc(CkptObject *self)
{
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    strata_ckpt_free(self->ck);
    Py_CLEAR(self->uri);
    Py_CLEAR(self->tensors);
    Py_CLEAR(self->blobs);
    Py_CLEAR(self->files);
    Py_CLEAR(self->format);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The bad chunks verify reports (on strata's I/O threads, one at a time): kept in C. */
typedef struct {
    size_t n, cap, total;
    char **obj, **file, **msg;
} bad_list;

#define BAD_MAX 1000

static char *dup_or_empty(const char *s)
{
    char *d = strdup(s ? s : "");
    return d;
}

static void bad_report(void *ctx, const char *object, const char *file, const char *message)
{
    bad_list *b = ctx;
    b->total++;
    if (b->n >= BAD_MAX)
        return;
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 8;
        char **o = realloc(b->obj, cap * sizeof *o);
        if (o)
            b->obj = o;
        char **f = realloc(b->file, cap * sizeof *f);
        if (f)
            b->file = f;
        char **m = realloc(b->msg, cap * sizeof *m);
        if (m)
            b->msg = m;
        if (!o || !f || !m)
            return;
        b->cap = cap;
    }
    b->obj[b->n] = dup_or_empty(object);
    b->file[b->n] = dup_or_empty(file);
    b->msg[b->n] = dup_or_empty(message);
    b->n++;
}

static void bad_free(bad_list *b)
{
    for (size_t i = 0; i < b->n; i++) {
        free(b->obj[i]);
        free(b->file[i]);
        free(b->msg[i]);
    }
    free(b->obj);
    free(b->file);
    free(b->msg);
}

static PyObject *str_or_empty(const char *s)
{
    s = s ? s : "";
    return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "replace");
}

static PyObject *Ckpt_verify(CkptObject *self, PyObject *unused)
{
    (void)unused;
    bad_list b = {0, 0, 0, NULL, NULL, NULL};
    char msg[MSG_BYTES];
    int rc;
    strata_ckpt *ck = self->ck;
    Py_BEGIN_ALLOW_THREADS
    rc = strata_ckpt_verify(ck, bad_report, &b);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    if (!rc) {
        bad_free(&b);
        Py_RETURN_NONE;
    }
    /* the message lists the bad chunks (the first few); .bad has them all (up to 1000) */
    char full[4096];
    size_t k = (size_t)snprintf(full, sizeof full, "%s", msg[0] ? msg : strata_error_str(rc));
    for (size_t i = 0; i < b.n && i < 8 && k < sizeof full; i++)
        k += (size_t)snprintf(full + k, sizeof full - k, "%s'%s' in %s: %s", i ? "; " : ": ",
                              b.obj[i] ? b.obj[i] : "?", b.file[i] ? b.file[i] : "?",
                              b.msg[i] ? b.msg[i] : "?");
    if (b.total > 8 && k < sizeof full)
        snprintf(full + k, sizeof full - k, "; and %zu more", b.total - 8);
    PyObject *bad = PyList_New((Py_ssize_t)b.n);
    for (size_t i = 0; bad && i < b.n; i++) {
        PyObject *t = Py_BuildValue("(NNN)", str_or_empty(b.obj[i]), str_or_empty(b.file[i]),
                                    str_or_empty(b.msg[i]));
        if (!t) {
            Py_CLEAR(bad);
            break;
        }
        PyList_SET_ITEM(bad, (Py_ssize_t)i, t);
    }
    bad_free(&b);
    if (!bad)
        return NULL;
    raise_msg(rc, full);
    PyObject *v = err_take();
    if (v && PyObject_SetAttrString(v, "bad", bad) < 0)
        PyErr_Clear();
    Py_DECREF(bad);
    err_give(v);
    return NULL;
}

static PyMethodDef Ckpt_methods[] = {
    {"verify", (PyCFunction)Ckpt_verify, METH_NOARGS,
     "Reads every data byte and checks every checksum; raises ChecksumError listing the bad "
     "chunks (all of them, up to 1000, as .bad: (object, file, message) tuples)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Ckpt_members[] = {
    {"uri", T_OBJECT, offsetof(CkptObject, uri), READONLY, "the URI opened"},
    {"tensors", T_OBJECT, offsetof(CkptObject, tensors), READONLY,
     "list of {name, dtype, shape, bytes, shards: [{offsets, lengths, flat, file, "
     "file_offset, bytes}]}"},
    {"blobs", T_OBJECT, offsetof(CkptObject, blobs), READONLY,
     "list of {name, owner, bytes, file, file_offset}"},
    {"files", T_OBJECT, offsetof(CkptObject, files), READONLY, "list of {name, bytes}"},
    {"step", T_ULONGLONG, offsetof(CkptObject, step), READONLY, "the step saved"},
    {"data_bytes", T_ULONGLONG, offsetof(CkptObject, data_bytes), READONLY,
     "payload bytes of all shards and blobs"},
    {"chunk_bytes", T_UINT, offsetof(CkptObject, chunk_bytes), READONLY,
     "checksum chunk (0: no checksums, a safetensors source)"},
    {"format", T_OBJECT, offsetof(CkptObject, format), READONLY,
     "'strata', or 'safetensors' (a Hugging Face directory or file: no checksums)"},
    {"committed", T_BOOL, offsetof(CkptObject, committed), READONLY,
     "whether a valid commit record is there"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *Ckpt_repr(CkptObject *self)
{
    return PyUnicode_FromFormat("<strata.Checkpoint %R step %llu%s, %zd tensors, %zd blobs>",
                                self->uri, self->step, self->committed ? "" : " (incomplete)",
                                PyList_GET_SIZE(self->tensors), PyList_GET_SIZE(self->blobs));
}

static PyTypeObject CkptType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata.Checkpoint",
    .tp_basicsize = sizeof(CkptObject),
    .tp_weaklistoffset = offsetof(CkptObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Checkpoint(uri, incomplete=False)\n\nA checkpoint's description (strata_ckpt), "
              "read-only.",
    .tp_new = Ckpt_new,
    .tp_dealloc = (destructor)Ckpt_dealloc,
    .tp_methods = Ckpt_methods,
    .tp_members = Ckpt_members,
    .tp_repr = (reprfunc)Ckpt_repr,
};

/* ---- module functions ------------------------------------------------------------------ */

static PyObject *mod_dtype_size(PyObject *m, PyObject *arg)
{
    (void)m;
    if (!PyUnicode_Check(arg))
        return PyErr_Format(PyExc_TypeError, "dtype must be a str");
    const char *s = PyUnicode_AsUTF8(arg);
    if (!s)
        return NULL;
    strata_dtype dt;
    if (strata_dtype_parse(&dt, s))
        return raise_fmt(STRATA_EINVAL, "strata has no dtype '%s'", s);
    return PyLong_FromSize_t(strata_dtype_size(dt));
}

static PyObject *mod_hash_bytes(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"data_ptr", "nbytes", NULL};
    PyObject *optr, *on;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:hash_bytes", kwlist, &optr, &on))
        return NULL;
    uint64_t ptr, n;
    if (get_u64(optr, "data_ptr", &ptr) < 0 || get_u64(on, "nbytes", &n) < 0)
        return NULL;
    if (n && !ptr)
        return raise_fmt(STRATA_EINVAL, "hash_bytes: data_ptr is 0");
    XXH64_hash_t h;
    const void *p = (const void *)(uintptr_t)ptr;
    Py_BEGIN_ALLOW_THREADS
    h = XXH3_64bits(n ? p : "", (size_t)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *mod_uri_path(PyObject *m, PyObject *arg)
{
    (void)m;
    PyObject *keep;
    const char *uri = get_path(arg, &keep);
    if (!uri)
        return NULL;
    char path[4096];
    int rc = strata_uri_path(path, sizeof path, uri); /* at most a mkdir: the GIL stays held */
    Py_DECREF(keep);
    if (rc)
        return raise_last(rc);
    return PyUnicode_DecodeFSDefault(path);
}

static PyObject *mod_probe(PyObject *m, PyObject *arg)
{
    (void)m;
    PyObject *keep;
    const char *uri = get_path(arg, &keep);
    if (!uri)
        return NULL;
    strata_probe_info pi;
    char msg[MSG_BYTES];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = strata_probe(&pi, uri);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    Py_DECREF(keep);
    if (rc)
        return raise_msg(rc, msg);
    return Py_BuildValue("{s:O,s:O,s:O,s:O,s:K,s:K}", "is_ckpt", pi.is_ckpt ? Py_True : Py_False,
                         "has_commit", pi.has_commit ? Py_True : Py_False, "committed",
                         pi.committed ? Py_True : Py_False, "has_metadata",
                         pi.has_metadata ? Py_True : Py_False, "step",
                         (unsigned long long)pi.step, "disk_bytes",
                         (unsigned long long)pi.disk_bytes);
}

static PyObject *mod_retain(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"dir_uri", "keep", NULL};
    PyObject *odir;
    int keepn;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oi:retain", kwlist, &odir, &keepn))
        return NULL;
    PyObject *keep;
    const char *dir = get_path(odir, &keep);
    if (!dir)
        return NULL;
    int removed = 0, rc;
    char msg[MSG_BYTES];
    Py_BEGIN_ALLOW_THREADS
    rc = strata_retain(&removed, dir, keepn);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    Py_DECREF(keep);
    if (rc)
        return raise_msg(rc, msg);
    return PyLong_FromLong(removed);
}

static PyObject *mod_remove_incomplete(PyObject *m, PyObject *arg)
{
    (void)m;
    PyObject *keep;
    const char *uri = get_path(arg, &keep);
    if (!uri)
        return NULL;
    int rc;
    char msg[MSG_BYTES];
    Py_BEGIN_ALLOW_THREADS
    rc = strata_remove_incomplete(uri);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    Py_DECREF(keep);
    if (rc)
        return raise_msg(rc, msg);
    Py_RETURN_NONE;
}

/* ---- export to safetensors ------------------------------------------------------------ */

typedef struct {
    PyObject *fn;      /* the progress callable, or NULL */
    PyObject *pending; /* the exception it raised (or a KeyboardInterrupt) */
} export_ctx;

/* The export's progress callback, on the thread that called export_safetensors (the GIL
 * released by it): takes the GIL back, calls the callable with (done, total), and stops
 * the export when it raises or a signal handler does (Ctrl-C). */
static int export_progress(void *ctx, uint64_t done, uint64_t total)
{
    export_ctx *x = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    int rc = 0;
    if (PyErr_CheckSignals() < 0) {
        rc = -1;
    } else if (x->fn) {
        PyObject *r = PyObject_CallFunction(x->fn, "KK", (unsigned long long)done,
                                            (unsigned long long)total);
        if (r)
            Py_DECREF(r);
        else
            rc = -1;
    }
    if (rc) {
        PyObject *v = err_take();
        char text[768];
        exc_text(v, text, sizeof text);
        strata_error_set(STRATA_EABORTED, "export stopped: %s %s%s%s",
                         x->fn ? "the progress callback raised" : "interrupted by",
                         v ? Py_TYPE(v)->tp_name : "an error", text[0] ? ": " : "", text);
        Py_XSETREF(x->pending, v);
    }
    PyGILState_Release(g);
    return rc;
}

/* The export's selection: include / exclude (NULL-terminated arrays) and model_only. */
typedef struct {
    const char **inc, **exc;
    const char *model_only;
} export_sel;

static PyObject *export_run(PyObject *args, PyObject *kw, const export_sel *sel)
{
    static char *kwlist[] = {"ckpt", "out", "prefix", "max_file_bytes", "dtype", "progress",
                             "io_threads", "direct", NULL};
    PyObject *ockpt, *oout, *oprefix = Py_None, *omax = Py_None, *odtype = Py_None,
                            *oprog = Py_None, *othreads = Py_None;
    int direct = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OOOOOp:export_safetensors", kwlist, &ockpt,
                                     &oout, &oprefix, &omax, &odtype, &oprog, &othreads, &direct))
        return NULL;
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.include = sel->inc;
    o.exclude = sel->exc;
    o.model_only = sel->model_only;
    if (!direct)
        o.flags |= STRATA_EXPORT_NO_DIRECT;
    uint64_t v;
    long l;
    if (omax != Py_None) {
        if (get_u64(omax, "max_file_bytes", &v) < 0)
            return NULL;
        if (v == 0)
            return raise_fmt(STRATA_EINVAL, "max_file_bytes must be at least 1 (None: 5e9)");
        o.max_file_bytes = v;
    }
    if (othreads != Py_None) {
        if (get_int(othreads, "io_threads", 0, INT_MAX, &l) < 0)
            return NULL;
        o.io_threads = (int)l;
    }
    if (odtype != Py_None) {
        const char *d = PyUnicode_Check(odtype) ? PyUnicode_AsUTF8(odtype) : NULL;
        if (PyUnicode_Check(odtype) && !d)
            return NULL;
        if (!d || strcmp(d, "bf16") != 0) {
            PyObject *r = PyObject_Repr(odtype);
            const char *rs = r ? PyUnicode_AsUTF8(r) : NULL;
            if (!rs) {
                Py_XDECREF(r);
                return NULL;
            }
            raise_fmt(STRATA_EINVAL, "export dtype %s: only 'bf16' (or None: as saved)", rs);
            Py_DECREF(r);
            return NULL;
        }
        o.flags |= STRATA_EXPORT_BF16;
    }
    if (oprog != Py_None && !PyCallable_Check(oprog))
        return PyErr_Format(PyExc_TypeError, "progress must be callable or None");
    PyObject *kck = NULL, *kout = NULL, *kpre = NULL;
    const char *ck = get_path(ockpt, &kck), *out = ck ? get_path(oout, &kout) : NULL;
    if (!ck || !out) {
        Py_XDECREF(kck);
        return NULL;
    }
    if (oprefix != Py_None) {
        if (!PyUnicode_Check(oprefix)) {
            Py_DECREF(kck);
            Py_DECREF(kout);
            return PyErr_Format(PyExc_TypeError, "prefix must be a str or None");
        }
        o.prefix = get_name(oprefix, "prefix");
        if (!o.prefix) {
            Py_DECREF(kck);
            Py_DECREF(kout);
            return NULL;
        }
        kpre = oprefix;
        Py_INCREF(kpre);
    }
    export_ctx x = {oprog != Py_None ? oprog : NULL, NULL};
    Py_XINCREF(x.fn);
    o.progress = export_progress;
    o.progress_ctx = &x;
    strata_stats s = STRATA_STATS_INIT;
    char msg[MSG_BYTES];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = strata_export_safetensors(&s, ck, out, &o);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    Py_DECREF(kck);
    Py_DECREF(kout);
    Py_XDECREF(kpre);
    Py_XDECREF(x.fn);
    if (rc) {
        if (x.pending && !PyObject_IsInstance(x.pending, PyExc_Exception)) {
            err_give(x.pending); /* KeyboardInterrupt, SystemExit: raised as they are */
            return NULL;
        }
        raise_msg(rc, msg);
        set_cause(x.pending);
        Py_XDECREF(x.pending);
        return NULL;
    }
    Py_XDECREF(x.pending);
    return Py_BuildValue("{s:K,s:K,s:K,s:d}", "data_bytes", (unsigned long long)s.data_bytes,
                         "bytes", (unsigned long long)s.bytes, "io_calls",
                         (unsigned long long)s.io_calls, "seconds", s.seconds);
}

/* A pattern list (None, one str, or an iterable of str) as a NULL-terminated array
 * (PyMem; NULL for None) whose strings *keep (a tuple) holds alive. */
static int get_patterns(PyObject *o, const char *what, PyObject **keep, const char ***out)
{
    *keep = NULL;
    *out = NULL;
    if (!o || o == Py_None)
        return 0;
    PyObject *t = PyUnicode_Check(o) ? PyTuple_Pack(1, o) : PySequence_Tuple(o);
    if (!t)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    const char **a = PyMem_Calloc((size_t)n + 1, sizeof *a);
    if (!a) {
        Py_DECREF(t);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!(a[i] = get_name(PyTuple_GET_ITEM(t, i), what))) {
            PyMem_Free(a);
            Py_DECREF(t);
            return -1;
        }
    *keep = t;
    *out = a;
    return 0;
}

/* Takes the keyword argument `name` out of kw (a copy of the caller's): borrowed, or NULL. */
static PyObject *take_kw(PyObject *kw, const char *name)
{
    PyObject *v = PyDict_GetItemString(kw, name);
    if (v) /* still held by the caller's dict */
        PyDict_DelItemString(kw, name);
    return v;
}

static PyObject *mod_export_safetensors(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    PyObject *rest = kw ? PyDict_Copy(kw) : PyDict_New(), *kinc = NULL, *kexc = NULL, *r = NULL;
    if (!rest)
        return NULL;
    export_sel sel = {NULL, NULL, NULL};
    PyObject *oinc = take_kw(rest, "include"), *oexc = take_kw(rest, "exclude"),
             *omodel = take_kw(rest, "model_only");
    if (get_patterns(oinc, "include pattern", &kinc, &sel.inc) < 0 ||
        get_patterns(oexc, "exclude pattern", &kexc, &sel.exc) < 0)
        goto out;
    if (omodel == Py_True) {
        sel.model_only = "model";
    } else if (omodel && omodel != Py_None && omodel != Py_False) {
        if (!PyUnicode_Check(omodel)) {
            PyErr_Format(PyExc_TypeError, "model_only must be a str (the key the model was "
                         "saved under), True (\"model\") or None, not %.100s",
                         Py_TYPE(omodel)->tp_name);
            goto out;
        }
        if (!(sel.model_only = get_name(omodel, "model_only")))
            goto out;
    }
    r = export_run(args, rest, &sel);
out:
    PyMem_Free(sel.inc);
    PyMem_Free(sel.exc);
    Py_XDECREF(kinc);
    Py_XDECREF(kexc);
    Py_DECREF(rest);
    return r;
}

static PyMethodDef module_methods[] = {
    {"load", (PyCFunction)(void (*)(void))mod_load, METH_VARARGS | METH_KEYWORDS,
     "load(uris, states, comm=None, *, io_threads=0, max_io_bytes=0, direct=True, cast=False)"
     " -> dict\n\n"
     "strata_load: from the first source that loads (stats['tier'] says which). cast: a shard\n"
     "of another dtype than saved is converted (STRATA_LOAD_CAST: floats rounded once to\n"
     "nearest even; integers only where exact)."},
    {"dtype_size", (PyCFunction)mod_dtype_size, METH_O, "dtype_size(name) -> bytes per element"},
    {"hash_bytes", (PyCFunction)(void (*)(void))mod_hash_bytes, METH_VARARGS | METH_KEYWORDS,
     "hash_bytes(data_ptr, nbytes) -> int: XXH3-64 of the bytes (GIL released)."},
    {"uri_path", (PyCFunction)mod_uri_path, METH_O,
     "uri_path(uri) -> str: the local path a URI names (mem://name under $STRATA_MEM_ROOT)"},
    {"probe", (PyCFunction)mod_probe, METH_O,
     "probe(uri) -> {is_ckpt, has_commit, committed, has_metadata, step, disk_bytes}"},
    {"retain", (PyCFunction)(void (*)(void))mod_retain, METH_VARARGS | METH_KEYWORDS,
     "retain(dir_uri, keep) -> number of checkpoints removed"},
    {"remove_incomplete", (PyCFunction)mod_remove_incomplete, METH_O,
     "remove_incomplete(uri): removes a checkpoint that has no valid commit record."},
    {"export_safetensors", (PyCFunction)(void (*)(void))mod_export_safetensors,
     METH_VARARGS | METH_KEYWORDS,
     "export_safetensors(ckpt, out, *, prefix=None, max_file_bytes=None, dtype=None, "
     "progress=None, io_threads=None, direct=True, include=None, exclude=None, "
     "model_only=None) -> dict\n\n"
     "strata_export_safetensors: the checkpoint's tensors, merged to their global shapes, as "
     "Hugging Face safetensors files in the directory out (model-0000i-of-0000N.safetensors "
     "and model.safetensors.index.json), in bounded memory, every checksum verified. prefix "
     "is stripped from names; max_file_bytes (default 5e9) splits the files; dtype 'bf16' "
     "converts f64/f32/f16 tensors; direct=False never uses O_DIRECT. progress(done, total) "
     "is called with the GIL after each window (at most 64 MiB); if it raises, the export "
     "stops with AbortedError (that exception as __cause__) and leaves no file; Ctrl-C stops "
     "it too (KeyboardInterrupt). The GIL is released meanwhile. include / exclude (a str "
     "or a list of them): fnmatch globs on the checkpoint's names, exclude wins; model_only "
     "P (True: 'model'): only the tensors named P.<name>, written as <name>, never a "
     "per-rank <key>@rank<r> one; a selection keeping nothing is NotFoundError. "
     "Returns {data_bytes, bytes, io_calls, seconds}."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "strata._strata",
    "libstrata bound to Python: the layer strata.torch builds on.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

/* PyModule_AddObjectRef (3.10) for 3.9 too. */
static int add_ref(PyObject *m, const char *name, PyObject *o)
{
    Py_INCREF(o);
    if (PyModule_AddObject(m, name, o) < 0) {
        Py_DECREF(o);
        return -1;
    }
    return 0;
}

/* The exception classes, from STRATA_ERRNO_MAP: strata.Error and one subclass per code. */
static int add_errors(PyObject *m)
{
    PyObject *d = Py_BuildValue("{s:O,s:O}", "code", Py_None, "name", Py_None);
    if (!d)
        return -1;
    Error = PyErr_NewExceptionWithDoc("strata.Error",
                                      "A strata error: code (the C code), name "
                                      "('STRATA_E...'), and the C message as its text.",
                                      PyExc_Exception, d);
    Py_DECREF(d);
    if (!Error || add_ref(m, "Error", Error) < 0)
        return -1;
    PyObject *by_code = PyDict_New();
    if (!by_code)
        return -1;
    for (size_t i = 0; i < NERRS; i++) {
        if (errs[i].code == STRATA_OK)
            continue;
        char cname[96], qual[112];
        snprintf(cname, sizeof cname, "%sError", errs[i].name);
        for (size_t j = 0; j < sizeof err_class_names / sizeof err_class_names[0]; j++)
            if (!strcmp(err_class_names[j].name, errs[i].name))
                snprintf(cname, sizeof cname, "%s", err_class_names[j].cls);
        snprintf(qual, sizeof qual, "strata.%s", cname);
        PyObject *attrs = Py_BuildValue("{s:i,s:s}", "code", errs[i].code, "name",
                                        strata_error_name(errs[i].code));
        if (!attrs)
            goto fail;
        char doc[256];
        snprintf(doc, sizeof doc, "STRATA_%s: %s", errs[i].name, errs[i].msg);
        errs[i].cls = PyErr_NewExceptionWithDoc(qual, doc, Error, attrs);
        Py_DECREF(attrs);
        if (!errs[i].cls || add_ref(m, cname, errs[i].cls) < 0)
            goto fail;
        PyObject *k = PyLong_FromLong(errs[i].code);
        if (!k || PyDict_SetItem(by_code, k, errs[i].cls) < 0) {
            Py_XDECREF(k);
            goto fail;
        }
        Py_DECREF(k);
    }
    return PyModule_AddObject(m, "ERRORS", by_code) < 0 ? (Py_DECREF(by_code), -1) : 0;
fail:
    Py_DECREF(by_code);
    return -1;
}

PyMODINIT_FUNC PyInit__strata(void)
{
    PyTypeObject *types[] = {&StateType, &PoolType, &CommType, &SaverType, &HandleType,
                             &CkptType};
    const char *names[] = {"State", "Pool", "Comm", "Saver", "Handle", "Checkpoint"};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (add_ref(m, names[i], (PyObject *)types[i]) < 0)
            goto fail;
    if (add_errors(m) < 0)
        goto fail;
    PyObject *dt = PyTuple_New(STRATA_DTYPE_COUNT);
    if (!dt)
        goto fail;
    for (int i = 0; i < STRATA_DTYPE_COUNT; i++) {
        PyObject *s = PyUnicode_FromString(strata_dtype_name((strata_dtype)i));
        if (!s) {
            Py_DECREF(dt);
            goto fail;
        }
        PyTuple_SET_ITEM(dt, i, s);
    }
    if (PyModule_AddObject(m, "DTYPES", dt) < 0) {
        Py_DECREF(dt);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "MAX_DIMS", STRATA_MAX_DIMS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_NAME", STRATA_MAX_NAME) < 0 ||
        PyModule_AddIntConstant(m, "MAX_TIERS", STRATA_MAX_TIERS) < 0 ||
        PyModule_AddIntConstant(m, "DEFAULT_CHUNK", STRATA_DEFAULT_CHUNK) < 0 ||
        PyModule_AddObject(m, "VERSION",
                           Py_BuildValue("(ii)", STRATA_VERSION_MAJOR, STRATA_VERSION_MINOR)) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
