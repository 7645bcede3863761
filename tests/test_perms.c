/* test_perms.c - what strata creates and what it deletes on the filesystem:
 *  - file and directory modes: data files, metadata.bin and COMMIT are 0644 and the
 *    checkpoint directory and the parents it creates 0755, less the umask (022: 0644 /
 *    0755; 077: 0600 / 0700);
 *  - removal never follows a symlink out of the checkpoint directory: a symlink named like
 *    a strata file, or a symlinked subdirectory, is left alone and so is its target, by
 *    strata_remove_incomplete and by a save that clears an incomplete checkpoint; a
 *    checkpoint path that is itself a symlink is neither removed nor saved through;
 *  - the file backend opens nothing through a symlink, for writing or reading (a symlink
 *    planted after a save checked its directory gets ELOOP, not its target truncated). */
#include <dirent.h>

#include "io/vfs.h"
#include "meta/meta.h"
#include "testutil.h"

static char base_dir[512];

/* A small checkpoint of 2 ranks: 2 data files. */
static void save_small(const char *ck, int expect)
{
    tu_set s;
    tu_set_init(&s, 2);
    uint64_t shape[] = {16, 300};
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {(uint64_t)r * 8, 0}, len[] = {8, 300};
        tu_set_shard(&s, r, "w", STRATA_F32, 2, shape, off, len, 0, 0, 0, 1);
        tu_set_blob(&s, r, "rng", 1, 0, 100, 1);
    }
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 4096;
    o.flags |= STRATA_SAVE_NO_SYNC;
    assert_rc(strata_save(NULL, NULL, &ck, 1, s.st, 2, &o), expect);
    tu_set_free(&s);
}

/* An incomplete checkpoint: a save whose commit record is gone. */
static void make_incomplete(const char *ck)
{
    tu_rmrf(ck);
    save_small(ck, 0);
    char cp[800];
    tu_join(cp, ck, ST_COMMIT_FILE);
    assert_int_equal(unlink(cp), 0);
}

static mode_t mode_of(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        fail_msg("lstat %s: %s", path, strerror(errno));
    return st.st_mode;
}

static void assert_mode(const char *path, mode_t want, int dir)
{
    mode_t m = mode_of(path);
    if (dir ? !S_ISDIR(m) : !S_ISREG(m))
        fail_msg("%s is not a %s", path, dir ? "directory" : "regular file");
    if ((m & 07777) != want)
        fail_msg("%s has mode %04o, want %04o", path, (unsigned)(m & 07777), (unsigned)want);
}

static void test_modes(void **state)
{
    (void)state;
    static const mode_t masks[] = {022, 077, 027, 002};
    mode_t old = umask(022);
    for (size_t i = 0; i < sizeof masks / sizeof masks[0]; i++) {
        mode_t u = masks[i];
        char top[600], mid[700], ck[800], p[1100];
        snprintf(top, sizeof top, "%s/umask%03o", base_dir, (unsigned)u);
        snprintf(mid, sizeof mid, "%s/runs", top);
        snprintf(ck, sizeof ck, "%s/step-1", mid);
        umask(u);
        save_small(ck, 0); /* creates top and mid too */
        umask(022);
        mode_t fmode = 0644 & ~u, dmode = 0755 & ~u;
        assert_mode(top, dmode, 1);
        assert_mode(mid, dmode, 1);
        assert_mode(ck, dmode, 1);
        int files = 0;
        DIR *d = opendir(ck);
        assert_non_null(d);
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.')
                continue;
            tu_join(p, ck, e->d_name);
            assert_mode(p, fmode, 0);
            files++;
        }
        closedir(d);
        assert_int_equal(files, 4); /* data-000000.bin, data-000001.bin, metadata.bin, COMMIT (no LOCK) */
        const char *names[] = {"data-000000.bin", "data-000001.bin", ST_META_FILE,
                               ST_COMMIT_FILE};
        for (size_t k = 0; k < 4; k++) {
            tu_join(p, ck, names[k]);
            assert_mode(p, fmode, 0);
        }
        /* a save replacing an incomplete checkpoint creates its files the same way */
        tu_join(p, ck, ST_COMMIT_FILE);
        assert_int_equal(unlink(p), 0);
        umask(u);
        save_small(ck, 0);
        umask(022);
        for (size_t k = 0; k < 4; k++) {
            tu_join(p, ck, names[k]);
            assert_mode(p, fmode, 0);
        }
        assert_mode(ck, dmode, 1);
        tu_rmrf(top);
    }
    umask(old);
}

/* ---- symlinks ---- */

/* What a file outside looks like, to prove it untouched. */
typedef struct {
    char path[700];
    struct stat st;
    unsigned char *data;
    size_t len;
} snap;

static void snap_take(snap *s, const char *path)
{
    snprintf(s->path, sizeof s->path, "%s", path);
    assert_int_equal(lstat(path, &s->st), 0);
    s->data = S_ISREG(s->st.st_mode) ? tu_read_file(path, &s->len) : NULL;
}

static void snap_check(snap *s)
{
    struct stat st;
    if (lstat(s->path, &st) != 0)
        fail_msg("%s is gone", s->path);
    if (st.st_ino != s->st.st_ino || st.st_mode != s->st.st_mode || st.st_size != s->st.st_size ||
        st.st_nlink != s->st.st_nlink || st.st_mtim.tv_sec != s->st.st_mtim.tv_sec ||
        st.st_mtim.tv_nsec != s->st.st_mtim.tv_nsec)
        fail_msg("%s was modified", s->path);
    if (s->data) {
        size_t len;
        unsigned char *now = tu_read_file(s->path, &len);
        assert_int_equal(len, s->len);
        assert_memory_equal(now, s->data, len);
        free(now);
    }
    free(s->data);
    s->data = NULL;
}

/* The world outside the checkpoint that the symlinks point into. */
typedef struct {
    char dir[600], victim[700], victim2[700], vdir[700], vdir_data[800], vdir_meta[800];
    snap s[6];
} outside;

static void outside_make(outside *o)
{
    snprintf(o->dir, sizeof o->dir, "%s/outside", base_dir);
    tu_rmrf(o->dir);
    assert_int_equal(mkdir(o->dir, 0755), 0);
    tu_join(o->victim, o->dir, "victim.bin");
    tu_join(o->victim2, o->dir, "victim2.bin");
    tu_join(o->vdir, o->dir, "vdir");
    tu_join(o->vdir_data, o->vdir, "data-000001.bin");
    tu_join(o->vdir_meta, o->vdir, ST_META_FILE);
    tu_write_file(o->victim, "precious data", 13);
    tu_write_file(o->victim2, "more precious data", 18);
    assert_int_equal(mkdir(o->vdir, 0755), 0);
    tu_write_file(o->vdir_data, "not strata's", 12);
    tu_write_file(o->vdir_meta, "not strata's either", 19);
    const char *paths[] = {o->dir, o->victim, o->victim2, o->vdir, o->vdir_data, o->vdir_meta};
    for (int i = 0; i < 6; i++)
        snap_take(&o->s[i], paths[i]);
}

/* Everything outside is as it was (the directories' mtimes too: no entry was added or
 * removed there). */
static void outside_check(outside *o)
{
    for (int i = 0; i < 6; i++)
        snap_check(&o->s[i]);
    tu_rmrf(o->dir);
}

static void link_in(const char *ck, const char *name, const char *target)
{
    char p[800];
    tu_join(p, ck, name);
    unlink(p);
    if (symlink(target, p) != 0)
        fail_msg("symlink %s -> %s: %s", p, target, strerror(errno));
}

static int is_link(const char *ck, const char *name)
{
    char p[800];
    tu_join(p, ck, name);
    return S_ISLNK(mode_of(p));
}

static int exists_in(const char *ck, const char *name)
{
    char p[800];
    tu_join(p, ck, name);
    return tu_exists(p);
}

/* An incomplete checkpoint whose data-000000.bin and COMMIT.tmp are symlinks to files
 * outside, with a symlink named like a data file to a directory outside and a symlinked
 * subdirectory. */
static void make_trap(const char *ck, outside *o)
{
    make_incomplete(ck);
    link_in(ck, "data-000000.bin", o->victim);
    link_in(ck, ST_COMMIT_FILE ".tmp", o->victim2);
    link_in(ck, "data-000007.bin", o->vdir);
    link_in(ck, "sub", o->vdir);
}

static void assert_trap_links(const char *ck)
{
    assert_true(is_link(ck, "data-000000.bin"));
    assert_true(is_link(ck, ST_COMMIT_FILE ".tmp"));
    assert_true(is_link(ck, "data-000007.bin"));
    assert_true(is_link(ck, "sub"));
}

static void test_remove_symlinks(void **state)
{
    (void)state;
    outside o;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/trap", base_dir);
    outside_make(&o);
    make_trap(ck, &o);
    /* strata's own regular files go; the symlinks, their targets and the directory that
     * still holds them stay */
    assert_ok(strata_remove_incomplete(ck));
    assert_false(exists_in(ck, "data-000001.bin"));
    assert_false(exists_in(ck, ST_META_FILE));
    assert_trap_links(ck);
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_false(pi.is_ckpt); /* nothing of strata's is left */
    assert_ok(strata_remove_incomplete(ck)); /* again: still nothing followed */
    assert_trap_links(ck);
    outside_check(&o);
    tu_rmrf(ck);

    /* a symlink named COMMIT: not a commit record strata wrote, but its presence alone
     * keeps removal away (has_commit), and its target survives */
    outside_make(&o);
    make_incomplete(ck);
    link_in(ck, ST_COMMIT_FILE, o.victim);
    assert_rc(strata_remove_incomplete(ck), STRATA_EEXIST);
    assert_true(exists_in(ck, ST_META_FILE));
    assert_true(is_link(ck, ST_COMMIT_FILE));
    outside_check(&o);
    tu_rmrf(ck);

    /* the checkpoint path itself is a symlink to an incomplete checkpoint: refused, with or
     * without a trailing slash, and nothing behind it is removed */
    char real[600], link[600], slash[700];
    snprintf(real, sizeof real, "%s/real-inc", base_dir);
    snprintf(link, sizeof link, "%s/link-inc", base_dir);
    snprintf(slash, sizeof slash, "%s/", link);
    make_incomplete(real);
    assert_int_equal(symlink(real, link), 0);
    snap keep[3];
    const char *names[] = {"data-000000.bin", "data-000001.bin", ST_META_FILE};
    for (int i = 0; i < 3; i++) {
        char p[800];
        tu_join(p, real, names[i]);
        snap_take(&keep[i], p);
    }
    assert_rc(strata_remove_incomplete(link), STRATA_EINVAL);
    assert_msg_has("symlink");
    assert_rc(strata_remove_incomplete(slash), STRATA_EINVAL);
    char uri[800];
    snprintf(uri, sizeof uri, "file://%s", link);
    assert_rc(strata_remove_incomplete(uri), STRATA_EINVAL);
    assert_true(S_ISLNK(mode_of(link)));
    for (int i = 0; i < 3; i++)
        snap_check(&keep[i]);
    unlink(link);
    tu_rmrf(real);
}

static void test_save_symlinks(void **state)
{
    (void)state;
    outside o;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/trap2", base_dir);

    /* a save under the name of an incomplete checkpoint that holds symlinks with strata
     * names refuses to clear it: nothing there is removed or written, nothing outside
     * changes */
    outside_make(&o);
    make_trap(ck, &o);
    snap keep[2];
    char p[800];
    tu_join(p, ck, "data-000001.bin");
    snap_take(&keep[0], p);
    tu_join(p, ck, ST_META_FILE);
    snap_take(&keep[1], p);
    save_small(ck, STRATA_EEXIST);
    assert_msg_has(ck);
    assert_trap_links(ck);
    snap_check(&keep[0]);
    snap_check(&keep[1]);
    assert_false(exists_in(ck, ST_COMMIT_FILE));
    outside_check(&o);
    tu_rmrf(ck);

    /* one symlink alone, named like each file the save would create or truncate: refused,
     * target intact */
    const char *names[] = {ST_META_FILE, ST_COMMIT_FILE ".tmp", "data-000000.bin",
                           "data-000001.bin", ST_META_FILE ".tmp"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        outside_make(&o);
        make_incomplete(ck);
        link_in(ck, names[i], o.victim);
        save_small(ck, STRATA_EEXIST);
        assert_true(is_link(ck, names[i]));
        outside_check(&o);
        tu_rmrf(ck);
    }

    /* the same without any other file: a directory holding only a symlink to a strata
     * name is not an empty directory to save into */
    outside_make(&o);
    assert_int_equal(mkdir(ck, 0755), 0);
    link_in(ck, ST_META_FILE, o.victim);
    save_small(ck, STRATA_EEXIST);
    outside_check(&o);
    tu_rmrf(ck);

    /* the checkpoint path is a symlink to an incomplete checkpoint, or to an empty
     * directory, or dangling: no save through it */
    char real[600], link[600];
    snprintf(real, sizeof real, "%s/real2", base_dir);
    snprintf(link, sizeof link, "%s/link2", base_dir);
    make_incomplete(real);
    tu_join(p, real, ST_META_FILE);
    snap_take(&keep[0], p);
    assert_int_equal(symlink(real, link), 0);
    save_small(link, STRATA_EEXIST);
    snap_check(&keep[0]);
    assert_false(exists_in(real, ST_COMMIT_FILE));
    tu_rmrf(real);
    assert_int_equal(mkdir(real, 0755), 0);
    save_small(link, STRATA_EEXIST);
    DIR *d = opendir(real);
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    assert_int_equal(n, 0);
    tu_rmrf(real);
    save_small(link, STRATA_EEXIST); /* dangling now */
    assert_false(tu_exists(real));
    unlink(link);
}

static void test_backend_nofollow(void **state)
{
    (void)state;
    outside o;
    outside_make(&o);
    char ck[600];
    snprintf(ck, sizeof ck, "%s/nofollow", base_dir);
    assert_int_equal(mkdir(ck, 0755), 0);
    link_in(ck, "data-000000.bin", o.victim);
    char p[800];
    tu_join(p, ck, "data-000000.bin");
    const st_vfs *v = &st_vfs_posix;
    static const int modes[] = {ST_O_WRITE, ST_O_WRITE | ST_O_DIRECT, ST_O_READ,
                                ST_O_READ | ST_O_DIRECT};
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        st_file *f = NULL;
        int e = v->open(v, p, modes[i], &f);
        if (e == 0)
            v->close(f);
        if (e != -ELOOP)
            fail_msg("opening a symlink with flags %d: %d (%s), want -ELOOP", modes[i], e,
                     e ? strerror(-e) : "opened");
    }
    assert_true(is_link(ck, "data-000000.bin"));
    outside_check(&o);
    tu_rmrf(ck);
}

TU_TMPDIR_GROUP(base_dir, "perms")

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_modes),
        cmocka_unit_test(test_remove_symlinks),
        cmocka_unit_test(test_save_symlinks),
        cmocka_unit_test(test_backend_nofollow),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
