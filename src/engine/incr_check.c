/* incr_check.c - the base's bytes, checked before an incremental save refers to them
 * (docs/DESIGN.md, "Incremental saves"): matching compares the caller's bytes with the
 * checksums the base recorded, never with the base's bytes, so a base file that rotted
 * after its commit would be linked as it is and the new checkpoint would fail its own
 * checksums. Each base extent about to be referred to is read and its chunks' XXH3s
 * compared with the recorded ones; one that does not match (or cannot be read) is not
 * referred to: the caller's bytes are written instead. An extent found intact is
 * remembered for the life of the process by its file's version (device, inode, size,
 * modification time; on S3 the object's ETag too) and its place, so that a chain of
 * incremental saves, which links the same files over and over, reads each once per
 * process. Threading: the reads run on the save's I/O threads; the memory of extents
 * found intact is shared by every save of the process, under a mutex. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "engine.h"

_Atomic uint64_t st_incr_base_read;

/* ---- extents found intact, by file version and place (a set of 64-bit keys) ---- */

#define KNOWN_SLOTS (1u << 16) /* 512 KiB; emptied when 3/4 full */
static pthread_mutex_t known_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t *known; /* 0: a free slot */
static size_t nknown;

static int known_has(uint64_t key)
{
    int has = 0;
    pthread_mutex_lock(&known_mu);
    for (size_t i = key & (KNOWN_SLOTS - 1); known && known[i]; i = (i + 1) & (KNOWN_SLOTS - 1))
        if (known[i] == key) {
            has = 1;
            break;
        }
    pthread_mutex_unlock(&known_mu);
    return has;
}

static void known_add(uint64_t key)
{
    pthread_mutex_lock(&known_mu);
    if (!known)
        known = calloc(KNOWN_SLOTS, sizeof *known); /* without it: nothing remembered */
    if (known && nknown >= KNOWN_SLOTS / 4 * 3) {
        memset(known, 0, KNOWN_SLOTS * sizeof *known);
        nknown = 0;
    }
    size_t i = key & (KNOWN_SLOTS - 1);
    for (; known && known[i] && known[i] != key; i = (i + 1) & (KNOWN_SLOTS - 1))
        ;
    if (known && !known[i]) {
        known[i] = key;
        nknown++;
    }
    pthread_mutex_unlock(&known_mu);
}

/* ---- the check ---- */

typedef struct {
    const st_vfs *v;
    st_base_ext *e;
    size_t *todo;  /* indices into e of the extents to read */
    st_file **fh;  /* per extent: its file, open (NULL: it could not be opened) */
    uint64_t *key; /* per extent */
    uint32_t chunk;
} check_ctx;

static int run_check(void *arg, size_t i, int worker)
{
    (void)worker;
    check_ctx *c = arg;
    size_t k = c->todo[i];
    st_base_ext *e = &c->e[k];
    uint64_t nc = st_nchunks(e->bytes, c->chunk);
    size_t cap = (size_t)ST_MIN((uint64_t)c->chunk, e->bytes);
    unsigned char *buf = cap ? st_scratch_get(cap) : NULL;
    if (cap && !buf)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (uint64_t ch = 0; ch < nc && !e->bad; ch++) {
        size_t n = (size_t)ST_MIN((uint64_t)c->chunk, e->bytes - ch * c->chunk);
        int64_t got = st_vfs_read_full(c->v, c->fh[k], buf, n, e->off + ch * c->chunk);
        e->bad = got != (int64_t)n || st_hash(buf, n) != e->sums[ch];
        atomic_fetch_add(&st_incr_base_read, got > 0 ? (uint64_t)got : 0);
    }
    if (buf)
        st_scratch_put(buf, cap);
    if (!e->bad && c->key[k])
        known_add(c->key[k]);
    return 0;
}

static int cmp_by_file(const void *a, const void *b, void *ctx)
{
    const st_base_ext *e = ctx;
    return strcmp(e[*(const size_t *)a].file, e[*(const size_t *)b].file);
}

/* The key of a file version (0 when it cannot be told). */
static uint64_t version_key(const st_vfs *v, st_file *f)
{
    st_file_id id;
    if (v->ident(f, &id) != 0)
        return 0;
    /* not the change time: linking the file, which every incremental save does, changes
     * it; on S3 that slot holds the ETag's hash, which changes with the object */
    uint64_t h = st_mix64(id.dev ^ st_mix64(id.ino ^ st_mix64(id.size ^ st_mix64(id.mtime_ns))));
    return strcmp(v->scheme, "s3") == 0 ? st_mix64(h ^ id.ctime_ns) : h;
}

int st_incr_check_base(const st_vfs *v, const char *bdir, st_base_ext *e, size_t n,
                       uint32_t chunk, int threads)
{
    size_t *order = malloc((n + 1) * sizeof *order), *todo = malloc((n + 1) * sizeof *todo);
    st_file **fh = calloc(n + 1, sizeof *fh);
    uint64_t *key = calloc(n + 1, sizeof *key);
    int rc = order && todo && fh && key ? 0 : st_fail(STRATA_ENOMEM, "out of memory");
    size_t ntodo = 0;
    for (size_t i = 0; !rc && i < n; i++)
        order[i] = i, e[i].bad = 0;
    if (!rc && n)
        qsort_r(order, n, sizeof *order, cmp_by_file, e);
    /* each file opened once: its version, then which of its extents are known intact */
    for (size_t i = 0; !rc && i < n;) {
        size_t j = i;
        st_file *f = NULL;
        char p[PATH_MAX];
        uint64_t ver = 0;
        if (st_path_join(p, bdir, e[order[i]].file) == 0 && v->open(v, p, ST_O_READ, &f) == 0)
            ver = version_key(v, f);
        st_clear_error();
        for (; j < n && strcmp(e[order[j]].file, e[order[i]].file) == 0; j++) {
            st_base_ext *x = &e[order[j]];
            if (!f) { /* gone or not a regular file: not referred to */
                x->bad = 1;
                continue;
            }
            uint64_t nc = st_nchunks(x->bytes, chunk);
            uint64_t k = st_mix64(ver ^ st_mix64(x->off ^ st_mix64(x->bytes ^ chunk))) ^
                         st_hash(x->sums, (size_t)nc * 8);
            key[order[j]] = ver ? (k ? k : 1) : 0; /* 0: a version not told, not kept */
            fh[order[j]] = f;
            if (!key[order[j]] || !known_has(key[order[j]]))
                todo[ntodo++] = order[j];
        }
        i = j;
    }
    check_ctx c = {v, e, todo, fh, key, chunk};
    if (!rc && ntodo)
        rc = st_parallel(st_io_threads(threads), ntodo, run_check, &c);
    for (size_t i = 0; order && fh && i < n; i++) /* each file once: the last extent of its run */
        if (fh[order[i]] && (i + 1 == n || fh[order[i + 1]] != fh[order[i]]))
            v->close(fh[order[i]]);
    free(order);
    free(todo);
    free(fh);
    free(key);
    return rc;
}
