/* test_faults.c - the fault matrix: every storage call a save (or a load) makes is failed
 * once, in turn, through the fault-injecting backend (fault+file://...?op=OP&n=N&errno=E),
 * for each errno; short writes too. After each failed save: the mapped error code, nothing
 * committed, no strata file left behind, the previous checkpoint intact (verifies, loads
 * bitwise), and a retry without the fault succeeds. After each failed load: an error code,
 * never success with partial data.
 *
 * The number of calls of each op in a clean save is found by raising N until the save no
 * longer fails (a fault past the last call never fires), and checked against the save
 * protocol (docs/FORMAT.md "Save order"): F data files, T write tasks (stats.io_calls),
 *   open F + 2 (data files, metadata.bin, COMMIT.tmp)   write T + 2
 *   allocate F     rename 1     mkdir 1 (+ 1 per missing parent)
 *   fsync F + 4 (data files, metadata.bin, COMMIT.tmp, the directory, its parent)
 * Every one of those faults fails the save, including the last two fsyncs (the directory
 * and its parent), which come after COMMIT.tmp was renamed to COMMIT: the save reports the
 * error and its cleanup removes the commit record with the rest, so that a save that
 * returned an error never leaves a checkpoint behind. A short write (short=1) writes half
 * of the data file's buffer and fails the retry; writes under 8 KiB (metadata.bin,
 * COMMIT.tmp) just fail. Faults that never fire in a clean save: unlink, which only the
 * clearing of an incomplete checkpoint and the cleanup after a failure call (tested on
 * their own below).
 * Saves run on one I/O thread (deterministic call order) except for a few rounds on 4.
 * Synchronous saves are strata_save without a saver (straight from the caller's buffers).
 * The walk runs once more through strata_save_start on a saver with a pool, where every
 * fault must come back on the handle (the start does no I/O). */
#include <signal.h>
#include <sys/resource.h>

#include "meta/meta.h"
#include "testutil.h"

#define NR 3 /* logical ranks */

/* The engine maps an I/O error while reading metadata.bin of a checkpoint with a valid
 * commit record to STRATA_EFORMAT ("corrupt"), whatever the errno (src/engine/ckpt.c,
 * dir_open). A missing metadata.bin is corruption indeed; a transient EIO or EACCES is
 * not. Set to 0 once the engine maps those with st_from_errno. */
#define META_READ_ERROR_IS_EFORMAT 0

static char base_dir[512], prev_ck[600], new_ck[600], nest_dir[600], nest_ck[700];
static tu_set src;
static int nfiles;      /* data files of a clean save of src */
static int write_tasks; /* pwrite tasks of a clean save (stats.io_calls) */
static int save_points, load_points;
/* save_point saves through strata_save_start on async_saver (a pool of 4 buffers of
 * 8 KiB; the error travels on the handle) instead of strata_save */
static int async_mode;
static strata_pool *async_pool;
static strata_saver *async_saver;
static int verbose; /* $STRATA_FAULT_VERBOSE: print every fault point and its message */
static char op_msg[1024]; /* the message of the last load_all / verify_rc that failed */

static const char *const save_errnos[] = {"EIO", "ENOSPC", "EDQUOT"};
static const char *const load_errnos[] = {"EIO", "ENOSPC", "EDQUOT", "EACCES", "ENOENT"};

/* ---- the state: 3 ranks; row and column splits, replicas, flat shards, a scalar, global
 * and rank-local blobs; every data file spans several 4 KiB chunks ---- */

static const uint64_t w1s[] = {64, 48};  /* f32, rows split 20 / 20 / 24 */
static const uint64_t b1s[] = {300};     /* f32, replicated on every rank */
static const uint64_t ms[] = {4000};     /* f32, flat thirds (ZeRO) */
static const uint64_t es[] = {20000};    /* u8, replicated on ranks 0 and 1 */
static const uint64_t w2s[] = {32, 100}; /* bf16, columns split over ranks 1 and 2 */

/* fill = 1: a state to save; 0: the same layout as a request to load into. */
static void layout(tu_set *s, int fill)
{
    tu_set_init(s, NR);
    static const uint64_t rows[] = {0, 20, 40, 64};
    for (int r = 0; r < NR; r++) {
        uint64_t off[] = {rows[r], 0}, len[] = {rows[r + 1] - rows[r], 48};
        tu_set_shard(s, r, "w1", STRATA_F32, 2, w1s, off, len, 0, 0, 0, fill);
        tu_set_shard(s, r, "b1", STRATA_F32, 1, b1s, NULL, NULL, 0, 0, 0, fill);
        tu_set_shard(s, r, "opt.m", STRATA_F32, 1, ms, NULL, NULL, 1, 4000 * (uint64_t)r / 3,
                     4000 * (uint64_t)(r + 1) / 3, fill);
        if (r < 2)
            tu_set_shard(s, r, "emb", STRATA_U8, 1, es, NULL, NULL, 0, 0, 0, fill);
        if (r > 0) {
            uint64_t o2[] = {0, (uint64_t)(r - 1) * 50}, l2[] = {32, 50};
            tu_set_shard(s, r, "w2", STRATA_BF16, 2, w2s, o2, l2, 0, 0, 0, fill);
        }
        if (r == 0)
            tu_set_shard(s, r, "step", STRATA_I64, 0, NULL, NULL, NULL, 0, 0, 0, fill);
        tu_set_blob(s, r, "cfg", 0, fill ? 0 : -1, 300, fill);
        tu_set_blob(s, r, "rng", 1, fill ? 0 : r, 5000, fill);
    }
}

static strata_save_opts save_opts(int threads, int sync)
{
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 4096;
    o.step = 7;
    o.io_threads = threads;
    if (!sync)
        o.flags |= STRATA_SAVE_NO_SYNC;
    return o;
}

/* Loads everything through uri on `threads` I/O threads; on success checks every byte.
 * Returns the load's code (its message in op_msg). */
static int load_all(const char *uri, int threads)
{
    tu_set d;
    layout(&d, 0);
    strata_load_opts o = STRATA_LOAD_OPTS_INIT;
    o.io_threads = threads;
    int rc = strata_load(NULL, NULL, &uri, 1, d.st, d.n, &o);
    snprintf(op_msg, sizeof op_msg, "%s", strata_error_last());
    if (rc == 0 && tu_set_check(&d) != 0)
        fail_msg("load of %s succeeded with wrong data", uri);
    tu_set_free(&d);
    return rc;
}

static void assert_loads(const char *ck)
{
    int rc = load_all(ck, 1);
    if (rc)
        fail_msg("load of %s: %s (%s)", ck, strata_error_name(rc), op_msg);
}

/* The previous checkpoint is untouched: committed, every chunk verifies, loads bitwise. */
static void check_prev(void)
{
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, prev_ck, 0));
    assert_true(strata_ckpt_committed(c));
    assert_ok(strata_ckpt_verify(c, NULL, NULL));
    strata_ckpt_free(c);
    assert_loads(prev_ck);
}

/* Does dir (not recursing) hold any file with a strata name? */
static int has_strata_files(const char *dir)
{
    static const char *const names[] = {ST_COMMIT_FILE, ST_COMMIT_FILE ".tmp", ST_META_FILE,
                                        "data-000000.bin", "data-000001.bin",
                                        "data-000002.bin"};
    char p[900];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        tu_join(p, dir, names[i]);
        if (tu_exists(p))
            return 1;
    }
    return 0;
}

/* After a failed save to ck: nothing committed, and the save removed its directory. */
static void check_nothing_left(const char *ck, const char *what)
{
    char cp[800];
    tu_join(cp, ck, ST_COMMIT_FILE);
    if (tu_exists(cp))
        fail_msg("%s: a commit record exists after a failed save", what);
    strata_probe_info pi;
    int rc = strata_probe(&pi, ck);
    if (rc == 0 ? pi.committed || pi.is_ckpt : rc != STRATA_ENOENT)
        fail_msg("%s: probe after a failed save: %s, committed %d, is_ckpt %d", what,
                 strata_error_name(rc), pi.committed, pi.is_ckpt);
    if (tu_exists(ck))
        fail_msg("%s: the failed save left its directory %s behind (strata files: %d)", what,
                 ck, has_strata_files(ck));
}

static int mapped(const char *err)
{
    if (strcmp(err, "ENOSPC") == 0 || strcmp(err, "EDQUOT") == 0)
        return STRATA_ENOSPC;
    if (strcmp(err, "ENOENT") == 0)
        return STRATA_ENOENT;
    return STRATA_EIO; /* EIO, EACCES, EROFS */
}

/* Saves src to target through the fault URI built from query. Returns the save's code
 * after checking the aftermath: on failure nothing is left, the previous checkpoint is
 * intact and a plain retry succeeds and loads; on success (the fault did not fire) the
 * checkpoint loads. Either way target is gone afterwards. */
static int save_point(const char *target, const char *query, int threads, int sync,
                      char *msg, size_t cap)
{
    char uri[1400];
    snprintf(uri, sizeof uri, "fault+file://%s?%s", target, query);
    strata_save_opts o = save_opts(threads, sync);
    const char *u = uri;
    int rc;
    if (async_mode) {
        strata_handle *h;
        rc = strata_save_start(&h, async_saver, &u, 1, src.st, NR, &o);
        if (rc == 0) { /* the start does no I/O: faults show up on the handle */
            int src_rc = strata_wait_snapshot(h);
            rc = strata_wait_durable(NULL, h);
            if (src_rc && src_rc != rc)
                fail_msg("%s: wait_snapshot said %s, wait_durable %s", uri,
                         strata_error_name(src_rc), strata_error_name(rc));
            const char *hm;
            if (strata_handle_status(&hm, h) != rc)
                fail_msg("%s: strata_handle_status disagrees with wait_durable", uri);
            strata_handle_free(h);
        }
    } else {
        rc = strata_save(NULL, NULL, &u, 1, src.st, NR, &o);
    }
    snprintf(msg, cap, "%s", strata_error_last());
    if (rc == 0) {
        assert_loads(target);
        tu_rmrf(target);
        return 0;
    }
    if (!*msg)
        fail_msg("%s: save failed with %s but no message", uri, strata_error_name(rc));
    check_nothing_left(target, uri);
    check_prev();
    o = save_opts(threads, 0);
    assert_ok(strata_save(NULL, NULL, &target, 1, src.st, NR, &o)); /* the retry, no fault */
    assert_loads(target);
    tu_rmrf(target);
    return rc;
}

/* Fails call n = 1, 2, ... of op (for each errno) until the save succeeds; every call
 * before that must fail the save with the mapped code. Returns the number of calls, which
 * must be the same for every errno. */
static int save_matrix(const char *op, const char *target, int threads, int sync, int shortw,
                       int nerr)
{
    int count = -1;
    for (int e = 0; e < nerr; e++) {
        const char *err = save_errnos[e];
        for (int n = 1;; n++) {
            char q[128], msg[1024];
            snprintf(q, sizeof q, "op=%s&n=%d&errno=%s%s", op, n, err, shortw ? "&short=1" : "");
            if (target == nest_ck)
                tu_rmrf(nest_dir); /* its parents are missing every time */
            int rc = save_point(target, q, threads, sync, msg, sizeof msg);
            if (target == nest_ck) {
                char a[700];
                snprintf(a, sizeof a, "%s/a", nest_dir);
                assert_false(has_strata_files(nest_dir) || has_strata_files(a));
            }
            if (rc == 0) {
                if (count < 0)
                    count = n - 1;
                else if (n - 1 != count)
                    fail_msg("%s: %d calls with errno %s, %d with %s", op, n - 1, err, count,
                             save_errnos[0]);
                break;
            }
            save_points++;
            if (verbose)
                print_message("  %s: %s: %s\n", q, strata_error_name(rc), msg);
            if (rc != mapped(err))
                fail_msg("save with %s (%d threads): %s (%s), want %s", q, threads,
                         strata_error_name(rc), msg, strata_error_name(mapped(err)));
            if (n > 10000)
                fail_msg("%s: the save never stops failing", q);
        }
    }
    return count;
}

static void test_save_faults(void **state)
{
    (void)state;
    struct {
        const char *op;
        int sync, shortw, want;
    } ops[] = {
        {"open", 0, 0, nfiles + 2},
        {"write", 0, 0, write_tasks + 2},
        {"write", 0, 1, write_tasks + 2}, /* short writes: the retry fails */
        {"fsync", 1, 0, nfiles + 4},
        {"rename", 0, 0, 2}, /* metadata.bin.tmp, COMMIT.tmp */
        {"mkdir", 0, 0, 1},
        {"allocate", 0, 0, nfiles},
    };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        int got = save_matrix(ops[i].op, new_ck, 1, ops[i].sync, ops[i].shortw, 3);
        print_message("save: %-8s%s %2d calls\n", ops[i].op, ops[i].shortw ? " (short)" : "",
                      got);
        if (got != ops[i].want)
            fail_msg("a clean save makes %d %s calls, want %d", got, ops[i].op, ops[i].want);
    }
    /* mkdir -p: every missing parent is one more mkdir; a failure leaves the parents it
     * made (they are not strata's) but nothing else */
    assert_int_equal(save_matrix("mkdir", nest_ck, 1, 0, 0, 3), 3);
    tu_rmrf(nest_dir);
}

/* The same on 4 I/O threads: which write is the N-th varies from run to run, but every
 * call still happens once, so every fault fires and fails the save with its code. */
static void test_save_faults_threads(void **state)
{
    (void)state;
    assert_int_equal(save_matrix("write", new_ck, 4, 0, 0, 1), write_tasks + 2);
    assert_int_equal(save_matrix("write", new_ck, 4, 0, 1, 1), write_tasks + 2);
    assert_int_equal(save_matrix("open", new_ck, 4, 0, 0, 1), nfiles + 2);
    assert_int_equal(save_matrix("fsync", new_ck, 4, 1, 0, 1), nfiles + 4);
    assert_int_equal(save_matrix("allocate", new_ck, 4, 0, 0, 1), nfiles);
}

/* The same walk through strata_save_start on a saver with a pool: every fault point fails
 * the save on its handle with the mapped code and leaves nothing behind. The writes are
 * the pool-buffer-sized tasks of a clean asynchronous save (its stats.io_calls). */
static void test_save_faults_async(void **state)
{
    (void)state;
    assert_ok(strata_pool_new(&async_pool, 4 * 8192));
    assert_ok(strata_saver_new(&async_saver, NULL, async_pool));
    strata_save_opts o = save_opts(1, 0);
    strata_handle *h;
    strata_stats st = STRATA_STATS_INIT;
    const char *u = new_ck;
    assert_ok(strata_save_start(&h, async_saver, &u, 1, src.st, NR, &o));
    assert_ok(strata_wait_durable(&st, h));
    strata_handle_free(h);
    tu_rmrf(new_ck);
    int tasks = (int)st.io_calls;
    assert_true(tasks > write_tasks); /* smaller tasks than strata_save's */
    async_mode = 1;
    struct {
        const char *op;
        int sync, shortw, want;
    } ops[] = {
        {"open", 0, 0, nfiles + 2},  {"write", 0, 0, tasks + 2}, {"write", 0, 1, tasks + 2},
        {"fsync", 1, 0, nfiles + 4}, {"rename", 0, 0, 2},        {"mkdir", 0, 0, 1},
        {"allocate", 0, 0, nfiles},
    };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        int got = save_matrix(ops[i].op, new_ck, 1, ops[i].sync, ops[i].shortw, 2);
        print_message("async save: %-8s%s %2d calls\n", ops[i].op,
                      ops[i].shortw ? " (short)" : "", got);
        if (got != ops[i].want)
            fail_msg("a clean async save makes %d %s calls, want %d", got, ops[i].op,
                     ops[i].want);
    }
    assert_int_equal(save_matrix("write", new_ck, 3, 0, 0, 1), tasks + 2); /* 3 flushers */
    async_mode = 0;
    strata_saver_free(async_saver);
    async_saver = NULL;
    strata_pool_free(async_pool);
    async_pool = NULL;
}

/* Makes new_ck an incomplete checkpoint (a save without its commit record). */
static void make_incomplete(void)
{
    strata_save_opts o = save_opts(1, 0);
    tu_rmrf(new_ck);
    const char *u = new_ck;
    assert_ok(strata_save(NULL, NULL, &u, 1, src.st, NR, &o));
    char cp[800];
    tu_join(cp, new_ck, ST_COMMIT_FILE);
    assert_int_equal(unlink(cp), 0);
}

/* A save over an incomplete checkpoint first unlinks its files (F data files and
 * metadata.bin): an unlink that fails fails the save with its code before anything is
 * written; the directory stays incomplete (no commit record), the other files are
 * removed, and a retry replaces it. A clean save into a new directory unlinks nothing,
 * and unlink faults there never fire. */
static void test_unlink_faults(void **state)
{
    (void)state;
    int count = -1;
    for (int e = 0; e < 3; e++) {
        const char *err = save_errnos[e];
        for (int n = 1;; n++) {
            make_incomplete();
            char uri[1400];
            snprintf(uri, sizeof uri, "fault+file://%s?op=unlink&n=%d&errno=%s", new_ck, n, err);
            strata_save_opts o = save_opts(1, 0);
            const char *u = uri, *nu = new_ck;
            int rc = strata_save(NULL, NULL, &u, 1, src.st, NR, &o);
            if (rc == 0) {
                if (count < 0)
                    count = n - 1;
                assert_int_equal(count, n - 1);
                assert_loads(new_ck);
                break;
            }
            save_points++;
            if (rc != mapped(err))
                fail_msg("%s: %s (%s), want %s", uri, strata_error_name(rc),
                         strata_error_last(), strata_error_name(mapped(err)));
            assert_msg_has("cannot remove");
            strata_probe_info pi;
            assert_ok(strata_probe(&pi, new_ck));
            assert_false(pi.has_commit);
            assert_false(pi.committed);
            assert_true(pi.is_ckpt); /* the file that could not be removed */
            check_prev();
            assert_ok(strata_save(NULL, NULL, &nu, 1, src.st, NR, &o));
            assert_loads(new_ck);
        }
    }
    assert_int_equal(count, nfiles + 1);
    tu_rmrf(new_ck);
    /* into a fresh directory: no unlink at all */
    char uri[1400], msg[1024];
    snprintf(uri, sizeof uri, "op=unlink&n=1&errno=EIO");
    assert_int_equal(save_point(new_ck, uri, 1, 0, msg, sizeof msg), 0);
}

/* A fault in the cleanup that runs only after a failure: the data file cannot be
 * written (a file size limit: EFBIG, a full disk) and then its removal fails too. The save
 * reports the first failure, not the cleanup's; what it could not remove stays as a
 * visibly incomplete checkpoint (no commit record) that strata_remove_incomplete clears. */
static void test_cleanup_faults(void **state)
{
    (void)state;
    for (int sticky = 0; sticky <= 1; sticky++) {
        char uri[1400];
        snprintf(uri, sizeof uri, "fault+file://%s?op=unlink&n=1&errno=EIO%s", new_ck,
                 sticky ? "&sticky=1" : "");
        strata_save_opts o = save_opts(1, 0);
        struct rlimit old, lim;
        assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
        void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
        lim = old;
        lim.rlim_cur = 16384; /* the smallest data file is larger */
        assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
        const char *u = uri, *nu = new_ck;
        int rc = strata_save(NULL, NULL, &u, 1, src.st, NR, &o);
        setrlimit(RLIMIT_FSIZE, &old);
        signal(SIGXFSZ, prev);
        save_points++;
        if (rc != STRATA_ENOSPC)
            fail_msg("%s: %s (%s), want STRATA_ENOSPC", uri, strata_error_name(rc),
                     strata_error_last());
        assert_msg_has("data-000000.bin");
        strata_probe_info pi;
        assert_ok(strata_probe(&pi, new_ck));
        assert_true(pi.is_ckpt);
        assert_false(pi.has_commit);
        assert_false(pi.committed);
        strata_ckpt *c = NULL;
        assert_rc(strata_ckpt_open(&c, new_ck, 0), STRATA_EINCOMPLETE);
        check_prev();
        assert_ok(strata_remove_incomplete(new_ck));
        assert_false(tu_exists(new_ck));
        assert_ok(strata_save(NULL, NULL, &nu, 1, src.st, NR, &o));
        assert_loads(new_ck);
        tu_rmrf(new_ck);
    }
}

/* ---- load ---- */

/* What a load of prev_ck returns when call n of op (open or read) fails with err, one
 * I/O thread: call 1 is the commit record, call 2 metadata.bin, then the data files. */
static int load_expect(const char *op, int n, const char *err)
{
    int enoent = strcmp(err, "ENOENT") == 0;
    if (n == 1) /* no commit record: incomplete */
        return enoent ? STRATA_EINCOMPLETE : mapped(err);
    if (n == 2) /* a valid commit record without its metadata is corrupt */
        return enoent || META_READ_ERROR_IS_EFORMAT ? STRATA_EFORMAT : mapped(err);
    (void)op;
    return mapped(err);
}

/* strata_ckpt_open + strata_ckpt_verify through uri (message in op_msg). */
static int verify_rc(const char *uri)
{
    strata_ckpt *c = NULL;
    int rc = strata_ckpt_open(&c, uri, 0);
    if (rc == 0)
        rc = strata_ckpt_verify(c, NULL, NULL);
    snprintf(op_msg, sizeof op_msg, "%s", strata_error_last());
    strata_ckpt_free(c);
    return rc;
}

/* Like save_matrix for loads (verify = 0) or open + verify (verify = 1) of prev_ck.
 * Every failing load must say so: a load that returns 0 has filled every byte (checked). */
static int load_matrix(const char *op, int threads, int verify, int precise)
{
    int count = -1;
    for (size_t e = 0; e < sizeof load_errnos / sizeof load_errnos[0]; e++) {
        const char *err = load_errnos[e];
        for (int n = 1;; n++) {
            char uri[1400];
            snprintf(uri, sizeof uri, "fault+file://%s?op=%s&n=%d&errno=%s", prev_ck, op, n, err);
            int rc = verify ? verify_rc(uri) : load_all(uri, threads);
            if (rc == 0) {
                if (count < 0)
                    count = n - 1;
                else if (count != n - 1)
                    fail_msg("%s: %d calls with %s, %d with %s", op, n - 1, err, count,
                             load_errnos[0]);
                break;
            }
            load_points++;
            if (verbose)
                print_message("  %s %s: %s: %s\n", verify ? "verify" : "load", uri,
                              strata_error_name(rc), op_msg);
            int want = load_expect(op, n, err);
            if (precise && rc != want)
                fail_msg("%s %s: %s (%s), want %s", verify ? "verify" : "load", uri,
                         strata_error_name(rc), op_msg, strata_error_name(want));
            if (!*op_msg)
                fail_msg("%s: %s without a message", uri, strata_error_name(rc));
            if (n > 10000)
                fail_msg("%s: never succeeds", uri);
        }
    }
    check_prev();
    return count;
}

static void test_load_faults(void **state)
{
    (void)state;
    /* reads: commit record, metadata, then one per coalesced read of the plan */
    strata_stats st = STRATA_STATS_INIT;
    tu_set d;
    layout(&d, 0);
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.io_threads = 1;
    const char *pu = prev_ck;
    assert_ok(strata_load(&st, NULL, &pu, 1, d.st, d.n, &lo));
    tu_set_free(&d);
    int nreads = (int)st.io_calls;

    int opens = load_matrix("open", 1, 0, 1), reads = load_matrix("read", 1, 0, 1);
    print_message("load: open %d calls, read %d calls\n", opens, reads);
    assert_int_equal(opens, nfiles + 2);
    assert_int_equal(reads, nreads + 2);
    /* strata_ckpt_verify reads every chunk of every file the same way */
    assert_int_equal(load_matrix("open", 1, 1, 1), nfiles + 2);
    assert_true(load_matrix("read", 1, 1, 1) >= nfiles + 2);
    /* 4 threads: the data files' calls race, each still fails the load */
    assert_int_equal(load_matrix("open", 4, 0, 1), nfiles + 2);
    assert_int_equal(load_matrix("read", 4, 0, 1), nreads + 2);
}

/* ---- setup ---- */

static int setup(void **state)
{
    (void)state;
    verbose = tu_env_u64("STRATA_FAULT_VERBOSE", 0) != 0;
    tu_tmpdir(base_dir, sizeof base_dir, "faults");
    assert_int_equal(st_vfs_fault_register(), 0);
    snprintf(prev_ck, sizeof prev_ck, "%s/prev", base_dir);
    snprintf(new_ck, sizeof new_ck, "%s/new", base_dir);
    snprintf(nest_dir, sizeof nest_dir, "%s/nest", base_dir);
    snprintf(nest_ck, sizeof nest_ck, "%s/a/new", nest_dir);
    layout(&src, 1);
    /* the previous checkpoint: same layout, synced */
    strata_save_opts o = save_opts(0, 1);
    const char *pu = prev_ck, *nu = new_ck;
    if (strata_save(NULL, NULL, &pu, 1, src.st, NR, &o))
        fail_msg("saving %s: %s", prev_ck, strata_error_last());
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, prev_ck, 0));
    nfiles = (int)strata_ckpt_nfiles(c);
    strata_ckpt_free(c);
    strata_stats st = STRATA_STATS_INIT;
    o = save_opts(1, 0);
    assert_ok(strata_save(&st, NULL, &nu, 1, src.st, NR, &o));
    write_tasks = (int)st.io_calls;
    tu_rmrf(new_ck);
    assert_int_equal(nfiles, NR);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    printf("fault points tried: save %d, load %d\n", save_points, load_points);
    tu_set_free(&src);
    tu_rmrf(base_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_faults),
        cmocka_unit_test(test_save_faults_threads),
        cmocka_unit_test(test_save_faults_async),
        cmocka_unit_test(test_unlink_faults),
        cmocka_unit_test(test_cleanup_faults),
        cmocka_unit_test(test_load_faults),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
