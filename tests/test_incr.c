/* test_incr.c - incremental saves (strata_save_opts.base): a LoRA-style state (a frozen
 * base weight, small adapters and their AdamW moments) saved 20 times, bytes written
 * counted from the files on disk, every step loaded bitwise and verified, retention keeping
 * 3 (removing bases newer steps refer to), dense state writing everything, a corrupted
 * referenced chunk reported by both checkpoints, a base removed while a save links it, and
 * the bad bases refused. */
#include <pthread.h>

#include "meta/meta.h"
#include "testutil.h"
#include "threadcomm.h"

static char tmp[512];
TU_TMPDIR_GROUP(tmp, "incr")

#include "incr_lora.h"

static const uint64_t A4K = 4096;

/* The LoRA chain: 20 saves, each but the first naming the previous as its base. */
static void lora_chain(void **state)
{
    (void)state;
    char dir[600], path[700], base[32];
    snprintf(dir, sizeof dir, "%s/chain", tmp);
    tu_rmrf(dir);
    lora s;
    lora_init(&s, 1);
    snap want[20];
    uint64_t adapters = 0;
    for (int i = 1; i < NT; i++)
        adapters += ST_ALIGN_UP(tbytes(i), A4K);
    for (int k = 0; k < 20; k++) {
        if (k)
            lora_step(&s, k, 1);
        snprintf(path, sizeof path, "%s/step-%02d", dir, k);
        snprintf(base, sizeof base, "step-%02d", k - 1);
        strata_stats st = STRATA_STATS_INIT;
        assert_ok(save(path, &s, k, k ? base : NULL, k % 2, &st));
        snap_take(&want[k], &s);
        int nref;
        uint64_t disk = written_on_disk(path, &nref);
        uint64_t full = ST_ALIGN_UP(tbytes(0), A4K) + adapters + A4K; /* + the blob */
        if (k == 0) {
            assert_int_equal(disk, full);
            assert_int_equal(nref, 0);
            assert_int_equal(st.bytes, st.data_bytes);
        } else { /* only the adapters, their moments and the blob */
            assert_int_equal(disk, adapters + A4K);
            assert_int_equal(nref, 1);
            assert_int_equal(st.bytes, st.data_bytes - tbytes(0));
        }
    }
    /* every step's frozen bytes are step 0's file, linked: one inode */
    struct stat a, b;
    snprintf(path, sizeof path, "%s/step-00/data-000000.bin", dir);
    assert_int_equal(stat(path, &a), 0);
    assert_int_equal(a.st_nlink, 20);
    for (int k = 0; k < 20; k++) {
        snprintf(path, sizeof path, "%s/step-%02d", dir, k);
        load_same(path, &want[k]);
        verify_ok(path);
    }
    /* keep 3: removes steps 0..16, the bases 17..19 refer to; each still loads */
    int removed = 0;
    assert_ok(strata_retain(&removed, dir, 3));
    assert_int_equal(removed, 17);
    snprintf(path, sizeof path, "%s/step-00", dir);
    assert_false(tu_exists(path));
    for (int k = 17; k < 20; k++) {
        snprintf(path, sizeof path, "%s/step-%02d", dir, k);
        load_same(path, &want[k]);
        verify_ok(path);
    }
    /* the bytes live on in the files the survivors link: step 19's own link count */
    char ref[800];
    snprintf(path, sizeof path, "%s/step-19", dir);
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, path, 0));
    strata_shard_info si;
    strata_ckpt_shard(&si, ck, 0, 0);
    assert_string_equal(strstr(si.file, "ref-") == si.file ? "ref" : si.file, "ref");
    snprintf(ref, sizeof ref, "%s/%s", path, si.file);
    strata_ckpt_free(ck);
    assert_int_equal(stat(ref, &b), 0);
    assert_int_equal(b.st_ino, a.st_ino);
    assert_int_equal(b.st_nlink, 3);
    /* manual removal of a base: rm -r step-18, step 19 still loads */
    snprintf(path, sizeof path, "%s/step-18", dir);
    tu_rmrf(path);
    snprintf(path, sizeof path, "%s/step-19", dir);
    load_same(path, &want[19]);
    verify_ok(path);
    /* a save on top of a chain whose bases are gone */
    lora_step(&s, 20, 1);
    snprintf(path, sizeof path, "%s/step-20", dir);
    assert_ok(save(path, &s, 20, "step-19", 0, NULL));
    snap w20;
    snap_take(&w20, &s);
    load_same(path, &w20);
    snap_free(&w20);
    for (int k = 0; k < 20; k++)
        snap_free(&want[k]);
    lora_free(&s);
    tu_rmrf(dir);
}

/* Dense training: every tensor changes, every byte is written, nothing is linked. */
static void dense_writes_all(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700];
    snprintf(dir, sizeof dir, "%s/dense", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    snprintf(p1, sizeof p1, "%s/s1", dir);
    lora s;
    lora_init(&s, 2);
    assert_ok(save(p0, &s, 0, NULL, 0, NULL));
    lora_step(&s, 1, 0);
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(save(p1, &s, 1, "s0", 1, &st));
    assert_int_equal(st.bytes, st.data_bytes);
    int nref;
    uint64_t disk = written_on_disk(p1, &nref);
    assert_int_equal(nref, 0);
    assert_true(disk >= st.data_bytes);
    snap w;
    snap_take(&w, &s);
    load_same(p1, &w);
    /* what an incremental save wrote has no second checksums (it changed: it will likely
     * change again), so a save on top of it writes it even unchanged - no hashing at all
     * for dense training - until a save without a base (a full one) records them again */
    char p2[700], p3[700], p4[700];
    snprintf(p2, sizeof p2, "%s/s2", dir);
    snprintf(p3, sizeof p3, "%s/s3", dir);
    snprintf(p4, sizeof p4, "%s/s4", dir);
    assert_ok(save(p2, &s, 2, "s1", 0, &st));
    assert_int_equal(st.bytes, st.data_bytes);
    assert_ok(save(p3, &s, 3, NULL, 0, &st));
    assert_ok(save(p4, &s, 4, "s3", 0, &st));
    assert_int_equal(st.bytes, 100); /* the blob alone */
    load_same(p2, &w);
    load_same(p4, &w);
    verify_ok(p4);
    snap_free(&w);
    lora_free(&s);
    tu_rmrf(dir);
}

typedef struct {
    int n;
    char object[64], file[64];
} reports;

static void on_bad(void *ctx, const char *object, const char *file, const char *msg)
{
    (void)msg;
    reports *r = ctx;
    if (!r->n++) {
        snprintf(r->object, sizeof r->object, "%s", object);
        snprintf(r->file, sizeof r->file, "%s", file);
    }
}

/* A flipped byte in the frozen weight's bytes, which both checkpoints share: both report
 * it, naming the tensor and their own file. */
static void corrupt_shared_chunk(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700], f[800];
    snprintf(dir, sizeof dir, "%s/corrupt", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    snprintf(p1, sizeof p1, "%s/s1", dir);
    lora s;
    lora_init(&s, 3);
    assert_ok(save(p0, &s, 0, NULL, 0, NULL));
    lora_step(&s, 1, 1);
    assert_ok(save(p1, &s, 1, "s0", 0, NULL));
    tu_join(f, p0, "data-000000.bin");
    tu_flip_byte(f, 5 * CHUNK + 17, 0x40); /* base.w, chunk 5 */
    const char *paths[2] = {p0, p1};
    for (int i = 0; i < 2; i++) {
        strata_ckpt *ck;
        reports r = {0};
        assert_ok(strata_ckpt_open(&ck, paths[i], 0));
        assert_rc(strata_ckpt_verify(ck, on_bad, &r), STRATA_ECHECKSUM);
        strata_ckpt_free(ck);
        assert_int_equal(r.n, 1);
        assert_string_equal(r.object, "base.w");
        if (i == 0)
            assert_string_equal(r.file, "data-000000.bin");
        else
            assert_true(strncmp(r.file, "ref-", 4) == 0);
        lora d;
        lora_init(&d, 4);
        assert_rc(strata_load(NULL, NULL, &paths[i], 1, &d.st, 1, NULL), STRATA_ECHECKSUM);
        assert_msg_has("base.w");
        assert_msg_has(i == 0 ? "data-000000.bin" : "ref-");
        lora_free(&d);
    }
    lora_free(&s);
    tu_rmrf(dir);
}

/* Bad bases: missing, a path, not committed, not incremental-ready (a full save then). */
static void bad_bases(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700], f[800];
    snprintf(dir, sizeof dir, "%s/bad", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    snprintf(p1, sizeof p1, "%s/s1", dir);
    lora s;
    lora_init(&s, 5);
    assert_rc(save(p1, &s, 1, "nope", 0, NULL), STRATA_ENOENT);
    assert_msg_has("base");
    assert_false(tu_exists(p1));
    assert_rc(save(p1, &s, 1, "../s0", 1, NULL), STRATA_EINVAL);
    assert_msg_has("plain name");
    /* a symlink's name, to a committed incremental-ready checkpoint: refused the same */
    char real[700], lnk[700];
    snprintf(real, sizeof real, "%s/real", dir);
    snprintf(lnk, sizeof lnk, "%s/lnk", dir);
    assert_ok(save(real, &s, 0, NULL, 0, NULL));
    assert_int_equal(symlink("real", lnk), 0);
    for (int async = 0; async < 2; async++) {
        assert_rc(save(p1, &s, 1, "lnk", async, NULL), STRATA_EINVAL);
        assert_msg_has("symlink");
        assert_false(tu_exists(p1));
    }
    /* a full save without STRATA_SAVE_INCREMENTAL has no second checksums: all written */
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = CHUNK;
    o.flags = STRATA_SAVE_NO_SYNC;
    assert_ok(strata_save(NULL, NULL, (const char *[]){p0}, 1, &s.st, 1, &o));
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(save(p1, &s, 1, "s0", 0, &st));
    assert_int_equal(st.bytes, st.data_bytes);
    /* a base without its commit record */
    tu_join(f, p1, "COMMIT");
    assert_int_equal(unlink(f), 0);
    snprintf(p0, sizeof p0, "%s/s2", dir);
    assert_rc(save(p0, &s, 2, "s1", 0, NULL), STRATA_EINCOMPLETE);
    /* with a communicator (test_dist_incr.c has more): a base that is not incremental-ready
     * gives a full save there too; a missing one, unlike in one process, a full save (rank
     * 0 decides for every rank, and a save is never lost for its base) */
    strata_comm *self;
    strata_saver *sv;
    assert_ok(strata_comm_self(&self));
    assert_ok(strata_saver_new(&sv, self, NULL));
    o.flags = STRATA_SAVE_NO_SYNC | STRATA_SAVE_INCREMENTAL;
    const char *bases[2] = {"s0", "nope"};
    for (int i = 0; i < 2; i++) {
        o.base = bases[i];
        snprintf(p0, sizeof p0, "%s/s%d", dir, 3 + i);
        st = (strata_stats)STRATA_STATS_INIT;
        assert_ok(strata_save(&st, sv, (const char *[]){p0}, 1, &s.st, 1, &o));
        assert_int_equal(st.bytes, st.data_bytes);
        verify_ok(p0);
    }
    strata_saver_free(sv);
    strata_comm_free(self);
    lora_free(&s);
    tu_rmrf(dir);
}

/* The base is removed after the save matched it and before it links its files (the async
 * coordinator's test hook runs between the two): the save fails with STRATA_ECHANGED,
 * leaves nothing, and the other checkpoints stay loadable. */
static char race_base[700];
static void remove_base(strata_pool *p)
{
    (void)p;
    tu_rmrf(race_base);
}

static void base_removed_during_save(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700], p2[700];
    snprintf(dir, sizeof dir, "%s/race", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    snprintf(p1, sizeof p1, "%s/s1", dir);
    snprintf(p2, sizeof p2, "%s/s2", dir);
    lora s;
    lora_init(&s, 6);
    assert_ok(save(p0, &s, 0, NULL, 0, NULL));
    lora_step(&s, 1, 1);
    assert_ok(save(p1, &s, 1, "s0", 0, NULL));
    snap w1;
    snap_take(&w1, &s);
    lora_step(&s, 2, 1);
    snprintf(race_base, sizeof race_base, "%s", p1);
    extern void (*st_async_test_hook)(strata_pool *);
    st_async_test_hook = remove_base;
    assert_rc(save(p2, &s, 2, "s1", 1, NULL), STRATA_ECHANGED);
    st_async_test_hook = NULL;
    assert_msg_has("base");
    assert_false(tu_exists(p2)); /* a failed save leaves nothing */
    /* s1 is gone (removed by the "collector"); s0 loads; a new save on s0 works */
    assert_false(tu_exists(p1));
    assert_ok(save(p2, &s, 2, "s0", 0, NULL));
    snap w2;
    snap_take(&w2, &s);
    load_same(p2, &w2);
    snap_free(&w1);
    snap_free(&w2);
    lora_free(&s);
    tu_rmrf(dir);
}

/* Two tiers: each tier's base is its own copy; the new checkpoint on each links its own
 * tier's file; a load falls back to the second tier; inspect's view (strata_ckpt_base) and
 * a safetensors export read an incremental checkpoint as a full one. */
static void tiers_export_inspect(void **state)
{
    (void)state;
    char dir[600], a0[700], a1[700], b0[700], b1[700], out[700], f[800];
    snprintf(dir, sizeof dir, "%s/tiers", tmp);
    tu_rmrf(dir);
    snprintf(a0, sizeof a0, "%s/fast/s0", dir);
    snprintf(a1, sizeof a1, "%s/fast/s1", dir);
    snprintf(b0, sizeof b0, "%s/slow/s0", dir);
    snprintf(b1, sizeof b1, "%s/slow/s1", dir);
    lora s;
    lora_init(&s, 7);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = CHUNK;
    o.flags = STRATA_SAVE_INCREMENTAL | STRATA_SAVE_NO_SYNC;
    assert_ok(strata_save(NULL, NULL, (const char *[]){a0, b0}, 2, &s.st, 1, &o));
    lora_step(&s, 1, 1);
    o.base = "s0";
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(strata_save(&st, NULL, (const char *[]){a1, b1}, 2, &s.st, 1, &o));
    assert_int_equal(st.bytes, st.data_bytes - tbytes(0));
    snap w;
    snap_take(&w, &s);
    const char *tiers[2][2] = {{a0, a1}, {b0, b1}};
    for (int t = 0; t < 2; t++) { /* same inode as the tier's own base file */
        struct stat x, y;
        int nref;
        tu_join(f, tiers[t][0], "data-000000.bin");
        assert_int_equal(stat(f, &x), 0);
        written_on_disk(tiers[t][1], &nref);
        assert_int_equal(nref, 1);
        strata_ckpt *ck;
        assert_ok(strata_ckpt_open(&ck, tiers[t][1], 0));
        uint64_t own = 0;
        assert_string_equal(strata_ckpt_base(ck, &own), "s0");
        assert_int_equal(own, strata_ckpt_data_bytes(ck) - tbytes(0));
        strata_shard_info si;
        strata_ckpt_shard(&si, ck, 0, 0);
        snprintf(f, sizeof f, "%s/%s", tiers[t][1], si.file);
        strata_ckpt_free(ck);
        assert_int_equal(stat(f, &y), 0);
        assert_int_equal(x.st_ino, y.st_ino);
    }
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, a0, 0));
    assert_null(strata_ckpt_base(ck, NULL));
    strata_ckpt_free(ck);
    /* the fast tier's copy is gone: the load falls back to the slow one */
    tu_rmrf(a1);
    tu_rmrf(b0);
    lora d;
    lora_init(&d, 8);
    assert_ok(strata_load(&st, NULL, (const char *[]){a1, b1}, 2, &d.st, 1, NULL));
    assert_int_equal(st.tier, 1);
    for (int i = 0; i < NT; i++)
        assert_memory_equal(d.t[i], w.t[i], tbytes(i));
    lora_free(&d);
    /* export: the frozen weight's bytes come from the linked file */
    snprintf(out, sizeof out, "%s/export", dir);
    assert_ok(strata_export_safetensors(NULL, b1, out, NULL));
    strata_ckpt *ex;
    assert_ok(strata_ckpt_open(&ex, out, 0));
    lora e;
    lora_init(&e, 9);
    strata_state *est = e.st;
    strata_state *only;
    assert_ok(strata_state_new(&only));
    for (int i = 0; i < NT; i++) {
        uint64_t shape[2] = {rows[i], COLS};
        strata_shard sh = {.name = names[i], .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .data = e.t[i]};
        assert_ok(strata_state_add_shard(only, &sh));
    }
    (void)est;
    assert_ok(strata_load(NULL, NULL, (const char *[]){out}, 1, &only, 1, NULL));
    for (int i = 0; i < NT; i++)
        assert_memory_equal(e.t[i], w.t[i], tbytes(i));
    strata_state_free(only);
    strata_ckpt_free(ex);
    lora_free(&e);
    snap_free(&w);
    lora_free(&s);
    tu_rmrf(dir);
}

/* Version 2 metadata through the decoder: an incremental checkpoint's (a base, a linked
 * file, shards with and without second checksums) round-trips; random mutations are
 * refused as STRATA_EFORMAT or decode, never crash (ASan); a linked file without a base and
 * unknown shard flags are named. */
static void meta_v2_decoder(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700], f[800];
    snprintf(dir, sizeof dir, "%s/meta", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    snprintf(p1, sizeof p1, "%s/s1", dir);
    lora s;
    lora_init(&s, 10);
    assert_ok(save(p0, &s, 0, NULL, 0, NULL));
    lora_step(&s, 1, 1);
    assert_ok(save(p1, &s, 1, "s0", 0, NULL));
    tu_join(f, p1, "metadata.bin");
    size_t len;
    unsigned char *buf = tu_read_file(f, &len), *mut = malloc(len);
    st_meta *m;
    assert_ok(st_meta_decode(&m, buf, len));
    assert_int_equal(m->version, ST_META_VERSION_INCR);
    assert_string_equal(m->base, "s0");
    assert_int_equal(m->nfiles, 2);
    assert_true(st_file_linked(m, 1) && !st_file_linked(m, 0));
    assert_non_null(st_sums2(m, &m->tensors[0].shards[0]));  /* base.w: referred */
    assert_null(st_sums2(m, &m->tensors[1].shards[0]));      /* lora.a: written */
    unsigned char *again;
    size_t alen;
    assert_ok(st_meta_encode(m, &again, &alen));
    assert_int_equal(alen, len);
    assert_memory_equal(again, buf, len);
    free(again);
    st_meta_free(m);
    tu_rng r = {77};
    int refused = 0;
    for (int i = 0; i < 20000; i++) {
        memcpy(mut, buf, len);
        int nflip = 1 + (int)tu_below(&r, 3);
        for (int k = 0; k < nflip; k++)
            mut[ST_META_HEADER + tu_below(&r, len - ST_META_HEADER - ST_META_TRAILER)] ^=
                (unsigned char)(1 + tu_below(&r, 255));
        int rc = st_meta_decode_unchecked(&m, mut, len);
        if (rc == 0)
            st_meta_free(m);
        else if (rc != STRATA_EFORMAT)
            fail_msg("mutation %d: %s", i, strata_error_name(rc));
        refused += rc != 0;
    }
    print_message("v2 decoder: %d of 20000 mutations refused\n", refused);
    assert_true(refused > 5000);
    /* the base flag (first body byte after the chunk varint) off: the linked file is named */
    memcpy(mut, buf, len);
    size_t at = ST_META_HEADER;
    while (mut[at] & 0x80)
        at++;
    at++;
    assert_int_equal(mut[at], 1);
    mut[at] = 0; /* has_base 0: the base's name and id are now read as the file table */
    assert_rc(st_meta_decode_unchecked(&m, mut, len), STRATA_EFORMAT);
    free(mut);
    free(buf);
    lora_free(&s);
    tu_rmrf(dir);
}

/* A file system that refuses the link (the fault URI fails the first link, EXDEV: as
 * across file systems; EPERM the same): the save is a full one, committed and loading,
 * instead of failing at its links. */
static void link_refused_full_save(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700], u1[800];
    snprintf(dir, sizeof dir, "%s/nolink", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    lora s;
    lora_init(&s, 13);
    assert_ok(save(p0, &s, 0, NULL, 0, NULL));
    const char *errs[2] = {"EXDEV", "EPERM"};
    for (int i = 0; i < 2; i++) {
        lora_step(&s, 1 + i, 1);
        snprintf(p1, sizeof p1, "%s/s%d", dir, 1 + i);
        snprintf(u1, sizeof u1, "fault+file://%s?op=rename&n=1&errno=%s", p1, errs[i]);
        strata_stats st = STRATA_STATS_INIT;
        assert_ok(save(u1, &s, 1 + i, "s0", i, &st));
        int nref;
        assert_true(written_on_disk(p1, &nref) >= st.data_bytes);
        assert_int_equal(nref, 0);
        snap w;
        snap_take(&w, &s);
        load_same(p1, &w);
        verify_ok(p1);
        snap_free(&w);
    }
    lora_free(&s);
    tu_rmrf(dir);
}

/* The distributed load (two ranks as threads on a host communicator: rank 0 reads the
 * index and broadcasts it, each rank reads its rows) of an incremental checkpoint whose
 * base is gone: each rank gets its half of the frozen weight (from the linked file) and of
 * the adapter. */
typedef struct {
    hub *h;
    int rank, rc;
    const char *path;
    const snap *want;
} dist_rank;

static void *dist_load_one(void *arg)
{
    dist_rank *d = arg;
    tcomm tc = {d->h, d->rank};
    strata_comm *c;
    d->rc = strata_comm_host(&c, &tops, &tc, d->rank, 2);
    if (d->rc)
        return NULL;
    strata_state *st;
    strata_state_new(&st);
    float *rows_buf[2];
    for (int i = 0; i < 2; i++) {
        uint64_t shape[2] = {rows[i], COLS}, off[2] = {(uint64_t)d->rank * rows[i] / 2, 0},
                 len[2] = {rows[i] / 2, COLS};
        rows_buf[i] = malloc(tbytes(i) / 2);
        strata_shard sh = {.name = names[i], .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .offsets = off, .lengths = len,
                           .data = rows_buf[i]};
        strata_state_add_shard(st, &sh);
    }
    d->rc = strata_load(NULL, c, &d->path, 1, &st, 1, NULL);
    for (int i = 0; i < 2; i++) {
        const float *w = d->want->t[i] + (size_t)d->rank * rows[i] / 2 * COLS;
        if (!d->rc && memcmp(rows_buf[i], w, tbytes(i) / 2) != 0)
            d->rc = -1000 - i;
        free(rows_buf[i]);
    }
    strata_state_free(st);
    strata_comm_free(c);
    return NULL;
}

static void distributed_load(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700];
    snprintf(dir, sizeof dir, "%s/dist", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    snprintf(p1, sizeof p1, "%s/s1", dir);
    lora s;
    lora_init(&s, 11);
    assert_ok(save(p0, &s, 0, NULL, 0, NULL));
    lora_step(&s, 1, 1);
    assert_ok(save(p1, &s, 1, "s0", 1, NULL));
    tu_rmrf(p0);
    snap w;
    snap_take(&w, &s);
    hub h;
    h.size = 2;
    pthread_barrier_init(&h.bar, NULL, 2);
    h.send = calloc(2, sizeof *h.send);
    h.scounts = calloc(2, sizeof *h.scounts);
    dist_rank d[2];
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
        d[r] = (dist_rank){&h, r, 0, p1, &w};
        assert_int_equal(pthread_create(&th[r], NULL, dist_load_one, &d[r]), 0);
    }
    for (int r = 0; r < 2; r++) {
        pthread_join(th[r], NULL);
        if (d[r].rc)
            fail_msg("rank %d: %d (%s)", r, d[r].rc, strata_error_name(d[r].rc));
    }
    pthread_barrier_destroy(&h.bar);
    free(h.send);
    free(h.scounts);
    snap_free(&w);
    lora_free(&s);
    tu_rmrf(dir);
}

/* STRATA_SAVE_REPLACE of a fixed path ("latest") with that path as its own base: the new
 * checkpoint links the previous one's file, the previous one is removed by the replace,
 * and the new one loads (three times over). */
static void replace_own_base(void **state)
{
    (void)state;
    char dir[600], p[700];
    snprintf(dir, sizeof dir, "%s/replace", tmp);
    tu_rmrf(dir);
    snprintf(p, sizeof p, "%s/latest", dir);
    lora s;
    lora_init(&s, 12);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = CHUNK;
    o.flags = STRATA_SAVE_NO_SYNC | STRATA_SAVE_INCREMENTAL | STRATA_SAVE_REPLACE;
    assert_ok(strata_save(NULL, NULL, (const char *[]){p}, 1, &s.st, 1, &o));
    o.base = "latest";
    for (int k = 1; k <= 3; k++) {
        lora_step(&s, k, 1);
        strata_stats st = STRATA_STATS_INIT;
        assert_ok(strata_save(&st, NULL, (const char *[]){p}, 1, &s.st, 1, &o));
        assert_int_equal(st.bytes, st.data_bytes - tbytes(0));
        snap w;
        snap_take(&w, &s);
        load_same(p, &w);
        verify_ok(p);
        snap_free(&w);
    }
    lora_free(&s);
    tu_rmrf(dir);
}

/* A base whose frozen bytes rotted after its commit (a flipped byte in its data file):
 * an incremental save on top of it, synchronous or asynchronous, hashed or marked
 * STRATA_SHARD_UNCHANGED, reads the base's bytes before referring to them, finds the
 * chunk that fails its checksum and writes the caller's bytes instead: it verifies and
 * loads bitwise, and so does the next save on top of it. The base's bytes are read once
 * per file version: a save on a base whose files were checked reads nothing again. */
extern _Atomic uint64_t st_incr_base_read;

static void rotted_base(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700], p2[700], p3[700], f[800];
    for (int mode = 0; mode < 3; mode++) { /* hashed sync, hashed async, marked */
        snprintf(dir, sizeof dir, "%s/rot%d", tmp, mode);
        tu_rmrf(dir);
        snprintf(p0, sizeof p0, "%s/s0", dir);
        snprintf(p1, sizeof p1, "%s/s1", dir);
        snprintf(p2, sizeof p2, "%s/s2", dir);
        snprintf(p3, sizeof p3, "%s/s3", dir);
        lora s;
        lora_init_ex(&s, 13, mode == 2 ? STRATA_SHARD_UNCHANGED : 0, NULL);
        assert_ok(save(p0, &s, 0, NULL, 0, NULL));
        tu_join(f, p0, "data-000000.bin");
        tu_flip_byte(f, 5 * CHUNK + 17, 0x40); /* base.w, chunk 5 */
        lora_step(&s, 1, 1);
        strata_stats st = STRATA_STATS_INIT;
        uint64_t read0 = st_incr_base_read;
        assert_ok(save(p1, &s, 1, "s0", mode == 1, &st));
        snap w;
        snap_take(&w, &s);
        verify_ok(p1);
        load_same(p1, &w);
        snap_free(&w);
        assert_int_equal(st.bytes, st.data_bytes); /* base.w written, nothing linked */
        assert_true(st_incr_base_read - read0 >= 6 * CHUNK); /* up to the bad chunk */
        /* the next save refers to s1's intact bytes: reads them once, then not again */
        for (int k = 2; k <= 3; k++) {
            lora_step(&s, k, 1);
            read0 = st_incr_base_read;
            assert_ok(save(k == 2 ? p2 : p3, &s, k, k == 2 ? "s1" : "s2", mode == 1, &st));
            snap_take(&w, &s);
            verify_ok(k == 2 ? p2 : p3);
            load_same(k == 2 ? p2 : p3, &w);
            snap_free(&w);
            assert_int_equal(st.bytes, st.data_bytes - tbytes(0));
            assert_int_equal(st_incr_base_read - read0, k == 2 ? tbytes(0) : 0);
        }
        lora_free(&s);
        tu_rmrf(dir);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(lora_chain),
        cmocka_unit_test(dense_writes_all),
        cmocka_unit_test(corrupt_shared_chunk),
        cmocka_unit_test(bad_bases),
        cmocka_unit_test(link_refused_full_save),
        cmocka_unit_test(base_removed_during_save),
        cmocka_unit_test(tiers_export_inspect),
        cmocka_unit_test(meta_v2_decoder),
        cmocka_unit_test(distributed_load),
        cmocka_unit_test(replace_own_base),
        cmocka_unit_test(rotted_base),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
