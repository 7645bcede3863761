/* _strata_load.c - strata._strata's loads: load (strata_load) and Loader (strata_loader: a
 * checkpoint opened once - with a Comm, its index read by rank 0 and agreed on with one
 * broadcast - queried, and loaded as often as the caller wants). A Loader is used by one
 * thread at a time (a second call while one runs: InvalidArgumentError). */
#include "_strata.h"

/* The load options of keyword arguments (each may be NULL). 0, or -1 with an error. */
static int load_opts_get(strata_load_opts *o, PyObject *othreads, PyObject *omax, int direct,
                         int cast, int widen, int skip_crc)
{
    *o = (strata_load_opts)STRATA_LOAD_OPTS_INIT;
    long l;
    uint64_t v;
    if (othreads) {
        if (get_int(othreads, "io_threads", 0, INT_MAX, &l) < 0)
            return -1;
        o->io_threads = (int)l;
    }
    if (omax) {
        if (get_u64(omax, "max_io_bytes", &v) < 0)
            return -1;
        if (v > UINT32_MAX) {
            raise_fmt(STRATA_EINVAL, "max_io_bytes %llu does not fit in 32 bits",
                      (unsigned long long)v);
            return -1;
        }
        o->max_io_bytes = (uint32_t)v;
    }
    if (!direct)
        o->flags |= STRATA_LOAD_NO_DIRECT;
    if (cast)
        o->flags |= STRATA_LOAD_CAST;
    if (widen)
        o->flags |= STRATA_LOAD_WIDEN;
    if (skip_crc)
        o->flags |= STRATA_LOAD_SKIP_CRC;
    return 0;
}

static CommObject *comm_arg(PyObject *ocomm)
{
    if (ocomm != Py_None && !PyObject_TypeCheck(ocomm, &CommType)) {
        PyErr_Format(PyExc_TypeError, "comm must be a strata.Comm or None");
        return NULL;
    }
    return ocomm == Py_None ? NULL : (CommObject *)ocomm;
}

/* The body of strata.load (ld NULL: strata_load of the URIs u) and Loader.load (ld: its
 * strata_loader_load, *busy set while it runs): loads the states of ostates with the options
 * o, the GIL let go. Returns the stats dict, or NULL with the error raised. */
static PyObject *load_into(PyObject *ostates, CommObject *comm, const uri_list *u,
                           strata_loader *ld, int *busy, const strata_load_opts *o)
{
    state_list sl;
    if (states_get(&sl, ostates) < 0)
        return NULL;
    Py_XINCREF(comm);
    comm_begin(comm);
    if (busy)
        *busy = 1;
    strata_stats s = STRATA_STATS_INIT;
    char msg[MSG_BYTES];
    int rc;
    strata_comm *c = comm ? comm->c : NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = ld ? strata_loader_load(&s, ld, sl.p, sl.n, o)
            : strata_load(&s, c, u->p, u->n, sl.p, sl.n, o);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    if (busy)
        *busy = 0;
    states_release(&sl);
    PyObject *r = rc ? raise_comm(rc, msg, comm) : stats_dict(&s, 1);
    Py_XDECREF(comm);
    return r;
}

PyObject *mod_load(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"uris", "states", "comm", "io_threads", "max_io_bytes", "direct",
                             "cast", "widen", "skip_crc", NULL};
    PyObject *ouris, *ostates, *ocomm = Py_None, *othreads = NULL, *omax = NULL;
    int direct = 1, cast = 0, widen = 0, skip_crc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OOpppp:load", kwlist, &ouris, &ostates,
                                     &ocomm, &othreads, &omax, &direct, &cast, &widen,
                                     &skip_crc))
        return NULL;
    CommObject *comm = comm_arg(ocomm);
    strata_load_opts o;
    if ((!comm && ocomm != Py_None) ||
        load_opts_get(&o, othreads, omax, direct, cast, widen, skip_crc) < 0)
        return NULL;
    uri_list u;
    if (uris_get(&u, ouris) < 0)
        return NULL;
    PyObject *r = load_into(ostates, comm, &u, NULL, NULL, &o);
    uris_free(&u);
    return r;
}

/* ---- Loader ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    strata_loader *ld; /* NULL once closed */
    CommObject *comm;  /* or NULL */
    PyObject *uris;    /* the tuple of URIs given (str) */
    int busy;          /* a load in flight */
    PyObject *weakrefs;
} LoaderObject;

static PyObject *Loader_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"uris", "comm", NULL};
    PyObject *ouris, *ocomm = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:Loader", kwlist, &ouris, &ocomm))
        return NULL;
    CommObject *comm = comm_arg(ocomm);
    if (!comm && ocomm != Py_None)
        return NULL;
    uri_list u;
    if (uris_get(&u, ouris) < 0)
        return NULL;
    LoaderObject *self = (LoaderObject *)type->tp_alloc(type, 0);
    if (!self || !(self->uris = PyTuple_New(u.n))) {
        Py_XDECREF(self);
        uris_free(&u);
        return NULL;
    }
    for (int i = 0; i < u.n; i++) {
        PyObject *s = PyUnicode_DecodeFSDefault(u.p[i]);
        if (!s) {
            Py_DECREF(self);
            uris_free(&u);
            return NULL;
        }
        PyTuple_SET_ITEM(self->uris, i, s);
    }
    Py_XINCREF(comm);
    self->comm = comm;
    comm_begin(comm);
    char msg[MSG_BYTES];
    int rc;
    strata_comm *c = comm ? comm->c : NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = strata_loader_open(&self->ld, c, u.p, u.n, NULL);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    uris_free(&u);
    if (rc) {
        raise_comm(rc, msg, comm);
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int Loader_traverse(LoaderObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->comm);
    return 0;
}

static int Loader_clear(LoaderObject *self)
{
    Py_CLEAR(self->comm);
    return 0;
}

static void Loader_dealloc(LoaderObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    strata_loader_free(self->ld); /* not a collective */
    Py_CLEAR(self->comm);
    Py_CLEAR(self->uris);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int loader_usable(LoaderObject *self)
{
    if (!self->ld) {
        raise_fmt(STRATA_EINVAL, "strata.Loader: closed");
        return -1;
    }
    if (strata_loader_tier(self->ld) < 0) {
        raise_fmt(STRATA_EINVAL, "strata.Loader: no tier left (a load failed on every one)");
        return -1;
    }
    if (self->busy) {
        raise_fmt(STRATA_EINVAL, "strata.Loader: a load is in flight on another thread");
        return -1;
    }
    return 0;
}

static PyObject *Loader_load(LoaderObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"states", "io_threads", "max_io_bytes", "direct", "cast", "widen",
                             "skip_crc", NULL};
    PyObject *ostates, *othreads = NULL, *omax = NULL;
    int direct = 1, cast = 0, widen = 0, skip_crc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OOpppp:load", kwlist, &ostates, &othreads,
                                     &omax, &direct, &cast, &widen, &skip_crc))
        return NULL;
    strata_load_opts o;
    if (loader_usable(self) < 0 ||
        load_opts_get(&o, othreads, omax, direct, cast, widen, skip_crc) < 0)
        return NULL;
    return load_into(ostates, self->comm, NULL, self->ld, &self->busy, &o);
}

/* [(name, dtype, [shape...]) ...] of the index, as lists (what strata.torch's _Meta takes). */
static PyObject *index_tensors(const strata_ckpt *ck)
{
    size_t n = strata_ckpt_ntensors(ck);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        strata_tensor_info ti;
        strata_ckpt_tensor(&ti, ck, i);
        PyObject *shape = PyList_New(ti.ndim);
        for (int d = 0; shape && d < ti.ndim; d++) {
            PyObject *x = PyLong_FromUnsignedLongLong(ti.shape[d]);
            if (!x)
                Py_CLEAR(shape);
            else
                PyList_SET_ITEM(shape, d, x);
        }
        PyObject *e = shape ? Py_BuildValue("[NsN]", ckpt_name_str(ti.name),
                                            strata_dtype_name(ti.dtype), shape)
                            : NULL;
        if (!e) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, e);
    }
    return list;
}

static PyObject *index_blobs(const strata_ckpt *ck)
{
    size_t n = strata_ckpt_nblobs(ck);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        strata_blob_info bi;
        strata_ckpt_blob(&bi, ck, i);
        PyObject *e = Py_BuildValue("[NiK]", ckpt_name_str(bi.name), bi.owner,
                                    (unsigned long long)bi.bytes);
        if (!e) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, e);
    }
    return list;
}

static PyObject *Loader_index(LoaderObject *self, PyObject *unused)
{
    (void)unused;
    if (loader_usable(self) < 0)
        return NULL;
    const strata_ckpt *ck = strata_loader_index(self->ld);
    return Py_BuildValue("{s:K,s:i,s:s,s:I,s:K,s:N,s:N}", "step",
                         (unsigned long long)strata_ckpt_step(ck), "uri",
                         strata_loader_tier(self->ld), "f", ckpt_format_str(ck), "chunk_bytes",
                         (unsigned)strata_ckpt_chunk_bytes(ck), "data_bytes",
                         (unsigned long long)strata_ckpt_data_bytes(ck), "t", index_tensors(ck),
                         "b", index_blobs(ck));
}

static PyObject *Loader_close(LoaderObject *self, PyObject *unused)
{
    (void)unused;
    if (self->busy)
        return raise_fmt(STRATA_EINVAL, "strata.Loader: a load is in flight on another thread");
    strata_loader_free(self->ld);
    self->ld = NULL;
    Py_RETURN_NONE;
}

static PyObject *Loader_exit(LoaderObject *self, PyObject *args)
{
    (void)args;
    return Loader_close(self, NULL);
}

static PyObject *Loader_tier(LoaderObject *self, void *closure)
{
    (void)closure;
    if (loader_usable(self) < 0)
        return NULL;
    return PyLong_FromLong(strata_loader_tier(self->ld));
}

static PyObject *Loader_uri(LoaderObject *self, void *closure)
{
    (void)closure;
    if (loader_usable(self) < 0)
        return NULL;
    PyObject *u = PyTuple_GET_ITEM(self->uris, strata_loader_tier(self->ld));
    Py_INCREF(u);
    return u;
}

static PyMethodDef Loader_methods[] = {
    {"load", (PyCFunction)(void (*)(void))Loader_load, METH_VARARGS | METH_KEYWORDS,
     "load(states, *, io_threads=0, max_io_bytes=0, direct=True, cast=False, widen=False,\n"
     "     skip_crc=False)\n"
     "-> stats\n\n"
     "strata_loader_load: loads into the states (with a Comm: this rank's one state, every\n"
     "rank together) without reading the index again (cast, widen: as strata.load's); a\n"
     "request equal to the last load's\n"
     "reuses its plan (stats['plan_cached']). A load that fails on the tier open now goes on\n"
     "to the next tier (stats['tier']); stats['meta_reads'] / ['meta_bcasts'] count the\n"
     "index's reads and broadcasts since the open. The zip CRC-32s of a DCP, torch.save,\n"
     "DeepSpeed or Megatron checkpoint are checked (each entry read whole:\n"
     "stats['crc_checked'], ['crc_bytes']) unless skip_crc=True (stats['crc_skipped'])."},
    {"index", (PyCFunction)Loader_index, METH_NOARGS,
     "index() -> {step, uri (the tier's index), f (format), chunk_bytes (0: no checksums),\n"
     "data_bytes, t: [[name, dtype, [shape]]...], b: [[name, owner, bytes]...]}: the index\n"
     "of the tier open now, on every rank (no I/O)."},
    {"close", (PyCFunction)Loader_close, METH_NOARGS,
     "Frees the loader (not a collective); later calls raise."},
    {"__enter__", (PyCFunction)enter_self, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Loader_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Loader_getset[] = {
    {"tier", (getter)Loader_tier, NULL, "the index of the tier open now", NULL},
    {"uri", (getter)Loader_uri, NULL, "the URI of the tier open now", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject LoaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata.Loader",
    .tp_basicsize = sizeof(LoaderObject),
    .tp_weaklistoffset = offsetof(LoaderObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Loader(uris, comm=None)\n\nstrata_loader_open: opens the first of uris (one, or "
              "tiers fastest first) that\nholds a readable checkpoint and reads its index once "
              "(with a Comm, a collective:\nrank 0 reads, one broadcast agrees). Then "
              "index() and load(states) as often as\nwanted; close() (or a with block) frees "
              "it.",
    .tp_new = Loader_new,
    .tp_dealloc = (destructor)Loader_dealloc,
    .tp_traverse = (traverseproc)Loader_traverse,
    .tp_clear = (inquiry)Loader_clear,
    .tp_methods = Loader_methods,
    .tp_getset = Loader_getset,
};
