/* peer_rec.h - a node's peer replica record, PEER (docs/FORMAT.md, "Peer replica record"):
 * written by src/engine/peer.c into each node's copy of a checkpoint in its memory tier. */
#ifndef STRATA_PEER_REC_H
#define STRATA_PEER_REC_H
#include <stdint.h>

#include "../core/util.h"
#include "meta.h"

#define PEER_MAGIC "STRATAPR"
#define PEER_VERSION 1u
#define PEER_MAX_BYTES (1u << 26) /* a record: 64 MiB at most (files of 2^24 ranks) */

/* replicas > 0: the files of the `replicas` nodes before it on the ring are held too;
 * k > 0: Reed-Solomon, the node holds its own files and the parity blocks of its group's
 * codewords; neither: a whole copy (a restore's). */
typedef struct st_peer_rec {
    uint64_t save_id, step, block;
    uint32_t nodes, replicas, k, m, node, nfiles, clen;
    unsigned char commit[ST_COMMIT_SIZE];
    unsigned char *held;        /* nfiles bytes: 1 where the copy holds the file whole */
    const unsigned char *owner; /* decoded: nfiles u32 (little-endian), the node (of
                                   `nodes`) that wrote each file */
} st_peer_rec;

/* Appends r's record to b (its checksum last), the files' owners from owner[nfiles]. */
void st_peer_rec_encode(st_buf *b, const st_peer_rec *r, const uint32_t *owner);
/* Decodes and validates n bytes (magic, checksum, version, layout, flags, owners, the
 * commit record and its agreement with the record): 0, or STRATA_EFORMAT /
 * STRATA_ECHECKSUM naming what is wrong. r->held and r->owner point into buf. */
int st_peer_rec_decode(st_peer_rec *r, const unsigned char *buf, size_t n);
/* A parity file's name: "PEER-<j, six or more digits>.par". */
void st_peer_parity_name(char out[40], uint32_t j);

#endif
