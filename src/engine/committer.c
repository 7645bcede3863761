/* committer.c - a saver's background work: the count of its saves in flight (so that the
 * saver can be freed while they run) and, with a communicator that can be duplicated, one
 * thread that runs the commit collectives of its asynchronous saves, in the order they
 * were started, on a communicator of its own. Threading: every field after `mu` is guarded
 * by it; the communicator is used by the thread alone once it started. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "../comm/comm.h"
#include "../core/error.h"
#include "engine.h"

struct st_committer {
    atomic_int refs;
    strata_comm *comm; /* the background communicator, or NULL */
    pthread_t th;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    st_commit_job *head, *tail; /* commits to run, in start order */
    int stop;
    int inflight; /* saves started and not yet ended */
};

int st_committer_new(st_committer **out)
{
    st_committer *q = calloc(1, sizeof *q);
    *out = q;
    if (!q)
        return st_fail(STRATA_ENOMEM, "out of memory");
    atomic_init(&q->refs, 1);
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    return 0;
}

static void *committer_main(void *arg)
{
    st_committer *q = arg;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->head && !q->stop)
            pthread_cond_wait(&q->cv, &q->mu);
        st_commit_job *j = q->head;
        if (!j)
            break; /* stopped with nothing left */
        q->head = j->next;
        if (!q->head)
            q->tail = NULL;
        pthread_mutex_unlock(&q->mu);
        /* the commit; j lives in its save's handle, which may be freed once it ran */
        j->run(j->arg);
        pthread_mutex_lock(&q->mu);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

int st_committer_start(st_committer *q, strata_comm *comm)
{
    q->comm = comm;
    if (pthread_create(&q->th, NULL, committer_main, q)) {
        q->comm = NULL;
        strata_comm_free(comm);
        return st_fail(STRATA_ENOMEM, "cannot start the saver's commit thread");
    }
    q->started = 1;
    return 0;
}

void st_committer_stop(st_committer *q)
{
    if (q->started) {
        pthread_mutex_lock(&q->mu);
        q->stop = 1;
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
        pthread_join(q->th, NULL);
        q->started = q->stop = 0;
    }
    strata_comm_free(q->comm);
    q->comm = NULL;
}

strata_comm *st_committer_comm(const st_committer *q) { return q ? q->comm : NULL; }

void st_committer_ref(st_committer *q) { atomic_fetch_add(&q->refs, 1); }

void st_committer_unref(st_committer *q)
{
    if (!q || atomic_fetch_sub(&q->refs, 1) != 1)
        return;
    /* the last reference: no save is in flight (each holds one), so no job is queued */
    st_committer_stop(q);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q);
}

void st_committer_push(st_committer *q, st_commit_job *j)
{
    j->next = NULL;
    pthread_mutex_lock(&q->mu);
    if (q->tail)
        q->tail->next = j;
    else
        q->head = j;
    q->tail = j;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

void st_committer_begin(st_committer *q)
{
    pthread_mutex_lock(&q->mu);
    q->inflight++;
    pthread_mutex_unlock(&q->mu);
}

void st_committer_end(st_committer *q)
{
    pthread_mutex_lock(&q->mu);
    q->inflight--;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

void st_committer_drain(st_committer *q)
{
    pthread_mutex_lock(&q->mu);
    while (q->inflight > 0)
        pthread_cond_wait(&q->cv, &q->mu);
    pthread_mutex_unlock(&q->mu);
}
