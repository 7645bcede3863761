/* comm.h - the communicator behind strata_comm: three host ops (allgather, alltoallv,
 * bcast) and the collectives the engine builds on them. Every helper is a collective:
 * all ranks call it in the same order. A failed op marks the communicator broken; every
 * later call fails fast with STRATA_EABORTED. Not thread-safe. */
#ifndef STRATA_COMM_H
#define STRATA_COMM_H
#include <stddef.h>
#include <stdint.h>

#include "strata_comm.h"

struct strata_comm {
    strata_comm_ops ops;
    void *ctx;
    int rank, size;
    int timeout_ms;
    int broken;
};

/* Every rank sends n bytes; recv holds size * n. */
int st_allgather(strata_comm *c, const void *send, size_t n, void *recv);
/* Variable sizes: *recv (malloc'd) gets every rank's bytes in rank order; counts (size
 * entries, caller's array) each rank's count. */
int st_allgatherv(strata_comm *c, const void *send, size_t n, unsigned char **recv,
                  size_t *counts);
/* Gathers to root: at root *recv (malloc'd) and counts as above; elsewhere *recv = NULL. */
int st_gatherv(strata_comm *c, const void *send, size_t n, int root, unsigned char **recv,
               size_t *counts);
/* root sends counts[d] bytes (packed in rank order in send) to each rank d; every rank
 * gets its part in *recv (malloc'd, *n bytes). counts and send matter at root only. */
int st_scatterv(strata_comm *c, const void *send, const size_t *counts, int root,
                unsigned char **recv, size_t *n);
int st_bcast(strata_comm *c, void *buf, size_t n, int root);
int st_alltoallv(strata_comm *c, const void *send, const size_t *scounts, void *recv,
                 const size_t *rcounts);
/* A second communicator over the same ranks for another thread (the host's dup op; a
 * collective): STRATA_EINVAL where the host has none, else the op's error. */
int st_comm_dup(strata_comm *c, strata_comm **out);
/* AND of every rank's flag. */
int st_all_true(strata_comm *c, int flag, int *all);

#endif
