/* _strata.h - what the C files of the extension strata._strata share (internal: never
 * installed). _strata.c: the module, its errors and argument helpers; _strata_state.c:
 * State; _strata_comm.c: Comm (host communicators); _strata_save.c: Pool, Saver, Handle;
 * _strata_read.c: Checkpoint, probe, retain, export; _strata_load.c: load, Loader. The rules the binding keeps
 * (the GIL, errors, lifetimes) are in _strata.c's opening comment. Every name here is
 * hidden in the extension (-fvisibility=hidden): only PyInit__strata is exported. */
#ifndef STRATA_PY_STRATA_H
#define STRATA_PY_STRATA_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "strata.h"

#define MSG_BYTES 1024 /* strata_error_last()'s capacity */

/* ---- errors (_strata.c) ---------------------------------------------------------------- */

PyObject *err_take(void);
void err_give(PyObject *v);
PyObject *raise_msg(int code, const char *msg);
PyObject *raise_last(int code);
PyObject *raise_fmt(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void set_cause(PyObject *cause);
void exc_text(PyObject *v, char *text, size_t cap);
/* A message of libstrata's as a Python caller reads it: the C API's names of flags and
 * options replaced by the keyword arguments that set them ("replace=True"). */
PyObject *py_text(const char *msg);

/* ---- argument helpers (_strata.c) ------------------------------------------------------ */

int get_u64(PyObject *o, const char *what, uint64_t *out);
int get_int(PyObject *o, const char *what, long lo, long hi, long *out);
const char *get_path(PyObject *o, PyObject **keep);
const char *get_name(PyObject *o, const char *what);

/* A list of URIs (or a single one), as C strings for the duration of a call. */
typedef struct {
    int n;
    const char **p;
    PyObject **keep;
} uri_list;


void uris_free(uri_list *u);
int uris_get(uri_list *u, PyObject *arg);

PyObject *stats_dict(const strata_stats *s, int load);
PyObject *enter_self(PyObject *self, PyObject *unused);

/* ---- State (_strata_state.c) ----------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    strata_state *st;
    PyObject *keep;   /* list: the objects that own the registered memory */
    Py_ssize_t users; /* open save handles and calls in flight that use this state */
    PyObject *weakrefs;
} StateObject;

/* The states of a call, each held and marked in use for its duration. */
typedef struct {
    PyObject *tuple;
    strata_state **p;
    int n;
} state_list;

extern PyTypeObject StateType;
void states_release(state_list *l);
int states_get(state_list *l, PyObject *arg);

/* ---- Comm (_strata_comm.c) ------------------------------------------------------------- */

/* The context of a host communicator: the Python callables, and the exception the last
 * failing one raised (becomes the __cause__ of the AbortedError the caller sees). */
typedef struct {
    PyObject *fn[4]; /* allgather, alltoallv, bcast, dup (or NULL); NULL once cleared */
    int rank, size;
    PyObject *pending;
} host_ctx;

typedef struct {
    PyObject_HEAD
    strata_comm *c;
    host_ctx *ctx; /* NULL for Comm.self(); owned by c (released by host_destroy) */
    PyObject *weakrefs;
} CommObject;

extern PyTypeObject CommType;
void comm_begin(CommObject *c);
PyObject *comm_take_pending(CommObject *c);
PyObject *raise_comm(int rc, const char *msg, CommObject *comm);

/* ---- Pool, Saver, Handle (_strata_save.c) ---------------------------------------------- */

typedef struct {
    PyObject_HEAD
    strata_pool *pool; /* NULL once closed */
    int savers;        /* Savers holding it: close() refuses while any does */
    PyObject *weakrefs;
} PoolObject;

extern PyTypeObject PoolType, SaverType, HandleType;
/* finish_saves(): closes every Handle not closed yet (the exit handler, registered by
 * `import strata`). */
PyObject *mod_finish_saves(PyObject *m, PyObject *unused);

/* ---- reading (_strata_read.c) ---------------------------------------------------------- */

extern PyTypeObject CkptType;
/* A name of a checkpoint as str (bytes that are not UTF-8 as lone surrogates), and the name
 * of its format ("strata", "safetensors", ...). */
PyObject *ckpt_name_str(const char *s);
const char *ckpt_format_str(const strata_ckpt *ck);
PyObject *mod_probe(PyObject *m, PyObject *arg);
PyObject *mod_retain(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mod_copy(PyObject *m, PyObject *args);
PyObject *mod_remove_incomplete(PyObject *m, PyObject *arg);
PyObject *mod_export_safetensors(PyObject *m, PyObject *args, PyObject *kw);
/* _strata_pickle.c */
PyObject *mod_unpickle(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mod_unpickle_archive(PyObject *m, PyObject *args, PyObject *kw);

/* ---- loads (_strata_load.c) ------------------------------------------------------------ */

extern PyTypeObject LoaderType;
PyObject *mod_load(PyObject *m, PyObject *args, PyObject *kw);

#endif
