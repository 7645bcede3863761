/* test_export_overlap.c - an export reads window N+1 while it writes window N.
 *
 * One wrapper backend ("ovl") under both the checkpoint and the output directory meets the
 * first write to the output with the first read of the checkpoint's data past FAR (a quarter
 * into the export's second window, EXPORT_BUF): each waits for the other (up to a guard of
 * 10 s, against waiting for ever; not a timing check). An export that reads window 1 only
 * once window 0 is written cannot meet them: its first write waits out the guard and sees no
 * such read. One that loads window 1 on a thread of its own while window 0 is written meets
 * them at once. The exported bytes are checked too. */
#include <fcntl.h>
#include <pthread.h>
#include <time.h>

#include "tools/export.h" /* EXPORT_BUF */
#include "io/vfs.h"
#include "testutil.h"

#define FAR ((uint64_t)EXPORT_BUF * 5 / 4) /* a checkpoint read at or past this: window 1's */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int far_read;    /* the first read past FAR began */
static int first_write; /* the first write to the output began */
static int overlapped = -1, expired;

/* Marks *mine, then waits for *theirs (mu held); counts a wait that ran out. */
static void meet(int *mine, const int *theirs)
{
    *mine = 1;
    pthread_cond_broadcast(&cv);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    while (!*theirs)
        if (pthread_cond_timedwait(&cv, &mu, &until) != 0) {
            expired++;
            break;
        }
}

typedef struct {
    st_vfs base;
    const st_vfs *inner;
} ovl_vfs;
typedef struct {
    st_file base;
    st_file *in;
} ovl_file;
#define IN(f) (((ovl_file *)(f))->in)

static int wrap(const st_vfs *v, int e, ovl_file *f, st_file **out)
{
    if (e) {
        free(f);
        return e;
    }
    f->base.vfs = v;
    *out = &f->base;
    return 0;
}

static int o_open(const st_vfs *v, const char *path, int flags, st_file **out)
{
    const st_vfs *in = ((const ovl_vfs *)v)->inner;
    ovl_file *f = calloc(1, sizeof *f);
    return f ? wrap(v, in->open(in, path, flags, &f->in), f, out) : -ENOMEM;
}

static int o_lock(const st_vfs *v, const char *path, st_file **out)
{
    const st_vfs *in = ((const ovl_vfs *)v)->inner;
    ovl_file *f = calloc(1, sizeof *f);
    return f ? wrap(v, in->lock(in, path, &f->in), f, out) : -ENOMEM;
}

static int64_t o_pread(st_file *f, void *buf, size_t n, uint64_t off)
{
    pthread_mutex_lock(&mu);
    if (off >= FAR && !far_read)
        meet(&far_read, &first_write);
    pthread_mutex_unlock(&mu);
    return IN(f)->vfs->pread(IN(f), buf, n, off);
}

static int64_t o_pwrite(st_file *f, const void *buf, size_t n, uint64_t off)
{
    pthread_mutex_lock(&mu);
    if (!first_write) {
        meet(&first_write, &far_read);
        overlapped = far_read;
    }
    pthread_mutex_unlock(&mu);
    return IN(f)->vfs->pwrite(IN(f), buf, n, off);
}

static int o_close(st_file *f)
{
    int e = IN(f)->vfs->close(IN(f));
    free(f);
    return e;
}

static int o_sync(st_file *f) { return IN(f)->vfs->sync(IN(f)); }
static int o_size(st_file *f, uint64_t *out) { return IN(f)->vfs->size(IN(f), out); }
static int o_truncate(st_file *f, uint64_t n) { return IN(f)->vfs->truncate(IN(f), n); }
static int o_direct(st_file *f) { return IN(f)->vfs->direct(IN(f)); }
static int o_ident(st_file *f, st_file_id *out) { return IN(f)->vfs->ident(IN(f), out); }
static int o_allocate(st_file *f, uint64_t n) { return IN(f)->vfs->allocate(IN(f), n); }
static int o_undirect(st_file *f) { return IN(f)->vfs->undirect(IN(f)); }

static void o_release(const st_vfs *v)
{
    st_vfs_release(((const ovl_vfs *)v)->inner);
    free((void *)v);
}

static int o_make(const st_vfs **out, const st_vfs *inner, const char *query)
{
    (void)query;
    ovl_vfs *r = calloc(1, sizeof *r);
    if (!r)
        return STRATA_ENOMEM;
    r->base = *inner;
    r->base.open = o_open;
    r->base.lock = o_lock;
    r->base.pread = o_pread;
    r->base.pwrite = o_pwrite;
    r->base.close = o_close;
    r->base.sync = o_sync;
    r->base.size = o_size;
    r->base.truncate = o_truncate;
    r->base.direct = o_direct;
    r->base.ident = o_ident;
    r->base.allocate = o_allocate;
    r->base.undirect = o_undirect;
    r->base.release = o_release;
    r->inner = inner;
    *out = &r->base;
    return 0;
}

static void test_reads_overlap_writes(void **state)
{
    (void)state;
    const size_t N = EXPORT_BUF / 2; /* f32: two windows */
    char dir[512], ck[600], out[600], uck[700], uout[700];
    tu_tmpdir(dir, sizeof dir, "export-overlap");
    snprintf(ck, sizeof ck, "%s/ck", dir);
    snprintf(out, sizeof out, "%s/out", dir);
    snprintf(uck, sizeof uck, "ovl+file://%s", ck);
    snprintf(uout, sizeof uout, "ovl+file://%s", out);
    assert_ok(st_vfs_register_wrapper("ovl", o_make));
    float *x = malloc((size_t)N * 4);
    assert_non_null(x);
    for (size_t i = 0; i < N; i++)
        x[i] = (float)(i % 1000003);
    uint64_t shape[1] = {N};
    strata_state *st;
    assert_ok(strata_state_new(&st));
    strata_shard sh = {"w", STRATA_F32, 1, shape, NULL, NULL, .data = x};
    assert_ok(strata_state_add_shard(st, &sh));
    const char *u[] = {ck};
    assert_ok(strata_save(NULL, NULL, u, 1, &st, 1, NULL));
    strata_state_free(st);

    assert_ok(strata_export_safetensors(NULL, uck, uout, NULL));
    assert_int_equal(overlapped, 1); /* window 1 was read while window 0 was written */
    assert_int_equal(expired, 0);

    char f[700];
    snprintf(f, sizeof f, "%s/model.safetensors", out);
    int fd = open(f, O_RDONLY);
    assert_true(fd >= 0);
    uint64_t n;
    assert_int_equal(pread(fd, &n, 8, 0), 8);
    float *y = malloc((size_t)N * 4);
    assert_non_null(y);
    assert_int_equal(pread(fd, y, (size_t)N * 4, (off_t)(8 + n)), (ssize_t)N * 4);
    assert_memory_equal(x, y, (size_t)N * 4);
    close(fd);
    free(x);
    free(y);
    tu_rmrf(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reads_overlap_writes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
