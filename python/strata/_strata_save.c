/* _strata_save.c - strata._strata's saving: Pool (pinned staging memory), Saver (a
 * strata_saver: save, start) and Handle (a background save in flight). */
#include "_strata.h"

/* ---- Pool ------------------------------------------------------------------------------ */


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

static PyObject *Pool_exit(PoolObject *self, PyObject *args)
{
    (void)args;
    return Pool_close(self, NULL);
}

static PyMethodDef Pool_methods[] = {
    {"close", (PyCFunction)Pool_close, METH_NOARGS,
     "close(): frees the pool's memory now (else it goes with the last reference); "
     "BusyError while a Saver holds it. nbytes is 0 after, and no Saver takes it."},
    {"__enter__", (PyCFunction)enter_self, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Pool_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"nbytes", (getter)Pool_nbytes, NULL, "the pool's size in bytes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject PoolType = {
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

/* ---- Saver and Handle ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    strata_saver *sv;
    CommObject *comm; /* or NULL */
    PoolObject *pool; /* or NULL */
    int busy;         /* a save or start in flight (one thread at a time) */
    PyObject *weakrefs;
} SaverObject;


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
 * replace, base, incremental, peer_replicas). o->base points into the args' str (alive
 * for the call). */
static int save_args(PyObject *args, PyObject *kw, const char *fname, uri_list *u, state_list *l,
                     strata_save_opts *o)
{
    static char *kwlist[] = {"uris",   "states",  "step", "chunk_bytes", "io_threads",
                             "sync",   "direct",  "bg_nice", "replace", "base",
                             "incremental", "peer_replicas", "peer_parity", NULL};
    PyObject *ouris, *ostates, *step = NULL, *chunk = NULL, *threads = NULL, *nice = NULL;
    const char *base = NULL;
    int sync = 1, direct = 1, replace = 0, incremental = 0, peer = 0, pk = 0, pm = 0;
    char fmt[64];
    snprintf(fmt, sizeof fmt, "OO|$OOOppOpzpi(ii):%s", fname);
    if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &ouris, &ostates, &step, &chunk,
                                     &threads, &sync, &direct, &nice, &replace, &base,
                                     &incremental, &peer, &pk, &pm))
        return -1;
    if (save_opts_get(o, step, chunk, threads, sync, direct, nice) < 0)
        return -1;
    if (replace) /* STRATA_SAVE_REPLACE: swap the new checkpoint in atomically */
        o->flags |= STRATA_SAVE_REPLACE;
    if (incremental) /* second checksums: a later save may use this one as its base */
        o->flags |= STRATA_SAVE_INCREMENTAL;
    o->base = base;
    o->peer_replicas = peer; /* strata_save_start checks them */
    o->peer_k = pk, o->peer_m = pm;
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
    return stats_dict(&s, 0);
}

typedef struct HandleObject {
    PyObject_HEAD
    strata_handle *h;        /* NULL once closed */
    int collective;          /* the commit is wait_durable's collective (a communicator
                                without background commits) */
    SaverObject *saver;      /* held until close */
    PyObject *states;        /* tuple of State, marked in use until close */
    PyThread_type_lock lock; /* wait_durable and close, one at a time */
    Py_ssize_t users;        /* wait_snapshot / status calls in flight on h */
    int finished, final_rc;  /* the save's outcome, once wait_durable or close has run */
    int level;               /* strata_handle_level's, kept at close */
    char level_msg[MSG_BYTES];
    PyObject *final_msg, *final_stats, *final_cause;
    PyObject *weakrefs;
    struct HandleObject *prev, *next; /* in open_handles while h is set (GIL held) */
} HandleObject;

/* The handles not closed yet, newest first: the exit handler finishes them (GIL held). */
static HandleObject *open_handles;

static void handle_link(HandleObject *ho)
{
    ho->prev = NULL;
    ho->next = open_handles;
    if (open_handles)
        open_handles->prev = ho;
    open_handles = ho;
}

static void handle_unlink(HandleObject *ho)
{
    if (ho->prev)
        ho->prev->next = ho->next;
    else if (open_handles == ho)
        open_handles = ho->next;
    if (ho->next)
        ho->next->prev = ho->prev;
    ho->prev = ho->next = NULL;
}

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
    ho->finished = ho->final_rc = ho->level = 0;
    ho->level_msg[0] = 0;
    ho->final_msg = ho->final_stats = ho->final_cause = NULL;
    ho->weakrefs = NULL;
    ho->prev = ho->next = NULL;
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
    handle_link(ho);
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

PyTypeObject SaverType = {
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
    self->final_msg = py_text(msg);
    if (!self->final_msg)
        return -1;
    if (!rc && !(self->final_stats = stats_dict(&s, 0)))
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
        const char *lm;
        self->level = strata_handle_level(&lm, h);
        snprintf(self->level_msg, sizeof self->level_msg, "%s", lm);
        self->h = NULL;
        handle_unlink(self);
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

/* Is the interpreter finalizing (other threads can no longer take the GIL)? */
static int finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

static void Handle_dealloc(HandleObject *self)
{
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    if (self->h && self->lock && self->saver && self->saver->comm && finalizing()) {
        /* past the exit handler (strata.finish_saves): the commit's collectives run on
         * Python threads that can no longer run, so waiting would never end. The save is
         * left as it is (no commit record: gc removes it), its memory to the exit. */
        fprintf(stderr, "strata: an asynchronous save was still in flight when the "
                        "interpreter finalized and is left uncommitted (call wait(), or let "
                        "the exit handler finish it)\n");
        handle_unlink(self);
        self->h = NULL;
        self->states = NULL;
        self->saver = NULL;
    }
    if (self->h && self->lock) { /* not closed: close (waits, collective included) */
        PyObject *saved = err_take();
        handle_close(self);
        err_give(saved);
    }
    handle_unlink(self);
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
    return Py_BuildValue("(iN)", rc, py_text(m ? m : ""));
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

static PyObject *Handle_level(HandleObject *self, PyObject *unused)
{
    (void)unused;
    if (self->h) {
        const char *m;
        int l = strata_handle_level(&m, self->h);
        return Py_BuildValue("(is)", l, m);
    }
    return Py_BuildValue("(is)", self->level, self->level_msg);
}

PyObject *mod_finish_saves(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    long n = 0;
    while (open_handles) { /* newest first: each close waits for its save to end */
        HandleObject *ho = open_handles;
        Py_INCREF(ho);
        handle_close(ho);
        handle_unlink(ho);
        if (ho->final_rc) {
            const char *msg = ho->final_msg ? PyUnicode_AsUTF8(ho->final_msg) : NULL;
            if (!msg)
                PyErr_Clear();
            PySys_WriteStderr("strata: an asynchronous save still in flight at exit failed: "
                              "%s: %.900s\n", strata_error_name(ho->final_rc), msg ? msg : "");
        }
        Py_DECREF(ho);
        n++;
    }
    return PyLong_FromLong(n);
}

static PyObject *Handle_close(HandleObject *self, PyObject *unused)
{
    (void)unused;
    handle_close(self);
    Py_RETURN_NONE;
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
    {"level", (PyCFunction)Handle_level, METH_NOARGS,
     "(levels, message) without waiting: strata_handle_level's bits LEVEL_LOCAL (the first "
     "destination committed), LEVEL_REPLICATED (peer replicas committed on every node), "
     "LEVEL_DURABLE (a destination not mem:// committed); the message says why a "
     "replication asked for (peer_replicas=) failed."},
    {"close", (PyCFunction)Handle_close, METH_NOARGS,
     "Waits for the save to end (the commit's collective included), frees it, lets go of its "
     "states and saver. Idempotent; does not raise the save's error (wait_durable does)."},
    {"__enter__", (PyCFunction)enter_self, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Handle_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Handle_getset[] = {
    {"closed", (getter)Handle_get_closed, NULL, "True once close() has run", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata.Handle",
    .tp_basicsize = sizeof(HandleObject),
    .tp_weaklistoffset = offsetof(HandleObject, weakrefs),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A save in flight (strata_handle), from Saver.start().",
    .tp_dealloc = (destructor)Handle_dealloc,
    .tp_methods = Handle_methods,
    .tp_getset = Handle_getset,
};

