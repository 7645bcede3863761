/* dist.h - what the distributed save and load share (dist_*.c): the first-failure status
 * every rank learns, the wire encoding of a rank's registered state, and the plan cache of
 * a saver with a communicator. Every function taking a strata_comm is a collective. */
#ifndef STRATA_DIST_H
#define STRATA_DIST_H
#include <stdatomic.h>

#include "../comm/comm.h"
#include "engine.h"

#define ST_ROOT 0 /* the coordinator */
#define ST_MSG_BYTES 768

/* A status every rank learns: the code and message of the first failure. */
typedef struct {
    int32_t rc, rank;
    char msg[ST_MSG_BYTES];
} st_status;

/* Records rc of rank (with this thread's message) unless a failure is already there. */
void st_status_set(st_status *s, int rc, int rank);
/* The status as this rank's error: the failing rank's own code and message, or
 * STRATA_EABORTED naming that rank. */
int st_status_raise(const st_status *s, int me);
/* Sum, max and count of nonzero of v over the ranks (each may be NULL). */
void st_over_ranks(strata_comm *comm, uint64_t v, uint64_t *sum, uint64_t *max,
                   uint64_t *nonzero);
/* A rank's registered shards and blobs, on the wire; st_decode_all decodes every rank's
 * (rank me's is *mine, not decoded again). */
void st_encode_state(st_buf *b, const st_rank_view *v);
int st_decode_all(st_arena *a, const unsigned char *all, const size_t *counts, int P,
                  int me, const st_rank_view *mine, st_rank_view *out);

/* One piece this rank writes, as sent by the coordinator. */
typedef struct {
    uint32_t local;
    uint64_t src_off, offset, bytes;
} st_my_piece;

/* The last save plan, cached by a saver. Referenced by the saver and by each distributed
 * save in flight (so that a new plan can replace it meanwhile). */
struct st_plan_cache {
    atomic_int refs;
    uint64_t hash;
    int size;
    uint32_t chunk;
    /* every rank: its part */
    st_my_piece *mine;
    size_t nmine;
    uint64_t file_bytes;
    /* coordinator: the plan, and per rank the indices of its pieces in plan order */
    st_save_plan sp;
    size_t *by_rank, *rank0; /* pieces of rank r: by_rank[rank0[r] .. rank0[r+1]) */
};

/* Coordinator: each rank's part of c's plan, packed in rank order (counts[r] bytes). */
int st_cache_encode(st_plan_cache *c, int P, unsigned char **out, size_t *counts);
/* Every rank: its part, received from the coordinator, into c. */
int st_cache_decode(st_plan_cache *c, const unsigned char *p, size_t n);
/* This rank's save plan from its part of c and its registered state v. */
int st_cache_mine(const st_plan_cache *c, const st_rank_view *v, int me, st_save_plan *out);
/* The checksums this rank computed for its pieces (n of them), in plan order. */
const uint64_t *st_mine_sums(const st_save_plan *mine, size_t *n);
/* The hash of a rank's encoded local plan, world size and chunk: equal means unchanged. */
uint64_t st_plan_hash(const unsigned char *p, size_t n, int P, uint32_t chunk);

/* The ranks by node, and a shared memory segment per node (dist_node.c). */
typedef struct {
    int *node;           /* per rank: its node, named by the node's lowest rank */
    int *lidx;           /* per rank: its index among the ranks of its node */
    unsigned char *base; /* this node's segment: `slot` bytes per rank of the node; NULL:
                            none (no two ranks share a node, STRATA_LOAD_SHM=0, or it could
                            not be made everywhere) */
    size_t size, slot;
} st_node_shm;

/* Groups the ranks by node (host name and boot id; for tests, STRATA_LOAD_NODES=k makes k
 * groups of consecutive ranks) and, where ranks share a node, maps one segment per node of
 * `slot` bytes per rank, reserved in full (slot must be the same on every rank; 0: none). Every rank ends with a segment, or none does.
 * Errors: only those of the collectives, and STRATA_ENOMEM. */
int st_node_shm_open(strata_comm *comm, size_t slot, st_node_shm *out);
void st_node_shm_close(st_node_shm *s);
static inline unsigned char *st_node_slot(const st_node_shm *s, int rank)
{
    return s->base + (size_t)s->lidx[rank] * s->slot;
}
/* Do ranks a and b exchange through the segment? */
static inline int st_node_shared(const st_node_shm *s, int a, int b)
{
    return s->base && s->node[a] == s->node[b];
}

#endif
