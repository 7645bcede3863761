/* test_hostile.c - what a hostile or careless filesystem, or a hostile name, does to
 * readers (issue 10, items 5, 6, 8 and 10):
 *  - a FIFO, a device or a directory in place of COMMIT, metadata.bin or a data file never
 *    blocks a reader (open, load, verify, probe, retention) and is refused with its exact
 *    code: COMMIT -> no valid commit record (STRATA_EINCOMPLETE; ls says CORRUPT),
 *    metadata.bin -> STRATA_EFORMAT when committed, STRATA_EINCOMPLETE when not, a data
 *    file -> STRATA_EIO;
 *  - a sparse 4 GiB metadata.bin is refused before any large allocation (peak RSS checked),
 *    committed (the commit record states the size) or not (a fixed bound, 256 MiB);
 *  - mem:// roots are made private (0700) and refused when owned by another user, writable
 *    by others, a symlink or not a directory; the default root is per user;
 *  - tensor and blob names must be UTF-8 at registration; `strata inspect --json` escapes
 *    whatever an older checkpoint holds (tests/cli_test.sh runs this program with
 *    --make-bad-name DIR to make such a checkpoint).
 * Every blocking case runs under a watchdog, so a hang fails the test instead of hanging. */
#include <limits.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/sysmacros.h>
#include <sys/types.h>

#include "core/checksum.h"
#include "meta/meta.h"
#include "testutil.h"

static char base_dir[512];

/* ---- a watchdog: a call that blocks fails the test ---- */

static void on_alarm(int sig)
{
    (void)sig;
    static const char m[] = "test_hostile: a call blocked (watchdog expired)\n";
    ssize_t r = write(2, m, sizeof m - 1);
    (void)r;
    _exit(1);
}

static void watchdog(unsigned seconds)
{
    signal(SIGALRM, on_alarm);
    alarm(seconds);
}

/* ---- a small checkpoint ---- */

static const uint64_t wshape[] = {64, 64};

/* Saves tensor "w" (f32 [64, 64]) and global blob "cfg" (100 bytes), step 7, to ck. */
static void make_ckpt(const char *ck)
{
    tu_rmrf(ck);
    tu_set s;
    tu_set_init(&s, 1);
    tu_set_shard(&s, 0, "w", STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 1);
    tu_set_blob(&s, 0, "cfg", 0, 0, 100, 1);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 4096;
    o.step = 7;
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 1, &o));
    tu_set_free(&s);
}

/* The request of the last load, freed at the next one (the error message lives until the
 * next strata call). */
static tu_set last_req;

/* Loads everything of make_ckpt's checkpoint from uri; on success checks the values. */
static int load_rc(const char *uri)
{
    tu_set_free(&last_req);
    tu_set_init(&last_req, 1);
    tu_set_shard(&last_req, 0, "w", STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_blob(&last_req, 0, "cfg", 0, -1, 100, 0);
    int rc = strata_load(NULL, NULL, &uri, 1, last_req.st, 1, NULL);
    if (rc == 0)
        assert_int_equal(tu_set_check(&last_req), 0);
    return rc;
}

static int open_rc(const char *uri, unsigned flags)
{
    strata_ckpt *ck = NULL;
    int rc = strata_ckpt_open(&ck, uri, flags);
    strata_ckpt_free(ck);
    return rc;
}

static int verify_rc(const char *uri)
{
    strata_ckpt *ck = NULL;
    int rc = strata_ckpt_open(&ck, uri, 0);
    if (rc == 0)
        rc = strata_ckpt_verify(ck, NULL, NULL);
    strata_ckpt_free(ck);
    return rc;
}

/* parent = base_dir/<sub>, ck = parent/step7 (a fresh committed checkpoint). */
static void fresh(char *parent, size_t pcap, char *ck, size_t ccap, const char *sub)
{
    snprintf(parent, pcap, "%s/%s", base_dir, sub);
    tu_rmrf(parent);
    assert_int_equal(mkdir(parent, 0755), 0);
    snprintf(ck, ccap, "%s/step7", parent);
    make_ckpt(ck);
}

/* Replaces dir/name with a FIFO. */
static void fifo_in_place(const char *dir, const char *name)
{
    char p[800];
    tu_join(p, dir, name);
    assert_int_equal(unlink(p), 0);
    if (mkfifo(p, 0644))
        fail_msg("mkfifo %s: %s", p, strerror(errno));
}

static int is_fifo(const char *dir, const char *name)
{
    char p[800];
    struct stat st;
    tu_join(p, dir, name);
    return lstat(p, &st) == 0 && S_ISFIFO(st.st_mode);
}

/* ---- item 5: FIFOs and other non-regular files ---- */

static void test_backend_refuses_fifo(void **state)
{
    (void)state;
    char dir[600], p[700];
    snprintf(dir, sizeof dir, "%s/fifo_backend", base_dir);
    assert_int_equal(mkdir(dir, 0755), 0);
    tu_join(p, dir, "data-000000.bin");
    assert_int_equal(mkfifo(p, 0644), 0);
    watchdog(20);
    const st_vfs *v = &st_vfs_posix;
    static const int modes[] = {ST_O_READ, ST_O_READ | ST_O_DIRECT};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        st_file *f = NULL;
        int e = v->open(v, p, modes[i], &f);
        if (e == 0)
            v->close(f);
        if (e != -ST_ENOTREG)
            fail_msg("opening a FIFO with flags %d: %d (%s), want -ST_ENOTREG", modes[i], e,
                     e ? strerror(-e) : "opened");
    }
    /* a directory is not a file either */
    char sub[700];
    tu_join(sub, dir, "metadata.bin");
    assert_int_equal(mkdir(sub, 0755), 0);
    st_file *f = NULL;
    int e = v->open(v, sub, ST_O_READ, &f);
    if (e == 0)
        v->close(f);
    assert_int_equal(e, -ST_ENOTREG);
    /* st_vfs_read_all (metadata, commit records) the same */
    unsigned char *buf = NULL;
    size_t len = 0;
    assert_int_equal(st_vfs_read_all(v, p, 4096, 0, &buf, &len), -ST_ENOTREG);
    assert_null(buf);
    alarm(0);
    tu_rmrf(dir);
}

static void test_fifo_commit(void **state)
{
    (void)state;
    char parent[600], ck[700];
    fresh(parent, sizeof parent, ck, sizeof ck, "fifo_commit");
    fifo_in_place(ck, ST_COMMIT_FILE);
    watchdog(30);
    /* a commit record that is not a regular file is no valid commit record */
    assert_rc(open_rc(ck, 0), STRATA_EINCOMPLETE);
    assert_msg_has("COMMIT");
    assert_msg_has("not a regular file");
    assert_rc(load_rc(ck), STRATA_EINCOMPLETE);
    assert_msg_has("not a regular file");
    assert_rc(verify_rc(ck), STRATA_EINCOMPLETE);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, STRATA_OPEN_INCOMPLETE)); /* inspect shows it */
    assert_int_equal(strata_ckpt_committed(c), 0);
    assert_int_equal(strata_ckpt_step(c), 7);
    strata_ckpt_free(c);
    /* ls: CORRUPT (a commit record that does not verify); gc and retention keep it */
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_int_equal(pi.is_ckpt, 1);
    assert_int_equal(pi.has_commit, 1);
    assert_int_equal(pi.committed, 0);
    assert_int_equal(pi.has_metadata, 1);
    assert_int_equal(pi.step, 7);
    int removed = -1;
    assert_ok(strata_retain(&removed, parent, 0));
    assert_int_equal(removed, 0);
    assert_rc(strata_remove_incomplete(ck), STRATA_EEXIST);
    assert_true(is_fifo(ck, ST_COMMIT_FILE));
    alarm(0);
    tu_rmrf(parent);
}

static void test_fifo_metadata(void **state)
{
    (void)state;
    char parent[600], ck[700];
    fresh(parent, sizeof parent, ck, sizeof ck, "fifo_meta");
    fifo_in_place(ck, ST_META_FILE);
    watchdog(30);
    /* committed: metadata that is not a regular file does not match the commit record */
    assert_rc(open_rc(ck, 0), STRATA_EFORMAT);
    assert_msg_has("metadata.bin");
    assert_msg_has("not a regular file");
    assert_rc(open_rc(ck, STRATA_OPEN_INCOMPLETE), STRATA_EFORMAT);
    assert_rc(load_rc(ck), STRATA_EFORMAT);
    assert_msg_has("not a regular file");
    assert_rc(verify_rc(ck), STRATA_EFORMAT);
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_int_equal(pi.is_ckpt, 1); /* its data file */
    assert_int_equal(pi.has_commit, 1);
    assert_int_equal(pi.committed, 0);
    assert_int_equal(pi.has_metadata, 0);
    int removed = -1;
    assert_ok(strata_retain(&removed, parent, 0));
    assert_int_equal(removed, 0);
    /* not committed: the same metadata is a reason for incompleteness */
    char cp[800];
    tu_join(cp, ck, ST_COMMIT_FILE);
    assert_int_equal(unlink(cp), 0);
    assert_rc(open_rc(ck, STRATA_OPEN_INCOMPLETE), STRATA_EINCOMPLETE);
    assert_msg_has("not a regular file");
    assert_rc(load_rc(ck), STRATA_EINCOMPLETE);
    assert_ok(strata_probe(&pi, ck));
    assert_int_equal(pi.has_commit, 0);
    assert_int_equal(pi.has_metadata, 0);
    /* removing it as incomplete leaves the FIFO (not strata's) and so the directory */
    assert_ok(strata_remove_incomplete(ck));
    assert_true(is_fifo(ck, ST_META_FILE));
    alarm(0);
    tu_rmrf(parent);
}

/* The data file replaced by `make` (a FIFO, a directory, a device): open works (the
 * metadata is fine), every read of the data is STRATA_EIO naming the file, nothing blocks. */
static void data_file_refused(const char *sub, void (*make)(const char *path))
{
    char parent[600], ck[700], p[800];
    fresh(parent, sizeof parent, ck, sizeof ck, sub);
    tu_join(p, ck, "data-000000.bin");
    assert_int_equal(unlink(p), 0);
    make(p);
    watchdog(30);
    assert_ok(open_rc(ck, 0));
    assert_rc(verify_rc(ck), STRATA_EIO);
    assert_msg_has("data-000000.bin");
    assert_rc(load_rc(ck), STRATA_EIO);
    assert_msg_has("data-000000.bin");
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_int_equal(pi.committed, 1); /* probing reads no data */
    int removed = -1;
    assert_ok(strata_retain(&removed, parent, 1));
    assert_int_equal(removed, 0);
    alarm(0);
    tu_rmrf(parent);
}

static void make_fifo(const char *p) { assert_int_equal(mkfifo(p, 0644), 0); }
static void make_dir(const char *p) { assert_int_equal(mkdir(p, 0755), 0); }

static void test_fifo_data(void **state)
{
    (void)state;
    data_file_refused("fifo_data", make_fifo);
}

static void test_dir_data(void **state)
{
    (void)state;
    data_file_refused("dir_data", make_dir);
}

static int mknod_ok;
static void make_zero_dev(const char *p)
{
    /* /dev/zero's numbers: reading it would return zeros forever (wrong checksums at best) */
    mknod_ok = mknod(p, S_IFCHR | 0644, makedev(1, 5)) == 0;
    if (!mknod_ok)
        make_fifo(p);
}

static void test_device_data(void **state)
{
    (void)state;
    data_file_refused("dev_data", make_zero_dev);
    if (!mknod_ok)
        print_message("(mknod not permitted here: tested with a FIFO instead)\n");
}

/* ---- item 6: a sparse 4 GiB metadata.bin ---- */

static long peak_rss_kib(void)
{
    struct rusage ru;
    assert_int_equal(getrusage(RUSAGE_SELF, &ru), 0);
    return ru.ru_maxrss;
}

#define HUGE_META (4ull << 30)
#define RSS_SLACK_KIB (64l << 10) /* 64 MiB */

static void sparse_metadata(const char *ck)
{
    char mp[800];
    tu_join(mp, ck, ST_META_FILE);
    tu_truncate(mp, HUGE_META); /* a hole: 4 GiB long, a few KiB on disk */
}

static void test_sparse_metadata_committed(void **state)
{
    (void)state;
    char parent[600], ck[700];
    fresh(parent, sizeof parent, ck, sizeof ck, "sparse_committed");
    sparse_metadata(ck);
    watchdog(60);
    long rss0 = peak_rss_kib();
    assert_rc(open_rc(ck, 0), STRATA_EFORMAT);
    assert_msg_has("metadata.bin");
    assert_msg_has("commit record");
    assert_rc(open_rc(ck, STRATA_OPEN_INCOMPLETE), STRATA_EFORMAT);
    assert_rc(load_rc(ck), STRATA_EFORMAT);
    assert_rc(verify_rc(ck), STRATA_EFORMAT);
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_int_equal(pi.has_commit, 1);
    assert_int_equal(pi.committed, 0);
    assert_int_equal(pi.has_metadata, 0);
    int removed = -1;
    assert_ok(strata_retain(&removed, parent, 0));
    assert_int_equal(removed, 0); /* corrupt: kept */
    long grew = peak_rss_kib() - rss0;
    print_message("committed, sparse 4 GiB metadata: peak RSS grew by %ld KiB\n", grew);
    if (grew >= RSS_SLACK_KIB)
        fail_msg("peak RSS grew by %ld KiB reading a sparse 4 GiB metadata.bin", grew);
    alarm(0);
    tu_rmrf(parent);
}

static void test_sparse_metadata_incomplete(void **state)
{
    (void)state;
    char parent[600], ck[700], cp[800];
    fresh(parent, sizeof parent, ck, sizeof ck, "sparse_incomplete");
    tu_join(cp, ck, ST_COMMIT_FILE);
    assert_int_equal(unlink(cp), 0);
    sparse_metadata(ck);
    watchdog(60);
    long rss0 = peak_rss_kib();
    assert_rc(open_rc(ck, 0), STRATA_EINCOMPLETE);
    assert_rc(open_rc(ck, STRATA_OPEN_INCOMPLETE), STRATA_EINCOMPLETE);
    assert_msg_has("metadata.bin");
    assert_msg_has("256 MiB");
    assert_rc(load_rc(ck), STRATA_EINCOMPLETE);
    assert_rc(verify_rc(ck), STRATA_EINCOMPLETE);
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_int_equal(pi.is_ckpt, 1);
    assert_int_equal(pi.has_commit, 0);
    assert_int_equal(pi.has_metadata, 0);
    assert_ok(strata_retain(NULL, parent, 1)); /* (it may be removed: no save owns it) */
    long grew = peak_rss_kib() - rss0;
    print_message("incomplete, sparse 4 GiB metadata: peak RSS grew by %ld KiB\n", grew);
    if (grew >= RSS_SLACK_KIB)
        fail_msg("peak RSS grew by %ld KiB reading a sparse 4 GiB metadata.bin", grew);
    alarm(0);
    tu_rmrf(parent);
}

/* ---- item 8: mem:// roots ---- */

static char saved_root[700];
static int had_root;

static void set_root(const char *root)
{
    if (root)
        setenv("STRATA_MEM_ROOT", root, 1);
    else
        unsetenv("STRATA_MEM_ROOT");
}

static int mode_of(const char *p)
{
    struct stat st;
    assert_int_equal(lstat(p, &st), 0);
    return (int)(st.st_mode & 07777);
}

/* Saves make_ckpt's state to uri; returns the save's code. */
static int save_rc(const char *uri)
{
    tu_set s;
    tu_set_init(&s, 1);
    tu_set_shard(&s, 0, "w", STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 1);
    tu_set_blob(&s, 0, "cfg", 0, 0, 100, 1);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 4096;
    o.step = 7;
    int rc = strata_save(NULL, NULL, (const char *[]){uri}, 1, s.st, 1, &o);
    tu_set_free(&s);
    return rc;
}

static void test_mem_root_created_private(void **state)
{
    (void)state;
    char root[700];
    snprintf(root, sizeof root, "%s/memroot_new/a/b", base_dir); /* parents missing too */
    set_root(root);
    assert_ok(save_rc("mem://ck"));
    assert_int_equal(mode_of(root), 0700);
    struct stat st;
    assert_int_equal(lstat(root, &st), 0);
    assert_int_equal(st.st_uid, geteuid());
    assert_ok(load_rc("mem://ck"));
    /* a root made by an earlier version (0755: not writable by others) still serves */
    assert_int_equal(chmod(root, 0755), 0);
    assert_ok(load_rc("mem://ck"));
    assert_int_equal(chmod(root, 0750), 0);
    assert_ok(load_rc("mem://ck"));
    set_root(NULL);
}

/* Every entry point refuses mem:// under root, with STRATA_EINVAL and a message naming the
 * root and `why`. */
static void expect_root_refused(const char *root, const char *why)
{
    set_root(root);
    assert_rc(load_rc("mem://ck"), STRATA_EINVAL);
    assert_msg_has(root);
    assert_msg_has(why);
    assert_rc(open_rc("mem://ck", STRATA_OPEN_INCOMPLETE), STRATA_EINVAL);
    assert_msg_has(why);
    strata_probe_info pi;
    assert_rc(strata_probe(&pi, "mem://ck"), STRATA_EINVAL);
    assert_rc(strata_retain(NULL, "mem://ck", 0), STRATA_EINVAL);
    assert_rc(strata_remove_incomplete("mem://ck"), STRATA_EINVAL);
    assert_rc(save_rc("mem://other"), STRATA_EINVAL);
    assert_msg_has(why);
    char p[800];
    tu_join(p, root, "other");
    assert_false(tu_exists(p));
    set_root(NULL);
}

static void test_mem_root_squatted(void **state)
{
    (void)state;
    if (geteuid() != 0) {
        print_message("(not root: cannot give a directory to another user; skipped)\n");
        skip();
    }
    /* another user made the root first and put a valid checkpoint of their own in it */
    char root[700], ck[800];
    snprintf(root, sizeof root, "%s/memroot_squat", base_dir);
    assert_int_equal(mkdir(root, 0700), 0);
    tu_join(ck, root, "ck");
    make_ckpt(ck);
    assert_int_equal(chown(root, 65534, 65534), 0);
    expect_root_refused(root, "owned by uid 65534");
    /* the victim's own files were never touched */
    assert_ok(load_rc(ck));
    tu_rmrf(root);
}

static void test_mem_root_writable(void **state)
{
    (void)state;
    char root[700], ck[800];
    snprintf(root, sizeof root, "%s/memroot_open", base_dir);
    assert_int_equal(mkdir(root, 0700), 0);
    tu_join(ck, root, "ck");
    make_ckpt(ck);
    static const int modes[] = {0777, 01777, 0770, 0707, 0720, 0702};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        assert_int_equal(chmod(root, (mode_t)modes[i]), 0);
        expect_root_refused(root, "writable by others");
    }
    assert_int_equal(chmod(root, 0700), 0);
    set_root(root);
    assert_ok(load_rc("mem://ck"));
    set_root(NULL);
    tu_rmrf(root);
}

static void test_mem_root_not_a_dir(void **state)
{
    (void)state;
    /* a symlink (even to a private directory of ours) and a file are refused */
    char real[700], link[700], file[700], ck[800];
    snprintf(real, sizeof real, "%s/memroot_real", base_dir);
    snprintf(link, sizeof link, "%s/memroot_link", base_dir);
    snprintf(file, sizeof file, "%s/memroot_file", base_dir);
    assert_int_equal(mkdir(real, 0700), 0);
    tu_join(ck, real, "ck");
    make_ckpt(ck);
    assert_int_equal(symlink(real, link), 0);
    expect_root_refused(link, "symlink");
    tu_write_file(file, "x", 1);
    expect_root_refused(file, "not a directory");
    unlink(link);
    unlink(file);
    tu_rmrf(real);
}

static void test_mem_default_root_per_user(void **state)
{
    (void)state;
    char want_root[64], want[128], path[PATH_MAX];
    snprintf(want_root, sizeof want_root, "/dev/shm/strata-%u", (unsigned)geteuid());
    snprintf(want, sizeof want, "%s/x/y", want_root);
    int existed = tu_exists(want_root);
    set_root(NULL);
    const st_vfs *v;
    assert_ok(st_vfs_resolve("mem://x/y", &v, path, sizeof path));
    st_vfs_release(v);
    assert_string_equal(path, want);
    assert_int_equal(mode_of(want_root) & 022, 0);
    if (!existed) {
        assert_int_equal(mode_of(want_root), 0700);
        rmdir(want_root);
    }
}

/* ---- item 10: names are UTF-8 ---- */

static const char *const bad_names[] = {
    "w\xff",             /* never in UTF-8 */
    "\x80w",             /* a continuation byte alone */
    "w\xc0\xaf",         /* overlong '/' */
    "w\xc1\xbf",         /* overlong */
    "w\xe0\x80\xaf",     /* overlong, 3 bytes */
    "w\xf0\x80\x80\xaf", /* overlong, 4 bytes */
    "w\xed\xa0\x80",     /* a UTF-16 surrogate */
    "w\xed\xbf\xbf",     /* a surrogate */
    "w\xf4\x90\x80\x80", /* above U+10FFFF */
    "w\xf5\x80\x80\x80", /* above U+10FFFF */
    "w\xe2\x82",         /* truncated at the end */
    "w\xe2\x82x",        /* truncated inside */
    "w\xf0\x9f\x98",     /* truncated 4-byte */
    "\xc3",              /* a lead byte alone */
};

static const char *const good_names[] = {
    "poids.\xc3\xa9",                     /* é */
    "\xe5\xb1\x82.\xe6\x9d\x83\xe9\x87\x8d", /* 层.权重 */
    "emoji.\xf0\x9f\x98\x80",             /* U+1F600 */
    "\xef\xbf\xbd",                       /* U+FFFD itself */
    "max.\xf4\x8f\xbf\xbf",               /* U+10FFFF */
    "\xed\x9f\xbf.\xee\x80\x80",          /* U+D7FF, U+E000 around the surrogates */
    "ctl.\x01\x1f\x7f",                   /* control characters are UTF-8 too */
};

static void test_names_utf8(void **state)
{
    (void)state;
    strata_state *st;
    assert_ok(strata_state_new(&st));
    uint64_t shape[] = {4};
    float data[4] = {0};
    for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
        strata_shard sh = {.name = bad_names[i], .dtype = STRATA_F32, .ndim = 1,
                           .global_shape = shape, .data = data};
        assert_rc(strata_state_add_shard(st, &sh), STRATA_EINVAL);
        assert_msg_has("UTF-8");
        assert_msg_has("tensor");
        assert_int_equal(strata_shard_numel(&sh), 0);
        assert_rc(strata_state_add_blob(st, bad_names[i], 0, 0, data, sizeof data),
                  STRATA_EINVAL);
        assert_msg_has("UTF-8");
        assert_msg_has("blob");
        assert_rc(strata_state_add_blob(st, bad_names[i], STRATA_BLOB_RANK_LOCAL, 0, data,
                                        sizeof data),
                  STRATA_EINVAL);
    }
    strata_state_free(st);

    /* valid names of every length class register, save and load bitwise */
    char ck[600];
    snprintf(ck, sizeof ck, "%s/utf8", base_dir);
    tu_set s, d;
    tu_set_init(&s, 1);
    tu_set_init(&d, 1);
    for (size_t i = 0; i < sizeof good_names / sizeof good_names[0]; i++) {
        tu_set_shard(&s, 0, good_names[i], STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 1);
        tu_set_shard(&d, 0, good_names[i], STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
        tu_set_blob(&s, 0, good_names[i], 0, 0, 33, 1);
        tu_set_blob(&d, 0, good_names[i], 0, -1, 33, 0);
    }
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 1, NULL));
    assert_ok(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&s);
    tu_set_free(&d);
    tu_rmrf(ck);
}

/* ---- a checkpoint whose names are not UTF-8 (written before names were checked) ---- */

/* The bad names; each is saved first under a placeholder of its length (all 'Q', all
 * 'Z'), then patched in. */
#define TENSOR_BAD "tensor.\xff|\xc0\xaf|\x01\x1f\x7f|\"\\|\xc3\xa9|\xed\xa0\x80|\xe2\x82"
#define BLOB_BAD "blob.\x80\xf5\xe2\x82x\xf0\x9f\x98\x80ok"

static char *placeholder(const char *bad, char c)
{
    size_t n = strlen(bad);
    char *p = malloc(n + 1);
    assert_non_null(p);
    memset(p, c, n);
    p[n] = 0;
    return p;
}

static void patch(unsigned char *buf, size_t len, const char *ph, const char *bad)
{
    size_t n = strlen(ph);
    unsigned char *at = memmem(buf, len, ph, n);
    assert_non_null(at);
    memcpy(at, bad, n);
}

/* Saves a committed checkpoint at dir whose tensor and blob names hold bytes that are not
 * UTF-8 (patched into the metadata, checksums and commit record redone), and writes the
 * raw names to dir.names (tensor name, NUL, blob name). */
static int make_bad_name(const char *dir)
{
    char *tph = placeholder(TENSOR_BAD, 'Q'), *bph = placeholder(BLOB_BAD, 'Z');
    tu_set s;
    tu_set_init(&s, 1);
    tu_set_shard(&s, 0, tph, STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 1);
    tu_set_blob(&s, 0, bph, 0, 0, 10, 1);
    assert_ok(strata_save(NULL, NULL, (const char *[]){dir}, 1, s.st, 1, NULL));
    tu_set_free(&s);
    char mp[PATH_MAX], cp[PATH_MAX], np[PATH_MAX];
    snprintf(mp, sizeof mp, "%s/%s", dir, ST_META_FILE);
    snprintf(cp, sizeof cp, "%s/%s", dir, ST_COMMIT_FILE);
    snprintf(np, sizeof np, "%s.names", dir);
    size_t len, clen;
    unsigned char *m = tu_read_file(mp, &len), *c = tu_read_file(cp, &clen);
    patch(m, len, tph, TENSOR_BAD);
    patch(m, len, bph, BLOB_BAD);
    free(tph);
    free(bph);
    uint64_t h = st_hash(m, len - ST_META_TRAILER);
    for (int i = 0; i < 8; i++)
        m[len - ST_META_TRAILER + (size_t)i] = (unsigned char)(h >> (8 * i));
    st_commit cr;
    assert_ok(st_commit_decode(&cr, c, clen));
    cr.meta_hash = st_hash(m, len);
    st_commit_encode(&cr, c);
    tu_write_file(mp, m, len);
    tu_write_file(cp, c, clen);
    free(m);
    free(c);
    tu_write_file(np, TENSOR_BAD "\0" BLOB_BAD, sizeof TENSOR_BAD + sizeof BLOB_BAD - 1);
    /* readers accept it (names are not checked for UTF-8 when read) */
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, dir, 0));
    strata_tensor_info t;
    strata_ckpt_tensor(&t, ck, 0);
    assert_string_equal(t.name, TENSOR_BAD);
    assert_ok(strata_ckpt_verify(ck, NULL, NULL));
    strata_ckpt_free(ck);
    return 0;
}

static void test_bad_name_ckpt_reads(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/badname", base_dir);
    make_bad_name(ck);
    tu_rmrf(ck);
    char np[700];
    snprintf(np, sizeof np, "%s.names", ck);
    unlink(np);
}

static int setup(void **state)
{
    (void)state;
    tu_tmpdir(base_dir, sizeof base_dir, "hostile");
    const char *r = getenv("STRATA_MEM_ROOT");
    had_root = r != NULL;
    if (r)
        snprintf(saved_root, sizeof saved_root, "%s", r);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tu_set_free(&last_req);
    tu_rmrf(base_dir);
    set_root(had_root ? saved_root : NULL);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--make-bad-name") == 0)
        return make_bad_name(argv[2]);
    if (argc == 2) /* a test name pattern: runs those alone (a hang ends the run) */
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backend_refuses_fifo),
        cmocka_unit_test(test_fifo_commit),
        cmocka_unit_test(test_fifo_metadata),
        cmocka_unit_test(test_fifo_data),
        cmocka_unit_test(test_dir_data),
        cmocka_unit_test(test_device_data),
        cmocka_unit_test(test_sparse_metadata_committed),
        cmocka_unit_test(test_sparse_metadata_incomplete),
        cmocka_unit_test(test_mem_root_created_private),
        cmocka_unit_test(test_mem_root_squatted),
        cmocka_unit_test(test_mem_root_writable),
        cmocka_unit_test(test_mem_root_not_a_dir),
        cmocka_unit_test(test_mem_default_root_per_user),
        cmocka_unit_test(test_names_utf8),
        cmocka_unit_test(test_bad_name_ckpt_reads),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
