/* plan.h - pure planning. The save planner dedups replicated shards and balances the
 * write work; the load planner intersects requests with saved shards through a per-tensor
 * index and lists what to read and where each byte goes. No I/O, no communication. */
#ifndef STRATA_PLAN_H
#define STRATA_PLAN_H
#include <stdint.h>

#include "../core/convert.h"
#include "../meta/meta.h"
#include "strata_types.h"

/* One registered shard, normalised: lengths filled, [fs, fe) explicit. */
typedef struct st_entry {
    const char *name;
    strata_dtype dtype;
    int ndim;
    uint64_t shape[STRATA_MAX_DIMS], off[STRATA_MAX_DIMS], len[STRATA_MAX_DIMS];
    uint64_t fs, fe; /* within the box; whole box: 0, numel(box) */
    void *data;
    uint64_t bytes;
    int device; /* data is CUDA device memory */
    int unchanged; /* STRATA_SHARD_UNCHANGED: equal to the base's shard at its place */
    int replica;   /* STRATA_SHARD_REPLICA: another rank registers the main copy */
} st_entry;

/* A shard marked STRATA_SHARD_REPLICA, summarised: what a coordinator gets of it instead
 * of its description (dist_wire.c). Empty shards are never summarised. */
typedef struct st_ref {
    uint64_t tkey;    /* st_tensor_key: its tensor (name, dtype, shape) */
    uint64_t pkey;    /* st_piece_key: its piece of that tensor (box, flat range) */
    uint32_t local;   /* its registration index on its rank */
    uint32_t unchanged;
} st_ref;

/* The 64-bit key of a shard's tensor (name, dtype, shape) and of its piece of it (box and
 * flat range, hashed with the tensor's key as seed): XXH3 of a fixed encoding
 * (docs/DESIGN.md, "Planning at scale"). Pure. */
uint64_t st_tensor_key(const st_entry *e);
uint64_t st_piece_key(const st_entry *e, uint64_t tkey);
/* The ref of shard e, registration `local` of its rank. */
st_ref st_ref_of(const st_entry *e, uint32_t local);

typedef struct st_blobent {
    const char *name;
    int local, owner;
    void *data;
    uint64_t size;
} st_blobent;

/* What one rank registered: shards, then blobs, numbered in that order (registration
 * indices: shard i is i, blob i is nsh + nref + i). A coordinator's view of a peer's save
 * (st_decode_all) holds the shards marked STRATA_SHARD_REPLICA as refs, and the others in
 * sh with their registration indices in reg; every other view has neither (nref 0, reg
 * NULL: sh[i] is registration i), its marked shards in sh with `replica` set. */
typedef struct st_rank_view {
    const st_entry *sh;
    size_t nsh;
    const st_blobent *bl;
    size_t nbl;
    int cast; /* load: which shards of another dtype than saved are converted (ST_CAST_*) */
    const st_ref *ref;
    size_t nref;
    const uint32_t *reg; /* per sh[i]: its registration index; NULL: i */
} st_rank_view;

/* The registration index of blob i of v. */
static inline uint32_t st_blob_local(const st_rank_view *v, size_t i)
{
    return (uint32_t)(v->nsh + v->nref + i);
}

/* A load's conversions of dtypes: none (equal dtypes only), the exact ones
 * (STRATA_LOAD_WIDEN: st_convert_exact), or every one st_convert_ok allows
 * (STRATA_LOAD_CAST). */
enum { ST_CAST_NONE = 0, ST_CAST_EXACT = 1, ST_CAST_ANY = 2 };

/* 1 if a load at cast level `cast` fills a shard of dtype `to` from one saved as `from`. */
static inline int st_cast_allows(int cast, strata_dtype from, strata_dtype to)
{
    if (from == to)
        return strata_dtype_size(from) != 0;
    return cast == ST_CAST_ANY     ? st_convert_ok(from, to)
           : cast == ST_CAST_EXACT ? st_convert_exact(from, to)
                                   : 0;
}

/* ---- save ---- */

/* One extent to write: `bytes` from src to offset `offset` of writer's data file. The
 * source is registration `local` of the writer (shards first, then blobs: nsh + i),
 * starting `src_off` bytes into its data; src is that address (NULL when the planner was
 * given no data, as the coordinator of a distributed save is). */
typedef struct st_piece {
    int writer;
    uint32_t local;
    uint64_t src_off;
    uint64_t offset, bytes;
    const void *src;
    st_extent *ext;     /* in the plan's metadata; the writer fills ext->sums */
    const char *object; /* tensor or blob name, for messages */
    int device;         /* src is CUDA device memory */
    int unchanged;      /* every holder marked it STRATA_SHARD_UNCHANGED (incr.c) */
} st_piece;

typedef struct st_save_plan {
    st_meta *meta;      /* complete but for the checksums (sums arrays allocated) */
    st_piece *pieces;   /* metadata order; offsets grow within each writer file */
    size_t npieces;
    int nranks;
    int *writer_file;   /* per rank: index into meta->files, or -1 if it writes nothing */
    uint64_t *writer_bytes; /* per rank: payload bytes assigned */
    uint64_t max_writer_bytes;
    /* A lower bound on max_writer_bytes for any assignment: ranks linked by shared items
     * form groups that can only share work within the group, so the best possible is at
     * least max over groups of (group bytes / group ranks); and at least the bytes that
     * only one rank holds. */
    uint64_t writer_bytes_bound;
    int nwriters;
} st_save_plan;

/* Builds the global save plan from every rank's registered state. Each distinct shard
 * (same tensor, box and flat range) registered unmarked (a main copy) is written once by
 * one of its holders - the ranks registering it, marked STRATA_SHARD_REPLICA or not -
 * chosen to balance bytes per writer (fixed single-holder work first, then replicated
 * items largest first to the least-loaded holder; a large one split into flat pieces
 * spread over its holders). A marked shard identical to no main copy is not saved; its
 * tensor's main copies must then hold the whole tensor. Work and memory: linear in the
 * registrations, n log n in the distinct items; no pair of ranks or of one tensor's pieces
 * is ever compared (DESIGN.md, "Planning at scale"). Errors: STRATA_EMISMATCH (one name
 * with two dtypes/shapes, or a global blob with two sizes), STRATA_EOVERLAP (naming the
 * ranks of the two main copies), STRATA_EUNFILLED (a marked shard that no main copy
 * holds), STRATA_EINVAL, STRATA_ENOMEM. */
int st_plan_save(st_save_plan *out, const st_rank_view *ranks, int nranks, uint32_t chunk,
                 uint64_t step);
void st_save_plan_free(st_save_plan *p);
/* Work units of this thread's last st_plan_save: hash probes, holders visited, heap steps,
 * and the overlap check's boxes. For tests and the benchmark, which hold it to a bound
 * linear in the registrations (times log of the holders of a piece). */
uint64_t st_plan_save_work(void);

/* ---- load ---- */

/* A byte run to copy from a saved extent to a destination: registration `local` of rank
 * `rank` (shards first, then blobs: nsh + i), `dst` bytes into its data. rank -1: no
 * destination (verify only). src and n count bytes of the saved dtype, dst bytes of the
 * destination's: they differ where the load converts (st_io_plan.dtype). */
typedef struct st_run {
    uint32_t piece; /* index into st_io_plan.ext */
    int32_t rank;
    uint32_t local;
    uint64_t src;   /* byte offset within the extent */
    uint64_t n;
    uint64_t dst;
} st_run;

/* Is the destination of a run CUDA device memory? */
static inline int st_run_device(const st_run *r, const st_rank_view *ranks)
{
    const st_rank_view *v = &ranks[r->rank];
    return r->local < v->nsh && v->sh[r->local].device;
}

/* The dtype of a run's destination (a blob's bytes are u8). */
static inline strata_dtype st_run_dtype(const st_run *r, const st_rank_view *ranks)
{
    const st_rank_view *v = &ranks[r->rank];
    return r->local < v->nsh ? v->sh[r->local].dtype : STRATA_U8;
}

/* The destination address of a run, given the rank views the plan was made from. */
static inline char *st_run_dst(const st_run *r, const st_rank_view *ranks)
{
    const st_rank_view *v = &ranks[r->rank];
    void *base = r->local < v->nsh ? v->sh[r->local].data : v->bl[r->local - v->nsh].data;
    return (char *)base + r->dst;
}

/* An I/O plan: the reads of a load (st_plan_load, st_plan_verify_all), or the write tasks
 * of a save (st_layout_writes), over the extents of a checkpoint's files. */

/* A segment of an I/O: chunks [c0, c1) of one extent. */
typedef struct st_seg {
    uint32_t piece;
    uint64_t c0, c1;
} st_seg;

/* One coalesced read or write: [off, off+len) of file, covering segments [seg0, seg1);
 * a read of a source with checks (st_plan_checks) checks the parts [cp0, cp1) of its
 * plan's cparts. */
typedef struct st_io {
    uint32_t file;
    uint64_t off, len;
    size_t seg0, seg1;
    size_t cp0, cp1;
    uint32_t flags; /* ST_IO_*: a rank's reads of a load over several ranks (st_plan_rank_reads) */
} st_io;

enum {
    ST_IO_SHARED = 1, /* other ranks of the node read these bytes too: through the page cache */
    ST_IO_FIRST = 2,  /* ... and this rank is the one counted as reading them from storage */
    ST_IO_SEND = 4,   /* a whole read of the global plan whose bytes go to other nodes too */
};

/* Bytes [lo, hi) of check `check` (st_mcheck of the plan's metadata, counted from its
 * start) that one read holds and takes into the check's CRC-32. */
typedef struct st_cpart {
    uint32_t check;
    uint64_t lo, hi;
} st_cpart;

typedef struct st_io_plan {
    const st_meta *meta;
    const st_rank_view *ranks; /* a copy of the requests' views (for run destinations);
                                  NULL for verify */
    int nranks;
    size_t npieces;
    const st_extent **ext;   /* per piece */
    const char **object;     /* per piece: tensor or blob name */
    strata_dtype *dtype;     /* per piece: the saved dtype (a blob's: u8) */
    uint64_t *maxrun;        /* per piece: longest run, for run look-up */
    size_t *run0;            /* per piece: first run index; run0[npieces] = nruns */
    st_run *runs;            /* sorted by (piece, src) */
    size_t nruns;
    st_seg *segs;
    size_t nsegs;
    st_io *ios;              /* sorted by (file, off) */
    size_t nios;
    uint64_t payload_bytes;  /* bytes of chunks to read (not counting alignment padding) */
    uint64_t request_bytes;  /* bytes requested over all ranks */
    /* st_plan_checks: the parts of the checks the reads hold, read by read (a check's parts
     * lie in consecutive reads, in order); the bytes read only for them (no run needs
     * them); whether every check touched is read whole by this plan */
    st_cpart *cparts;
    size_t ncparts;
    uint64_t crc_bytes;
    int crc_whole;
} st_io_plan;

/* The first run of piece `piece` that can hold its byte lo: runs are sorted by src and none
 * is longer than maxrun, so it starts at or after lo - maxrun (binary search). */
size_t st_io_first_run(const st_io_plan *p, uint32_t piece, uint64_t lo);

/* The largest read of a plan for max_io: whole chunks, at least one; with chunks under 8
 * bytes (a foreign source's are 1) a multiple of 8, so that no read splits an element, and
 * 2 * ST_ALIGN less where that leaves 2 * ST_ALIGN: a foreign read starts anywhere, and is
 * issued from the ST_ALIGN boundary before it to the one after it, which must stay within
 * max_io (one device request, where max_io is the device's largest). */
static inline uint64_t st_plan_max_io(const st_meta *m, uint64_t max_io)
{
    const uint64_t C = m->chunk;
    max_io = max_io < C ? C : max_io / C * C;
    if (C < 8) {
        if (max_io >= 4 * (uint64_t)ST_ALIGN)
            max_io -= 2 * (uint64_t)ST_ALIGN;
        max_io = max_io < 8 ? 8 : max_io / 8 * 8;
    }
    return max_io;
}

/* Is read i (with parts) a continuation of the check whose parts the reads before it hold
 * (its first part is of the check of the last part before it)? Such reads form a group
 * that one reader must do, so that it sees the whole check. */
static inline int st_io_joined(const st_io_plan *p, size_t i)
{
    const st_io *r = &p->ios[i];
    return r->cp0 < r->cp1 && r->cp0 > 0 &&
           p->cparts[r->cp0 - 1].check == p->cparts[r->cp0].check;
}

/* Plans a load of the requests of nranks ranks from meta. max_io bounds one read (as
 * st_plan_max_io makes it). A request of another dtype than saved is
 * STRATA_EMISMATCH unless its rank's view's `cast` level allows the pair (st_cast_allows).
 * Errors: STRATA_ENOTFOUND, STRATA_EMISMATCH, STRATA_EUNFILLED (messages name tensor and
 * rank), STRATA_ENOMEM. */
int st_plan_load(st_io_plan *out, const st_meta *meta, const st_rank_view *ranks,
                 int nranks, uint64_t max_io);
/* A plan that reads every chunk of every extent once (runs with rank -1): for verify. */
int st_plan_verify_all(st_io_plan *out, const st_meta *meta, uint64_t max_io);
/* From out->runs (pieces numbered, runs filled): sorts the runs, derives the needed chunk
 * segments and coalesces them into reads. Used by both planners above. */
int st_plan_reads(st_io_plan *out, uint64_t max_io);
void st_io_plan_free(st_io_plan *p);
/* Work units of this thread's last st_plan_load: saved shards visited by the requests
 * (each pair of a request and a saved shard looked at), and the index entries built. */
uint64_t st_plan_load_work(void);

/* The checks of a plan whose metadata has check ranges (a zip entry's CRC-32 covers the whole
 * entry): with widen, every read that touches a check is widened, and reads of the bytes no
 * run needs are added, so that each check touched is read whole (merged into neighbouring
 * reads up to max_io, as st_plan_reads rounds it; overlapping reads, tied tensors, merged
 * where they fit); without, the reads stay as planned. Then each byte of a check is given to
 * one read (the first that reads it), which holds it as a part (cparts). Fills cparts,
 * ncparts, crc_bytes (the added bytes) and crc_whole. Nothing to do for metadata without
 * checks. Pure. Errors: STRATA_ENOMEM (the plan is then unchanged). */
int st_plan_checks(st_io_plan *p, uint64_t max_io, int widen);
/* Bytes of read i that none of its segments holds (read only for a check). */
uint64_t st_io_crc_bytes(const st_io_plan *p, size_t i);

/* Rank me's reads in a load by several ranks, from the global plan g (st_plan_load of every
 * rank's request) that every rank made the same (plan_rank.c). node[r]: rank r's node (equal
 * values: one node); reader[i]: for read i of g, the rank that reads it whole and sends its
 * bytes to the ranks of other nodes that need them, or -1 where only ranks of one node need
 * it. Each rank reads the chunks it needs itself, split where the set of its node's ranks
 * that need them changes and coalesced into reads of at most max_io (as st_plan_load rounds
 * it); chunks others of its node need too are ST_IO_SHARED, ST_IO_FIRST on one such rank
 * (in turns, max_io bytes at a time; the node's reader where there is one). Then, ST_IO_SEND, the reads of g it reads whole for others.
 * Reads are ordered: shared and first, private, shared, sent. out borrows g's runs, extents
 * and views; free it with st_rank_reads_free, before g. payload_bytes: its reads' chunk bytes.
 * Errors: STRATA_ENOMEM. */
int st_plan_rank_reads(st_io_plan *out, const st_io_plan *g, int me, const int *node,
                       const int *reader, uint64_t max_io);
void st_rank_reads_free(st_io_plan *p);
/* The end of the unit of reads of g that starts at read i: reads [i, end) that a rank reads
 * all of where it reads any, so that it sees each check they touch whole (a check spread
 * over several reads, st_io_joined; reads overlapping those before them). i + 1 for a plan
 * without checks. */
size_t st_io_unit_end(const st_io_plan *g, size_t i);

#endif
