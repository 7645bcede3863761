/* strata_comm.h - communicators: how the ranks of a distributed save or load talk.
 * Included by strata.h. All communication goes through a strata_comm: the single-process
 * default, the caller's own collectives (host callbacks, e.g. torch.distributed from the
 * Python package), or MPI (strata_mpi.h, the separate libstrata_mpi). libstrata itself
 * depends on no MPI. */
#ifndef STRATA_COMM_H_PUBLIC
#define STRATA_COMM_H_PUBLIC

#include "strata_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A communicator is used by one thread at a time, and every rank makes the same sequence
 * of strata calls on it. It holds no engine state: plans are cached by a strata_saver.
 *
 * Background commits. A saver's asynchronous saves commit on a thread of the saver's own
 * (so that a save is committed as soon as every rank has written it, with no call from the
 * caller), over a second communicator made by the dup op below at the saver's first
 * asynchronous save. That thread calls the duplicate's ops while the caller's thread may
 * call the original's (a new save's plan exchange, a load): the duplicate's collectives
 * must be independent of the original's (MPI: MPI_Comm_dup, and MPI_THREAD_MULTIPLE;
 * torch.distributed: a process group of its own) and callable from a thread strata
 * started. Without dup (ops version 1 or 2, or dup NULL), or where it fails on any rank,
 * the commit stays on the caller's thread, in strata_wait_durable (strata_saver_background
 * says which, and why). */
typedef struct strata_comm strata_comm;

#define STRATA_COMM_OPS_VERSION 3
/* Collectives a host provides. Every call is made by all ranks together. Each returns 0,
 * or a negative STRATA_E* code (STRATA_EABORTED when a peer is gone or a time limit
 * passed; strata_error_set gives it a message); after an error the communicator is not
 * used again. Version 1 had the first four fields, version 2 the first five. */
typedef struct strata_comm_ops {
    int version;
    /* Every rank sends n bytes; recv gets size * n bytes, in rank order. */
    int (*allgather)(void *ctx, const void *send, size_t n, void *recv);
    /* Rank r sends scounts[d] bytes to each rank d, packed in rank order in send, and
     * receives rcounts[s] bytes from each rank s, packed in rank order in recv. */
    int (*alltoallv)(void *ctx, const void *send, const size_t *scounts, void *recv,
                     const size_t *rcounts);
    /* root's n bytes of buf are copied to every rank's buf. */
    int (*bcast)(void *ctx, void *buf, size_t n, int root);
    /* version 2: called once by strata_comm_free (may be NULL): releases ctx. */
    void (*destroy)(void *ctx);
    /* version 3 (may be NULL): makes *out, a communicator over the same ranks (same rank
     * and size; strata_comm_host with ops of the host's choice) whose collectives never
     * mix with this one's and may run on another thread at the same time as this one's.
     * A collective: strata calls it on every rank at the same point (a saver's first
     * strata_save_start), on the caller's thread. strata owns *out (strata_comm_free) and
     * uses it from the saver's commit thread only. Returns 0, or a negative code with a
     * message (strata_error_set): the commits then stay on the caller's thread. */
    int (*dup)(void *ctx, strata_comm **out);
} strata_comm_ops;

/* The single-process communicator (rank 0 of 1). */
int strata_comm_self(strata_comm **out);
/* A communicator over the host's own collectives; ops is copied, ctx must outlive the
 * communicator (or is released by ops->destroy). Errors: STRATA_EINVAL, STRATA_ENOMEM; on
 * failure ops->destroy is not called (ctx stays the caller's). The single-process
 * communicator's dup makes another single-process one. */
int strata_comm_host(strata_comm **out, const strata_comm_ops *ops, void *ctx, int rank,
                     int size);
void strata_comm_free(strata_comm *c);
int strata_comm_rank(const strata_comm *c);
int strata_comm_size(const strata_comm *c);
/* Time limit of every collective, for communicators that can keep one (MPI): a peer that
 * does not take part within ms milliseconds (a dead rank) makes the call return
 * STRATA_EABORTED instead of waiting forever. Default 300000 (5 minutes); 0 waits forever. */
void strata_comm_set_timeout(strata_comm *c, int ms);
int strata_comm_timeout(const strata_comm *c);

/* strata_comm_agree's flags. STRATA_AGREE_SAME: where every rank's payload is the same
 * bytes, *out is NULL (one allgather, whatever the payloads' size). */
#define STRATA_AGREE_SAME 1u

/* A step each rank ran on its own, agreed on: the protocol strata runs around its own
 * steps, for the caller's (strata.torch runs it before each save and load). A collective:
 * every rank calls it at the same point, with the same what, inline_bytes and flags.
 * rc: this rank's outcome, 0 or a negative STRATA_E* code whose message is
 * strata_error_last(); payload: its n bytes (not sent where rc is not 0).
 * Where every rank's rc is 0, returns 0 with *out holding every rank's payload in rank
 * order (free it with strata_free; NULL where all are empty, or with STRATA_AGREE_SAME all
 * the same) and lens[r] the length of rank r's (lens: the caller's array of
 * strata_comm_size entries). Else every rank fails: a rank that failed with its own rc and
 * message, the others with the code of the first rank that failed and "<what> failed on
 * rank <r>: <its message>"; a collective that fails, STRATA_EABORTED (a rank that failed
 * keeps its own). One allgather of 24 + inline_bytes bytes a rank where every payload - or
 * every failing rank's message - is at most inline_bytes long, or with STRATA_AGREE_SAME
 * all are the same; else an alltoallv after it carries the ones that are longer. Errors
 * of the arguments: STRATA_EINVAL, before any collective. */
int strata_comm_agree(unsigned char **out, size_t *lens, strata_comm *c, const char *what,
                      int rc, const void *payload, size_t n, size_t inline_bytes,
                      unsigned flags);
/* Frees memory a strata function gave the caller (strata_comm_agree's *out); NULL is
 * ignored. */
void strata_free(void *p);

#ifdef __cplusplus
}
#endif
#endif /* STRATA_COMM_H_PUBLIC */
