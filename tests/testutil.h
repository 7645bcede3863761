/* testutil.h - helpers shared by the test programs (header-only; each test is one file):
 * temp directories, recursive removal, a deterministic RNG (splitmix64), the
 * deterministic value pattern of (tensor name, global element index), small file
 * surgery, a "rank set" that owns strata states and their buffers, a tensor of an open
 * checkpoint by name, and a collector looping in a child process. */
#ifndef STRATA_TESTUTIL_H
#define STRATA_TESTUTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/util.h"
#include "io/vfs_fault.h"
#include "strata.h"

/* ---- assertions on strata calls ---- */

/* Asserts that `call` returns `want`, printing the error message otherwise. */
#define assert_rc(call, want)                                                                \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_ != (want))                                                                   \
            fail_msg("%s returned %s (%s), want %s", #call, strata_error_name(rc_),          \
                     strata_error_last(), strata_error_name(want));                          \
    } while (0)
#define assert_ok(call) assert_rc(call, 0)

/* Asserts that the last error message contains `sub`. */
#define assert_msg_has(sub)                                                                  \
    do {                                                                                     \
        const char *m_ = strata_error_last(), *s_ = (sub);                                   \
        if (!strstr(m_, s_))                                                                 \
            fail_msg("error message \"%s\" does not mention \"%s\"", m_, s_);              \
    } while (0)

/* ---- deterministic randomness ---- */

#define tu_mix st_mix64 /* the library's own 64-bit mixer (core/util.h) */

typedef struct {
    uint64_t s;
} tu_rng;

static inline uint64_t tu_next(tu_rng *r) { return tu_mix(r->s += 0x9e3779b97f4a7c15ULL); }
/* Uniform in [0, n) (n > 0; the tiny modulo bias does not matter here). */
static inline uint64_t tu_below(tu_rng *r, uint64_t n) { return tu_next(r) % n; }
/* Uniform in [lo, hi]. */
static inline uint64_t tu_range(tu_rng *r, uint64_t lo, uint64_t hi)
{
    return lo + tu_below(r, hi - lo + 1);
}
/* 1 with probability pct/100. */
static inline int tu_chance(tu_rng *r, unsigned pct) { return tu_below(r, 100) < pct; }

static inline uint64_t tu_env_u64(const char *name, uint64_t def)
{
    const char *e = getenv(name);
    return e && *e ? strtoull(e, NULL, 0) : def;
}

/* ---- the value pattern ---- */

static inline uint64_t tu_name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    while (*s)
        h = (h ^ (unsigned char)*s++) * 1099511628211ULL;
    return tu_mix(h);
}

/* The bytes of element `gidx` (global row-major index) of tensor `name`. */
static inline void tu_elem(unsigned char *out, size_t esz, uint64_t name_hash, uint64_t gidx)
{
    uint64_t v = tu_mix(name_hash ^ tu_mix(gidx + 1));
    for (size_t i = 0; i < esz; i++)
        out[i] = (unsigned char)(v >> (8 * i));
}

/* Elements a shard holds (assumes a valid description). */
static inline uint64_t tu_shard_numel(const strata_shard *s)
{
    if (s->flat)
        return s->flat_end - s->flat_start;
    uint64_t n = 1;
    for (int d = 0; d < s->ndim; d++)
        n *= s->lengths ? s->lengths[d] : s->global_shape[d];
    return n;
}

/* Walks the shard's elements: fill = 1 writes the pattern into s->data; fill = 0
 * compares, returning the index of the first wrong element, or -1 if all match. */
static inline int64_t tu_pattern_walk(const strata_shard *s, int fill)
{
    size_t esz = strata_dtype_size(s->dtype);
    uint64_t nh = tu_name_hash(s->name), n = tu_shard_numel(s);
    uint64_t len[STRATA_MAX_DIMS], gstride[STRATA_MAX_DIMS], idx[STRATA_MAX_DIMS];
    uint64_t g = 1, fs = s->flat ? s->flat_start : 0;
    for (int d = s->ndim - 1; d >= 0; d--) {
        len[d] = s->lengths ? s->lengths[d] : s->global_shape[d];
        gstride[d] = g;
        g *= s->global_shape[d];
    }
    /* multi-index in the box of element fs, then an odometer */
    uint64_t t = fs;
    for (int d = s->ndim - 1; d >= 0; d--) {
        idx[d] = len[d] ? t % len[d] : 0;
        t = len[d] ? t / len[d] : 0;
    }
    unsigned char *p = s->data, want[8];
    for (uint64_t i = 0; i < n; i++) {
        uint64_t gi = 0;
        for (int d = 0; d < s->ndim; d++)
            gi += ((s->offsets ? s->offsets[d] : 0) + idx[d]) * gstride[d];
        tu_elem(fill ? p + i * esz : want, esz, nh, gi);
        if (!fill && memcmp(want, p + i * esz, esz) != 0)
            return (int64_t)i;
        for (int d = s->ndim - 1; d >= 0; d--) {
            if (++idx[d] < len[d])
                break;
            idx[d] = 0;
        }
    }
    return -1;
}
static inline void tu_fill_shard(const strata_shard *s) { tu_pattern_walk(s, 1); }
static inline int64_t tu_check_shard(const strata_shard *s) { return tu_pattern_walk(s, 0); }

/* Blob contents: a pattern of (name, owner), owner -1 for a global blob. */
static inline void tu_blob_bytes(unsigned char *out, uint64_t n, const char *name, int owner)
{
    uint64_t h = tu_name_hash(name) ^ tu_mix((uint64_t)(int64_t)owner + 3);
    for (uint64_t i = 0; i < n; i++)
        out[i] = (unsigned char)(tu_mix(h + i / 8) >> (8 * (i % 8)));
}

/* ---- temp directories and files ---- */

/* Creates a fresh directory $TMPDIR/strata-<tag>-XXXXXX (or under /tmp) into out. */
static inline void tu_tmpdir(char *out, size_t cap, const char *tag)
{
    const char *base = getenv("TMPDIR");
    if (!base || !*base)
        base = "/tmp";
    snprintf(out, cap, "%s/strata-%s-XXXXXX", base, tag);
    if (!mkdtemp(out))
        fail_msg("mkdtemp(%s): %s", out, strerror(errno));
}

/* The group setup / teardown of a test file whose tests share one temporary directory:
 * TU_TMPDIR_GROUP(dir, "tag") defines tu_group_setup and tu_group_teardown. */
#define TU_TMPDIR_GROUP(dir, tag)                                                            \
    static int tu_group_setup(void **state)                                                  \
    {                                                                                        \
        (void)state;                                                                         \
        tu_tmpdir(dir, sizeof dir, tag);                                                     \
        return st_vfs_fault_register(); /* fault+<uri> for the fault walks */                \
    }                                                                                        \
    static int tu_group_teardown(void **state)                                               \
    {                                                                                        \
        (void)state;                                                                         \
        tu_rmrf(dir);                                                                        \
        return 0;                                                                            \
    }

static inline int tu_rm_one(const char *p, const struct stat *sb, int flag, struct FTW *f)
{
    (void)sb, (void)flag, (void)f;
    return remove(p) ? -1 : 0;
}
/* Removes a directory tree (symlinks are removed, not followed). Missing is fine. */
static inline void tu_rmrf(const char *path)
{
    struct stat st;
    if (lstat(path, &st) == 0)
        nftw(path, tu_rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static inline int tu_exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

/* snprintf into a static-size buffer: tu_join(buf, dir, name) -> "dir/name". */
#define tu_join(buf, dir, name) snprintf((buf), sizeof(buf), "%s/%s", (dir), (name))

static inline unsigned char *tu_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("open %s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static inline void tu_write_file(const char *path, const void *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        fail_msg("create %s: %s", path, strerror(errno));
    assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* XORs the byte at off of a file with mask. */
static inline void tu_flip_byte(const char *path, uint64_t off, unsigned char mask)
{
    int fd = open(path, O_RDWR);
    if (fd < 0)
        fail_msg("open %s: %s", path, strerror(errno));
    unsigned char c;
    assert_int_equal(pread(fd, &c, 1, (off_t)off), 1);
    c ^= mask;
    assert_int_equal(pwrite(fd, &c, 1, (off_t)off), 1);
    close(fd);
}

static inline void tu_truncate(const char *path, uint64_t len)
{
    if (truncate(path, (off_t)len) != 0)
        fail_msg("truncate %s: %s", path, strerror(errno));
}

/* ---- a checkpoint's tensor by name ---- */

/* The index of tensor `name` in ck (its info into *t), or -1. */
static inline int tu_find_tensor(const strata_ckpt *ck, const char *name, strata_tensor_info *t)
{
    for (size_t i = 0; i < strata_ckpt_ntensors(ck); i++) {
        strata_ckpt_tensor(t, ck, i);
        if (strcmp(t->name, name) == 0)
            return (int)i;
    }
    return -1;
}

/* ---- a collector beside the test ---- */

/* Forks a child that runs strata_retain(dir, keep) in a loop until tu_collector_stop (it
 * never outlives the test: PR_SET_PDEATHSIG). keep 1 << 30: only the removal of incomplete
 * checkpoints no live save owns (strata gc DIR). */
static inline pid_t tu_collector(const char *dir, int keep)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        for (;;) {
            int removed;
            strata_retain(&removed, dir, keep);
        }
    }
    return pid;
}

static inline void tu_collector_stop(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* ---- a set of ranks owning their states and buffers ---- */

typedef struct {
    int rank;
    strata_shard sh;
    uint64_t shape[STRATA_MAX_DIMS], off[STRATA_MAX_DIMS], len[STRATA_MAX_DIMS];
    char *name;
} tu_shard_rec;

typedef struct {
    int rank, owner; /* owner: the load-time owner, or for a save the effective one */
    char *name;
    unsigned char *data;
    uint64_t size;
} tu_blob_rec;

typedef struct {
    int n;
    strata_state **st;
    tu_shard_rec *sh;
    size_t nsh, capsh;
    tu_blob_rec *bl;
    size_t nbl, capbl;
} tu_set;

static inline void tu_set_init(tu_set *s, int nranks)
{
    memset(s, 0, sizeof *s);
    s->n = nranks;
    s->st = calloc((size_t)nranks, sizeof *s->st);
    assert_non_null(s->st);
    for (int r = 0; r < nranks; r++)
        assert_ok(strata_state_new(&s->st[r]));
}

static inline void tu_set_free(tu_set *s)
{
    for (int r = 0; r < s->n; r++)
        strata_state_free(s->st[r]);
    for (size_t i = 0; i < s->nsh; i++) {
        free(s->sh[i].sh.data);
        free(s->sh[i].name);
    }
    for (size_t i = 0; i < s->nbl; i++) {
        free(s->bl[i].data);
        free(s->bl[i].name);
    }
    free(s->st);
    free(s->sh);
    free(s->bl);
    memset(s, 0, sizeof *s);
}

/* Registers on rank r a shard of tensor `name` (offsets/lengths NULL: the whole tensor;
 * flat: [fs, fe) of the box) with STRATA_SHARD_* flags. fill = 1: the buffer gets the
 * pattern (to save); else it is poisoned (to load into). A shard of 0 elements gets data =
 * NULL. Returns the record. */
static inline tu_shard_rec *tu_set_shard_flags(tu_set *s, int r, const char *name,
                                               strata_dtype dt, int ndim,
                                               const uint64_t *shape, const uint64_t *off,
                                               const uint64_t *len, int flat, uint64_t fs,
                                               uint64_t fe, int fill, unsigned flags)
{
    if (s->nsh == s->capsh) {
        s->capsh = s->capsh ? 2 * s->capsh : 16;
        s->sh = realloc(s->sh, s->capsh * sizeof *s->sh);
        assert_non_null(s->sh);
        for (size_t i = 0; i < s->nsh; i++) { /* the records moved: re-aim their arrays */
            s->sh[i].sh.global_shape = s->sh[i].shape;
            s->sh[i].sh.offsets = s->sh[i].off;
            s->sh[i].sh.lengths = s->sh[i].len;
        }
    }
    tu_shard_rec *x = &s->sh[s->nsh];
    memset(x, 0, sizeof *x);
    x->rank = r;
    x->name = strdup(name);
    for (int d = 0; d < ndim; d++) {
        x->shape[d] = shape[d];
        x->off[d] = off ? off[d] : 0;
        x->len[d] = len ? len[d] : shape[d];
    }
    x->sh = (strata_shard){.name = x->name, .dtype = dt, .ndim = ndim, .global_shape = x->shape,
                           .offsets = x->off, .lengths = x->len, .flat = flat,
                           .flat_start = fs, .flat_end = fe, .flags = flags};
    uint64_t n = tu_shard_numel(&x->sh);
    if (n) {
        x->sh.data = malloc(n * strata_dtype_size(dt));
        assert_non_null(x->sh.data);
        if (fill)
            tu_fill_shard(&x->sh);
        else
            memset(x->sh.data, 0xA5, n * strata_dtype_size(dt));
    }
    assert_ok(strata_state_add_shard(s->st[r], &x->sh));
    s->nsh++;
    return x;
}

/* The same without flags. */
static inline tu_shard_rec *tu_set_shard(tu_set *s, int r, const char *name, strata_dtype dt,
                                         int ndim, const uint64_t *shape, const uint64_t *off,
                                         const uint64_t *len, int flat, uint64_t fs, uint64_t fe,
                                         int fill)
{
    return tu_set_shard_flags(s, r, name, dt, ndim, shape, off, len, flat, fs, fe, fill, 0);
}

/* Registers a blob on rank r. Save (fill = 1): contents are the pattern of (name, r) for a
 * rank-local blob, (name, -1) for a global one. Load (fill = 0): asks for owner's blob. */
static inline void tu_set_blob(tu_set *s, int r, const char *name, int rank_local, int owner,
                               uint64_t size, int fill)
{
    if (s->nbl == s->capbl) {
        s->capbl = s->capbl ? 2 * s->capbl : 8;
        s->bl = realloc(s->bl, s->capbl * sizeof *s->bl);
        assert_non_null(s->bl);
    }
    tu_blob_rec *x = &s->bl[s->nbl++];
    x->rank = r;
    x->owner = fill ? (rank_local ? r : -1) : owner;
    x->name = strdup(name);
    x->size = size;
    x->data = size ? malloc(size) : NULL;
    if (size && fill)
        tu_blob_bytes(x->data, size, name, x->owner);
    else if (size)
        memset(x->data, 0x5A, size);
    assert_ok(strata_state_add_blob(s->st[r], name, rank_local ? STRATA_BLOB_RANK_LOCAL : 0, owner,
                                    x->data, size));
}

/* Overwrites rank r's buffers in the set with 0xff (the optimizer step after the snapshot). */
static inline void tu_set_poison(tu_set *s, int r)
{
    for (size_t i = 0; i < s->nsh; i++)
        if (s->sh[i].rank == r && s->sh[i].sh.data)
            memset(s->sh[i].sh.data, 0xff,
                   tu_shard_numel(&s->sh[i].sh) * strata_dtype_size(s->sh[i].sh.dtype));
    for (size_t i = 0; i < s->nbl; i++)
        if (s->bl[i].rank == r)
            memset(s->bl[i].data, 0xff, s->bl[i].size);
}

/* Checks every shard and blob of the set against the pattern. Returns 0, or -1 after
 * printing what differs. */
static inline int tu_set_check(const tu_set *s)
{
    for (size_t i = 0; i < s->nsh; i++) {
        const tu_shard_rec *x = &s->sh[i];
        int64_t bad = x->sh.data ? tu_check_shard(&x->sh) : -1;
        if (bad >= 0) {
            size_t esz = strata_dtype_size(x->sh.dtype);
            const unsigned char *got = (const unsigned char *)x->sh.data + (size_t)bad * esz;
            print_error("rank %d tensor '%s' (%s, ndim %d, flat %d [%" PRIu64 ", %" PRIu64
                        ")): element %" PRId64 " differs: got",
                        x->rank, x->name, strata_dtype_name(x->sh.dtype), x->sh.ndim, x->sh.flat,
                        x->sh.flat_start, x->sh.flat_end, bad);
            for (size_t k = 0; k < esz; k++)
                print_error(" %02x", got[k]);
            print_error("\n");
            return -1;
        }
    }
    for (size_t i = 0; i < s->nbl; i++) {
        const tu_blob_rec *x = &s->bl[i];
        unsigned char *want = malloc(x->size + 1);
        tu_blob_bytes(want, x->size, x->name, x->owner);
        int bad = x->size && memcmp(want, x->data, x->size) != 0;
        free(want);
        if (bad) {
            print_error("rank %d blob '%s' of owner %d differs\n", x->rank, x->name, x->owner);
            return -1;
        }
    }
    return 0;
}

#endif
