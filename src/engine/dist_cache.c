/* dist_cache.c - a saver's cached save plan: the coordinator's global plan, each rank's
 * part of it as sent over the wire, the hash that tells whether a layout changed, and the
 * plan stored with a checkpoint (plan.bin) that a restarted job reads back. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "../meta/planfile.h"
#include "dist.h"

void st_plan_cache_release(st_plan_cache *c)
{
    if (!c || atomic_fetch_sub(&c->refs, 1) > 1)
        return;
    free(c->mine);
    st_save_plan_free(&c->sp);
    free(c->by_rank);
    free(c->rank0);
    free(c->hashes);
    free(c);
}

/* Coordinator: groups the plan's pieces by writer and encodes each rank's part. */
int st_cache_encode(st_plan_cache *c, int P, unsigned char **out, size_t *counts)
{
    const st_save_plan *sp = &c->sp;
    c->rank0 = calloc((size_t)P + 1, sizeof *c->rank0);
    c->by_rank = malloc((sp->npieces + 1) * sizeof *c->by_rank);
    if (!c->rank0 || !c->by_rank)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < sp->npieces; i++)
        c->rank0[sp->pieces[i].writer + 1]++;
    for (int r = 0; r < P; r++)
        c->rank0[r + 1] += c->rank0[r];
    size_t *fill = calloc((size_t)P, sizeof *fill);
    if (!fill)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < sp->npieces; i++) {
        int w = sp->pieces[i].writer;
        c->by_rank[c->rank0[w] + fill[w]++] = i;
    }
    free(fill);
    st_buf b = {0};
    for (int r = 0; r < P; r++) {
        size_t start = b.n;
        int f = sp->writer_file[r];
        st_buf_u64(&b, c->id);
        st_buf_var(&b, f < 0 ? 0 : sp->meta->files[f].bytes);
        st_buf_var(&b, c->rank0[r + 1] - c->rank0[r]);
        for (size_t k = c->rank0[r]; k < c->rank0[r + 1]; k++) {
            const st_piece *pc = &sp->pieces[c->by_rank[k]];
            st_buf_var(&b, pc->local);
            st_buf_var(&b, pc->src_off);
            st_buf_var(&b, pc->offset);
            st_buf_var(&b, pc->bytes);
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

int st_cache_decode(st_plan_cache *c, const unsigned char *p, size_t n)
{
    st_rd r = {.p = p, .end = p + n, .base = p};
    c->id = st_rd_u64(&r);
    c->file_bytes = st_rd_var(&r);
    uint64_t k = st_rd_count(&r, 4, "piece count");
    c->mine = malloc((k + 1) * sizeof *c->mine);
    if (!c->mine)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < k && !r.err; i++) {
        c->mine[i].local = (uint32_t)st_rd_var(&r);
        c->mine[i].src_off = st_rd_var(&r);
        c->mine[i].offset = st_rd_var(&r);
        c->mine[i].bytes = st_rd_var(&r);
    }
    c->nmine = (size_t)k;
    if (r.err || r.p != r.end)
        return st_fail(STRATA_EINVAL, "the coordinator's plan is malformed: %s", r.what);
    return 0;
}

/* This rank's part of the save as a one-file plan: its data file, its pieces, their
 * extents, and one array of checksums in piece order (ext[0].sums). Owns its memory. */
int st_cache_mine(const st_plan_cache *c, const st_rank_view *v, int me, st_save_plan *out)
{
    memset(out, 0, sizeof *out);
    st_meta *m = calloc(1, sizeof *m);
    if (!m)
        return st_fail(STRATA_ENOMEM, "out of memory");
    out->meta = m;
    out->nranks = 1;
    m->chunk = c->chunk;
    size_t total = 0;
    for (size_t i = 0; i < c->nmine; i++)
        total += (size_t)st_nchunks(c->mine[i].bytes, c->chunk);
    char name[ST_DATA_FILE_BYTES];
    st_data_file_name(name, me);
    st_extent *ext = st_arena_alloc(&m->arena, (c->nmine + 1) * sizeof *ext);
    uint64_t *sums = st_arena_alloc(&m->arena, (total + 1) * 8);
    m->files = st_arena_alloc(&m->arena, sizeof *m->files);
    char *fname = st_arena_strndup(&m->arena, name, strlen(name));
    out->pieces = calloc(c->nmine + 1, sizeof *out->pieces);
    if (!ext || !sums || !m->files || !fname || !out->pieces) {
        st_save_plan_free(out);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    if (c->nmine) {
        m->nfiles = 1;
        m->files[0] = (st_mfile){fname, c->file_bytes};
    }
    size_t at = 0;
    for (size_t i = 0; i < c->nmine; i++) {
        const st_my_piece *q = &c->mine[i];
        if (q->local >= v->nsh + v->nbl) {
            st_save_plan_free(out);
            return st_fail(STRATA_EINVAL, "the coordinator assigned an unknown registration");
        }
        int shard = q->local < v->nsh;
        const void *data = shard ? v->sh[q->local].data : v->bl[q->local - v->nsh].data;
        ext[i] = (st_extent){0, q->offset, q->bytes, sums + at};
        at += (size_t)st_nchunks(q->bytes, c->chunk);
        out->pieces[i] = (st_piece){0, q->local, q->src_off, q->offset, q->bytes,
                                    (const char *)data + q->src_off, &ext[i],
                                    shard ? v->sh[q->local].name : v->bl[q->local - v->nsh].name,
                                    shard && v->sh[q->local].device,
                                    0 /* STRATA_SHARD_UNCHANGED: not across ranks yet */};
        m->data_bytes += q->bytes;
    }
    out->npieces = c->nmine;
    return 0;
}

/* The checksums of a rank's part, in piece order. */
const uint64_t *st_mine_sums(const st_save_plan *mine, size_t *n)
{
    *n = 0;
    for (size_t i = 0; i < mine->npieces; i++)
        *n += (size_t)st_nchunks(mine->pieces[i].bytes, mine->meta->chunk);
    return mine->npieces ? mine->pieces[0].ext->sums : NULL;
}

uint64_t st_plan_hash(const unsigned char *p, size_t n, int P, uint32_t chunk)
{
    return st_hash(p, n) ^ st_mix64((uint64_t)P * 0x100000001b3ULL + chunk);
}

int st_cache_hashes(st_plan_cache *c, const unsigned char *all, const size_t *counts, int P,
                    uint32_t chunk)
{
    if (!(c->hashes = malloc((size_t)P * sizeof *c->hashes)))
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (int r = 0; r < P; all += counts[r], r++)
        c->hashes[r] = st_plan_hash(all, counts[r], P, chunk);
    return 0;
}

/* ---- the plan stored with a checkpoint ---- */

int st_plan_store(const st_plan_cache *c, const st_vfs *v, const char *dir, uint64_t save_id,
                  int sync)
{
    const st_save_plan *sp = &c->sp;
    const int P = c->size;
    if (!c->hashes || !c->rank0)
        return st_fail(STRATA_EINVAL, "internal: the coordinator has no plan to store");
    st_ppart *parts = calloc((size_t)P, sizeof *parts);
    st_ppiece *all = malloc((sp->npieces + 1) * sizeof *all);
    int rc = parts && all ? 0 : st_fail(STRATA_ENOMEM, "out of memory");
    for (int r = 0; r < P && !rc; r++) {
        int f = sp->writer_file[r];
        parts[r] = (st_ppart){c->hashes[r], f < 0 ? 0 : sp->meta->files[f].bytes,
                              c->rank0[r + 1] - c->rank0[r], all + c->rank0[r]};
        for (size_t k = c->rank0[r]; k < c->rank0[r + 1]; k++) {
            const st_piece *pc = &sp->pieces[c->by_rank[k]];
            all[k] = (st_ppiece){c->by_rank[k], pc->local, pc->src_off, pc->offset, pc->bytes};
        }
    }
    unsigned char *buf = NULL;
    size_t len = 0;
    st_phead h = {(uint32_t)P, sp->meta->chunk, save_id, 0};
    if (!rc)
        rc = st_planfile_encode(&h, parts, &buf, &len);
    if (!rc)
        rc = st_write_new(v, dir, ST_PLAN_FILE, buf, len, sync);
    free(buf);
    free(parts);
    free(all);
    return rc;
}

/* Bytes [off, off + n) of f into a new buffer: STRATA_EFORMAT if the file is shorter. */
static int read_at(const st_vfs *v, st_file *f, uint64_t off, size_t n, unsigned char **out)
{
    *out = malloc(n + 1);
    if (!*out)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int64_t got = st_vfs_read_full(v, f, *out, n, off);
    if (got == (int64_t)n)
        return 0;
    free(*out);
    *out = NULL;
    return got < 0 ? st_fail(st_from_errno((int)-got), "reading %s: %s", ST_PLAN_FILE,
                             strerror((int)-got))
                   : st_fail(STRATA_EFORMAT, "%s is truncated", ST_PLAN_FILE);
}

/* A rank's own part of the plan at path (not rank 0's): header, index entries, part. */
static int adopt_part(st_plan_cache *c, const st_vfs *v, const char *path, int me, int P)
{
    st_file *f = NULL;
    uint64_t size = 0, off = 0, n = 0;
    unsigned char *hdr = NULL, *idx = NULL, *part = NULL;
    st_phead h;
    st_ppart pp = {0};
    int e = v->open(v, path, ST_O_READ, &f), rc;
    if (e)
        return st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e), "cannot open %s: %s",
                       path, strerror(-e));
    if ((e = v->size(f, &size)))
        rc = st_fail(st_from_errno(-e), "%s: %s", path, strerror(-e));
    else if (!(rc = read_at(v, f, 0, ST_PLAN_HEADER, &hdr)) &&
             !(rc = st_planfile_header(&h, hdr, ST_PLAN_HEADER)) && h.ranks != (uint32_t)P)
        rc = st_fail(STRATA_EMISMATCH, "%s: a plan of %u ranks, not %d", path, h.ranks, P);
    if (!rc)
        rc = read_at(v, f, st_planfile_index_at((uint32_t)me), 16, &idx);
    if (!rc)
        rc = st_planfile_span(&off, &n, &h, (uint32_t)me, idx, size);
    if (!rc && !(rc = read_at(v, f, off, (size_t)n, &part)))
        rc = st_planfile_part(&pp, hdr, (uint32_t)me, part, (size_t)n);
    v->close(f);
    if (!rc && !(c->mine = malloc((pp.n + 1) * sizeof *c->mine)))
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; !rc && i < pp.n; i++)
        c->mine[i] = (st_my_piece){pp.p[i].local, pp.p[i].src_off, pp.p[i].offset, pp.p[i].bytes};
    if (!rc) {
        c->nmine = pp.n;
        c->file_bytes = pp.file_bytes;
        c->hash = pp.hash;
        c->chunk = h.chunk;
        c->id = h.save_id;
    }
    st_ppart_free(&pp);
    free(hdr);
    free(idx);
    free(part);
    return rc;
}

/* Rank 0: the global plan from the checkpoint's metadata m (taken) and every rank's part.
 * Each piece of m is some rank's, once, with its bytes; the skeleton is m with the plan's
 * files (each writer's data file) and extents, and no second checksums or base. */
static int rebuild(st_plan_cache *c, st_meta *m, const st_phead *h, const st_ppart *parts)
{
    st_save_plan *sp = &c->sp;
    const int P = (int)h->ranks;
    size_t np = m->nblobs, k = 0;
    for (size_t t = 0; t < m->ntensors; t++)
        np += m->tensors[t].nshards;
    sp->meta = m;
    sp->nranks = P;
    sp->pieces = calloc(np + 1, sizeof *sp->pieces);
    sp->writer_file = malloc((size_t)P * sizeof *sp->writer_file);
    sp->writer_bytes = calloc((size_t)P, sizeof *sp->writer_bytes);
    c->by_rank = malloc((np + 1) * sizeof *c->by_rank);
    c->rank0 = calloc((size_t)P + 1, sizeof *c->rank0);
    c->hashes = malloc((size_t)P * sizeof *c->hashes);
    st_extent **ext = malloc((np + 1) * sizeof *ext);
    const char **obj = malloc((np + 1) * sizeof *obj);
    unsigned char *seen = calloc(np + 1, 1);
    st_mfile *files = st_arena_alloc(&m->arena, (size_t)P * sizeof *files);
    int rc = sp->pieces && sp->writer_file && sp->writer_bytes && c->by_rank && c->rank0 &&
                     c->hashes && ext && obj && seen && files
                 ? 0 : st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t t = 0; !rc && t < m->ntensors; t++)
        for (size_t s = 0; s < m->tensors[t].nshards; s++, k++) {
            m->tensors[t].shards[s].has2 = 0;
            ext[k] = &m->tensors[t].shards[s].ext;
            obj[k] = m->tensors[t].name;
        }
    for (size_t b = 0; !rc && b < m->nblobs; b++, k++) {
        ext[k] = &m->blobs[b].ext;
        obj[k] = m->blobs[b].name;
    }
    uint32_t nw = 0;
    for (int r = 0; !rc && r < P; r++) {
        const st_ppart *pp = &parts[r];
        c->hashes[r] = pp->hash;
        c->rank0[r + 1] = c->rank0[r] + pp->n;
        sp->writer_file[r] = -1;
        if (pp->n) {
            char name[ST_DATA_FILE_BYTES];
            st_data_file_name(name, r);
            files[nw] = (st_mfile){st_arena_strndup(&m->arena, name, strlen(name)), pp->file_bytes};
            if (!files[nw].name)
                rc = st_fail(STRATA_ENOMEM, "out of memory");
            sp->writer_file[r] = (int)nw++;
        }
        for (size_t i = 0; !rc && i < pp->n; i++) {
            const st_ppiece *q = &pp->p[i];
            if (q->meta_index >= np || seen[q->meta_index] || ext[q->meta_index]->bytes != q->bytes) {
                rc = st_fail(STRATA_EFORMAT, "%s: rank %d's piece %zu is not the metadata's",
                             ST_PLAN_FILE, r, i);
                break;
            }
            seen[q->meta_index] = 1;
            st_extent *x = ext[q->meta_index];
            x->file = (uint32_t)sp->writer_file[r];
            x->offset = q->offset;
            c->by_rank[c->rank0[r] + i] = q->meta_index;
            sp->pieces[q->meta_index] = (st_piece){r, q->local, q->src_off, q->offset, q->bytes,
                                                   NULL, x, obj[q->meta_index], 0, 0};
            sp->writer_bytes[r] += q->bytes;
        }
    }
    if (!rc && c->rank0[P] != np)
        rc = st_fail(STRATA_EFORMAT, "%s: its parts hold %zu pieces, the metadata %zu",
                     ST_PLAN_FILE, c->rank0[P], np);
    if (!rc) {
        m->files = files;
        m->nfiles = nw;
        m->version = ST_META_VERSION;
        m->base = NULL;
        m->base_id = 0;
        m->linked = NULL;
        m->chunk = h->chunk;
        sp->npieces = np;
        sp->nwriters = (int)nw;
        for (int r = 0; r < P; r++)
            sp->max_writer_bytes = ST_MAX(sp->max_writer_bytes, sp->writer_bytes[r]);
    }
    free(ext);
    free(obj);
    free(seen);
    return rc;
}

/* Rank 0: the commit record and metadata (validated), the whole plan, tied to that commit. */
static int adopt_all(st_plan_cache *c, const char *uri, int P)
{
    st_dir d;
    int rc = st_dir_open(&d, uri, 0);
    if (rc)
        return rc;
    char path[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    st_phead h;
    st_ppart *parts = NULL;
    int e = 0;
    if (d.src != &st_source_strata)
        rc = st_fail(STRATA_ENOENT, "'%s' is not a strata checkpoint: it has no stored plan", uri);
    if (!rc && !(rc = st_path_join(path, d.path, ST_PLAN_FILE)) &&
        (e = st_vfs_read_all(d.vfs, path, SIZE_MAX / 2, 0, &buf, &len)))
        rc = st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e), "cannot read %s: %s",
                     path, strerror(-e));
    if (!rc)
        rc = st_planfile_decode(&h, &parts, buf, len);
    if (!rc && h.ranks != (uint32_t)P)
        rc = st_fail(STRATA_EMISMATCH, "%s: a plan of %u ranks, not %d", path, h.ranks, P);
    if (!rc && (d.commit.save_id == 0 || h.save_id != d.commit.save_id ||
                h.chunk != d.meta->chunk))
        rc = st_fail(STRATA_EFORMAT, "%s is not the plan of the save committed there", path);
    if (!rc) {
        st_meta *m = d.meta;
        d.meta = NULL; /* the plan's skeleton from here on */
        rc = rebuild(c, m, &h, parts);
    }
    if (!rc) { /* rank 0's own part */
        const st_ppart *pp = &parts[0];
        if (!(c->mine = malloc((pp->n + 1) * sizeof *c->mine)))
            rc = st_fail(STRATA_ENOMEM, "out of memory");
        for (size_t i = 0; !rc && i < pp->n; i++)
            c->mine[i] = (st_my_piece){pp->p[i].local, pp->p[i].src_off, pp->p[i].offset,
                                       pp->p[i].bytes};
        c->nmine = pp->n;
        c->file_bytes = pp->file_bytes;
        c->hash = pp->hash;
        c->chunk = h.chunk;
        c->id = h.save_id;
    }
    if (parts)
        st_planfile_free(parts, h.ranks);
    free(buf);
    st_dir_close(&d);
    return rc;
}

int st_plan_adopt(st_plan_cache **out, const char *uri, int me, int P)
{
    *out = NULL;
    st_plan_cache *c = calloc(1, sizeof *c);
    if (!c)
        return st_fail(STRATA_ENOMEM, "out of memory");
    atomic_init(&c->refs, 1);
    c->size = P;
    int rc;
    if (me == ST_ROOT) {
        rc = adopt_all(c, uri, P);
    } else {
        const st_vfs *v = NULL;
        char dir[PATH_MAX], path[PATH_MAX];
        rc = st_vfs_resolve(uri, &v, dir, sizeof dir);
        if (!rc && !(rc = st_path_join(path, dir, ST_PLAN_FILE)))
            rc = adopt_part(c, v, path, me, P);
        if (v)
            st_vfs_release(v);
    }
    if (rc) {
        st_plan_cache_release(c);
        return rc;
    }
    *out = c;
    return 0;
}
