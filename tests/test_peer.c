/* test_peer.c - peer-memory replicas (strata_peer_replicate, strata_peer_restore) on nodes
 * simulated as groups of consecutive thread ranks (STRATA_LOAD_NODES=k), each node's
 * memory tier a directory of its own (node<n>/...): a save to every node's copy, replicas on
 * the ring, nodes lost (their directories removed), and the job restarted on the survivors
 * with another world size and layout, loading bitwise what was saved; more nodes lost than
 * the replicas cover fails clearly and the load falls back to disk; a replication stopped
 * on one rank leaves the previous replicated step restorable and the new one unused. */
#include "distutil.h"

enum { REPLICATE, RESTORE, LOAD2, BG_SAVE, ENCODE };

typedef struct {
    world *w;
    int rank, what, replicas;
    const char *uri, *disk;
    tu_set *set;
    int rc;
    char msg[1024];
    strata_peer_info info;
    strata_stats stats;
    int level, done;
    char level_msg[1024];
} pjob;

/* A save with peer replicas left to the saver's commit thread: start, snapshot, then no
 * call until strata_handle_done; the levels it reached then. */
static int bg_save(pjob *j)
{
    strata_handle *h;
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags = STRATA_SAVE_NO_SYNC;
    so.chunk_bytes = 4096;
    so.step = save_step;
    so.peer_replicas = j->replicas;
    int rc = strata_save_start(&h, j->w->sv[j->rank], &j->uri, 1, &j->set->st[j->rank], 1,
                               &so);
    if (rc)
        return rc;
    rc = strata_wait_snapshot(h);
    for (int i = 0; i < 30000 && !strata_handle_done(h); i++) /* a hang guard: 30 s */
        usleep(1000);
    j->done = strata_handle_done(h);
    const char *m;
    j->level = strata_handle_level(&m, h);
    snprintf(j->level_msg, sizeof j->level_msg, "%s", m);
    int drc = strata_wait_durable(NULL, h);
    strata_handle_free(h);
    return rc ? rc : drc;
}

static void *run_pjob(void *p)
{
    pjob *j = p;
    strata_comm *c = j->w->comm[j->rank];
    if (j->what == REPLICATE) {
        j->rc = strata_peer_replicate(&j->info, c, j->uri, j->replicas);
    } else if (j->what == ENCODE) { /* replicas: k * 16 + m */
        j->rc = strata_peer_encode(&j->info, c, j->uri, j->replicas / 16, j->replicas % 16);
    } else if (j->what == RESTORE) {
        j->rc = strata_peer_restore(&j->info, c, j->uri);
    } else if (j->what == BG_SAVE) {
        j->rc = bg_save(j);
    } else {
        const char *u[2] = {j->uri, j->disk};
        j->rc = strata_load(&j->stats, c, u, j->disk ? 2 : 1, &j->set->st[j->rank], 1, NULL);
    }
    snprintf(j->msg, sizeof j->msg, "%s", strata_error_last());
    return NULL;
}

/* Runs what on every rank of w, rank r on uris[r]. */
static void prun(world *w, int what, const char **uris, int replicas, const char *disk,
                 tu_set *set, pjob *jobs)
{
    int n = w->h.size;
    pthread_t th[16];
    for (int r = 0; r < n; r++) {
        jobs[r] = (pjob){.w = w, .rank = r, .what = what, .replicas = replicas,
                         .uri = uris[r], .disk = disk, .set = set,
                         .stats = STRATA_STATS_INIT};
        assert_int_equal(pthread_create(&th[r], NULL, run_pjob, &jobs[r]), 0);
    }
    for (int r = 0; r < n; r++)
        pthread_join(th[r], NULL);
}

static void pexpect_ok(const pjob *jobs, int n)
{
    for (int r = 0; r < n; r++)
        if (jobs[r].rc)
            fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
}


static char node_uri[16][700]; /* per rank: its node's copy */
static const char *uris[16];

static void set_nodes(int nodes)
{
    char v[16];
    snprintf(v, sizeof v, "%d", nodes);
    setenv("STRATA_LOAD_NODES", v, 1);
    setenv("STRATA_MEM_ROOT", base, 1); /* node n's memory: mem://node<n> = base/node<n> */
}

/* Rank r of a world of n ranks on `nodes` nodes names node dirs[r * nodes / n]'s copy of
 * step. */
static void name_copies(int n, int nodes, const int *dirs, const char *step)
{
    for (int r = 0; r < n; r++) {
        snprintf(node_uri[r], sizeof node_uri[r], "mem://node%d/%s", dirs[r * nodes / n],
                 step);
        uris[r] = node_uri[r];
    }
}

static void model(tu_set *s, int tp, int dp, int fill, int old_ranks)
{
    layout(s, tp, dp, fill);
    if (fill)
        for (int r = 0; r < tp * dp; r++)
            tu_set_blob(s, r, "rng", 1, r, 17 + (uint64_t)r, 1);
    else /* every old rank's rng asked for by some new rank: every saved byte is loaded */
        for (int o = 0; o < old_ranks; o++)
            tu_set_blob(s, o % (tp * dp), "rng", 1, o, 17 + (uint64_t)o, 0);
}

/* 8 ranks (tp 2 x dp 4) on 4 nodes save step to every node's copy (and to disk if given),
 * then replicate it with R copies. */
static void save_replicated(const char *step, int R, const char *disk, int expect_rc)
{
    static const int ident[] = {0, 1, 2, 3};
    set_nodes(4);
    name_copies(8, 4, ident, step);
    world w;
    world_init(&w, 8);
    tu_set src;
    model(&src, 2, 4, 1, 8);
    job jobs[8];
    const char *t2[8];
    if (disk) {
        for (int r = 0; r < 8; r++)
            t2[r] = disk;
        tier2 = t2;
    }
    run_all(&w, disk ? SAVE_TIERS : SAVE_ASYNC, NULL, uris, &src, jobs);
    tier2 = NULL;
    expect_all_ok(jobs, 8);
    pjob pj[8];
    prun(&w, REPLICATE, uris, R, NULL, NULL, pj);
    if (expect_rc) {
        for (int r = 0; r < 8; r++)
            assert_int_equal(pj[r].rc, expect_rc);
    } else {
        pexpect_ok(pj, 8);
        /* each node holds its share and the shares of the R nodes before it on the ring:
         * (R + 1) x the nodes' shares in all, and each rank sent R x its file */
        uint64_t held = 0, share = 0, sent = 0;
        for (int r = 0; r < 8; r++) {
            assert_int_equal(pj[r].info.nodes, 4);
            assert_true(pj[r].info.share_bytes > 0);
            if (r % 2 == 0) /* one rank of each node: its node's figures */
                held += pj[r].info.bytes_held, share += pj[r].info.share_bytes;
            sent += pj[r].info.bytes_sent;
        }
        for (int n = 0; n < 4; n++) {
            uint64_t h = 0;
            for (int r = 0; r < 8; r++) {
                char p[800];
                struct stat sb;
                snprintf(p, sizeof p, "%s/node%d/%s/data-%06d.bin", base, n, step, r);
                if (stat(p, &sb) == 0)
                    h += (uint64_t)sb.st_size;
            }
            assert_int_equal(h, pj[2 * n].info.bytes_held); /* the files really there */
        }
        assert_int_equal(held, (uint64_t)(R + 1) * share);
        assert_int_equal(sent, (uint64_t)R * (share + 16 * 8)); /* the files + headers */
        /* a node's copy holds the metadata and its replica record */
        for (int n = 0; n < 4; n++) {
            char p[800];
            snprintf(p, sizeof p, "%s/node%d/%s/PEER", base, n, step);
            assert_true(tu_exists(p));
            snprintf(p, sizeof p, "%s/node%d/%s/metadata.bin", base, n, step);
            assert_true(tu_exists(p));
        }
    }
    world_free(&w);
    tu_set_free(&src);
}

/* STRATA_PEER_SEEDS=dir: the records of a save's nodes copied there (the fuzz seeds). */
static void keep_seed(const char *step, int node, const char *as)
{
    const char *to = getenv("STRATA_PEER_SEEDS");
    if (!to)
        return;
    char p[800], q[800];
    size_t n;
    snprintf(p, sizeof p, "%s/node%d/%s/PEER", base, node, step);
    snprintf(q, sizeof q, "%s/%s", to, as);
    unsigned char *b = tu_read_file(p, &n);
    tu_write_file(q, b, n);
    free(b);
}

static void lose_node(int n)
{
    char p[600];
    snprintf(p, sizeof p, "%s/node%d", base, n);
    tu_rmrf(p);
}

/* The survivors (dirs) restart as n ranks on `nodes` nodes with layout tp x dp: restore
 * step, then load it from the nodes' copies; rc is the restore's expected outcome. */
static void restart(const char *step, int n, int nodes, const int *dirs, int tp, int dp,
                    int rc, const char *disk, uint64_t want_step)
{
    set_nodes(nodes);
    name_copies(n, nodes, dirs, step);
    world w;
    world_init(&w, n);
    pjob pj[16];
    prun(&w, RESTORE, uris, 0, NULL, NULL, pj);
    if (rc) {
        for (int r = 0; r < n; r++) {
            assert_int_equal(pj[r].rc, rc);
            if (!strstr(pj[r].msg, step))
                fail_msg("rank %d's message does not name %s: %s", r, step, pj[r].msg);
        }
    } else {
        pexpect_ok(pj, n);
        for (int r = 0; r < n; r++)
            assert_int_equal(pj[r].info.step, want_step);
        for (int r = 0; r < n; r++) /* each node's copy is whole and committed on its own */
            expect_loads(uris[r]);
    }
    if (!rc || disk) {
        tu_set dst;
        model(&dst, tp, dp, 0, 8);
        prun(&w, LOAD2, uris, 0, disk, &dst, pj);
        pexpect_ok(pj, n);
        assert_int_equal(tu_set_check(&dst), 0); /* bitwise what was saved */
        for (int r = 0; r < n; r++) /* from the nodes' memory, or else from disk */
            assert_int_equal(pj[r].stats.tier, rc ? 1 : 0);
        tu_set_free(&dst);
    }
    world_free(&w);
}

static void wipe(void)
{
    for (int n = 0; n < 4; n++)
        lose_node(n);
}

/* One node lost of four with one replica: the survivors restart as 3 nodes x 2 ranks
 * (tp 3 x dp 2) and as 2 nodes x 3 ranks (tp 1 x dp 6, one survivor's memory unused). */
static void test_lose_one_node(void **state)
{
    (void)state;
    save_step = 5;
    save_replicated("s1", 1, NULL, 0);
    keep_seed("s1", 1, "seed-valid-replicas");
    lose_node(2);
    static const int three[] = {0, 1, 3};
    restart("s1", 6, 3, three, 3, 2, 0, NULL, 5);
    wipe();
    save_replicated("s1", 1, NULL, 0);
    lose_node(0); /* rank 0's node, with the commit record */
    static const int two[] = {1, 3};
    restart("s1", 6, 2, two, 1, 6, 0, NULL, 5);
    wipe();
}

/* Two neighbouring nodes lost: one replica cannot rebuild (STRATA_ENOREPLICA naming the
 * step and the files, and the load falls back to the disk tier); two replicas can. */
static void test_lose_two_nodes(void **state)
{
    (void)state;
    char disk[600];
    snprintf(disk, sizeof disk, "%s/disk-s2", base);
    save_step = 6;
    save_replicated("s2", 1, disk, 0);
    lose_node(1);
    lose_node(2);
    static const int two[] = {0, 3};
    restart("s2", 4, 2, two, 2, 2, STRATA_ENOREPLICA, disk, 6);
    wipe();
    save_replicated("s2", 2, NULL, 0);
    lose_node(1);
    lose_node(2);
    restart("s2", 6, 2, two, 3, 2, 0, NULL, 6);
    /* more replicas than other nodes: refused */
    wipe();
    save_replicated("s2", 4, NULL, STRATA_EINVAL);
    wipe();
    tu_rmrf(disk);
}

/* A replication stopped on one rank (rank 5, on node 2, after the files came and with one
 * of them cut short, as a kill leaves it): every rank fails, node 2 commits no replica set
 * of the new step, and with node 1 lost the new step cannot be rebuilt (node 1's files
 * were only on node 2) while the previous replicated step restores, bitwise. */
static void test_killed_replication(void **state)
{
    (void)state;
    save_step = 7;
    save_replicated("s3", 1, NULL, 0);
    save_step = 8;
    setenv("STRATA_PEER_FAULT", "replicate:5", 1);
    save_replicated("s4", 1, NULL, STRATA_EABORTED);
    unsetenv("STRATA_PEER_FAULT");
    char p[700];
    snprintf(p, sizeof p, "%s/node2/s4/PEER", base);
    assert_false(tu_exists(p));
    snprintf(p, sizeof p, "%s/node2/s4/data-000002.bin", base);
    assert_true(tu_exists(p));
    tu_truncate(p, 100);
    lose_node(1);
    static const int three[] = {0, 2, 3};
    restart("s4", 6, 3, three, 2, 3, STRATA_ENOREPLICA, NULL, 8);
    restart("s3", 6, 3, three, 2, 3, 0, NULL, 7);
    wipe();
}

/* A save with peer_replicas: replicated by the saver's commit thread with no call from the
 * caller (strata_handle_level: local and replicated, not durable: all in memory); a node
 * lost, the survivors restore it. With the fault injected, the save is still committed
 * but not replicated, and the level's message says why. */
static void test_background(void **state)
{
    (void)state;
    static const int ident[] = {0, 1, 2, 3};
    save_step = 11;
    set_nodes(4);
    name_copies(8, 4, ident, "bg");
    world w;
    world_init(&w, 8);
    tu_set src;
    model(&src, 2, 4, 1, 8);
    pjob pj[8];
    prun(&w, BG_SAVE, uris, 1, NULL, &src, pj);
    pexpect_ok(pj, 8);
    for (int r = 0; r < 8; r++) {
        assert_true(pj[r].done);
        assert_int_equal(pj[r].level, STRATA_LEVEL_LOCAL | STRATA_LEVEL_REPLICATED);
        assert_string_equal(pj[r].level_msg, "");
    }
    setenv("STRATA_PEER_FAULT", "replicate:3", 1);
    name_copies(8, 4, ident, "bg2");
    prun(&w, BG_SAVE, uris, 1, NULL, &src, pj);
    unsetenv("STRATA_PEER_FAULT");
    pexpect_ok(pj, 8); /* committed all the same */
    for (int r = 0; r < 8; r++) {
        assert_int_equal(pj[r].level, STRATA_LEVEL_LOCAL);
        if (!strstr(pj[r].level_msg, "rank 3"))
            fail_msg("rank %d: %s", r, pj[r].level_msg);
    }
    world_free(&w);
    tu_set_free(&src);
    lose_node(2); /* node 1's files of bg2: on node 1 (no replica set) and node 2 */
    static const int three[] = {0, 1, 3};
    restart("bg", 3, 3, three, 1, 3, 0, NULL, 11);
    restart("bg2", 3, 3, three, 1, 3, STRATA_ENOREPLICA, NULL, 11);
    wipe();
}

/* 8 ranks on 4 nodes save and protect with k + m parity (one group of 4 nodes). */
static void save_encoded(const char *step, int k, int m, int expect_rc)
{
    static const int ident[] = {0, 1, 2, 3};
    set_nodes(4);
    name_copies(8, 4, ident, step);
    world w;
    world_init(&w, 8);
    tu_set src;
    model(&src, 2, 4, 1, 8);
    job jobs[8];
    run_all(&w, SAVE_ASYNC, NULL, uris, &src, jobs);
    expect_all_ok(jobs, 8);
    pjob pj[8];
    prun(&w, ENCODE, uris, k * 16 + m, NULL, NULL, pj);
    if (expect_rc) {
        for (int r = 0; r < 8; r++)
            assert_int_equal(pj[r].rc, expect_rc);
    } else {
        pexpect_ok(pj, 8);
        /* each node: its share and m parity blocks of ceil(largest share / k), rounded up
         * to 64; the parity files are there, of that size */
        uint64_t most = 0;
        for (int r = 0; r < 8; r += 2)
            most = pj[r].info.share_bytes > most ? pj[r].info.share_bytes : most;
        uint64_t block = ((most + (uint64_t)k - 1) / (uint64_t)k + 63) / 64 * 64;
        for (int r = 0; r < 8; r += 2) {
            assert_int_equal(pj[r].info.bytes_held,
                             pj[r].info.share_bytes + (uint64_t)m * block);
            int pars = 0;
            for (int j = 0; j < 4; j++) {
                char p[800];
                struct stat sb;
                snprintf(p, sizeof p, "%s/node%d/%s/PEER-%06d.par", base, r / 2, step, j);
                if (stat(p, &sb) == 0) {
                    assert_int_equal((uint64_t)sb.st_size, block);
                    pars++;
                }
            }
            assert_int_equal(pars, m);
        }
    }
    world_free(&w);
    tu_set_free(&src);
}

/* Reed-Solomon: k = 2, m = 2 over 4 nodes: any two lost (here nodes 1 and 2, then 0 and
 * 3) restore onto the survivors as 2 nodes x 3 ranks, bitwise; three lost cannot. k = 3,
 * m = 1: one lost restores as 3 nodes x 2. Groups that do not divide the nodes: refused. */
static void test_parity(void **state)
{
    (void)state;
#ifndef ST_HAVE_ISAL /* built without ISA-L: refused, clearly */
    save_encoded("p0", 2, 2, STRATA_ENOTSUP);
    wipe();
    return;
#endif
    save_step = 21;
    save_encoded("p1", 2, 2, 0);
    keep_seed("p1", 3, "seed-valid-parity");
    lose_node(1);
    lose_node(2);
    static const int two[] = {0, 3}, one_three[] = {1, 2}, three[] = {0, 1, 3};
    restart("p1", 6, 2, two, 3, 2, 0, NULL, 21);
    wipe();
    save_encoded("p1", 2, 2, 0);
    lose_node(0);
    lose_node(3);
    restart("p1", 6, 2, one_three, 1, 6, 0, NULL, 21);
    wipe();
    save_encoded("p1", 2, 2, 0);
    lose_node(0);
    lose_node(1);
    lose_node(3);
    static const int only2[] = {2};
    restart("p1", 2, 1, only2, 2, 1, STRATA_ENOREPLICA, NULL, 21);
    wipe();
    save_step = 22;
    save_encoded("p2", 3, 1, 0);
    lose_node(2);
    restart("p2", 6, 3, three, 2, 3, 0, NULL, 22);
    wipe();
    save_encoded("p3", 2, 1, STRATA_EINVAL);
    wipe();
}

TU_TMPDIR_GROUP(base, "peer")

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lose_one_node),
        cmocka_unit_test(test_lose_two_nodes),
        cmocka_unit_test(test_killed_replication),
        cmocka_unit_test(test_background),
        cmocka_unit_test(test_parity),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
