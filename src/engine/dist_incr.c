/* dist_incr.c - incremental saves by the ranks of a communicator (docs/DESIGN.md,
 * "Incremental saves", "Across ranks"). Rank 0 opens the base and finds, for every piece
 * of the save plan, the base's shard at its very place; one scatterv sends each rank its
 * candidates with the base's two checksums. Each rank hashes its candidates where they
 * lie, checks the base's bytes of those that match (st_incr_check_base), hard-links the
 * base's files holding those still matching into every destination, and reads the base's
 * commit record again; a rank that cannot use the base (a link refused:
 * EXDEV, EPERM, ...; the base removed or replaced) writes its whole part instead, so no
 * rank's failure to link loses or fails anything. Each rank drops what matched from its
 * writes and reports which pieces those were with the checksums of the rest; rank 0
 * builds the metadata on a copy of the cached plan, which stays as it was for the next
 * save. Every function taking a comm is a collective. Threading: the hashing runs on the
 * save's I/O threads. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../io/pool.h"
#include "dist.h"

/* ---- rank 0: the candidates of every rank ---- */

/* Encodes each rank's block: rank 0's outcome (code, message), the base's id and name,
 * then per piece of the rank's part: 0, or 1 with the base file to link (its name there,
 * the link's name, its size), the base shard's offset in it and its XXH3s and XXH64s. */
static int encode_parts(st_dist_incr *x, const st_dests *d, const strata_save_opts *o,
                        const st_plan_cache *c, int P, unsigned char **out, size_t *counts)
{
    int rc = 0;
    if (!c) /* rank 0 failed before it had the plan: the save fails anyway */
        rc = st_fail(STRATA_EABORTED, "rank 0 has no plan");
    if (!rc && o->base) {
        snprintf(x->base, sizeof x->base, "%s", o->base);
        rc = st_incr_open_base(&x->bd, &x->base_id, d, o->base, c->sp.meta->chunk, 1);
    }
    if (!rc && x->base_id) {
        if (!(x->cand = calloc(c->sp.npieces + 1, sizeof *x->cand)))
            rc = st_fail(STRATA_ENOMEM, "out of memory");
        else
            rc = st_incr_candidates(&c->sp, x->bd.meta, 0, x->cand);
    }
    if (rc)
        x->base_id = 0;
    char msg[ST_ERR_BYTES]; /* 1..ST_ERR_BYTES - 1 bytes, as every rank reads it */
    if (!st_err_keep(msg, rc) || !msg[0])
        snprintf(msg, sizeof msg, "-");
    st_buf b = {0};
    const st_meta *bm = x->bd.meta;
    for (int r = 0; r < P; r++) {
        size_t start = b.n;
        st_buf_u32(&b, (uint32_t)rc);
        st_buf_str(&b, msg);
        st_buf_u64(&b, x->base_id);
        st_buf_str(&b, x->base_id ? x->base : "-");
        for (size_t k = c && x->base_id ? c->rank0[r] : 0;
             c && x->base_id && k < c->rank0[r + 1]; k++) {
            const st_mshard *s = x->cand[c->by_rank[k]];
            st_buf_u8(&b, s != NULL);
            if (!s)
                continue;
            char to[ST_REF_FILE_BYTES];
            st_incr_ref_name(to, bm, s->ext.file, x->base_id);
            st_buf_str(&b, bm->files[s->ext.file].name);
            st_buf_str(&b, to);
            st_buf_var(&b, bm->files[s->ext.file].bytes);
            st_buf_var(&b, s->ext.offset);
            uint64_t nc = st_nchunks(s->ext.bytes, bm->chunk);
            for (uint64_t i = 0; i < 2 * nc; i++)
                st_buf_u64(&b, s->ext.sums[i]);
        }
        counts[r] = b.n - start;
    }
    if (b.oom) {
        free(b.p);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    *out = b.p;
    return 0;
}

/* ---- every rank: its candidates ---- */

typedef struct {
    const char *from, *to; /* NULL: no candidate */
    uint64_t file_bytes, off; /* the base file's size, the base shard's offset in it */
    uint64_t *sums;           /* 2 x nchunks */
} cand;

typedef struct {
    const st_save_plan *mine;
    cand *cs;
    unsigned char *same;
} hash_ctx;

static int run_hash(void *arg, size_t k, int worker)
{
    (void)worker;
    hash_ctx *h = arg;
    const cand *c = &h->cs[k];
    const st_piece *pc = &h->mine->pieces[k];
    uint32_t chunk = h->mine->meta->chunk;
    h->same[k] = c->from && pc->src && !pc->device &&
                 st_incr_same(pc, c->sums, c->sums + st_nchunks(pc->bytes, chunk), chunk);
    return 0;
}

/* Decodes this rank's candidates (one per piece of mine). */
static int decode_cands(st_rd *rd, st_arena *a, const st_save_plan *mine, cand *cs)
{
    for (size_t k = 0; k < mine->npieces && !rd->err; k++) {
        if (!st_rd_u8(rd))
            continue;
        cs[k].from = st_rd_str(rd, a, ST_REF_FILE_BYTES - 1);
        cs[k].to = st_rd_str(rd, a, ST_REF_FILE_BYTES - 1);
        cs[k].file_bytes = st_rd_var(rd);
        cs[k].off = st_rd_var(rd);
        uint64_t nc = st_nchunks(mine->pieces[k].bytes, mine->meta->chunk);
        if (rd->err || nc > st_rd_left(rd) / 16) {
            st_rd_fail(rd, "truncated checksums");
            break;
        }
        if (!cs[k].to || !st_is_ref_file(cs[k].to) ||
            (st_data_file_rank(cs[k].from) < 0 && !st_is_ref_file(cs[k].from))) {
            st_rd_fail(rd, "a base file that strata does not link");
            break;
        }
        if (!(cs[k].sums = st_arena_alloc(a, (size_t)(2 * nc + 1) * 8))) {
            st_rd_fail(rd, "out of memory");
            break;
        }
        for (uint64_t i = 0; i < 2 * nc; i++)
            cs[k].sums[i] = st_rd_u64(rd);
    }
    if (!rd->err && rd->p != rd->end)
        st_rd_fail(rd, "trailing bytes");
    return rd->err ? st_fail(STRATA_EINVAL, "rank 0's candidates are malformed: %s", rd->what)
                   : 0;
}

/* The base's commit record's save id at bdir now (0 if none or unreadable). */
static uint64_t base_id_now(const st_vfs *v, const char *bdir)
{
    char p[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    st_commit c;
    uint64_t id = 0;
    if (st_path_join(p, bdir, ST_COMMIT_FILE) == 0 &&
        st_vfs_read_all(v, p, 4096, 0, &buf, &len) == 0 && st_commit_decode(&c, buf, len) == 0)
        id = c.save_id;
    free(buf);
    return id;
}

/* This rank's matched pieces whose base bytes fail their checksums in any destination's
 * base are not referred to: it writes the caller's bytes instead (same[k] 2), with the
 * base's second checksums, which it hashed them against (equal bytes: the next save
 * matches them again). */
static int check_base(const st_dist_incr *x, const st_dests *d, st_save_plan *mine,
                      const cand *cs, unsigned char *same, int threads)
{
    size_t n = 0, *of = calloc(mine->npieces + 1, sizeof *of);
    st_base_ext *e = calloc(mine->npieces + 1, sizeof *e);
    int rc = e && of ? 0 : st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t k = 0; !rc && k < mine->npieces; k++)
        if (same[k]) {
            e[n] = (st_base_ext){.file = cs[k].from, .off = cs[k].off,
                                 .bytes = mine->pieces[k].bytes, .sums = cs[k].sums};
            of[n++] = k;
        }
    for (int t = 0; !rc && n && t < d->n; t++) {
        char bdir[PATH_MAX];
        if (!(rc = st_incr_base_path(bdir, d->final[t], x->base)))
            rc = st_incr_check_base(d->vfs[t], bdir, e, n, mine->meta->chunk, threads);
        for (size_t i = 0; !rc && i < n; i++) {
            st_piece *pc = &mine->pieces[of[i]];
            uint64_t nc = st_nchunks(pc->bytes, mine->meta->chunk);
            if (!e[i].bad || same[of[i]] != 1)
                continue;
            same[of[i]] = 2;
            if (!(pc->ext->sums = st_arena_alloc(&mine->meta->arena, (size_t)(2 * nc + 1) * 8)))
                rc = st_fail(STRATA_ENOMEM, "out of memory");
            else
                memcpy(pc->ext->sums, cs[of[i]].sums, 2 * nc * 8);
        }
    }
    free(e);
    free(of);
    return rc;
}

/* Links the base files holding this rank's matched pieces into every destination, then
 * checks that the base is still the save matched. 0, or why this rank cannot use it (the
 * caller writes in full; the links made stay listed in x->made: unused ones are cleared by
 * rank 0 at the commit, or with the save if it fails). A link that already exists (another
 * rank of this save linked the same base file) is taken if it has the file's size: a
 * ref-<id>-<rank> name only ever names that save's file. */
static int make_links(st_dist_incr *x, const st_dests *d, const cand *cs,
                      const unsigned char *same, size_t n)
{
    for (int t = 0; t < d->n; t++) {
        const st_vfs *v = d->vfs[t];
        char bdir[PATH_MAX], from[PATH_MAX], to[PATH_MAX];
        int rc = st_incr_base_path(bdir, d->final[t], x->base);
        for (size_t k = 0; !rc && k < n; k++) {
            if (same[k] != 1)
                continue;
            size_t j = 0; /* once per base file */
            for (; j < k && !(same[j] == 1 && strcmp(cs[j].to, cs[k].to) == 0); j++)
                ;
            if (j < k)
                continue;
            if ((rc = st_path_join(from, bdir, cs[k].from)) ||
                (rc = st_path_join(to, d->dir[t], cs[k].to)))
                break;
            int e = v->link ? v->link(v, from, to) : -EOPNOTSUPP;
            uint64_t size = 0;
            int kind = -1;
            if (e == -EEXIST && v->stat(v, to, &size, &kind) == 0 && kind == 0 &&
                size == cs[k].file_bytes)
                continue;
            if (e)
                return st_fail(st_from_errno(-e), "linking '%s' into '%s': %s", from, to,
                               strerror(-e));
            for (j = 0; j < x->nmade && strcmp(x->made[j], cs[k].to) != 0; j++)
                ;
            if (j == x->nmade) {
                char(*m)[ST_REF_FILE_BYTES] = realloc(x->made, (x->nmade + 1) * sizeof *m);
                if (!m)
                    return st_fail(STRATA_ENOMEM, "out of memory");
                x->made = m;
                snprintf(x->made[x->nmade++], ST_REF_FILE_BYTES, "%s", cs[k].to);
            }
        }
        if (rc)
            return rc;
        /* a collector removes a commit record first: the base's still there now was there
         * when each link was made (and when the link another rank made was found) */
        if (base_id_now(v, bdir) != x->base_id)
            return st_fail(STRATA_ECHANGED, "the base '%s' was removed or replaced during "
                           "the save", bdir);
    }
    return 0;
}

/* Drops the matched pieces from mine and lays its file out again without them (in the
 * same order, as rank 0 does in st_incr_meta_take); with second checksums, room for them. */
static int strip(st_dist_incr *x, st_save_plan *mine)
{
    st_meta *m = mine->meta;
    uint64_t fill = 0;
    size_t kept = 0;
    m->write2 = x->write2;
    for (size_t i = 0; i < mine->npieces; i++) {
        st_piece pc = mine->pieces[i];
        if (x->matched[i] == 1) {
            m->data_bytes -= pc.bytes;
            x->matched_bytes += pc.bytes;
            continue;
        }
        uint64_t nc = st_nchunks(pc.bytes, m->chunk);
        if (x->write2 && !(pc.ext->sums = st_arena_alloc(&m->arena, (size_t)(2 * nc + 1) * 8)))
            return st_fail(STRATA_ENOMEM, "out of memory");
        pc.offset = pc.ext->offset = fill;
        fill = ST_ALIGN_UP(fill + pc.bytes, ST_ALIGN);
        mine->pieces[kept++] = pc;
    }
    mine->npieces = kept;
    if (m->nfiles)
        m->files[0].bytes = fill;
    return 0;
}

int st_dist_incr_begin(st_dist_incr *x, strata_comm *comm, const st_dests *d,
                       const strata_save_opts *o, const st_plan_cache *c, st_save_plan *mine,
                       int *local_rc, char *local_msg)
{
    const int P = comm->size, me = comm->rank;
    unsigned char *parts = NULL, *part = NULL;
    size_t *counts = calloc((size_t)P, sizeof *counts), len = 0;
    x->on = 1;
    x->write2 = 1;
    if (!counts)
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    int rc = 0;
    if (o->base) { /* without one (STRATA_SAVE_INCREMENTAL alone) there is nothing to offer */
        if (me == ST_ROOT)
            rc = encode_parts(x, d, o, c, P, &parts, counts);
        if (!rc)
            rc = st_scatterv(comm, parts, counts, ST_ROOT, &part, &len);
    }
    free(parts);
    free(counts);
    if (rc)
        return rc;
    st_rd rd = {.p = part, .end = part + len, .base = part};
    st_arena a = {0};
    int prc = 0;
    const char *pmsg = NULL, *name = NULL;
    uint64_t id = 0;
    if (o->base) {
        prc = (int32_t)st_rd_u32(&rd);
        pmsg = st_rd_str(&rd, &a, ST_ERR_BYTES);
        id = st_rd_u64(&rd);
        name = st_rd_str(&rd, &a, STRATA_MAX_NAME);
    }
    int lrc = rd.err ? st_fail(STRATA_EINVAL, "rank 0's candidates are malformed: %s", rd.what)
                     : prc ? st_fail(prc, "rank 0: %s", pmsg) : 0;
    x->nmine = mine->npieces;
    cand *cs = calloc(x->nmine + 1, sizeof *cs);
    if (!lrc && (!cs || !(x->matched = calloc(x->nmine + 1, 1))))
        lrc = st_fail(STRATA_ENOMEM, "out of memory");
    if (!lrc && !*local_rc && id) {
        x->base_id = id;
        snprintf(x->base, sizeof x->base, "%s", name);
        hash_ctx h = {mine, cs, x->matched};
        if (!(lrc = decode_cands(&rd, &a, mine, cs)) && x->nmine)
            lrc = st_parallel(st_io_threads(o->io_threads), x->nmine, run_hash, &h);
        if (!lrc)
            lrc = check_base(x, d, mine, cs, x->matched, o->io_threads);
        if (!lrc && make_links(x, d, cs, x->matched, x->nmine) == 0)
            x->write2 = 0; /* this rank matched against the base: it writes no second sums */
        else if (!lrc) /* a rank that cannot use the base writes its part in full */
            memset(x->matched, 0, x->nmine);
    }
    if (!lrc && !*local_rc)
        lrc = strip(x, mine);
    if (lrc && !*local_rc) {
        *local_rc = lrc;
        st_err_keep(local_msg, lrc);
    }
    free(cs);
    st_arena_free(&a);
    free(part);
    return 0;
}

void st_dist_incr_report(const st_dist_incr *x, st_buf *b, const st_save_plan *mine, int ok)
{
    st_buf_u8(b, (uint8_t)x->write2);
    st_buf_var(b, ok ? x->nmine : 0);
    for (size_t i = 0; ok && i < x->nmine; i++)
        st_buf_u8(b, x->matched ? x->matched[i] : 0);
    /* the pieces written, in order: those not matched (flag 2: with second checksums) */
    for (size_t i = 0, j = 0; ok && i < mine->npieces; i++, j++) {
        for (; x->matched && j < x->nmine && x->matched[j] == 1; j++)
            ;
        const st_piece *pc = &mine->pieces[i];
        uint64_t nc = st_nchunks(pc->bytes, mine->meta->chunk);
        int two = x->write2 || (x->matched && j < x->nmine && x->matched[j] == 2);
        for (uint64_t k = 0; k < (two ? 2 : 1) * nc; k++)
            st_buf_u64(b, pc->ext->sums[k]);
    }
}

/* ---- rank 0: the metadata ---- */

int st_incr_meta_new(st_incr_meta *im, const st_plan_cache *c)
{
    memset(im, 0, sizeof *im);
    unsigned char *enc = NULL;
    size_t n = 0;
    st_meta *m = NULL;
    int rc = st_meta_encode(c->sp.meta, &enc, &n);
    if (!rc)
        rc = st_meta_decode(&m, enc, n);
    free(enc);
    if (rc)
        return rc;
    im->sp = c->sp;
    im->sp.meta = m;
    m->version = ST_META_VERSION_INCR;
    m->linked = st_arena_alloc(&m->arena, m->nfiles + 1);
    im->ext = calloc(c->sp.npieces + 1, sizeof *im->ext);
    im->sh = calloc(c->sp.npieces + 1, sizeof *im->sh);
    if (!m->linked || !im->ext || !im->sh)
        return st_fail(STRATA_ENOMEM, "out of memory");
    memset(m->linked, 0, m->nfiles + 1);
    size_t k = 0; /* the plan's pieces are in metadata order: shards, then blobs */
    for (size_t t = 0; t < m->ntensors; t++)
        for (size_t s = 0; s < m->tensors[t].nshards && k < c->sp.npieces; s++, k++) {
            im->sh[k] = &m->tensors[t].shards[s];
            im->ext[k] = &im->sh[k]->ext;
        }
    for (size_t b = 0; b < m->nblobs && k < c->sp.npieces; b++, k++)
        im->ext[k] = &m->blobs[b].ext;
    if (k != c->sp.npieces)
        return st_fail(STRATA_EINVAL, "internal: save plan out of metadata order");
    return 0;
}

/* The copy's file index of the link to base file bf, appended if new. */
static int link_file(st_meta *m, const st_meta *bm, uint32_t bf, uint64_t id, uint32_t *out)
{
    char to[ST_REF_FILE_BYTES];
    st_incr_ref_name(to, bm, bf, id);
    for (uint32_t f = 0; f < m->nfiles; f++)
        if (st_file_linked(m, f) && strcmp(m->files[f].name, to) == 0) {
            *out = f;
            return 0;
        }
    return st_incr_add_link(m, bm, bf, id, out);
}

int st_incr_meta_take(st_incr_meta *im, const st_dist_incr *x, const st_plan_cache *c, int r,
                      st_rd *rd)
{
    st_meta *m = im->sp.meta;
    const st_meta *bm = x->bd.meta;
    int write2 = st_rd_u8(rd) != 0;
    uint64_t n = st_rd_var(rd), fill = 0;
    if (!rd->err && n != c->rank0[r + 1] - c->rank0[r])
        return st_fail(STRATA_EINVAL, "rank %d reported %llu pieces, not the plan's %zu", r,
                       (unsigned long long)n, c->rank0[r + 1] - c->rank0[r]);
    const unsigned char *flags = st_rd_take(rd, (size_t)n);
    for (size_t k = 0; k < n && flags && !rd->err; k++) {
        size_t q = c->by_rank[c->rank0[r] + k];
        st_extent *e = im->ext[q];
        uint64_t nc = st_nchunks(e->bytes, m->chunk);
        if (flags[k] > 2)
            return st_fail(STRATA_EINVAL, "rank %d's report is malformed: piece flag %u", r,
                           flags[k]);
        if (flags[k] == 1) {
            const st_mshard *bs = x->cand ? x->cand[q] : NULL;
            uint32_t f = 0;
            int rc = !bs ? st_fail(STRATA_EINVAL, "rank %d referred a piece of '%s' to a base "
                                   "not offered", r, c->sp.pieces[q].object)
                         : link_file(m, bm, bs->ext.file, x->base_id, &f);
            if (rc)
                return rc;
            if (!(e->sums = st_arena_alloc(&m->arena, (size_t)(2 * nc + 1) * 8)))
                return st_fail(STRATA_ENOMEM, "out of memory");
            memcpy(e->sums, bs->ext.sums, 2 * nc * 8); /* both checksums */
            e->file = f;
            e->offset = bs->ext.offset;
            if (im->sh[q])
                im->sh[q]->has2 = 1;
            continue;
        }
        e->offset = fill;
        fill = ST_ALIGN_UP(fill + e->bytes, ST_ALIGN);
        int two = write2 || flags[k] == 2; /* 2: written for a base's bytes that rotted */
        if (two && !(e->sums = st_arena_alloc(&m->arena, (size_t)(2 * nc + 1) * 8)))
            return st_fail(STRATA_ENOMEM, "out of memory");
        for (uint64_t i = 0; i < (two ? 2 : 1) * nc; i++)
            e->sums[i] = st_rd_u64(rd);
        if (im->sh[q])
            im->sh[q]->has2 = two;
    }
    if (rd->err || rd->p != rd->end)
        return st_fail(STRATA_EINVAL, "rank %d's report is malformed: %s", r,
                       rd->err ? rd->what : "trailing bytes");
    int wf = im->sp.writer_file[r];
    if (wf >= 0)
        m->files[wf].bytes = fill;
    return 0;
}

int st_incr_meta_end(st_incr_meta *im, const st_dist_incr *x)
{
    st_meta *m = im->sp.meta;
    for (uint32_t f = 0; f < m->nfiles; f++)
        if (st_file_linked(m, f)) {
            m->base_id = x->base_id;
            if (!(m->base = st_arena_strndup(&m->arena, x->base, strlen(x->base))))
                return st_fail(STRATA_ENOMEM, "out of memory");
            break;
        }
    return 0;
}

void st_incr_meta_free(st_incr_meta *im)
{
    st_meta_free(im->sp.meta);
    free(im->ext);
    free(im->sh);
    memset(im, 0, sizeof *im);
}

void st_dist_incr_unlink(const st_dist_incr *x, const st_vfs *v, const char *dir)
{
    char p[PATH_MAX];
    for (size_t i = 0; i < x->nmade; i++)
        if (st_path_join(p, dir, x->made[i]) == 0)
            v->unlink(v, p);
}

void st_dist_incr_free(st_dist_incr *x)
{
    if (x->bd.vfs)
        st_dir_close(&x->bd);
    free(x->cand);
    free(x->matched);
    free(x->made);
    memset(x, 0, sizeof *x);
}
