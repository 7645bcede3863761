/* _strata.c - strata._strata, the CPython binding of libstrata (layer 1 of the Python package,
 * docs/DESIGN.md "Python package"): the module itself, its exception classes and the helpers
 * the binding's other files share (_strata.h names them all). Written against the CPython C
 * API and include/strata.h alone; the extension carries libstrata statically (setup.py
 * compiles src/ into it).
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
#include "_strata.h"

#include <xxhash.h>

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
    {"ENOTSUP", "UnsupportedError"},    {"ENOTCKPT", "NotCheckpointError"},
    {"ENOREPLICA", "ReplicaLostError"},
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
PyObject *err_take(void)
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

void err_give(PyObject *v) /* reference stolen; NULL: nothing is raised */
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

/* The names of the C API that libstrata's messages give (flags, option fields), each with
 * what a Python caller writes instead: the keyword argument that sets it. In order: a
 * message naming both ("replace=True, STRATA_SAVE_REPLACE") keeps one. */
static const struct {
    const char *c, *py;
} py_names[] = {
    {"replace=True, STRATA_SAVE_REPLACE", "replace=True"},
    {"STRATA_SAVE_REPLACE", "replace=True"},
    {"STRATA_LOAD_CAST", "cast=True"},
    {"STRATA_LOAD_WIDEN", "widen=True"},
    {"strata_save_opts.base '", "base='"},
    {"strata_export_opts.", ""},
    {"strata_copy: ", "strata.copy: "},
};

/* msg as a Python caller reads it (py_names); a new reference, or NULL with an error. */
PyObject *py_text(const char *msg)
{
    PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
    for (size_t i = 0; text && i < sizeof py_names / sizeof py_names[0]; i++) {
        if (!strstr(msg, py_names[i].c))
            continue;
        PyObject *c = PyUnicode_FromString(py_names[i].c);
        PyObject *py = PyUnicode_FromString(py_names[i].py);
        PyObject *t = c && py ? PyUnicode_Replace(text, c, py, -1) : NULL;
        Py_XDECREF(c);
        Py_XDECREF(py);
        Py_SETREF(text, t);
    }
    return text;
}

/* Raises the class of code with msg (strata_error_str(code) when empty), in Python's names
 * (py_text); returns NULL. */
PyObject *raise_msg(int code, const char *msg)
{
    PyObject *cls = class_for(code);
    if (!msg || !*msg)
        msg = strata_error_str(code);
    PyObject *text = py_text(msg);
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
PyObject *raise_last(int code)
{
    char msg[MSG_BYTES];
    snprintf(msg, sizeof msg, "%s", strata_error_last());
    return raise_msg(code, msg);
}

/* Raises code with a message of the binding's own (printf-style). */
PyObject *raise_fmt(int code, const char *fmt, ...)
{
    char msg[MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return raise_msg(code, msg);
}

/* The exception being raised gets cause as its __cause__ (a reference taken). */
void set_cause(PyObject *cause)
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

/* str(v) into text (cap bytes; "" if v is NULL or has no string). */
void exc_text(PyObject *v, char *text, size_t cap)
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

/* ---- argument helpers ------------------------------------------------------------------ */

/* A non-negative integer into *out; what names it in the InvalidArgumentError. */
int get_u64(PyObject *o, const char *what, uint64_t *out)
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

int get_int(PyObject *o, const char *what, long lo, long hi, long *out)
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
const char *get_path(PyObject *o, PyObject **keep)
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

/* A name as UTF-8 without NUL (strata checks the rest). */
const char *get_name(PyObject *o, const char *what)
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

void uris_free(uri_list *u)
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

int uris_get(uri_list *u, PyObject *arg)
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

/* __enter__ of an object that is its own context manager (Pool, Handle). */
PyObject *enter_self(PyObject *self, PyObject *unused)
{
    (void)unused;
    Py_INCREF(self);
    return self;
}

/* ---- stats ------------------------------------------------------------------------------ */

/* The stats of a save, or of a load: a save's with its writers' balance (max_writer_bytes,
 * writers, balance_bound); a load's with the source it read (tier), how often it read and
 * broadcast the index (meta_reads, meta_bcasts), and the zip CRC-32s checked (crc_checked,
 * crc_bytes: bytes read only for the checks, crc_skipped). */
PyObject *stats_dict(const strata_stats *s, int load)
{
    if (load)
        return Py_BuildValue("{s:K,s:K,s:K,s:d,s:K,s:O,s:i,s:K,s:K,s:K,s:K,s:O}", "data_bytes",
                             (unsigned long long)s->data_bytes, "bytes",
                             (unsigned long long)s->bytes, "io_calls",
                             (unsigned long long)s->io_calls, "seconds", s->seconds,
                             "all_bytes", (unsigned long long)s->all_bytes, "plan_cached",
                             s->plan_cached ? Py_True : Py_False, "tier", s->tier, "meta_reads",
                             (unsigned long long)s->meta_reads, "meta_bcasts",
                             (unsigned long long)s->meta_bcasts, "crc_checked",
                             (unsigned long long)s->crc_checked, "crc_bytes",
                             (unsigned long long)s->crc_bytes, "crc_skipped",
                             s->crc_skipped ? Py_True : Py_False);
    return Py_BuildValue("{s:K,s:K,s:K,s:d,s:K,s:K,s:K,s:K,s:O,s:i}", "data_bytes",
                         (unsigned long long)s->data_bytes, "bytes", (unsigned long long)s->bytes,
                         "io_calls", (unsigned long long)s->io_calls, "seconds", s->seconds,
                         "max_writer_bytes", (unsigned long long)s->max_writer_bytes, "writers",
                         (unsigned long long)s->writers, "balance_bound",
                         (unsigned long long)s->balance_bound, "all_bytes",
                         (unsigned long long)s->all_bytes, "plan_cached",
                         s->plan_cached ? Py_True : Py_False, "tier", s->tier);
}

/* ---- module functions ------------------------------------------------------------------ */

/* The strata dtype named by the str o into *dt; 0, or -1 with an error raised. */
static int dtype_get(PyObject *o, strata_dtype *dt)
{
    if (!PyUnicode_Check(o)) {
        PyErr_Format(PyExc_TypeError, "dtype must be a str");
        return -1;
    }
    const char *s = PyUnicode_AsUTF8(o);
    if (!s)
        return -1;
    if (strata_dtype_parse(dt, s)) {
        raise_fmt(STRATA_EINVAL, "strata has no dtype '%s'", s);
        return -1;
    }
    return 0;
}

static PyObject *mod_dtype_size(PyObject *m, PyObject *arg)
{
    (void)m;
    strata_dtype dt;
    if (dtype_get(arg, &dt) < 0)
        return NULL;
    return PyLong_FromSize_t(strata_dtype_size(dt));
}

static PyObject *mod_load_converts(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"saved", "requested", "cast", "widen", NULL};
    PyObject *osaved, *oreq;
    int cast = 0, widen = 0;
    strata_dtype saved, req;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$pp:load_converts", kwlist, &osaved, &oreq,
                                     &cast, &widen) ||
        dtype_get(osaved, &saved) < 0 || dtype_get(oreq, &req) < 0)
        return NULL;
    unsigned flags = (cast ? STRATA_LOAD_CAST : 0) | (widen ? STRATA_LOAD_WIDEN : 0);
    return PyBool_FromLong(strata_load_converts(saved, req, flags));
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
    int rc;
    /* a mkdir, or for s3:// a HEAD of the bucket (whose server may be a thread of this
     * process: the GIL is let go) */
    Py_BEGIN_ALLOW_THREADS
    rc = strata_uri_path(path, sizeof path, uri);
    Py_END_ALLOW_THREADS
    Py_DECREF(keep);
    if (rc)
        return raise_last(rc);
    return PyUnicode_DecodeFSDefault(path);
}

typedef struct {
    char **names;
    size_t n, cap;
    size_t skip; /* strlen(dir_uri) + 1 */
} dir_names;

static int collect_dir(void *ctx, const char *uri)
{
    dir_names *d = ctx;
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 64;
        char **nn = realloc(d->names, cap * sizeof *nn);
        if (!nn)
            return 1;
        d->names = nn;
        d->cap = cap;
    }
    return !(d->names[d->n] = strdup(uri + d->skip)) || !++d->n;
}

/* list_dirs(uri) -> [names]: strata_list_dirs, the GIL released (an s3:// listing is a
 * round trip or more). */
static PyObject *mod_list_dirs(PyObject *m, PyObject *arg)
{
    (void)m;
    PyObject *keep;
    const char *uri = get_path(arg, &keep);
    if (!uri)
        return NULL;
    size_t n = strlen(uri);
    while (n > 1 && uri[n - 1] == '/')
        n--;
    dir_names d = {.skip = n + 1};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = strata_list_dirs(uri, collect_dir, &d);
    Py_END_ALLOW_THREADS
    Py_DECREF(keep);
    PyObject *out = rc ? NULL : PyList_New((Py_ssize_t)d.n);
    for (size_t i = 0; out && i < d.n; i++) {
        PyObject *s = PyUnicode_DecodeFSDefault(d.names[i]);
        if (!s)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, s);
    }
    for (size_t i = 0; i < d.n; i++)
        free(d.names[i]);
    free(d.names);
    if (rc)
        return rc == STRATA_EABORTED ? PyErr_NoMemory() : raise_last(rc);
    return out;
}

static PyMethodDef module_methods[] = {
    {"load", (PyCFunction)(void (*)(void))mod_load, METH_VARARGS | METH_KEYWORDS,
     "load(uris, states, comm=None, *, io_threads=0, max_io_bytes=0, direct=True, cast=False,"
     " widen=False, skip_crc=False) -> dict\n\n"
     "strata_load: from the first source that loads (stats['tier'] says which; stats\n"
     "['meta_reads'] / ['meta_bcasts'] count the index's reads and broadcasts). cast: a shard\n"
     "of another dtype than saved is converted (STRATA_LOAD_CAST: floats rounded once to\n"
     "nearest even; integers only where exact); widen: only where every value is exact\n"
     "(STRATA_LOAD_WIDEN: f16, bf16 to f32, f64; f32 to f64; the integer pairs). skip_crc:\n"
     "leave a foreign checkpoint's zip CRC-32s unchecked (STRATA_LOAD_SKIP_CRC)."},
    {"load_converts", (PyCFunction)(void (*)(void))mod_load_converts,
     METH_VARARGS | METH_KEYWORDS,
     "load_converts(saved, requested, *, cast=False, widen=False) -> bool\n\n"
     "strata_load_converts: whether a load with those options fills a shard of dtype\n"
     "`requested` (a name: 'f32', 'bf16', ...) from a tensor saved as `saved`."},
    {"dtype_size", (PyCFunction)mod_dtype_size, METH_O, "dtype_size(name) -> bytes per element"},
    {"hash_bytes", (PyCFunction)(void (*)(void))mod_hash_bytes, METH_VARARGS | METH_KEYWORDS,
     "hash_bytes(data_ptr, nbytes) -> int: XXH3-64 of the bytes (GIL released)."},
    {"uri_path", (PyCFunction)mod_uri_path, METH_O,
     "uri_path(uri) -> str: the local path a URI names (mem://name under $STRATA_MEM_ROOT)"},
    {"list_dirs", (PyCFunction)mod_list_dirs, METH_O,
     "list_dirs(uri) -> [names]: the directories (prefixes, on s3://) directly under uri"},
    {"probe", (PyCFunction)mod_probe, METH_O,
     "probe(uri) -> {is_ckpt, has_commit, committed, has_metadata, step, disk_bytes}"},
    {"retain", (PyCFunction)(void (*)(void))mod_retain, METH_VARARGS | METH_KEYWORDS,
     "retain(dir_uri, keep) -> number of checkpoints removed"},
    {"copy", (PyCFunction)mod_copy, METH_VARARGS,
     "copy(src_uri, dst_uri) -> stats: a committed checkpoint copied to a new directory on "
     "any backend, every chunk's checksum verified, committed last (strata_copy)"},
    {"finish_saves", (PyCFunction)mod_finish_saves, METH_NOARGS,
     "finish_saves() -> count: closes every Handle not closed yet, newest first, each waiting\n"
     "for its save to end (committed or failed; a failure is printed to stderr, not raised).\n"
     "Registered with atexit by `import strata`, so that a process that returns without\n"
     "wait() still commits what it started, while the commit's collectives can run."},
    {"remove_incomplete", (PyCFunction)mod_remove_incomplete, METH_O,
     "remove_incomplete(uri): removes a checkpoint that has no valid commit record."},
    {"unpickle", (PyCFunction)(void (*)(void))mod_unpickle, METH_VARARGS | METH_KEYWORDS,
     "unpickle(data, tensor=None, glob=None, name='pickle') -> value\n\n"
     "A pickle (a torch.save archive's data.pkl) read by strata's restricted reader into\n"
     "Python values, nothing executed (_strata_pickle.c): None, bool, int, float, str, bytes,\n"
     "tuple, list, dict, OrderedDict; torch.Size as a tuple; a tensor as tensor(name, dtype,\n"
     "shape, None); a global value (a torch dtype) as glob(module, name). FormatError for\n"
     "anything else or a forbidden global."},
    {"unpickle_archive", (PyCFunction)(void (*)(void))mod_unpickle_archive,
     METH_VARARGS | METH_KEYWORDS,
     "unpickle_archive(data, tensor=None, glob=None, name='torch.save archive') -> value\n\n"
     "The same for a whole torch.save archive in memory (a DCP non-tensor item): its zip and\n"
     "data.pkl read by strata's rules; a tensor is tensor(name, dtype, shape, data), data\n"
     "the tensor's bytes (bytes)."},
    {"export_safetensors", (PyCFunction)(void (*)(void))mod_export_safetensors,
     METH_VARARGS | METH_KEYWORDS,
     "export_safetensors(ckpt, out, *, prefix=None, max_file_bytes=None, dtype=None, "
     "progress=None, io_threads=None, direct=True, include=None, exclude=None, "
     "model_only=None, skip_crc=False) -> dict\n\n"
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
     "skip_crc=True leaves the zip CRC-32s of a DCP, torch.save, DeepSpeed or Megatron "
     "checkpoint unchecked (by default each entry read is checked before out is replaced). "
     "Returns {data_bytes, bytes, io_calls, seconds, meta_reads, crc_checked, crc_bytes, "
     "crc_skipped} (meta_reads: the reads of the checkpoint's index, 1: the export opens it "
     "once)."},
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
                             &CkptType, &LoaderType};
    const char *names[] = {"State", "Pool", "Comm", "Saver", "Handle", "Checkpoint", "Loader"};
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
        PyModule_AddIntConstant(m, "LEVEL_LOCAL", STRATA_LEVEL_LOCAL) < 0 ||
        PyModule_AddIntConstant(m, "LEVEL_REPLICATED", STRATA_LEVEL_REPLICATED) < 0 ||
        PyModule_AddIntConstant(m, "LEVEL_DURABLE", STRATA_LEVEL_DURABLE) < 0 ||
        PyModule_AddObject(m, "VERSION",
                           Py_BuildValue("(ii)", STRATA_VERSION_MAJOR, STRATA_VERSION_MINOR)) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

