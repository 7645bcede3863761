/* peer.h - what peer.c (replicas, restore) and peer_rs.c (Reed-Solomon parity) share: a
 * peer operation's context (the nodes, this node's copy of the checkpoint, its metadata)
 * and the replica record (FORMAT.md, "Peer replica record"). Every function taking a
 * peer_ctx whose comment says so is a collective. */
#ifndef STRATA_PEER_H
#define STRATA_PEER_H
#include <limits.h>

#include "../io/vfs.h"
#include "../meta/meta.h"
#include "../meta/peer_rec.h"
#include "dist.h"

#define HDR 16                    /* a file on the wire: u32 file index, u32 0, u64 bytes */

typedef struct {
    strata_comm *comm;
    const st_vfs *vfs;
    char dir[PATH_MAX];
    int P, me, N;      /* ranks, this rank, nodes */
    st_node_map ns;    /* node[r]: the node's lowest rank; lidx[r] */
    int *ix;           /* per rank: its node's index 0..N-1 (nodes by lowest rank) */
    int *lead, *nloc;  /* per node index: its lowest rank, its ranks */
    unsigned char *mbuf, *cbuf; /* metadata.bin and the commit record */
    size_t mlen, clen;
    st_meta *meta;
    st_commit cr;
} peer_ctx;

typedef st_peer_rec peer_rec;

/* This node's copy (peer_io.c): a file's path in it (STRATA_EINVAL if too long); its files
 * read whole, written (atomic: name.tmp and a rename). */
int st_peer_path(const peer_ctx *c, const char *name, char *out);
int st_peer_read(const peer_ctx *c, const char *name, size_t max, unsigned char **out,
                 size_t *len);
int st_peer_write(const peer_ctx *c, const char *name, const void *buf, size_t n, int atomic);
/* Reads the file name, which must have exactly n bytes, into buf. */
int st_peer_read_into(const peer_ctx *c, const char *name, void *buf, size_t n);
/* Every rank's outcome agreed on (a collective): 0, or the first failure's. */
int st_peer_agree(strata_comm *comm, const char *what, int rc);

/* A peer operation cut into steps (its state s, shared by them): run does a step's work
 * and sets *local, this rank's outcome; it returns a failure that ends the operation where
 * it stands (a failed collective, or one rank's that the others time out on). Where agree
 * names the step, every rank then agrees on the outcomes (st_peer_agree); where it is NULL,
 * a failed outcome ends the steps, for the caller to agree on. A step runs where `when` is
 * NULL or says so (the same on every rank). The steps do the work, st_peer_steps (a
 * collective) holds the agreements: DCP's _DistWrapper's shape. */
typedef struct {
    int (*run)(void *s, int *local);
    const char *agree;
    int (*when)(const void *s);
} st_peer_step;
/* Runs steps[0..n) in order; 0 with *local set where a step without agreement failed. */
int st_peer_steps(strata_comm *comm, const st_peer_step *steps, size_t n, void *s, int *local);

/* Reed-Solomon (peer_rs.c; STRATA_ENOTSUP without ISA-L). The nodes in groups of k + m
 * consecutive ones (N a multiple of k + m); owner[f]: the node of each file. Encode (a
 * collective; node leaders do the work): each group's n = k + m codewords of k data
 * blocks (a node's files, concatenated and cut into k blocks of *block bytes) and m
 * parity blocks; this node's parity files written. *local: this rank's outcome. */
int st_peer_rs_encode(peer_ctx *c, int k, int m, const uint32_t *owner, uint64_t *block,
                      uint64_t *sent, int *local);
/* Restore (a collective): the old nodes of an RS save that no surviving copy holds
 * (old[i]: the new node holding old node i's copy, or -1) decoded from their groups'
 * survivors, each at the first survivor of its group, whose copy then holds its files:
 * holds[new node * nfiles + f] set. STRATA_ENOREPLICA where a group lost more than m. */
int st_peer_rs_rebuild(peer_ctx *c, const peer_rec *r, const int *old, unsigned char *holds,
                       uint64_t *sent, uint64_t *got, int *local);

#endif
