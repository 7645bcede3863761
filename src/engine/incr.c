/* incr.c - incremental saves (docs/DESIGN.md, "Incremental saves"): a save given a base
 * (a committed checkpoint beside its destination) does not write a shard whose every chunk
 * equals the base's shard at the same place - same tensor, dtype, box, flat range and
 * chunk size, equal XXH3-64 and then equal XXH64, or marked STRATA_SHARD_UNCHANGED by the
 * caller, whose bytes are then not read at all - but refers to the base's bytes: the
 * base's data file that holds them is hard-linked into the new checkpoint (as
 * ref-<id>-<rank>.bin), so that the new checkpoint stays self-contained and removing the
 * base frees nothing it uses. Matching runs on the caller's thread when the save starts,
 * before anything is copied; the links are made once the save owns its directory.
 * Threading: none of its own. */
#define XXH_STATIC_LINKING_ONLY /* the streaming states on the stack */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "engine.h"

/* One base data file linked into the new checkpoint. */
typedef struct {
    char from[ST_REF_FILE_BYTES]; /* its name in the base (data-N.bin or ref-...) */
    uint32_t base_file;           /* its index in the base's file table */
} incr_link;

struct st_incr {
    char base[STRATA_MAX_NAME + 1];
    uint64_t base_id;
    incr_link *links; /* nlinks: the new checkpoint's files [nfiles - nlinks, nfiles) */
    uint32_t nlinks;
    uint64_t matched_bytes;
};

uint64_t st_hash2(const void *p, size_t n) { return XXH64(p, n, 0); }

/* Both checksums of one chunk in one pass over memory: 256 KiB at a time through each, so
 * that the second hash reads from cache. */
#define BOTH_BLOCK (256u << 10)
void st_hash_both(const void *p, size_t n, uint64_t *h1, uint64_t *h2)
{
    if (n <= BOTH_BLOCK) {
        *h1 = st_hash(p, n);
        *h2 = st_hash2(p, n);
        return;
    }
    XXH3_state_t a;
    XXH64_state_t b;
    XXH3_64bits_reset(&a);
    XXH64_reset(&b, 0);
    for (size_t at = 0; at < n; at += BOTH_BLOCK) {
        size_t k = n - at < BOTH_BLOCK ? n - at : BOTH_BLOCK;
        XXH3_64bits_update(&a, (const unsigned char *)p + at, k);
        XXH64_update(&b, (const unsigned char *)p + at, k);
    }
    *h1 = XXH3_64bits_digest(&a);
    *h2 = XXH64_digest(&b);
}

void st_incr_free(st_incr *x)
{
    if (x)
        free(x->links);
    free(x);
}

/* Gives every extent of sp room for second checksums (blobs too, whose are computed and
 * never stored) and marks the metadata version 2. */
static int want_sums2(st_save_plan *sp)
{
    st_meta *m = sp->meta;
    m->version = ST_META_VERSION_INCR;
    if (!(m->linked = st_arena_alloc(&m->arena, m->nfiles + 1)))
        return st_fail(STRATA_ENOMEM, "out of memory");
    memset(m->linked, 0, m->nfiles + 1);
    for (size_t i = 0; i < sp->npieces; i++) {
        st_extent *e = sp->pieces[i].ext;
        uint64_t nc = st_nchunks(e->bytes, m->chunk);
        if (!(e->sums = st_arena_alloc(&m->arena, (size_t)(nc ? 2 * nc : 1) * 8)))
            return st_fail(STRATA_ENOMEM, "out of memory");
    }
    return 0;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp((*(const st_mtensor *const *)a)->name, (*(const st_mtensor *const *)b)->name);
}

/* Orders shards of one tensor by (box offsets, flat start), the metadata order. */
static int cmp_shard(int ndim, const st_mshard *a, const st_mshard *b)
{
    for (int d = 0; d < ndim; d++)
        if (a->off[d] != b->off[d])
            return a->off[d] < b->off[d] ? -1 : 1;
    return a->fs < b->fs ? -1 : a->fs > b->fs;
}

/* The base's shard at the very place of s (same box and flat range), or NULL. */
static const st_mshard *base_shard(const st_mtensor *bt, const st_mtensor *t, const st_mshard *s)
{
    size_t lo = 0, hi = bt->nshards;
    while (lo < hi) { /* base shards are in metadata order; a base that is not only misses */
        size_t mid = lo + (hi - lo) / 2;
        int c = cmp_shard(t->ndim, &bt->shards[mid], s);
        if (c == 0) {
            const st_mshard *b = &bt->shards[mid];
            for (int d = 0; d < t->ndim; d++)
                if (b->len[d] != s->len[d])
                    return NULL;
            return b->fe == s->fe && b->flat == s->flat ? b : NULL;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Does every chunk of the piece's bytes have the checksums s1 (XXH3) and s2 (XXH64)?
 * Stops at the first chunk that differs: a changed tensor costs one chunk's hash. */
int st_incr_same(const st_piece *pc, const uint64_t *s1, const uint64_t *s2, uint32_t chunk)
{
    const unsigned char *p = pc->src;
    uint64_t nc = st_nchunks(pc->bytes, chunk);
    for (uint64_t c = 0; c < nc; c++) {
        size_t n = (size_t)ST_MIN((uint64_t)chunk, pc->bytes - c * chunk);
        uint64_t h1, h2;
        if (c == 0) { /* the first chunk alone: a changed tensor costs one XXH3 */
            if ((h1 = st_hash(p, n)) != s1[0] || st_hash2(p, n) != s2[0])
                return 0;
            continue;
        }
        st_hash_both(p + c * chunk, n, &h1, &h2);
        if (h1 != s1[c] || h2 != s2[c])
            return 0;
    }
    return 1;
}

void st_incr_ref_name(char to[ST_REF_FILE_BYTES], const st_meta *bm, uint32_t bf,
                      uint64_t base_id)
{
    const char *n = bm->files[bf].name;
    if (st_is_ref_file(n)) /* already a link: keeps its name down the chain */
        snprintf(to, ST_REF_FILE_BYTES, "%s", n);
    else
        st_ref_file_name(to, base_id, st_data_file_rank(n));
}

int st_incr_add_link(st_meta *m, const st_meta *bm, uint32_t bf, uint64_t base_id,
                     uint32_t *out)
{
    char to[ST_REF_FILE_BYTES];
    st_incr_ref_name(to, bm, bf, base_id);
    st_mfile *f = st_arena_alloc(&m->arena, (m->nfiles + 1) * sizeof *f);
    uint8_t *lk = st_arena_alloc(&m->arena, m->nfiles + 1);
    char *name = st_arena_strndup(&m->arena, to, strlen(to));
    if (!f || !lk || !name)
        return st_fail(STRATA_ENOMEM, "out of memory");
    memcpy(f, m->files, m->nfiles * sizeof *f);
    memcpy(lk, m->linked, m->nfiles);
    f[m->nfiles] = (st_mfile){name, bm->files[bf].bytes};
    lk[m->nfiles] = 1;
    m->files = f;
    m->linked = lk;
    *out = m->nfiles++;
    return 0;
}

/* The new checkpoint's file index for base file bf, appending a link entry if new. */
static int link_index(st_incr *x, st_meta *m, const st_meta *bm, uint32_t bf, uint32_t *out)
{
    for (uint32_t i = 0; i < x->nlinks; i++)
        if (x->links[i].base_file == bf) {
            *out = m->nfiles - x->nlinks + i;
            return 0;
        }
    incr_link *l = realloc(x->links, (x->nlinks + 1) * sizeof *l);
    if (!l)
        return st_fail(STRATA_ENOMEM, "out of memory");
    x->links = l;
    int rc = st_incr_add_link(m, bm, bf, x->base_id, out);
    if (rc)
        return rc;
    snprintf(l[x->nlinks].from, sizeof l[x->nlinks].from, "%s", bm->files[bf].name);
    l[x->nlinks].base_file = bf;
    x->nlinks++;
    return 0;
}

/* Can base file b be linked under a name of its own? (data-N.bin or ref-...: what strata
 * writes; anything else is not used as a base's bytes.) */
static int linkable(const st_meta *bm, uint32_t f)
{
    const char *n = bm->files[f].name;
    return !st_file_linked(bm, f) ? st_data_file_rank(n) >= 0 : st_is_ref_file(n);
}

/* The candidates (a piece and the base shard at its place); those to hash (hash[0, nhash):
 * the unmarked ones) are hashed on the I/O threads. */
typedef struct {
    const st_save_plan *sp;
    const st_meta *bm;
    size_t *piece, *tensor, *shard, *hash;
    const st_mshard **bs;
    char *same;
} cand_ctx;

static int run_same(void *arg, size_t i, int worker)
{
    (void)worker;
    cand_ctx *c = arg;
    size_t k = c->hash[i];
    const st_mshard *b = c->bs[k];
    c->same[k] = (char)st_incr_same(&c->sp->pieces[c->piece[k]], b->ext.sums,
                                    st_sums2(c->bm, b), c->sp->meta->chunk);
    return 0;
}

/* Can piece pc be referred to base shard bs? The same place (found by the caller), size and
 * a linkable file; then either the caller's mark (no bytes read: device memory too, and a
 * base shard with one checksum only), or host bytes to hash against both checksums. A
 * plan without data (have_data 0: a distributed save's coordinator) offers a piece of a
 * rank that hashes it on its own. */
static int candidate(const st_piece *pc, const st_mshard *bs, const st_meta *bm, int have_data)
{
    if (!bs || (have_data && !pc->src) || bs->ext.bytes != pc->bytes ||
        !linkable(bm, bs->ext.file))
        return 0;
    if (!have_data) /* a rank's piece: it hashes against both checksums (marks and the */
        return bs->has2; /* device are not carried to the coordinator) */
    return pc->unchanged || (bs->has2 && !pc->device);
}

int st_incr_candidates(const st_save_plan *sp, const st_meta *bm, int have_data,
                       const st_mshard **bs)
{
    st_meta *m = sp->meta;
    const st_mtensor **bt = malloc((bm->ntensors + 1) * sizeof *bt);
    if (!bt)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < bm->ntensors; i++)
        bt[i] = &bm->tensors[i];
    qsort(bt, bm->ntensors, sizeof *bt, cmp_tensor_name);
    memset(bs, 0, sp->npieces * sizeof *bs);
    /* pieces are in metadata order: the shards of each tensor, then the blobs */
    size_t pi = 0;
    int rc = 0;
    for (size_t t = 0; !rc && t < m->ntensors; t++) {
        const st_mtensor *mt = &m->tensors[t], key = {.name = mt->name}, *kp = &key;
        const st_mtensor **found = bm->ntensors ? bsearch(&kp, bt, bm->ntensors, sizeof *bt,
                                                          cmp_tensor_name) : NULL;
        const st_mtensor *b = found && (*found)->dtype == mt->dtype &&
                                      (*found)->ndim == mt->ndim &&
                                      !memcmp((*found)->shape, mt->shape, sizeof mt->shape)
                                  ? *found : NULL;
        for (size_t s = 0; !rc && s < mt->nshards; s++, pi++) {
            const st_piece *pc = &sp->pieces[pi];
            const st_mshard *c = b ? base_shard(b, mt, &mt->shards[s]) : NULL;
            if (pi >= sp->npieces || pc->ext != &mt->shards[s].ext)
                rc = st_fail(STRATA_EINVAL, "internal: save plan out of metadata order");
            else if (candidate(pc, c, bm, have_data))
                bs[pi] = c;
        }
    }
    free(bt);
    return rc;
}

/* The candidates found equal (cc->same[0, nc)) whose base bytes fail their checksums in
 * any destination's base are not referred to: the caller's bytes are written instead,
 * with the base's second checksums where they were hashed against them (equal bytes:
 * the next save matches them again). */
static int check_matched(cand_ctx *cc, size_t nc, const st_dests *d, const char *base,
                         int threads)
{
    st_base_ext *e = calloc(nc + 1, sizeof *e);
    size_t *of = calloc(nc + 1, sizeof *of), n = 0;
    int rc = e && of ? 0 : st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t k = 0; !rc && k < nc; k++)
        if (cc->same[k]) {
            const st_extent *b = &cc->bs[k]->ext;
            e[n] = (st_base_ext){.file = cc->bm->files[b->file].name, .off = b->offset,
                                 .bytes = b->bytes, .sums = b->sums};
            of[n++] = k;
        }
    for (int t = 0; !rc && n && t < d->n; t++) {
        char bdir[PATH_MAX];
        if (!(rc = st_incr_base_path(bdir, d->final[t], base)))
            rc = st_incr_check_base(d->vfs[t], bdir, e, n, cc->sp->meta->chunk, threads);
        for (size_t i = 0; !rc && i < n; i++) {
            size_t k = of[i];
            const st_piece *pc = &cc->sp->pieces[cc->piece[k]];
            if (!e[i].bad || !cc->same[k])
                continue;
            cc->same[k] = 0;
            if (pc->unchanged || !cc->bs[k]->has2)
                continue; /* a mark is a promise, not a hash: no second checksums */
            uint64_t nsum = st_nchunks(pc->bytes, cc->sp->meta->chunk);
            memcpy(pc->ext->sums + nsum, st_sums2(cc->bm, cc->bs[k]), nsum * 8);
            cc->sp->meta->tensors[cc->tensor[k]].shards[cc->shard[k]].has2 = 1;
        }
    }
    free(e);
    free(of);
    return rc;
}

/* Refers every shard piece of sp that equals its base shard, and whose base bytes are
 * intact, to the base, drops it from the writes and lays each writer's file out again
 * without it. */
static int match(st_incr *x, st_save_plan *sp, const st_meta *bm, const st_dests *d,
                 int threads)
{
    st_meta *m = sp->meta;
    uint64_t *fill = calloc(m->nfiles + 1, sizeof *fill);
    const st_mshard **all = calloc(sp->npieces + 1, sizeof *all);
    /* first the candidates, the unmarked ones hashed in parallel, then the pieces that
     * equal theirs leave the writes */
    cand_ctx cc = {sp, bm, calloc(sp->npieces + 1, sizeof *cc.piece),
                   calloc(sp->npieces + 1, sizeof *cc.tensor),
                   calloc(sp->npieces + 1, sizeof *cc.shard),
                   calloc(sp->npieces + 1, sizeof *cc.hash),
                   calloc(sp->npieces + 1, sizeof *cc.bs), calloc(sp->npieces + 1, 1)};
    int rc = fill && all && cc.piece && cc.tensor && cc.shard && cc.hash && cc.bs && cc.same
                 ? st_incr_candidates(sp, bm, 1, all) : st_fail(STRATA_ENOMEM, "out of memory");
    size_t pi = 0, nc = 0, nhash = 0, kept = 0;
    for (size_t t = 0; !rc && t < m->ntensors; t++)
        for (size_t s = 0; s < m->tensors[t].nshards; s++, pi++)
            if (all[pi]) {
                /* a marked piece is the caller's promise (STRATA_SHARD_UNCHANGED): equal,
                 * its bytes not read, now that the base's shard at its place was found */
                if (!(cc.same[nc] = (char)sp->pieces[pi].unchanged))
                    cc.hash[nhash++] = nc;
                cc.piece[nc] = pi;
                cc.tensor[nc] = t;
                cc.shard[nc] = s;
                cc.bs[nc++] = all[pi];
            }
    free(all);
    if (!rc && nhash) /* (no threads started for marked pieces alone) */
        rc = st_parallel(threads, nhash, run_same, &cc);
    if (!rc)
        rc = check_matched(&cc, nc, d, x->base, threads);
    size_t k = 0;
    for (pi = 0; !rc && pi < sp->npieces; pi++) {
        st_piece *pc = &sp->pieces[pi];
        for (; k < nc && cc.piece[k] < pi; k++)
            ;
        uint32_t file = 0;
        if (k < nc && cc.piece[k] == pi && cc.same[k] &&
            !(rc = link_index(x, m, bm, cc.bs[k]->ext.file, &file))) {
            const st_mshard *bs = cc.bs[k];
            uint64_t n = st_nchunks(pc->bytes, m->chunk);
            pc->ext->file = file;
            pc->ext->offset = bs->ext.offset;
            /* the base's checksums: both where it has them (a marked piece's base shard may
             * have the first alone, which the next save can then match by mark only) */
            memcpy(pc->ext->sums, bs->ext.sums, (bs->has2 ? 2 : 1) * n * 8);
            m->tensors[cc.tensor[k]].shards[cc.shard[k]].has2 = bs->has2;
            x->matched_bytes += pc->bytes;
            sp->writer_bytes[pc->writer] -= pc->bytes;
            continue; /* not written */
        }
        sp->pieces[kept++] = *pc;
    }
    free(cc.piece);
    free(cc.tensor);
    free(cc.shard);
    free(cc.hash);
    free(cc.bs);
    free(cc.same);
    if (!rc) { /* each writer's file again, in the same order, without the matched pieces */
        sp->npieces = kept;
        for (size_t i = 0; i < kept; i++) {
            st_piece *pc = &sp->pieces[i];
            pc->offset = pc->ext->offset = fill[pc->ext->file];
            fill[pc->ext->file] = ST_ALIGN_UP(fill[pc->ext->file] + pc->bytes, ST_ALIGN);
        }
        for (uint32_t f = 0; f < m->nfiles; f++)
            if (!st_file_linked(m, f))
                m->files[f].bytes = fill[f];
        sp->max_writer_bytes = 0;
        for (int r = 0; r < sp->nranks; r++)
            sp->max_writer_bytes = ST_MAX(sp->max_writer_bytes, sp->writer_bytes[r]);
    }
    free(fill);
    return rc;
}

/* The path of base beside destination path dir (its parent joined with the name). */
int st_incr_base_path(char *out, const char *dir, const char *base)
{
    char parent[PATH_MAX];
    st_parent_of(parent, dir);
    return st_path_join(out, parent, base);
}

int st_incr_check_name(const char *base, const st_dests *d)
{
    if (!st_plain_name(base, strlen(base)) || strlen(base) > STRATA_MAX_NAME)
        return st_fail(STRATA_EINVAL, "strata_save_opts.base '%s' is not the name of a "
                       "checkpoint beside the destination (a plain name, no '/')", base);
    /* named by its own directory's name: a symlink there (which a load reads through)
     * could lead anywhere, and its files would be linked through it */
    for (int t = 0; t < d->n; t++) {
        char p[PATH_MAX];
        int kind, rc = st_incr_base_path(p, d->final[t], base);
        if (rc)
            return rc;
        if (d->vfs[t]->stat(d->vfs[t], p, NULL, &kind) == 0 && kind == 2)
            return st_fail(STRATA_EINVAL, "strata_save_opts.base '%s' is a symlink: a base "
                           "is named by the name of a checkpoint directory beside the "
                           "destination, never through a link", p);
    }
    return 0;
}

int st_incr_open_base(st_dir *bd, uint64_t *id, const st_dests *d, const char *base,
                      uint32_t chunk, int missing_ok)
{
    memset(bd, 0, sizeof *bd);
    *id = 0;
    int rc = st_incr_check_name(base, d), usable = 1;
    if (rc)
        return rc;
    for (int t = 0; t < d->n && !rc; t++) {
        char p[PATH_MAX];
        st_dir o, *b = t ? &o : bd;
        if ((rc = st_incr_base_path(p, d->final[t], base)) || (rc = st_dir_open(b, p, 0))) {
            if (missing_ok && (rc == STRATA_ENOENT || rc == STRATA_EINCOMPLETE))
                rc = 0, usable = 0;
            else
                rc = st_wrap(rc, "the base of an incremental save");
            if (t == 0)
                memset(bd, 0, sizeof *bd);
            if (t == 0 || !usable)
                break;
            continue;
        }
        if (b->src != &st_source_strata) /* safetensors, DCP, ...: a base is strata's own */
            rc = st_fail(STRATA_EINVAL, "base '%s' is a %s checkpoint: an incremental save's "
                         "base must be a strata checkpoint", p, b->src->name);
        else if (t > 0 && o.commit.save_id != bd->commit.save_id)
            usable = 0; /* each tier's base must be the same save: else a full save */
        if (d->vfs[t]->version < 3 || !d->vfs[t]->link)
            usable = 0; /* a backend that cannot link: a full save */
        if (t > 0)
            st_dir_close(&o);
    }
    if (rc && bd->vfs)
        st_dir_close(bd);
    if (!rc && usable && bd->meta && bd->commit.save_id &&
        bd->meta->version == ST_META_VERSION_INCR && bd->meta->chunk == chunk)
        *id = bd->commit.save_id;
    return rc;
}

/* Can each destination's file system link a base file beside it? One link of a base
 * data file to a temporary name in the destination's parent, removed at once: where it is
 * refused (EXDEV: another file system; EPERM: protected_hardlinks, a file system without
 * links; ...) the save is a full one rather than failing at its links. */
static int links_work(const st_dests *d, const char *base, const st_meta *bm)
{
    uint32_t f = 0;
    for (; f < bm->nfiles && !linkable(bm, f); f++)
        ;
    if (f == bm->nfiles)
        return 0;
    for (int t = 0; t < d->n; t++) {
        const st_vfs *v = d->vfs[t];
        if (!strcmp(v->scheme, "s3")) /* a link there is a server-side copy: no file system */
            continue;                 /* to refuse it, and a probe would copy a whole file */
        char bdir[PATH_MAX], from[PATH_MAX], parent[PATH_MAX], to[PATH_MAX], name[64];
        snprintf(name, sizeof name, ".strata-link-probe-%016llx",
                 (unsigned long long)st_save_id_new());
        st_parent_of(parent, d->final[t]);
        if (st_incr_base_path(bdir, d->final[t], base) ||
            st_path_join(from, bdir, bm->files[f].name) || st_path_join(to, parent, name) ||
            v->link(v, from, to) != 0)
            return 0;
        v->unlink(v, to);
    }
    return 1;
}

int st_incr_plan(st_incr **out, st_save_plan *sp, const st_dests *d, const strata_save_opts *o)
{
    *out = NULL;
    if (!o->base && !(o->flags & STRATA_SAVE_INCREMENTAL))
        return 0;
    /* A save without a usable base computes the second checksums of everything it writes
     * (the start of a chain: full saves); one that matches against a base computes none
     * for what it writes - a shard that changed now will likely change again (adapters,
     * dense training), and one that stops changing is matched from the next full save on.
     * So dense training pays for the second hash once per full save, not at every save. */
    int rc = want_sums2(sp);
    sp->meta->write2 = 1;
    for (size_t t = 0; t < sp->meta->ntensors; t++)
        for (size_t s = 0; s < sp->meta->tensors[t].nshards; s++)
            sp->meta->tensors[t].shards[s].has2 = 1;
    if (rc || !o->base)
        return rc;
    st_incr *x = calloc(1, sizeof *x);
    if (!x)
        return st_fail(STRATA_ENOMEM, "out of memory");
    snprintf(x->base, sizeof x->base, "%s", o->base);
    st_dir bd;
    if (!(rc = st_incr_open_base(&bd, &x->base_id, d, o->base, sp->meta->chunk, 0)) &&
        x->base_id && !links_work(d, o->base, bd.meta))
        x->base_id = 0; /* a full save */
    if (!rc && x->base_id) {
        st_meta *m = sp->meta;
        m->write2 = 0; /* matched ones get the base's (match) */
        for (size_t t = 0; t < m->ntensors; t++)
            for (size_t s = 0; s < m->tensors[t].nshards; s++)
                m->tensors[t].shards[s].has2 = 0;
        rc = match(x, sp, bd.meta, d, st_io_threads(o->io_threads));
        if (!rc && x->nlinks) {
            sp->meta->base = st_arena_strndup(&sp->meta->arena, x->base, strlen(x->base));
            sp->meta->base_id = x->base_id;
            if (!sp->meta->base)
                rc = st_fail(STRATA_ENOMEM, "out of memory");
        }
    }
    if (bd.vfs)
        st_dir_close(&bd);
    if (rc || !x->nlinks) {
        st_incr_free(x);
        return rc;
    }
    *out = x;
    return 0;
}

int st_incr_link(const st_incr *x, const st_meta *m, const st_dests *d, int t)
{
    if (!x)
        return 0;
    const st_vfs *v = d->vfs[t];
    char bdir[PATH_MAX], from[PATH_MAX], to[PATH_MAX];
    int rc = st_incr_base_path(bdir, d->final[t], x->base);
    for (uint32_t i = 0; !rc && i < x->nlinks; i++) {
        const char *name = m->files[m->nfiles - x->nlinks + i].name;
        if ((rc = st_path_join(from, bdir, x->links[i].from)) ||
            (rc = st_path_join(to, d->dir[t], name)))
            break;
        int e = v->link ? v->link(v, from, to) : -EOPNOTSUPP;
        if (e)
            rc = st_fail(e == -ENOENT ? STRATA_ECHANGED : st_from_errno(-e),
                         "linking '%s' of the base into '%s': %s%s", from, to, strerror(-e),
                         e == -ENOENT ? " (the base was removed during the save)" : "");
    }
    /* the files linked are the base's only if the base is still the save that was matched:
     * its commit record is removed first by whoever removes it, so one still there now was
     * there when each link was made */
    st_dir bd;
    if (!rc && !(rc = st_dir_open(&bd, bdir, 0))) {
        if (bd.commit.save_id != x->base_id)
            rc = st_fail(STRATA_ECHANGED, "the base '%s' was replaced by another checkpoint "
                         "during the save", bdir);
        st_dir_close(&bd);
    } else if (rc == STRATA_ENOENT || rc == STRATA_EINCOMPLETE) {
        rc = st_wrap(STRATA_ECHANGED, "the base was removed during the save");
    }
    return rc;
}
