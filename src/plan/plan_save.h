/* plan_save.h - the save planner's working state, shared by its two files: plan_save.c
 * (registrations to distinct pieces, holders, metadata) and plan_balance.c (the split of
 * large replicated pieces and the choice of writers). Internal to src/plan. */
#ifndef STRATA_PLAN_SAVE_H
#define STRATA_PLAN_SAVE_H
#include "plan.h"

typedef struct {
    const st_entry *e; /* first registration: name, dtype, shape */
    int rank;
    size_t pos;        /* position in name order */
    uint64_t tkey;     /* st_tensor_key (only with refs) */
    int ambiguous;     /* another tensor has its key */
    int whole_rank;    /* a rank with a marked shard that copies no main piece, or -1 */
    uint32_t whole_local;
} st_tinfo;

typedef struct {
    int32_t rank;
    uint32_t local;    /* registration index on that rank: shards, then blobs */
    uint32_t unchanged;
} st_holder;

typedef struct {
    int blob;
    size_t tensor;         /* shards */
    const st_entry *e;     /* shards: first main registration */
    const st_blobent *b;   /* blobs: first registration */
    int64_t owner;         /* blobs: -1 global, else the rank */
    uint64_t fs, fe;       /* shards: the flat range saved (a piece of e's when split) */
    uint64_t bytes;
    size_t h0;             /* holders: hold[h0 .. h0 + nh) */
    uint32_t nh;
    int main_rank;         /* the first rank registering it unmarked */
    uint64_t pkey;         /* st_piece_key (only with refs) */
    int ambiguous;         /* another piece has its key */
    size_t x0, nx;         /* split: its other pieces are it[x0 .. x0 + nx) */
    int extra;             /* one of those pieces (another item's) */
    int writer;
    size_t wh;        /* the writer's holder: hold[wh] */
    uint32_t local;   /* the writer's registration index */
    uint64_t src_off; /* bytes into that registration's data */
    const void *src;
    int device;       /* src is CUDA device memory */
    int unchanged;    /* every holder marked it STRATA_SHARD_UNCHANGED */
    size_t meta_pos;
} st_item;

typedef struct {
    size_t *slot;
    size_t cap;
} st_imap; /* open addressing over indices; SIZE_MAX = empty */

int st_imap_init(st_imap *m, size_t n);

/* st_plan_save_work's count, of this thread's plan in progress (plan_balance.c, so that
 * plan_save.c alone calls into the other file). */
extern _Thread_local uint64_t st_save_work;

/* One save plan in the making: its inputs, the tensors and distinct items found, their
 * holders, and the plan and metadata being built. */
typedef struct {
    const st_rank_view *ranks;
    int nranks;
    uint32_t chunk;
    st_save_plan *out;
    size_t nent, nref, nblob, ndesc; /* registrations: shards, refs, blobs; all */
    st_tinfo *ti;       /* tensors, in order of first registration */
    size_t nt, tcap;
    st_item *it;        /* distinct items (pieces after the split) */
    size_t ni;
    uint32_t *ids;      /* per registration: its item, or UINT32_MAX */
    st_imap tm, im;     /* tensors by name; items by tensor and geometry or blob and owner */
    st_imap km, tk;     /* with refs: pieces by st_shard_key, tensors by st_tensor_key */
    st_holder *hold;    /* item j's holders: hold[it[j].h0 .. + nh) */
    size_t *order;      /* scratch: ni + nt indices */
    st_meta *m;
} st_save_ctx;

/* plan_balance.c. The balance bound (st_save_plan.writer_bytes_bound), before the split. */
uint64_t st_balance_bound(const st_save_ctx *c);
/* Splits each large replicated piece into flat pieces (st_item.x0, nx). */
int st_split_large(st_save_ctx *c);
/* Chooses each piece's writer (st_item.writer, wh) and fills the plan's writer_bytes. */
int st_balance_writers(st_save_ctx *c);

#endif
