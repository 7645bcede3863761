/* _strata_state.c - strata._strata's State: the tensors and blobs a rank saves or loads
 * (strata_state), registered by pointer; the objects owning that memory held by the State. */
#include "_strata.h"

/* ---- State ----------------------------------------------------------------------------- */


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

/* What add_shard and add_blob (fn) check first: data_ptr and nbytes given (keyword-only,
 * without a default), the State not in use by a save, the name (of a what); returns the name,
 * or NULL with the error raised. */
static const char *add_begin(StateObject *self, const char *fn, PyObject *optr, PyObject *onbytes,
                             PyObject *oname, const char *what)
{
    if (!optr || !onbytes) {
        PyErr_Format(PyExc_TypeError, "%s() missing required keyword argument '%s'", fn,
                     optr ? "nbytes" : "data_ptr");
        return NULL;
    }
    if (state_writable(self) < 0)
        return NULL;
    return get_name(oname, what);
}

static PyObject *State_add_shard(StateObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name",   "dtype",  "global_shape", "offsets", "lengths", "data_ptr",
                             "nbytes", "flat",   "device",       "keep",    "unchanged",
                             "replica", NULL};
    PyObject *oname, *odtype, *oshape, *ooff = Py_None, *olen = Py_None, *optr = NULL,
                                            *onbytes = NULL, *oflat = Py_None, *keep = Py_None;
    int device = 0, unchanged = 0, replica = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OO$OOOpOpp:add_shard", kwlist, &oname,
                                     &odtype, &oshape, &ooff, &olen, &optr, &onbytes, &oflat,
                                     &device, &keep, &unchanged, &replica))
        return NULL;
    const char *name = add_begin(self, "add_shard", optr, onbytes, oname, "tensor");
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
                      device,
                      (unchanged ? STRATA_SHARD_UNCHANGED : 0) |
                          (replica ? STRATA_SHARD_REPLICA : 0)};
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
    const char *name = add_begin(self, "add_blob", optr, onbytes, oname, "blob");
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
     "flat=None, device=False, keep=None, unchanged=False, replica=False)\n\nRegisters a "
     "shard (strata_state_add_shard). nbytes must be the shard's numel times the dtype's size; "
     "keep is held until clear(). unchanged=True: STRATA_SHARD_UNCHANGED, the caller's promise "
     "that the bytes equal the base's shard at the same place (not read where the base holds "
     "it). replica=True: STRATA_SHARD_REPLICA, not the main copy of its piece (another rank "
     "registers that, e.g. Megatron's replica_id != 0): saved by its main copy's holders, or "
     "not at all when no main piece is identical to it."},
    {"add_blob", (PyCFunction)(void (*)(void))State_add_blob, METH_VARARGS | METH_KEYWORDS,
     "add_blob(name, *, data_ptr, nbytes, rank_local=False, owner=-1, keep=None)"},
    {"clear", (PyCFunction)State_clear, METH_NOARGS,
     "Drops every registration and kept reference; the State can be filled again."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject StateType = {
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

void states_release(state_list *l)
{
    if (l->tuple)
        for (int i = 0; i < l->n; i++)
            ((StateObject *)PyTuple_GET_ITEM(l->tuple, i))->users--;
    Py_CLEAR(l->tuple);
    PyMem_Free(l->p);
    l->p = NULL;
    l->n = 0;
}

int states_get(state_list *l, PyObject *arg)
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

