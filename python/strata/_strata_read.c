/* _strata_read.c - strata._strata's reading: Checkpoint (open, verify), probe, retain,
 * remove_incomplete and export_safetensors (loads: _strata_load.c). */
#include "_strata.h"

/* ---- Checkpoint ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    strata_ckpt *ck;
    PyObject *uri, *tensors, *blobs, *files, *format, *base;
    unsigned long long step, data_bytes, written_bytes;
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
PyObject *ckpt_name_str(const char *s)
{
    s = s ? s : "";
    return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "surrogateescape");
}
#define name_str ckpt_name_str

const char *ckpt_format_str(const strata_ckpt *ck) { return strata_ckpt_format_name(ck); }

/* [item(ck, i) for i in range(n)]; item returns a new reference, NULL with an error. */
static PyObject *ckpt_list(const strata_ckpt *ck, size_t n,
                           PyObject *(*item)(const strata_ckpt *ck, size_t i))
{
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *x = item(ck, i);
        if (!x) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, x);
    }
    return list;
}

static PyObject *shard_dict(const strata_ckpt *ck, size_t t, size_t j, int ndim)
{
    strata_shard_info si;
    strata_ckpt_shard(&si, ck, t, j);
    PyObject *flat = si.flat ? Py_BuildValue("(KK)", (unsigned long long)si.flat_start,
                                             (unsigned long long)si.flat_end)
                             : (Py_INCREF(Py_None), Py_None);
    if (!flat)
        return NULL;
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:K,s:K}", "offsets", u64_tuple(si.offsets, ndim),
                         "lengths", u64_tuple(si.lengths, ndim), "flat", flat, "file",
                         name_str(si.file), "file_offset", (unsigned long long)si.file_offset,
                         "bytes", (unsigned long long)si.bytes);
}

static PyObject *tensor_dict(const strata_ckpt *ck, size_t i)
{
    strata_tensor_info ti;
    strata_ckpt_tensor(&ti, ck, i);
    PyObject *shards = PyList_New((Py_ssize_t)ti.nshards);
    for (size_t j = 0; shards && j < ti.nshards; j++) {
        PyObject *d = shard_dict(ck, i, j, ti.ndim);
        if (!d) {
            Py_CLEAR(shards);
            break;
        }
        PyList_SET_ITEM(shards, (Py_ssize_t)j, d);
    }
    if (!shards)
        return NULL;
    return Py_BuildValue("{s:N,s:s,s:N,s:K,s:N}", "name", name_str(ti.name), "dtype",
                         strata_dtype_name(ti.dtype), "shape", u64_tuple(ti.shape, ti.ndim),
                         "bytes", (unsigned long long)ti.bytes, "shards", shards);
}

static PyObject *blob_dict(const strata_ckpt *ck, size_t i)
{
    strata_blob_info bi;
    strata_ckpt_blob(&bi, ck, i);
    return Py_BuildValue("{s:N,s:i,s:K,s:N,s:K}", "name", name_str(bi.name), "owner", bi.owner,
                         "bytes", (unsigned long long)bi.bytes, "file", name_str(bi.file),
                         "file_offset", (unsigned long long)bi.file_offset);
}

static PyObject *file_dict(const strata_ckpt *ck, size_t i)
{
    strata_file_info fi;
    strata_ckpt_file(&fi, ck, i);
    return Py_BuildValue("{s:N,s:K}", "name", name_str(fi.name), "bytes",
                         (unsigned long long)fi.bytes);
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
    uint64_t own = 0;
    const char *base = strata_ckpt_base(self->ck, &own);
    self->written_bytes = own;
    self->base = base ? PyUnicode_FromString(base) : Py_NewRef(Py_None);
    self->format = PyUnicode_FromString(ckpt_format_str(self->ck));
    const strata_ckpt *ck = self->ck;
    if (!self->uri || !self->format || !self->base ||
        !(self->tensors = ckpt_list(ck, strata_ckpt_ntensors(ck), tensor_dict)) ||
        !(self->blobs = ckpt_list(ck, strata_ckpt_nblobs(ck), blob_dict)) ||
        !(self->files = ckpt_list(ck, strata_ckpt_nfiles(ck), file_dict))) {
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
    Py_CLEAR(self->base);
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
    {"base", T_OBJECT, offsetof(CkptObject, base), READONLY,
     "an incremental checkpoint's base (the name of the checkpoint beside it), or None"},
    {"written_bytes", T_ULONGLONG, offsetof(CkptObject, written_bytes), READONLY,
     "payload bytes in files its save wrote (the rest: files linked from its base)"},
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

PyTypeObject CkptType = {
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

PyObject *mod_probe(PyObject *m, PyObject *arg)
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

PyObject *mod_retain(PyObject *m, PyObject *args, PyObject *kw)
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

PyObject *mod_copy(PyObject *m, PyObject *args)
{
    (void)m;
    PyObject *osrc, *odst, *ksrc, *kdst;
    if (!PyArg_ParseTuple(args, "OO:copy", &osrc, &odst))
        return NULL;
    const char *src = get_path(osrc, &ksrc);
    if (!src)
        return NULL;
    const char *dst = get_path(odst, &kdst);
    if (!dst) {
        Py_DECREF(ksrc);
        return NULL;
    }
    strata_stats s = STRATA_STATS_INIT;
    int rc;
    char msg[MSG_BYTES];
    Py_BEGIN_ALLOW_THREADS
    rc = strata_copy(&s, src, dst, 0);
    snprintf(msg, sizeof msg, "%s", rc ? strata_error_last() : "");
    Py_END_ALLOW_THREADS
    Py_DECREF(ksrc);
    Py_DECREF(kdst);
    if (rc)
        return raise_msg(rc, msg);
    return stats_dict(&s, 0);
}

PyObject *mod_remove_incomplete(PyObject *m, PyObject *arg)
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
                             "io_threads", "direct", "skip_crc", NULL};
    PyObject *ockpt, *oout, *oprefix = Py_None, *omax = Py_None, *odtype = Py_None,
                            *oprog = Py_None, *othreads = Py_None;
    int direct = 1, skip_crc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OOOOOpp:export_safetensors", kwlist, &ockpt,
                                     &oout, &oprefix, &omax, &odtype, &oprog, &othreads, &direct,
                                     &skip_crc))
        return NULL;
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    o.include = sel->inc;
    o.exclude = sel->exc;
    o.model_only = sel->model_only;
    if (!direct)
        o.flags |= STRATA_EXPORT_NO_DIRECT;
    if (skip_crc)
        o.flags |= STRATA_EXPORT_SKIP_CRC;
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
    return Py_BuildValue("{s:K,s:K,s:K,s:d,s:K,s:K,s:K,s:O}", "data_bytes",
                         (unsigned long long)s.data_bytes, "bytes", (unsigned long long)s.bytes,
                         "io_calls", (unsigned long long)s.io_calls, "seconds", s.seconds,
                         "meta_reads", (unsigned long long)s.meta_reads, "crc_checked",
                         (unsigned long long)s.crc_checked, "crc_bytes",
                         (unsigned long long)s.crc_bytes, "crc_skipped",
                         s.crc_skipped ? Py_True : Py_False);
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

PyObject *mod_export_safetensors(PyObject *m, PyObject *args, PyObject *kw)
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

