/* test_copy.c - strata_copy_ext between file paths (s3:// is test_s3.c's and
 * tests/s3_test.sh's): the progress callback sees 0 of the total first, then growing counts
 * up to the total, one call at a time; a callback that stops the copy fails it with
 * STRATA_EABORTED and its message, leaving nothing committed at the destination, which a
 * later copy then fills; options of another version are refused. */
#include <pthread.h>

#include "tools/export.h" /* st_copy_block */
#include "meta/meta.h"     /* ST_COMMIT_FILE */
#include "stdckpt.h"

typedef struct {
    pthread_mutex_t mu;
    int calls, inside, overlap, stop_at;
    uint64_t last, total;
    int bad; /* a count that went down, or a total that changed */
} seen;

static int on_progress(void *ctx, uint64_t done, uint64_t total)
{
    seen *s = ctx;
    pthread_mutex_lock(&s->mu);
    s->overlap |= s->inside++;
    pthread_mutex_unlock(&s->mu);
    if (s->calls == 0 && done != 0)
        s->bad = 1;
    if (s->calls && (done < s->last || total != s->total))
        s->bad = 1;
    s->last = done, s->total = total;
    int stop = s->stop_at && ++s->calls >= s->stop_at;
    if (!s->stop_at)
        s->calls++;
    if (stop)
        strata_error_set(STRATA_EABORTED, "stopped by the test after %d calls", s->calls);
    pthread_mutex_lock(&s->mu);
    s->inside--;
    pthread_mutex_unlock(&s->mu);
    return stop;
}

static void test_progress(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "copysrc");
    char dst[700], p[800];
    snprintf(dst, sizeof dst, "%s/copydst", base_dir);
    uint64_t was = st_copy_block;
    st_copy_block = 4096; /* several blocks a file, several threads */
    seen s = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, 0, 0};
    strata_copy_opts o = STRATA_COPY_OPTS_INIT;
    o.progress = on_progress;
    o.progress_ctx = &s;
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(strata_copy_ext(&st, f.ck, dst, &o));
    assert_false(s.bad);
    assert_false(s.overlap);
    assert_true(s.calls > 3);
    assert_int_equal(s.last, s.total);
    assert_int_equal(s.total, st.bytes);
    assert_ok(load_all(dst)); /* bitwise */

    /* stopped at its third report: nothing committed there; a later copy fills it */
    char dst2[700];
    snprintf(dst2, sizeof dst2, "%s/copystopped", base_dir);
    seen s2 = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 3, 0, 0, 0};
    o.progress_ctx = &s2;
    assert_rc(strata_copy_ext(NULL, f.ck, dst2, &o), STRATA_EABORTED);
    assert_msg_has("stopped by the test after 3 calls");
    tu_join(p, dst2, ST_COMMIT_FILE);
    assert_false(tu_exists(p));
    assert_int_equal(open_rc(dst2, 0) != 0, 1);
    assert_ok(strata_copy_ext(NULL, f.ck, dst2, NULL));
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, dst2, 0));
    assert_int_equal(strata_ckpt_step(ck), 42);
    strata_ckpt_free(ck);

    /* a version it does not know */
    o.version = 99;
    assert_rc(strata_copy_ext(NULL, f.ck, dst2, &o), STRATA_EINVAL);
    assert_msg_has("strata_copy_opts.version 99");
    st_copy_block = was;
    drop_ckpt(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_progress),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
