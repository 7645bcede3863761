/* dist.h - what the distributed save and load share (dist_*.c): the first-failure status
 * every rank learns, the wire encoding of a rank's registered state, and the plan cache of
 * a saver with a communicator. Every function taking a strata_comm is a collective. */
#ifndef STRATA_DIST_H
#define STRATA_DIST_H
#include <stdatomic.h>

#include "../comm/comm.h"
#include "../core/error.h"
#include "engine.h"

#define ST_ROOT 0 /* the coordinator */

/* A status every rank learns: the code and message of the first failure. */
typedef struct {
    int32_t rc, rank;
    char msg[ST_ERR_BYTES];
} st_status;

/* Records rc of rank (with this thread's message) unless a failure is already there. */
void st_status_set(st_status *s, int rc, int rank);
/* The status as this rank's error: the failing rank's own code and message, or
 * STRATA_EABORTED naming that rank. */
int st_status_raise(const st_status *s, int me);
/* Sum, max and count of nonzero of v over the ranks (each may be NULL). */
void st_over_ranks(strata_comm *comm, uint64_t v, uint64_t *sum, uint64_t *max,
                   uint64_t *nonzero);
/* A rank's registered shards and blobs, on the wire: st_encode_state every shard in full
 * (a load's requests), st_encode_local_plan a save's, its shards marked
 * STRATA_SHARD_REPLICA as refs (st_ref). st_decode_all decodes every rank's (rank me's is
 * *mine, not decoded again). */
void st_encode_state(st_buf *b, const st_rank_view *v);
void st_encode_local_plan(st_buf *b, const st_rank_view *v);
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
    uint64_t id; /* the plan's: every rank holding it has the same (the save id of the save
                    that made it, or of the checkpoint whose plan.bin it was read from) */
    /* every rank: its part */
    st_my_piece *mine;
    size_t nmine;
    uint64_t file_bytes;
    /* coordinator: the plan, and per rank the indices of its pieces in plan order */
    st_save_plan sp;
    size_t *by_rank, *rank0; /* pieces of rank r: by_rank[rank0[r] .. rank0[r+1]) */
    uint64_t *hashes;        /* per rank: the hash of its local plan (st_plan_hash) */
};

/* Coordinator: each rank's part of c's plan (and c->id), packed in rank order (counts[r]
 * bytes). */
int st_cache_encode(st_plan_cache *c, int P, unsigned char **out, size_t *counts);
/* Every rank: its part, received from the coordinator, into c. */
int st_cache_decode(st_plan_cache *c, const unsigned char *p, size_t n);
/* This rank's save plan from its part of c and its registered state v. */
int st_cache_mine(const st_plan_cache *c, const st_rank_view *v, int me, st_save_plan *out);
/* The checksums this rank computed for its pieces (n of them), in plan order. */
const uint64_t *st_mine_sums(const st_save_plan *mine, size_t *n);
/* The hash of a rank's encoded local plan, world size and chunk: equal means unchanged. */
uint64_t st_plan_hash(const unsigned char *p, size_t n, int P, uint32_t chunk);
/* Coordinator: every rank's st_plan_hash into c->hashes, from the gathered local plans. */
int st_cache_hashes(st_plan_cache *c, const unsigned char *all, const size_t *counts, int P,
                    uint32_t chunk);

/* The plan stored with a checkpoint (plan.bin, docs/FORMAT.md). Rank 0, at the commit of
 * tier dir (before its commit record): writes c's plan, every rank's part with its local
 * plan's hash, tied to the save save_id. */
int st_plan_store(const st_plan_cache *c, const st_vfs *v, const char *dir, uint64_t save_id,
                  int sync);
/* Rank me of P: the plan stored with the committed checkpoint at uri as a cache (*out):
 * rank 0 reads the commit record, the metadata and the whole plan and rebuilds the global
 * plan; every other rank reads its own part alone (three small reads). No collective.
 * Errors: STRATA_ENOENT (no plan.bin: saved in one process, or by an older strata),
 * STRATA_EFORMAT (corrupt, or not the plan of that commit), STRATA_EMISMATCH (another
 * world size), the checkpoint's open errors; *out NULL then. */
int st_plan_adopt(st_plan_cache **out, const char *uri, int me, int P);

/* An incremental distributed save (dist_incr.c): what rank 0 offered and each rank used. */
typedef struct {
    int on;               /* a base or STRATA_SAVE_INCREMENTAL: metadata version 2 */
    char base[STRATA_MAX_NAME + 1]; /* rank 0's name of the base ("" without one) */
    uint64_t base_id;     /* the save every rank matched against (rank 0's base); 0: none */
    st_dir bd;            /* rank 0: the base (open while bd.vfs is set) */
    const st_mshard **cand; /* rank 0: per piece of the plan, its base shard, or NULL */
    unsigned char *matched; /* per piece of this rank's part: 1 if referred to the base,
                               2 if written for base bytes that failed their check */
    size_t nmine;
    int write2;           /* this rank's written shards carry second checksums */
    uint64_t matched_bytes; /* this rank's, referred to instead of written */
    char (*made)[ST_REF_FILE_BYTES]; /* the links this rank made (in every tier) */
    size_t nmade;
} st_dist_incr;

/* After each rank learned its part (mine; rank 0 the plan c): rank 0 opens the base and
 * sends each rank its candidates with the base's checksums (one scatterv); each rank
 * hashes them, links the base's files holding those equal into every destination of d,
 * checks the base is still the save matched, and drops what matched from mine (laid out
 * again). A rank that cannot use the base (a link refused, the base gone or replaced)
 * writes its part in full. A local failure goes to *local_rc (local_msg). Returns the
 * collective's error. */
int st_dist_incr_begin(st_dist_incr *x, strata_comm *comm, const st_dests *d,
                       const strata_save_opts *o, const st_plan_cache *c, st_save_plan *mine,
                       int *local_rc, char *local_msg);
/* This rank's report for the commit: which pieces matched, and the checksums of those it
 * wrote (none unless ok). */
void st_dist_incr_report(const st_dist_incr *x, st_buf *b, const st_save_plan *mine, int ok);
/* Rank 0: the save's metadata, built on a copy of the cached plan c (never changed). */
typedef struct {
    st_save_plan sp;   /* c's plan, but meta: the copy (owned) */
    st_extent **ext;   /* per piece of the plan: its extent in the copy */
    st_mshard **sh;    /* per piece: its shard in the copy (NULL for a blob) */
} st_incr_meta;
int st_incr_meta_new(st_incr_meta *im, const st_plan_cache *c);
/* Takes rank r's report (after its statuses) into im. STRATA_EINVAL naming the rank if it
 * is not the plan's. */
int st_incr_meta_take(st_incr_meta *im, const st_dist_incr *x, const st_plan_cache *c, int r,
                      st_rd *rd);
/* After every report: names the base where a piece refers to it. */
int st_incr_meta_end(st_incr_meta *im, const st_dist_incr *x);
void st_incr_meta_free(st_incr_meta *im);
/* Removes the links this rank made in dir (a failed save's). */
void st_dist_incr_unlink(const st_dist_incr *x, const st_vfs *v, const char *dir);
void st_dist_incr_free(st_dist_incr *x);

/* Every rank's node (dist_node.c), named by its lowest rank: ranks of one host name and boot
 * id share one (for tests, STRATA_LOAD_NODES=k makes k groups of consecutive ranks). One
 * allgather; node has a slot per rank. */
int st_nodes(strata_comm *comm, int *node);
/* The ranks by node for the peer replicas (peer.c): node[r] as st_nodes gives it, lidx[r]
 * r's index among its node's ranks. One allgather; close frees both (closing a zeroed map
 * is a no-op). Errors: those of the allgather, STRATA_ENOMEM. */
typedef struct {
    int *node, *lidx;
} st_node_map;
int st_node_map_open(strata_comm *comm, st_node_map *out);
void st_node_map_close(st_node_map *m);

#endif
