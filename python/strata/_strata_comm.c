/* _strata_comm.c - strata._strata's Comm: a host communicator whose collectives are Python
 * callables (taking the GIL for each call), its dup for a saver's background commits,
 * Comm.self(), and Comm.agree (strata_comm_agree: the agreement strata.torch runs before
 * each save and load). */
#include "_strata.h"

/* ---- Comm: host collectives ------------------------------------------------------------ */

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


/* Before a call that may run the callbacks: forget an older callback's exception. */
void comm_begin(CommObject *c)
{
    if (c && c->ctx)
        Py_CLEAR(c->ctx->pending);
}

/* After a failed call: the exception a callback raised becomes the __cause__. */
PyObject *comm_take_pending(CommObject *c)
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

/* The code another rank raises for exception e of this rank's step: a strata.Error's own
 * (its class's `code`), else STRATA_EINVAL. */
static int code_of(PyObject *e)
{
    PyObject *c = PyObject_GetAttrString(e, "code");
    long v = c && PyLong_Check(c) ? PyLong_AsLong(c) : 0;
    Py_XDECREF(c);
    PyErr_Clear();
    return v < 0 && v >= INT32_MIN && strcmp(strata_error_name((int)v), "STRATA_E?")
               ? (int)v
               : STRATA_EINVAL;
}

/* Comm.agree: strata_comm_agree, the GIL let go (the callbacks take it). */
static PyObject *Comm_agree(CommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"payload", "what", "error", "inline", "same", NULL};
    Py_buffer pb = {0};
    const char *what = "a step";
    PyObject *error = Py_None;
    Py_ssize_t inl = 0;
    int same = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|y*$sOnp:agree", kwlist, &pb, &what, &error,
                                     &inl, &same))
        return NULL;
    int rc = 0;
    if (inl < 0) {
        PyBuffer_Release(&pb);
        return PyErr_Format(PyExc_ValueError, "Comm.agree: inline must be >= 0");
    }
    if (error != Py_None) {
        if (!PyExceptionInstance_Check(error)) {
            PyBuffer_Release(&pb);
            return PyErr_Format(PyExc_TypeError, "Comm.agree: error must be an exception");
        }
        char text[MSG_BYTES];
        exc_text(error, text, sizeof text);
        rc = strata_error_set(code_of(error), "%s", text[0] ? text : Py_TYPE(error)->tp_name);
    }
    size_t size = (size_t)strata_comm_size(self->c), *lens = PyMem_Calloc(size, sizeof *lens);
    if (!lens) {
        PyBuffer_Release(&pb);
        return PyErr_NoMemory();
    }
    unsigned char *out = NULL;
    char msg[MSG_BYTES];
    int r;
    comm_begin(self);
    Py_BEGIN_ALLOW_THREADS
    r = strata_comm_agree(&out, lens, self->c, what, rc, pb.buf, (size_t)pb.len, (size_t)inl,
                          same ? STRATA_AGREE_SAME : 0);
    snprintf(msg, sizeof msg, "%s", r ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pb);
    PyObject *res = NULL;
    if (r) {
        raise_comm(r, msg, self);
    } else if (same && !out) {
        res = Py_NewRef(Py_None);
    } else if ((res = PyList_New((Py_ssize_t)size))) {
        size_t at = 0;
        for (size_t i = 0; i < size; i++) {
            PyObject *b = PyBytes_FromStringAndSize(lens[i] ? (const char *)out + at : "",
                                                    (Py_ssize_t)lens[i]);
            if (!b) {
                Py_CLEAR(res);
                break;
            }
            PyList_SET_ITEM(res, (Py_ssize_t)i, b);
            at += lens[i];
        }
    }
    strata_free(out);
    PyMem_Free(lens);
    return res;
}

/* strata_peer_replicate (replicas > 0) or strata_peer_restore on this communicator. */
static PyObject *peer_call(CommObject *self, const char *uri, int replicas)
{
    strata_peer_info info;
    char msg[MSG_BYTES];
    int r;
    comm_begin(self);
    Py_BEGIN_ALLOW_THREADS
    r = replicas ? strata_peer_replicate(&info, self->c, uri, replicas)
                 : strata_peer_restore(&info, self->c, uri);
    snprintf(msg, sizeof msg, "%s", r ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    if (r)
        return raise_comm(r, msg, self);
    return Py_BuildValue("{s:i,s:i,s:K,s:K,s:K,s:K,s:K,s:K}", "nodes", info.nodes,
                         "replicas", info.replicas, "step", (unsigned long long)info.step,
                         "save_id", (unsigned long long)info.save_id, "bytes_sent",
                         (unsigned long long)info.bytes_sent, "bytes_received",
                         (unsigned long long)info.bytes_received, "bytes_held",
                         (unsigned long long)info.bytes_held, "share_bytes",
                         (unsigned long long)info.share_bytes);
}

static PyObject *Comm_peer_replicate(CommObject *self, PyObject *args)
{
    const char *uri;
    int replicas;
    if (!PyArg_ParseTuple(args, "si:peer_replicate", &uri, &replicas))
        return NULL;
    if (replicas < 1)
        return PyErr_Format(PyExc_ValueError, "peer_replicate: replicas must be >= 1");
    return peer_call(self, uri, replicas);
}

static PyObject *Comm_peer_restore(CommObject *self, PyObject *args)
{
    const char *uri;
    if (!PyArg_ParseTuple(args, "s:peer_restore", &uri))
        return NULL;
    return peer_call(self, uri, 0);
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
    {"agree", (PyCFunction)(void (*)(void))Comm_agree, METH_VARARGS | METH_KEYWORDS,
     "agree(payload=b'', *, what='a step', error=None, inline=0, same=False) -> list | None\n\n"
     "A step each rank ran on its own, agreed on (strata_comm_agree; a collective): every\n"
     "rank's payload (bytes), a list by rank - or None where same=True and every rank's is\n"
     "the same. error: the exception of this rank's step, which failed: every rank then\n"
     "raises - this one the strata error of error's code (a strata.Error's, else\n"
     "InvalidArgumentError) with its text, the others that of the first rank that failed,\n"
     "\"<what> failed on rank <r>: <its text>\". One collective when every payload (or\n"
     "failing rank's text) is at most `inline` bytes, or with same=True all are the same;\n"
     "else two."},
    {"peer_replicate", (PyCFunction)Comm_peer_replicate, METH_VARARGS,
     "peer_replicate(uri, replicas) -> dict\n\nstrata_peer_replicate (a collective): each "
     "rank names its node's copy of the committed checkpoint uri (mem://); its data files "
     "go to `replicas` other nodes. The dict: nodes, replicas, step, save_id, bytes_sent, "
     "bytes_received, bytes_held, share_bytes."},
    {"peer_restore", (PyCFunction)Comm_peer_restore, METH_VARARGS,
     "peer_restore(uri) -> dict\n\nstrata_peer_restore (a collective): rebuilds every "
     "node's copy of uri from the replicas the surviving nodes hold (ReplicaLostError "
     "where some file is held by none), committed, to load as any checkpoint."},
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

PyTypeObject CommType = {
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


/* Raises rc with msg, the exception of a failing callback of comm as its __cause__. */
PyObject *raise_comm(int rc, const char *msg, CommObject *comm)
{
    PyObject *cause = comm_take_pending(comm);
    raise_msg(rc, msg);
    set_cause(cause);
    Py_XDECREF(cause);
    return NULL;
}

