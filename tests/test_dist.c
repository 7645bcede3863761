/* test_dist.c - saves through a saver with a communicator (strata_save, strata_save_start)
 * and strata_load with a communicator, the ranks as threads of this process joined by a
 * host communicator (tests/distutil.h): resharding across world sizes, read-once loading,
 * plan caching (one saver per rank, kept across saves), asynchronous saves, the fault walk
 * of the distributed save, failure on one rank, a load across processes with one rank
 * killed (nothing left in /dev/shm), and strata_comm_agree (the agreement the Python package
 * runs). Background commits, commit order, tiers and replace: test_dist_commit.c. */
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "distutil.h"
#include "io/pool.h"
#include "io/vfs_fault.h"
#include "proccomm.h"

static const uint64_t xs_one[] = {1};

static void save_world(const char *ck, int tp, int dp, tu_set *src, job *jobs)
{
    world w;
    world_init(&w, tp * dp);
    layout(src, tp, dp, 1);
    for (int r = 0; r < tp * dp; r++)
        tu_set_blob(src, r, "rng", 1, 0, 17 + (uint64_t)r, 1);
    run_all(&w, 1, ck, NULL, src, jobs);
    world_free(&w);
}

/* A corrupt chunk read by one rank fails the load on every rank, and every rank's message
 * names the tensor and the file (the message outlives the collectives that spread it). */
static void test_corrupt_load(void **state)
{
    (void)state;
    char ck[600], f[700];
    snprintf(ck, sizeof ck, "%s/corrupt", base);
    tu_set src, dst;
    job jobs[4];
    save_world(ck, 2, 2, &src, jobs);
    expect_all_ok(jobs, 4);
    tu_join(f, ck, "data-000001.bin");
    tu_flip_byte(f, 100, 0x40);
    world w;
    world_init(&w, 2);
    layout(&dst, 2, 1, 0);
    run_all(&w, 0, ck, NULL, &dst, jobs);
    for (int r = 0; r < 2; r++) {
        if (jobs[r].rc != STRATA_ECHECKSUM && jobs[r].rc != STRATA_EABORTED)
            fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
        if (!strstr(jobs[r].msg, "tensor '") || !strstr(jobs[r].msg, "data-000001.bin"))
            fail_msg("rank %d's message names no tensor and file: %s", r, jobs[r].msg);
    }
    world_free(&w);
    tu_set_free(&src);
    tu_set_free(&dst);
    tu_rmrf(ck);
}

/* Ranks of one load asking for different I/O threads and read sizes (options, or
 * $STRATA_IO_THREADS on some ranks only): each sized its rounds, its reads and its slot in
 * the node's segment from its own, and the collectives went out of step (a hang here, or
 * wrong bytes). Every rank now uses rank 0's values, loads bitwise, and reports them. */
static void test_load_opts_differ(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/opts", base);
    /* a [300, 257] f32 weight over 2 ranks: 75 chunks of 4 KiB, so small reads make many
     * rounds */
    static const uint64_t big[] = {300, 257};
    tu_set src;
    tu_set_init(&src, 2);
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {150 * (uint64_t)r, 0}, len[] = {150, 257};
        tu_set_shard(&src, r, "big", STRATA_F32, 2, big, off, len, 0, 0, 0, 1);
    }
    job jobs[3];
    world w2;
    world_init(&w2, 2);
    run_all(&w2, 1, ck, NULL, &src, jobs);
    expect_all_ok(jobs, 2);
    world_free(&w2);
    /* per case: each rank's io_threads and max_io_bytes */
    static const int cases[][3][2] = {
        {{1, 0}, {4, 0}, {2, 0}},                /* threads differ */
        {{0, 8192}, {0, 0}, {0, 12288}},         /* read sizes differ */
        {{3, 4096}, {1, 65536}, {8, 0}},         /* both */
        {{0, 0}, {2, 4096}, {2, 4096}},          /* rank 0 alone differs */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        strata_load_opts lo[3];
        for (int r = 0; r < 3; r++) {
            lo[r] = (strata_load_opts)STRATA_LOAD_OPTS_INIT;
            lo[r].io_threads = cases[k][r][0];
            lo[r].max_io_bytes = (uint32_t)cases[k][r][1];
        }
        /* every rank wants the whole tensor: the ranks share its reads */
        tu_set d;
        tu_set_init(&d, 3);
        for (int r = 0; r < 3; r++)
            tu_set_shard(&d, r, "big", STRATA_F32, 2, big, NULL, NULL, 0, 0, 0, 0);
        world w;
        world_init(&w, 3);
        load_opts = lo;
        run_all(&w, 0, ck, NULL, &d, jobs);
        load_opts = NULL;
        for (int r = 0; r < 3; r++) {
            if (jobs[r].rc)
                fail_msg("case %zu, rank %d: %s: %s", k, r, strata_error_name(jobs[r].rc),
                         jobs[r].msg);
            /* rank 0's effective values, on every rank */
            const char *env = getenv("STRATA_IO_THREADS");
            int want_threads = cases[k][0][0]   ? cases[k][0][0]
                               : env && atoi(env) > 0 ? ST_MIN(atoi(env), 64)
                                                     : 4;
            /* the default: the device's largest request, 4 to 16 MiB */
            uint64_t dev = st_dev_max_request(ck) >> 20 << 20;
            uint32_t want_io = cases[k][0][1] ? (uint32_t)cases[k][0][1]
                                              : (uint32_t)ST_MIN(ST_MAX(dev, 4u << 20), 16u << 20);
            assert_int_equal(jobs[r].stats.io_threads, want_threads);
            assert_int_equal(jobs[r].stats.max_io_bytes, want_io);
        }
        assert_int_equal(tu_set_check(&d), 0);
        world_free(&w);
        tu_set_free(&d);
    }
    tu_set_free(&src);
    tu_rmrf(ck);
}

/* ---- a load across processes with one rank killed ---- */

/* Entries of /dev/shm that a load by the processes pids made: strata before named its node
 * segment "strata-load-...-<pid>-<random>" after its maker; any entry naming one of them
 * counts. The count; the first's name in first (NAME_MAX + 1). */
static int shm_left(const pid_t *pids, int n, char *first)
{
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    int found = 0;
    while (d && (e = readdir(d))) {
        for (int k = 0; k < n; k++) {
            char pat[32];
            snprintf(pat, sizeof pat, "-%d-", (int)pids[k]);
            if (strncmp(e->d_name, "strata", 6) == 0 && strstr(e->d_name, pat)) {
                if (!found++)
                    snprintf(first, NAME_MAX + 1, "%s", e->d_name);
                char nm[NAME_MAX + 2];
                snprintf(nm, sizeof nm, "/%s", e->d_name);
                shm_unlink(nm); /* not left for the next trial to find */
            }
        }
    }
    if (d)
        closedir(d);
    return found;
}

/* One load of ck by 3 processes (each rank every tensor: every read is one all 3 need, which
 * made strata before share it through a node segment). Rank `victim` SIGKILLs itself as it
 * enters its collective number `at` (0: never), or reads through `victim_uri` (a fault URI
 * that kills it in a read; NULL: ck). *killed: the victim died of SIGKILL; returns the number
 * of ranks whose load succeeded, -1 if any process hung (60 s). */
static int three_process_load(const char *ck, int victim, int at, const char *victim_uri,
                              int *killed, pid_t *pids)
{
    pcomm pc;
    assert_int_equal(pc_world_init(&pc, 3), 0);
    for (int r = 0; r < 3; r++) {
        pids[r] = fork();
        assert_true(pids[r] >= 0);
        if (pids[r] == 0) {
            pc_become(&pc, r);
            pc.kill_at = r == victim ? at : 0;
            st_vfs_fault_register();
            tu_set d;
            layout(&d, 1, 3, 0);
            strata_comm *c;
            if (strata_comm_host(&c, &pc_ops, &pc, r, 3))
                _exit(2);
            const char *u = r == victim && victim_uri ? victim_uri : ck;
            int rc = strata_load(NULL, c, &u, 1, &d.st[r], 1, NULL);
            _exit(rc ? 1 : 0);
        }
    }
    pc_world_close(&pc);
    int ok = 0, hung = 0;
    *killed = 0;
    for (int r = 0; r < 3; r++) {
        int ws = 0;
        pid_t got = 0;
        for (int t = 0; t < 6000 && (got = waitpid(pids[r], &ws, WNOHANG)) == 0; t++)
            usleep(10000); /* polls for the exit; no outcome depends on the time */
        if (got != pids[r]) {
            hung = 1;
            for (int k = 0; k < 3; k++)
                kill(pids[k], SIGKILL);
            waitpid(pids[r], &ws, 0);
        }
        if (WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL && r == victim)
            *killed = 1;
        ok += WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
    }
    return hung ? -1 : ok;
}

/* A load across 3 processes with one rank killed anywhere in it - as it enters each of its
 * collectives in turn, or in its first or second read - leaves nothing in /dev/shm, and the
 * other ranks fail instead of waiting. Before, ranks of one node shared their reads through
 * a shared memory segment in /dev/shm, and a rank killed while it was set up left it there. */
static void test_load_killed_leaves_no_shm(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/killed", base);
    tu_set src;
    job jobs[2];
    save_world(ck, 2, 1, &src, jobs);
    expect_all_ok(jobs, 2);
    char *nodes_env = getenv("STRATA_LOAD_NODES"), saved_nodes[32] = "";
    snprintf(saved_nodes, sizeof saved_nodes, "%s", nodes_env ? nodes_env : "");
    unsetenv("STRATA_LOAD_NODES"); /* every rank on this node */
    pid_t pids[3];
    int killed, trials = 0;
    char left[NAME_MAX + 1];
    /* rank 0 (which made the segment) killed entering its 1st, 2nd, ... collective, until a
     * load passes its last one */
    for (int at = 1;; at++, trials++) {
        int ok = three_process_load(ck, 0, at, NULL, &killed, pids);
        if (ok < 0)
            fail_msg("killed at collective %d: the other ranks hung", at);
        if (shm_left(pids, 3, left))
            fail_msg("rank 0 killed entering collective %d left /dev/shm/%s", at, left);
        if (!killed) {
            assert_int_equal(ok, 3); /* no kill: every rank loaded */
            break;
        }
        assert_int_equal(ok, 0); /* the others failed */
        assert_true(at < 64);
    }
    assert_true(trials >= 4);
    /* rank 1 killed in its first and in its second read */
    for (int n = 1; n <= 2; n++) {
        char uri[700];
        snprintf(uri, sizeof uri, "fault+file://%s?op=read&n=%d&kill=1", ck, n);
        int ok = three_process_load(ck, 1, 0, uri, &killed, pids);
        if (ok < 0)
            fail_msg("killed in read %d: the other ranks hung", n);
        if (shm_left(pids, 3, left))
            fail_msg("rank 1 killed in read %d left /dev/shm/%s", n, left);
        assert_true(killed);
        assert_int_equal(ok, 0);
    }
    if (saved_nodes[0])
        setenv("STRATA_LOAD_NODES", saved_nodes, 1);
    tu_set_free(&src);
    tu_rmrf(ck);
}

/* strata_reclaim_load_segments (strata gc) removes what loads of earlier strata versions,
 * killed on this node, left in /dev/shm - a segment named by this user, boot and pid
 * namespace whose maker is gone - and never a live process's, another user's name or
 * another owner's file. */
static void make_shm(const char *name, uid_t owner)
{
    char n[NAME_MAX + 2];
    snprintf(n, sizeof n, "/%s", name);
    int fd = shm_open(n, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        fail_msg("shm_open %s: %s", n, strerror(errno));
    assert_int_equal(ftruncate(fd, 4096), 0);
    if (owner != geteuid())
        assert_int_equal(fchown(fd, owner, (gid_t)-1), 0);
    close(fd);
}

static int shm_exists(const char *name)
{
    char p[NAME_MAX + 16];
    snprintf(p, sizeof p, "/dev/shm/%s", name);
    return tu_exists(p);
}

static void test_reclaim_old_segments(void **state)
{
    (void)state;
    char id[64] = "x", ns[64] = {0}, prefix[160];
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(id, sizeof id, f))
            snprintf(id, sizeof id, "x");
        fclose(f);
    }
    id[8] = 0;
    ssize_t nl = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    snprintf(prefix, sizeof prefix, "strata-load-%u-%s-%llu-", (unsigned)geteuid(), id,
             nl > 5 ? strtoull(ns + 5, NULL, 10) : 0);
    pid_t dead = fork(); /* a pid that is gone */
    assert_true(dead >= 0);
    if (dead == 0)
        _exit(0);
    assert_int_equal(waitpid(dead, NULL, 0), dead);
    char gone[NAME_MAX + 1], live[NAME_MAX + 1], other_uid[NAME_MAX + 1],
        other_owner[NAME_MAX + 1];
    snprintf(gone, sizeof gone, "%s%d-0000000000000000", prefix, (int)dead);
    snprintf(live, sizeof live, "%s%d-0000000000000001", prefix, (int)getpid());
    const char *boot_ns = strchr(prefix + strlen("strata-load-"), '-') + 1; /* after the uid */
    snprintf(other_uid, sizeof other_uid, "strata-load-%u-%s%d-0000000000000002",
             (unsigned)geteuid() + 1, boot_ns, (int)dead);
    snprintf(other_owner, sizeof other_owner, "%s%d-0000000000000003", prefix, (int)dead);
    make_shm(gone, geteuid());
    make_shm(live, geteuid());
    make_shm(other_uid, geteuid());
    int root = geteuid() == 0; /* only root can give a file to another user */
    if (root)
        make_shm(other_owner, 4242);
    int removed = -1;
    assert_int_equal(strata_reclaim_load_segments(&removed), 0);
    int gone_gone = !shm_exists(gone), live_kept = shm_exists(live),
        uid_kept = shm_exists(other_uid), owner_kept = !root || shm_exists(other_owner);
    const char *all[] = {gone, live, other_uid, other_owner};
    for (int i = 0; i < 4; i++) {
        char n[NAME_MAX + 2];
        snprintf(n, sizeof n, "/%s", all[i]);
        shm_unlink(n);
    }
    assert_true(gone_gone);
    assert_int_equal(removed, 1);
    assert_true(live_kept);
    assert_true(uid_kept);
    assert_true(owner_kept);
}

static void test_reshard(void **state)
{
    (void)state;
    static const int pairs[][4] = {{2, 2, 1, 3}, {2, 2, 3, 1}, {4, 1, 1, 1}, {1, 3, 2, 2},
                                   {3, 1, 1, 4}, {1, 1, 2, 3}};
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++) {
        char ck[600];
        snprintf(ck, sizeof ck, "%s/reshard%zu", base, k);
        int tp = pairs[k][0], dp = pairs[k][1], tp2 = pairs[k][2], dp2 = pairs[k][3];
        tu_set src, dst;
        job jobs[16];
        save_world(ck, tp, dp, &src, jobs);
        expect_all_ok(jobs, tp * dp);
        uint64_t data = jobs[0].stats.all_bytes;
        /* load on another world size; every rank also asks for the rng of the old ranks
         * r, r + n2, ... so that every saved byte is requested */
        world w;
        world_init(&w, tp2 * dp2);
        layout(&dst, tp2, dp2, 0);
        for (int o = 0; o < tp * dp; o++)
            tu_set_blob(&dst, o % (tp2 * dp2), "rng", 1, o, 17 + (uint64_t)o, 0);
        run_all(&w, 0, ck, NULL, &dst, jobs);
        expect_all_ok(jobs, tp2 * dp2);
        assert_int_equal(tu_set_check(&dst), 0);
        /* read once: the bytes read over all ranks are the saved bytes, whatever dp */
        assert_int_equal(jobs[0].stats.all_bytes, data);
        world_free(&w);
        tu_set_free(&src);
        tu_set_free(&dst);
        tu_rmrf(ck);
    }
}

static void test_plan_cache(void **state)
{
    (void)state;
    world w;
    world_init(&w, 4);
    tu_set a;
    layout(&a, 2, 2, 1);
    job jobs[4];
    char ck[600];
    for (int i = 0; i < 3; i++) {
        snprintf(ck, sizeof ck, "%s/cache%d", base, i);
        run_all(&w, 1, ck, NULL, &a, jobs);
        expect_all_ok(jobs, 4);
        for (int r = 0; r < 4; r++)
            assert_int_equal(jobs[r].stats.plan_cached, i > 0); /* miss, then hits */
    }
    /* a cached save still saves the current values */
    expect_loads(ck);
    /* one rank's layout changes (rank 2 also saves an extra tensor): the cache misses */
    uint64_t xs[] = {5};
    tu_set_shard(&a, 2, "extra", STRATA_I32, 1, xs, NULL, NULL, 0, 0, 0, 1);
    snprintf(ck, sizeof ck, "%s/cache-changed", base);
    run_all(&w, 1, ck, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    for (int r = 0; r < 4; r++)
        assert_int_equal(jobs[r].stats.plan_cached, 0);
    tu_set d;
    layout(&d, 1, 1, 0);
    tu_set_shard(&d, 0, "extra", STRATA_I32, 1, xs, NULL, NULL, 0, 0, 0, 0);
    const char *u = ck;
    assert_ok(strata_load(NULL, NULL, &u, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_set_free(&a);
    world_free(&w);
}

static void test_rank_failure(void **state)
{
    (void)state;
    char prev[600], ck[600], bad[700];
    snprintf(prev, sizeof prev, "%s/fail-prev", base);
    snprintf(ck, sizeof ck, "%s/fail-new", base);
    tu_set src;
    job jobs[4];
    save_world(prev, 2, 2, &src, jobs);
    expect_all_ok(jobs, 4);
    /* rank 1's writes fail: every rank learns it, nothing is committed */
    snprintf(bad, sizeof bad, "fault+file://%s?op=write&n=1&errno=EIO", ck);
    const char *uris[4] = {ck, bad, ck, ck};
    world w;
    world_init(&w, 4);
    run_all(&w, 1, NULL, uris, &src, jobs);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(jobs[r].rc, STRATA_EIO);
        if (r != 1 && !strstr(jobs[r].msg, "rank 1"))
            fail_msg("rank %d's message does not name rank 1: %s", r, jobs[r].msg);
    }
    char c[700];
    tu_join(c, ck, "COMMIT");
    assert_false(tu_exists(c));
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_false(pi.committed);
    /* the previous checkpoint is intact; a retry succeeds */
    expect_loads(prev);
    run_all(&w, 1, ck, NULL, &src, jobs);
    expect_all_ok(jobs, 4);
    /* a request for a missing tensor on one rank fails the load on every rank */
    world w3;
    world_init(&w3, 3);
    tu_set d;
    layout(&d, 3, 1, 0);
    tu_set_shard(&d, 2, "nope", STRATA_U8, 1, xs_one, NULL, NULL, 0, 0, 0, 0);
    run_all(&w3, 0, ck, NULL, &d, jobs);
    for (int r = 0; r < 3; r++)
        assert_int_equal(jobs[r].rc, STRATA_ENOTFOUND);
    tu_set_free(&d);
    world_free(&w3);
    world_free(&w);
    tu_set_free(&src);
}

/* Asynchronous distributed saves: the poison after the snapshot does not reach the
 * checkpoint; the second save reuses the plan; a failing rank fails every rank at
 * wait_durable (the start returned 0: its I/O came after) and nothing is committed. */
static void test_async(void **state)
{
    (void)state;
    world w;
    world_init(&w, 4);
    job jobs[4];
    char ck[600];
    for (int i = 0; i < 2; i++) {
        tu_set a;
        layout(&a, 2, 2, 1); /* fresh values: the last save poisoned them */
        snprintf(ck, sizeof ck, "%s/async%d", base, i);
        run_all(&w, SAVE_ASYNC, ck, NULL, &a, jobs);
        expect_all_ok(jobs, 4);
        for (int r = 0; r < 4; r++)
            assert_int_equal(jobs[r].stats.plan_cached, i > 0);
        assert_true(jobs[0].stats.all_bytes > 0);
        expect_loads(ck);
        tu_set_free(&a);
    }
    /* two saves overlap, the second with a new plan: both load bitwise */
    tu_set a;
    layout(&a, 2, 2, 1);
    snprintf(ck, sizeof ck, "%s/overlap", base);
    run_all(&w, SAVE_OVERLAP, ck, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    for (int i = 0; i < 2; i++) {
        char p[700];
        snprintf(p, sizeof p, "%s%s", ck, i ? "-b" : "");
        expect_loads(p);
    }
    tu_set_free(&a);
    /* rank 2 cannot write: every rank fails with its error at wait_durable */
    layout(&a, 2, 2, 1);
    char bad[700], prev[600];
    snprintf(prev, sizeof prev, "%s", ck);
    snprintf(ck, sizeof ck, "%s/async-fail", base);
    snprintf(bad, sizeof bad, "fault+file://%s?op=write&n=1&errno=ENOSPC", ck);
    const char *uris[4] = {ck, ck, bad, ck};
    run_all(&w, SAVE_ASYNC, NULL, uris, &a, jobs);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(jobs[r].rc, STRATA_ENOSPC);
        if (r != 2 && !strstr(jobs[r].msg, "rank 2"))
            fail_msg("rank %d's message does not name rank 2: %s", r, jobs[r].msg);
    }
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_false(pi.committed);
    assert_false(pi.is_ckpt); /* every rank removed what it wrote */
    /* a save onto a committed checkpoint is refused, and the checkpoint is untouched */
    tu_set_free(&a);
    layout(&a, 2, 2, 1);
    run_all(&w, SAVE_ASYNC, prev, NULL, &a, jobs);
    for (int r = 0; r < 4; r++)
        assert_int_equal(jobs[r].rc, STRATA_EEXIST);
    expect_loads(prev);
    /* and a retry of the failed one works */
    tu_set_free(&a);
    layout(&a, 2, 2, 1);
    run_all(&w, SAVE_ASYNC, ck, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    expect_loads(ck);
    /* an incomplete directory whose data files are hard links to that committed
     * checkpoint's (cp -al, rsync --link-dest): a save there in another layout (so other
     * bytes) writes new files, never through the links */
    char linked[700];
    snprintf(linked, sizeof linked, "%s/async-linked", base);
    assert_int_equal(mkdir(linked, 0755), 0);
    for (int r = 0; r < 4; r++) {
        char fa[800], fb[800], nm[32];
        snprintf(nm, sizeof nm, "data-%06d.bin", r);
        tu_join(fa, ck, nm);
        tu_join(fb, linked, nm);
        if (tu_exists(fa))
            assert_int_equal(link(fa, fb), 0);
    }
    tu_set_free(&a);
    layout(&a, 4, 1, 1);
    run_all(&w, SAVE_ASYNC, linked, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    expect_loads(linked);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    assert_ok(strata_ckpt_verify(c, NULL, NULL)); /* the committed one is untouched */
    strata_ckpt_free(c);
    expect_loads(ck);
    tu_set_free(&a);
    world_free(&w);
}

/* The fault walk of the distributed save (synchronous, or asynchronous): call n of op
 * fails on rank 0 (which also commits) or rank 1, for n = 1, 2, ... until the save
 * succeeds. Every rank must return the same error, nothing may be committed or left
 * behind, and the counts must be the protocol's: a rank opens, reserves and fsyncs its
 * data file and writes its tasks; rank 0 also writes plan.bin.tmp, metadata.bin.tmp and
 * COMMIT.tmp, renames the three, and fsyncs the directory and its parent. */
static void fault_walk(int mode)
{
    world w;
    world_init(&w, 4);
    job jobs[4];
    char ck[600], bad[700];
    snprintf(ck, sizeof ck, "%s/afault", base);
    sync_saves = 1;
    tu_set a;
    layout(&a, 2, 2, 1);
    run_all(&w, mode, ck, NULL, &a, jobs); /* a clean save: the write counts */
    expect_all_ok(jobs, 4);
    tu_set_free(&a);
    int tasks[2] = {(int)jobs[0].stats.io_calls, (int)jobs[1].stats.io_calls};
    tu_rmrf(ck);
    static const char *const ops[] = {"open", "write", "allocate", "fsync", "rename", "mkdir"};
    int points = 0;
    for (int who = 0; who < 2; who++)
        for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
            /* the synchronous save: rank 0 alone prepares the directory */
            int mkdirs = mode == SAVE_ASYNC || who == 0;
            int want[] = {who ? 1 : 4, tasks[who] + (who ? 0 : 3), 1, who ? 1 : 6, who ? 0 : 3,
                          mkdirs};
            for (int n = 1;; n++) {
                snprintf(bad, sizeof bad, "fault+file://%s?op=%s&n=%d&errno=EIO", ck, ops[k], n);
                const char *uris[4] = {ck, ck, ck, ck};
                uris[who] = bad;
                layout(&a, 2, 2, 1);
                run_all(&w, mode, NULL, uris, &a, jobs);
                tu_set_free(&a);
                if (jobs[0].rc == 0) {
                    expect_all_ok(jobs, 4);
                    expect_loads(ck);
                    tu_rmrf(ck);
                    if (n - 1 != want[k])
                        fail_msg("rank %d makes %d %s calls, want %d", who, n - 1, ops[k],
                                 want[k]);
                    break;
                }
                points++;
                for (int r = 0; r < 4; r++)
                    if (jobs[r].rc != STRATA_EIO)
                        fail_msg("%s on rank %d: rank %d returned %s (%s)", bad, who, r,
                                 strata_error_name(jobs[r].rc), jobs[r].msg);
                strata_probe_info pi;
                int prc = strata_probe(&pi, ck);
                if (prc == 0 && (pi.committed || pi.has_commit || pi.is_ckpt))
                    fail_msg("%s on rank %d: committed %d, strata files left %d", bad, who,
                             pi.committed, pi.is_ckpt);
                tu_rmrf(ck);
                assert_true(n < 1000);
            }
        }
    print_message("%s distributed save: %d fault points, each failed every rank\n",
                  mode == SAVE_ASYNC ? "async" : "sync", points);
    sync_saves = 0;
    world_free(&w);
}

static void test_save_faults(void **state)
{
    (void)state;
    fault_walk(1);
    fault_walk(SAVE_ASYNC);
}

/* ---- strata_comm_agree ---- */

static int agree_ag, agree_a2a; /* collectives, counted by rank 0 */

static int c_allgather(void *ctx, const void *send, size_t n, void *recv)
{
    if (((tcomm *)ctx)->rank == 0) /* one writer: the test reads it after the joins */
        agree_ag++;
    return t_allgather(ctx, send, n, recv);
}

static int c_alltoallv(void *ctx, const void *send, const size_t *sc, void *recv,
                       const size_t *rc)
{
    if (((tcomm *)ctx)->rank == 0)
        agree_a2a++;
    return t_alltoallv(ctx, send, sc, recv, rc);
}

static const strata_comm_ops counting_ops = {2, c_allgather, c_alltoallv, t_bcast, NULL, NULL};

typedef struct {
    strata_comm *c;
    int rank, rc; /* rc: this rank's outcome going in (its message "boom on <rank>") */
    const char *payload;
    size_t inl;
    unsigned flags;
    int got;
    char msg[1024];
    unsigned char *out;
    size_t lens[3];
} agree_job;

static void *agree_run(void *p)
{
    agree_job *j = p;
    if (j->rc)
        strata_error_set(j->rc, "boom on %d", j->rank);
    j->got = strata_comm_agree(&j->out, j->lens, j->c, "the step", j->rc, j->payload,
                               j->payload ? strlen(j->payload) : 0, j->inl, j->flags);
    snprintf(j->msg, sizeof j->msg, "%s", strata_error_last());
    return NULL;
}

/* strata_comm_agree on three thread ranks with payloads p[r] (NULL: empty) and outcomes
 * rc[r]; the collectives it made are in agree_ag and agree_a2a. */
static void agree3(agree_job *j, const char *const p[3], const int rc[3], size_t inl,
                   unsigned flags)
{
    hub h;
    hub_init(&h, 3);
    tcomm tc[3];
    pthread_t th[3];
    agree_ag = agree_a2a = 0;
    for (int r = 0; r < 3; r++) {
        tc[r] = (tcomm){&h, r};
        j[r] = (agree_job){.rank = r, .rc = rc[r], .payload = p[r], .inl = inl, .flags = flags};
        assert_ok(strata_comm_host(&j[r].c, &counting_ops, &tc[r], r, 3));
    }
    for (int r = 0; r < 3; r++)
        assert_int_equal(pthread_create(&th[r], NULL, agree_run, &j[r]), 0);
    for (int r = 0; r < 3; r++) {
        pthread_join(th[r], NULL);
        strata_comm_free(j[r].c);
    }
    hub_free(&h);
}

static void expect_payloads(agree_job *j, const char *want, size_t l0, size_t l1, size_t l2)
{
    for (int r = 0; r < 3; r++) {
        if (j[r].got)
            fail_msg("rank %d: %s: %s", r, strata_error_name(j[r].got), j[r].msg);
        assert_int_equal(j[r].lens[0], l0);
        assert_int_equal(j[r].lens[1], l1);
        assert_int_equal(j[r].lens[2], l2);
        if (!want)
            assert_null(j[r].out);
        else
            assert_memory_equal(j[r].out, want, strlen(want));
        strata_free(j[r].out);
    }
}

/* The agreement the Python package runs before its saves and loads (strata.torch's
 * _exchange): every payload on every rank, or the first failure's code and message on
 * every rank, in one allgather when all is well or every payload fits inline, two
 * collectives otherwise. */
static void test_agree(void **state)
{
    (void)state;
    agree_job j[3];
    const char *abc[3] = {"a", "bb", "ccc"}, *xyz[3] = {"xyz", "xyz", "xyz"};
    const char *none[3] = {NULL, NULL, NULL};
    const int ok[3] = {0, 0, 0}, bad[3] = {0, STRATA_EMISMATCH, STRATA_ENOTFOUND};
    /* every payload inline: one allgather */
    agree3(j, abc, ok, 8, 0);
    expect_payloads(j, "abbccc", 1, 2, 3);
    assert_int_equal(agree_ag, 1);
    assert_int_equal(agree_a2a, 0);
    /* one does not fit: its bytes in an alltoallv after */
    agree3(j, abc, ok, 2, 0);
    expect_payloads(j, "abbccc", 1, 2, 3);
    assert_int_equal(agree_ag + agree_a2a, 2);
    /* the same on every rank: NULL, whatever the size */
    agree3(j, xyz, ok, 0, STRATA_AGREE_SAME);
    expect_payloads(j, NULL, 3, 3, 3);
    assert_int_equal(agree_ag + agree_a2a, 1);
    agree3(j, abc, ok, 0, STRATA_AGREE_SAME);
    expect_payloads(j, "abbccc", 1, 2, 3);
    assert_int_equal(agree_ag + agree_a2a, 2);
    agree3(j, none, ok, 0, 0);
    expect_payloads(j, NULL, 0, 0, 0);
    /* ranks 1 and 2 fail: each keeps its own error, rank 0 gets the first's; the message
     * inline (one allgather) or not (its bytes after) */
    for (size_t inl = 0; inl <= 64; inl += 64) {
        agree3(j, abc, bad, inl, STRATA_AGREE_SAME);
        assert_int_equal(agree_ag + agree_a2a, inl ? 1 : 2);
        assert_int_equal(j[0].got, STRATA_EMISMATCH);
        assert_string_equal(j[0].msg, "the step failed on rank 1: boom on 1");
        assert_int_equal(j[1].got, STRATA_EMISMATCH);
        assert_string_equal(j[1].msg, "boom on 1");
        assert_int_equal(j[2].got, STRATA_ENOTFOUND);
        assert_string_equal(j[2].msg, "boom on 2");
        for (int r = 0; r < 3; r++)
            assert_null(j[r].out);
    }
    /* bad arguments: before any collective */
    strata_comm *self;
    unsigned char *out = (unsigned char *)"x";
    size_t lens[1];
    assert_ok(strata_comm_self(&self));
    assert_int_equal(strata_comm_agree(&out, lens, self, "x", 0, "a", 1, 0, 4), STRATA_EINVAL);
    assert_null(out);
    assert_int_equal(strata_comm_agree(&out, lens, self, "x", 0, NULL, 1, 0, 0), STRATA_EINVAL);
    assert_ok(strata_comm_agree(&out, lens, self, NULL, 0, "a", 1, 0, 0));
    assert_int_equal(lens[0], 1);
    assert_memory_equal(out, "a", 1);
    strata_free(out);
    strata_comm_free(self);
}

TU_TMPDIR_GROUP(base, "dist")

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reshard),
        cmocka_unit_test(test_corrupt_load),
        cmocka_unit_test(test_plan_cache),
        cmocka_unit_test(test_rank_failure),
        cmocka_unit_test(test_async),
        cmocka_unit_test(test_save_faults),
        cmocka_unit_test(test_load_opts_differ),
        cmocka_unit_test(test_load_killed_leaves_no_shm),
        cmocka_unit_test(test_reclaim_old_segments),
        cmocka_unit_test(test_agree),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
