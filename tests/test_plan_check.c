/* test_plan_check.c - the load plan's checks (st_plan_checks, src/plan/plan_check.c): the
 * reads of a foreign index with check ranges (a zip entry's CRC-32) widened so that every
 * check touched is read whole, each checked byte given to one read as a part; pure, on
 * indexes built here (chunk 1, extents at byte offsets). Cases by hand (a row block of an
 * entry, an entry longer than a read, tied tensors on one entry, a request outside any
 * check, no widening), random layouts held to the invariants, and a load by two ranks cut
 * into each rank's reads in whole entries (st_plan_rank_reads). */
#include "meta/checks.h"
#include "plan/plan.h"
#include "testutil.h"

/* ---- a foreign index by hand ---- */

typedef struct {
    const char *name;
    uint64_t rows, cols; /* f32 [rows, cols] */
    uint64_t offset;     /* its bytes in file 0 */
} tdef;

static st_meta *index_of(const tdef *t, size_t nt, const st_mcheck *c, size_t nc,
                         uint64_t file_bytes)
{
    st_meta *m = calloc(1, sizeof *m);
    assert_non_null(m);
    m->foreign = 1;
    m->chunk = 1;
    m->nfiles = 1;
    m->files = st_arena_alloc(&m->arena, sizeof *m->files);
    m->files[0] = (st_mfile){"f", file_bytes};
    m->tensors = st_arena_alloc(&m->arena, (nt + 1) * sizeof *m->tensors);
    for (size_t i = 0; i < nt; i++) {
        st_mtensor *x = &m->tensors[m->ntensors++];
        memset(x, 0, sizeof *x);
        x->name = (char *)t[i].name;
        x->dtype = STRATA_F32;
        x->ndim = 2;
        x->shape[0] = t[i].rows;
        x->shape[1] = t[i].cols;
        x->nshards = 1;
        x->shards = st_arena_alloc(&m->arena, sizeof *x->shards);
        uint64_t *d = st_arena_alloc(&m->arena, 4 * sizeof *d);
        d[0] = d[1] = 0;
        d[2] = t[i].rows;
        d[3] = t[i].cols;
        x->bytes = t[i].rows * t[i].cols * 4;
        x->shards[0] = (st_mshard){d, d + 2, 0, t[i].rows * t[i].cols, 0,
                                   {0, t[i].offset, x->bytes, NULL}, 0};
        m->data_bytes += x->bytes;
    }
    st_check_set cs = {0};
    for (size_t i = 0; i < nc; i++) {
        assert_int_equal(st_grow(&cs.v, &cs.cap, cs.n + 1, sizeof *cs.v), 0);
        cs.v[cs.n++] = c[i];
    }
    assert_int_equal(st_meta_set_checks(m, &cs, "test"), 0);
    free(cs.v);
    return m;
}

/* A request of rows [r0, r1) of tensor t (whole rows). */
static st_entry rows_of(const tdef *t, uint64_t r0, uint64_t r1)
{
    st_entry e = {0};
    e.name = t->name;
    e.dtype = STRATA_F32;
    e.ndim = 2;
    e.shape[0] = t->rows;
    e.shape[1] = t->cols;
    e.off[0] = r0;
    e.len[0] = r1 - r0;
    e.len[1] = t->cols;
    e.fs = 0;
    e.fe = (r1 - r0) * t->cols;
    e.bytes = e.fe * 4;
    return e;
}

static uint64_t seg_lo(const st_io_plan *p, const st_seg *s)
{
    return p->ext[s->piece]->offset + s->c0;
}

static uint64_t seg_hi(const st_io_plan *p, const st_seg *s)
{
    return p->ext[s->piece]->offset + ST_MIN(s->c1, p->ext[s->piece]->bytes);
}

/* Everything st_plan_checks promises, for a plan planned with max_io (widen: 1). */
static void check_plan(const st_io_plan *p, uint64_t max_io, int widen)
{
    const st_meta *m = p->meta;
    uint64_t payload = 0, read = 0;
    size_t seg = 0;
    for (size_t i = 0; i < p->nios; i++) {
        const st_io *r = &p->ios[i];
        assert_true(r->len > 0 && r->len <= max_io);
        if (i)
            assert_true(p->ios[i - 1].file < r->file ||
                        (p->ios[i - 1].file == r->file && p->ios[i - 1].off <= r->off));
        assert_int_equal(r->seg0, seg); /* the segments, in order, each in one read */
        seg = r->seg1;
        for (size_t k = r->seg0; k < r->seg1; k++) {
            assert_true(seg_lo(p, &p->segs[k]) >= r->off);
            assert_true(seg_hi(p, &p->segs[k]) <= r->off + r->len);
        }
        read += r->len;
        for (size_t j = r->cp0; j < r->cp1; j++) { /* parts inside their read */
            const st_cpart *c = &p->cparts[j];
            const st_mcheck *k = &m->checks[c->check];
            assert_true(c->lo < c->hi && c->hi <= k->bytes);
            assert_true(k->offset + c->lo >= r->off);
            assert_true(k->offset + c->hi <= r->off + r->len);
        }
        if (i + 1 < p->nios)
            assert_int_equal(r->cp1, p->ios[i + 1].cp0);
    }
    assert_int_equal(seg, p->nsegs);
    for (size_t k = 0; k < p->nsegs; k++)
        payload += seg_hi(p, &p->segs[k]) - seg_lo(p, &p->segs[k]);
    (void)payload;
    /* every check a segment touches: its parts are consecutive, in order, from its first
     * byte to its last (widened), and no other check has any */
    unsigned char *touched = calloc(m->nchecks + 1, 1), *seen = calloc(m->nchecks + 1, 1);
    assert_true(touched && seen);
    for (size_t k = 0; k < p->nsegs; k++)
        for (size_t c = 0; c < m->nchecks; c++)
            if (m->checks[c].offset < seg_hi(p, &p->segs[k]) &&
                m->checks[c].offset + m->checks[c].bytes > seg_lo(p, &p->segs[k]))
                touched[c] = 1;
    for (size_t j = 0; j < p->ncparts;) {
        uint32_t c = p->cparts[j].check;
        assert_true(touched[c] && !seen[c]);
        seen[c] = 1;
        uint64_t at = widen ? 0 : p->cparts[j].lo;
        for (; j < p->ncparts && p->cparts[j].check == c; j++) {
            if (widen) /* whole: no gap */
                assert_int_equal(p->cparts[j].lo, at);
            else       /* in order, disjoint */
                assert_true(p->cparts[j].lo >= at);
            at = p->cparts[j].hi;
        }
        if (widen)
            assert_int_equal(at, m->checks[c].bytes);
    }
    for (size_t c = 0; c < m->nchecks; c++)
        assert_int_equal(seen[c], touched[c]);
    if (widen)
        assert_true(p->crc_whole || !p->ncparts);
    free(touched);
    free(seen);
}

/* Plans the requests e[0, n) of one rank, with its checks. */
static void plan(st_io_plan *p, const st_meta *m, st_entry *e, size_t n, uint64_t max_io,
                 int widen)
{
    st_rank_view v = {.sh = e, .nsh = n};
    assert_int_equal(st_plan_load(p, m, &v, 1, max_io), 0);
    assert_int_equal(st_plan_checks(p, max_io, widen), 0);
    check_plan(p, st_plan_max_io(m, max_io), widen);
}

/* Bytes of the reads. */
static uint64_t read_bytes(const st_io_plan *p)
{
    uint64_t n = 0;
    for (size_t i = 0; i < p->nios; i++)
        n += p->ios[i].len;
    return n;
}

/* a: 1600 bytes at 100 inside entry [50, 1750); b: 480 bytes at 2000 inside [2000, 2600);
 * tied: a's bytes under another name; c: at 3000, in no entry. */
static const tdef T[] = {{"a", 100, 4, 100}, {"b", 40, 3, 2000}, {"tied", 100, 4, 100},
                         {"c", 10, 2, 3000}};
static const st_mcheck C[] = {{0, 0x1234, 50, 1700, "x/data/0"},
                              {0, 0x5678, 2000, 600, "x/data/1"},
                              {0, 0x9abc, 2700, 10, "x/version"}};

static void test_row_block(void **state)
{
    (void)state;
    st_meta *m = index_of(T, 4, C, 3, 4000);
    assert_int_equal(m->nchecks, 2); /* x/version holds no tensor's byte: left out */
    st_io_plan p;
    st_entry e = rows_of(&T[0], 0, 50); /* a's bytes [100, 900) */
    plan(&p, m, &e, 1, 4096, 1);
    assert_int_equal(p.nios, 1);
    assert_int_equal(p.ios[0].off, 50);
    assert_int_equal(p.ios[0].len, 1700);
    assert_int_equal(p.payload_bytes, 800);
    assert_int_equal(p.crc_bytes, 900);
    assert_int_equal(p.ncparts, 1);
    st_io_plan_free(&p);
    /* not widened: the rows only, a part of the entry */
    plan(&p, m, &e, 1, 4096, 0);
    assert_int_equal(p.nios, 1);
    assert_int_equal(p.ios[0].off, 100);
    assert_int_equal(p.ios[0].len, 800);
    assert_int_equal(p.crc_bytes, 0);
    assert_int_equal(p.crc_whole, 0);
    assert_int_equal(p.ncparts, 1);
    assert_int_equal(p.cparts[0].lo, 50);
    assert_int_equal(p.cparts[0].hi, 850);
    st_io_plan_free(&p);
    /* a tensor in no entry: nothing added, no part */
    e = rows_of(&T[3], 2, 7);
    plan(&p, m, &e, 1, 4096, 1);
    assert_int_equal(p.nios, 1);
    assert_int_equal(p.crc_bytes, 0);
    assert_int_equal(p.ncparts, 0);
    st_io_plan_free(&p);
    st_meta_free(m);
}

static void test_entry_longer_than_a_read(void **state)
{
    (void)state;
    st_meta *m = index_of(T, 4, C, 3, 4000);
    st_io_plan p;
    st_entry e[2] = {rows_of(&T[0], 0, 100), rows_of(&T[1], 10, 20)};
    plan(&p, m, e, 2, 512, 1);
    /* a's entry [50, 1750) in reads of at most 512 bytes, then b's [2000, 2600) */
    assert_true(p.nios >= 5);
    assert_int_equal(read_bytes(&p), 1700 + 600);
    assert_int_equal(p.crc_bytes, 100 + 480);
    size_t joined = 0;
    for (size_t i = 0; i < p.nios; i++)
        joined += st_io_joined(&p, i);
    assert_int_equal(joined, p.nios - 2); /* one group per entry */
    st_io_plan_free(&p);
    st_meta_free(m);
}

static void test_tied_tensors_share_reads(void **state)
{
    (void)state;
    st_meta *m = index_of(T, 4, C, 3, 4000);
    st_io_plan p;
    st_entry e[2] = {rows_of(&T[0], 0, 100), rows_of(&T[2], 0, 100)};
    plan(&p, m, e, 2, 4096, 1);
    assert_int_equal(p.nios, 1); /* a and tied: the same bytes, one read */
    assert_int_equal(p.ios[0].len, 1700);
    assert_int_equal(p.ncparts, 1);
    st_io_plan_free(&p);
    st_meta_free(m);
}

/* Random layouts: entries with gaps between them, tensors inside entries (some two to an
 * entry, some tied) and outside; random row blocks requested; every max_io. */
static void test_random_layouts(void **state)
{
    (void)state;
    tu_rng g = {28};
    for (int round = 0; round < 400; round++) {
        tdef t[12];
        st_mcheck c[8];
        char names[12][8];
        size_t nt = 0, nc = 0;
        uint64_t at = tu_below(&g, 64);
        for (int k = 0; k < 8; k++) {
            uint64_t start = at;
            int in_entry = tu_below(&g, 4) != 0;
            int ntens = 1 + (int)tu_below(&g, 2);
            at += tu_below(&g, 40); /* bytes of the entry before its first tensor */
            for (int j = 0; j < ntens && nt < 12; j++) {
                snprintf(names[nt], sizeof names[nt], "t%zu", nt);
                t[nt] = (tdef){names[nt], 1 + tu_below(&g, 300), 1 + tu_below(&g, 5), at};
                at += t[nt].rows * t[nt].cols * 4;
                if (tu_below(&g, 5) == 0 && nt + 1 < 12) { /* tied: the same bytes */
                    nt++;
                    snprintf(names[nt], sizeof names[nt], "t%zu", nt);
                    t[nt] = t[nt - 1];
                    t[nt].name = names[nt];
                }
                nt++;
                at += tu_below(&g, 3) * tu_below(&g, 50);
            }
            at += tu_below(&g, 40);
            if (in_entry)
                c[nc++] = (st_mcheck){0, (uint32_t)tu_next(&g), start, at - start, "e"};
            at += 30 + tu_below(&g, 100); /* a local header */
        }
        st_meta *m = index_of(t, nt, c, nc, at + 100);
        st_entry e[12];
        size_t ne = 0;
        for (size_t i = 0; i < nt; i++) {
            if (tu_below(&g, 3) == 0)
                continue;
            uint64_t r0 = tu_below(&g, t[i].rows), r1 = r0 + 1 + tu_below(&g, t[i].rows - r0);
            e[ne++] = rows_of(&t[i], r0, r1);
        }
        const uint64_t ios[] = {8, 64, 1000, 4096, 1u << 20};
        for (int w = 0; w < 2; w++)
            for (size_t k = 0; k < 5; k++) {
                st_io_plan p;
                plan(&p, m, e, ne, ios[k], w);
                st_io_plan_free(&p);
            }
        st_meta_free(m);
    }
}

/* A load by two ranks cut into each rank's reads (st_plan_rank_reads) in units: a rank that
 * needs any byte of an entry reads all of the global plan's reads of it, as they are (parts
 * and all), so that it compares the entry itself; an entry both need is shared and counted
 * for one of them; a read outside every entry is cut by chunk as before. On two nodes the
 * entry's reader sends it and the other rank reads none of it. */
static int has_read(const st_io_plan *rp, const st_io *r, uint32_t *flags)
{
    for (size_t i = 0; i < rp->nios; i++)
        if (rp->ios[i].off == r->off && rp->ios[i].len == r->len &&
            rp->ios[i].cp0 == r->cp0 && rp->ios[i].cp1 == r->cp1) {
            *flags = rp->ios[i].flags;
            return 1;
        }
    return 0;
}

static void test_rank_units(void **state)
{
    (void)state;
    st_meta *m = index_of(T, 4, C, 3, 4000);
    /* rank 0: a's first rows and c's; rank 1: a's last rows and b's */
    st_entry e0[2] = {rows_of(&T[0], 0, 30), rows_of(&T[3], 0, 10)};
    st_entry e1[2] = {rows_of(&T[0], 60, 100), rows_of(&T[1], 10, 20)};
    st_rank_view v[2] = {{.sh = e0, .nsh = 2}, {.sh = e1, .nsh = 2}};
    st_io_plan g;
    assert_int_equal(st_plan_load(&g, m, v, 2, 1024), 0);
    assert_int_equal(st_plan_checks(&g, 1024, 1), 0);
    /* units: a's entry [50, 1750) in reads of at most 1024, b's, c's read */
    size_t ua = st_io_unit_end(&g, 0), ub = st_io_unit_end(&g, ua);
    assert_true(ua >= 2);
    assert_int_equal(g.ios[ua].off, 2000);
    assert_int_equal(ub, ua + 1);
    assert_int_equal(st_io_unit_end(&g, ub), ub + 1);
    assert_int_equal(ub + 1, g.nios);
    int node[2] = {0, 0}, reader[16];
    assert_true(g.nios <= 16);
    for (size_t i = 0; i < g.nios; i++)
        reader[i] = -1;
    st_io_plan rp[2];
    for (int r = 0; r < 2; r++)
        assert_int_equal(st_plan_rank_reads(&rp[r], &g, r, node, reader, 1024), 0);
    int first = 0;
    for (size_t i = 0; i < ua; i++) { /* a: both read every read of it, one counted */
        uint32_t f0 = 0, f1 = 0;
        assert_true(has_read(&rp[0], &g.ios[i], &f0) && has_read(&rp[1], &g.ios[i], &f1));
        assert_true((f0 & ST_IO_SHARED) && (f1 & ST_IO_SHARED));
        assert_int_equal(((f0 & ST_IO_FIRST) != 0) + ((f1 & ST_IO_FIRST) != 0), 1);
        first |= (f0 & ST_IO_FIRST) ? 1 : 2; /* the same rank for the whole unit */
    }
    assert_true(first == 1 || first == 2);
    uint32_t f = 9;
    assert_false(has_read(&rp[0], &g.ios[ua], &f)); /* b: rank 1's alone, private */
    assert_true(has_read(&rp[1], &g.ios[ua], &f));
    assert_int_equal(f, 0);
    /* c (no entry): rank 0's 80 bytes, by chunk */
    assert_int_equal(rp[0].ios[rp[0].nios - 1].off, 3000);
    assert_int_equal(rp[0].ios[rp[0].nios - 1].len, 80);
    assert_int_equal(rp[0].ios[rp[0].nios - 1].cp0, rp[0].ios[rp[0].nios - 1].cp1);
    for (int r = 0; r < 2; r++)
        st_rank_reads_free(&rp[r]);
    /* two nodes: a's unit read and sent by rank 0; rank 1 reads none of it */
    node[1] = 1;
    for (size_t i = 0; i < ua; i++)
        reader[i] = 0;
    for (int r = 0; r < 2; r++)
        assert_int_equal(st_plan_rank_reads(&rp[r], &g, r, node, reader, 1024), 0);
    for (size_t i = 0; i < ua; i++) {
        assert_true(has_read(&rp[0], &g.ios[i], &f));
        assert_int_equal(f, ST_IO_SEND | ST_IO_FIRST);
        assert_false(has_read(&rp[1], &g.ios[i], &f));
    }
    for (int r = 0; r < 2; r++)
        st_rank_reads_free(&rp[r]);
    st_io_plan_free(&g);
    st_meta_free(m);
}

/* The table's encoding: decoded as written, and a table out of order refused. */
static void test_encoding(void **state)
{
    (void)state;
    st_meta *m = index_of(T, 4, C, 3, 4000), *back = NULL;
    unsigned char *enc = NULL;
    size_t n = 0;
    assert_int_equal(st_meta_encode(m, &enc, &n), 0);
    assert_int_equal(st_meta_decode_foreign(&back, enc, n), 0);
    assert_int_equal(back->nchecks, 2);
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(back->checks[i].offset, m->checks[i].offset);
        assert_int_equal(back->checks[i].bytes, m->checks[i].bytes);
        assert_int_equal(back->checks[i].crc, m->checks[i].crc);
        assert_string_equal(back->checks[i].name, m->checks[i].name);
    }
    st_meta_free(back);
    free(enc);
    /* overlapping entries: refused when set */
    st_mcheck bad[2] = {{0, 1, 50, 1700, "p"}, {0, 2, 1000, 1200, "q"}};
    st_meta *m2 = index_of(T, 4, NULL, 0, 4000);
    st_check_set cs = {0};
    cs.v = bad;
    cs.n = 2;
    assert_int_equal(st_meta_set_checks(m2, &cs, "here"), STRATA_EFORMAT);
    assert_non_null(strstr(strata_error_last(), "overlap"));
    st_meta_free(m2);
    st_meta_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_row_block),
        cmocka_unit_test(test_entry_longer_than_a_read),
        cmocka_unit_test(test_tied_tensors_share_reads),
        cmocka_unit_test(test_random_layouts),
        cmocka_unit_test(test_encoding),
        cmocka_unit_test(test_rank_units),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
