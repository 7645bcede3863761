/* async.c - lazy asynchronous saving (after DataStates-LLM): the plan is made on the
 * caller's thread; a coordinator thread copies the shards into a bounded pool of reused
 * buffers (the snapshot) while flusher threads write full buffers behind it; the commit
 * follows the last write (a distributed save's commit on its saver's commit thread, or in
 * strata_wait_durable). Threading: the handle's fields after `mu` are guarded by it;
 * pool buffers are owned by one thread at a time (coordinator fills, one flusher writes). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "../io/cuda.h"
#include "../io/bufpool.h"
#include "../io/pool.h"
#include "engine.h"

void (*st_async_test_hook)(strata_pool *pool);

int strata_pool_new(strata_pool **out, uint64_t bytes) { return st_pool_new(out, bytes); }
void strata_pool_free(strata_pool *p) { st_pool_free(p); }
uint64_t strata_pool_bytes(const strata_pool *p) { return st_pool_bytes(p); }

struct strata_handle {
    st_save_plan sp;
    st_io_plan lay;
    int ntiers;
    const st_dests *dst; /* the commit's: backends and directories */
    const st_commit_ops *ops;
    void *ctx;
    st_file **files[ST_MAX_TIERS];
    int tier_rc[ST_MAX_TIERS]; /* guarded by mu, as is tier_msg */
    char tier_msg[ST_MAX_TIERS][ST_ERR_BYTES];
    strata_save_opts o;
    strata_pool *pool;
    int own_pool;  /* made for this save alone: freed with the handle */
    int uses_pool; /* counted in pool->users */
    pthread_t coord;
    pthread_t *flushers;
    int nflush;
    double t0;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int snap_done, durable_done;
    int rc;
    char msg[ST_ERR_BYTES];
    atomic_size_t next_task;               /* the snapshot's next write task to copy */
    size_t *q_task, *q_buf, q_head, q_len; /* ring of full buffers to write */
    int q_closed;
    int copying; /* snapshot threads still copying; the last closes the queue */
    int finished, final_rc; /* the commit's outcome, once known */
    strata_stats stats;
    int no_thread; /* failed before the coordinator started */
    st_committer *q; /* the saver's (referenced), or NULL */
    int bg;          /* the commit runs on q's thread (finish_once there) */
    st_commit_job job;
};

/* Records the first failure of the save (message from this thread); tier >= 0 also
 * abandons that tier, tier -1 stops the whole save. */
static void fail(strata_handle *h, int rc, int tier)
{
    pthread_mutex_lock(&h->mu);
    if (!h->rc) {
        h->rc = rc;
        st_err_keep(h->msg, rc);
    }
    for (int t = 0; t < h->ntiers; t++)
        if ((tier < 0 || t == tier) && !h->tier_rc[t]) {
            h->tier_rc[t] = rc;
            st_err_keep(h->tier_msg[t], rc);
        }
    pthread_mutex_unlock(&h->mu);
}

/* Is every tier abandoned? */
static int all_failed(strata_handle *h)
{
    pthread_mutex_lock(&h->mu);
    int all = 1;
    for (int t = 0; t < h->ntiers; t++)
        all &= h->tier_rc[t] != 0;
    pthread_mutex_unlock(&h->mu);
    return all;
}

static int tier_failed(strata_handle *h, int t)
{
    pthread_mutex_lock(&h->mu);
    int rc = h->tier_rc[t];
    pthread_mutex_unlock(&h->mu);
    return rc;
}

/* Lowers the calling background thread's priority (Linux threads have their own nice
 * values): the coordinator, whose snapshot the caller may wait for, by the save's bg_nice;
 * the flushers, whose writes only have to end before the next save and mostly wait for
 * the disk, to the lowest (19). The training loop keeps its cores; idle cores still run
 * the save at full speed. */
static void bg_nice(const strata_handle *h, int flusher)
{
    int n = h->o.bg_nice ? h->o.bg_nice : 10;
    if (n < 0)
        return;
    id_t tid = (id_t)syscall(SYS_gettid);
    errno = 0;
    int cur = getpriority(PRIO_PROCESS, tid);
    if (cur != -1 || errno == 0)
        setpriority(PRIO_PROCESS, tid, flusher || cur + n > 19 ? 19 : cur + n);
}

static void *flusher(void *arg)
{
    strata_handle *h = arg;
    bg_nice(h, 1);
    for (;;) {
        pthread_mutex_lock(&h->mu);
        while (!h->q_len && !h->q_closed)
            pthread_cond_wait(&h->cv, &h->mu);
        if (!h->q_len) {
            pthread_mutex_unlock(&h->mu);
            return NULL;
        }
        size_t slot = h->q_head;
        size_t task = h->q_task[slot], b = h->q_buf[slot];
        h->q_head = (h->q_head + 1) % st_pool_nbuf(h->pool);
        h->q_len--;
        pthread_mutex_unlock(&h->mu);
        /* the checksums here, not in the snapshot: the caller may be waiting for that */
        st_hash_write(&h->lay, &h->sp, task, st_pool_buf(h->pool, b));
        /* fastest tier first; a tier that failed is abandoned, the others go on */
        const st_io *w = &h->lay.ios[task];
        for (int t = 0; t < h->ntiers; t++) {
            if (tier_failed(h, t))
                continue;
            int rc = st_write_task(h->dst->vfs[t], h->files[t][w->file], h->dst->dir[t],
                                   h->sp.meta->files[w->file].name, w, st_pool_buf(h->pool, b));
            if (rc)
                fail(h, rc, t);
        }
        st_pool_put(h->pool, b);
    }
}

/* Snapshot threads: the coordinator and up to SNAPSHOT_THREADS - 1 more copy write tasks
 * into pool buffers, each taking the next task, and hand them to the flushers. Two copies
 * at once come close to the memory's bandwidth where one thread's memcpy does not (and
 * device copies run on two streams); STRATA_SNAPSHOT_THREADS (1..8) overrides. */
#define SNAPSHOT_THREADS 2

static int snapshot_threads(void)
{
    const char *e = getenv("STRATA_SNAPSHOT_THREADS");
    int n = e ? atoi(e) : SNAPSHOT_THREADS;
    return n < 1 ? 1 : n > 8 ? 8 : n;
}

static void *copier(void *arg)
{
    strata_handle *h = arg;
    for (;;) {
        size_t t = atomic_fetch_add(&h->next_task, 1), b;
        if (t >= h->lay.nios || all_failed(h))
            return NULL;
        int frc = st_pool_get(h->pool, &b);
        if (frc) {
            fail(h, frc, -1);
            return NULL;
        }
        if ((frc = st_fill_write(&h->lay, &h->sp, t, st_pool_buf(h->pool, b), 0))) {
            fail(h, frc, -1);
            st_pool_put(h->pool, b);
            return NULL;
        }
        pthread_mutex_lock(&h->mu);
        size_t slot = (h->q_head + h->q_len) % st_pool_nbuf(h->pool);
        h->q_task[slot] = t;
        h->q_buf[slot] = b;
        h->q_len++;
        pthread_cond_broadcast(&h->cv);
        pthread_mutex_unlock(&h->mu);
    }
}

/* A snapshot thread: copies, then the last one to end marks the snapshot done (the
 * caller's buffers are no longer read) and closes the queue. */
static void *copier_main(void *arg)
{
    strata_handle *h = arg;
    copier(h);
    pthread_mutex_lock(&h->mu);
    if (--h->copying == 0) {
        h->q_closed = 1;
        h->snap_done = 1;
        pthread_cond_broadcast(&h->cv);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* The save no longer uses the pool's buffers (a saver's pool may be made again, or
 * freed with the saver, from now on). */
static void pool_release(strata_handle *h)
{
    if (h->uses_pool)
        st_pool_use(h->pool, -1);
    h->uses_pool = 0;
}

static void set_flag(strata_handle *h, int *flag)
{
    pthread_mutex_lock(&h->mu);
    *flag = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

/* The snapshot starts at once on its own threads; meanwhile this thread prepares the tiers
 * (directories, files, space reserved: a tier in memory allocates its pages there), then
 * starts the flushers, which take the buffers the copiers filled meanwhile. */
static void *coordinator(void *arg)
{
    strata_handle *h = arg;
    if (st_async_test_hook)
        st_async_test_hook(h->pool);
    bg_nice(h, 0);
    int started = 0, rc = 0;
    const st_dests *dst = h->dst;
    for (size_t i = 0; i < h->sp.npieces; i++)
        if (h->sp.pieces[i].device) {
            st_pool_pin(h->pool);
            break;
        }
    pthread_t cp[8];
    int ncopy = 0, want = snapshot_threads();
    pthread_mutex_lock(&h->mu);
    h->copying = want;
    pthread_mutex_unlock(&h->mu);
    for (; ncopy < want; ncopy++) /* at this thread's nice */
        if (pthread_create(&cp[ncopy], NULL, copier_main, h))
            break;
    pthread_mutex_lock(&h->mu);
    h->copying -= want - ncopy; /* the threads that did not start */
    pthread_mutex_unlock(&h->mu);
    for (int t = 0; t < h->ntiers; t++) {
        int trc = h->ops->prepare(h->ctx, t);
        if (!trc && !(h->files[t] = calloc(h->sp.meta->nfiles + 1, sizeof *h->files[t])))
            trc = st_fail(STRATA_ENOMEM, "out of memory");
        if (!trc)
            trc = st_create_data_files(dst->vfs[t], dst->dir[t], &h->sp, ST_DIRECT(&h->o),
                                       h->files[t]);
        if (trc)
            fail(h, trc, t);
    }
    /* flushers even where every tier failed: they give the copiers' buffers back */
    for (int i = 0; i < h->nflush; i++, started++)
        if (pthread_create(&h->flushers[i], NULL, flusher, h))
            break;
    if (!started) {
        rc = st_fail(STRATA_ENOMEM, "cannot start an I/O thread");
        fail(h, rc, -1); /* the copiers stop at their next task */
    }
    if (!ncopy) { /* no snapshot thread: this one copies */
        pthread_mutex_lock(&h->mu);
        h->copying = 1;
        pthread_mutex_unlock(&h->mu);
        copier_main(h);
    }
    if (!started) /* ... and gives back what they filled */
        flusher(h);
    for (int i = 0; i < ncopy; i++)
        pthread_join(cp[i], NULL);
    for (int i = 0; i < started; i++)
        pthread_join(h->flushers[i], NULL);
    /* each tier is done on its own once its copy is complete (a local save commits it) */
    for (int t = 0; t < h->ntiers; t++) {
        int trc = tier_failed(h, t);
        trc = st_finish_data_files(dst->vfs[t], dst->dir[t], &h->sp, h->files[t], ST_SYNC(&h->o),
                                   trc);
        trc = h->ops->tier_done(h->ctx, t, trc, &h->sp);
        if (trc && !tier_failed(h, t))
            fail(h, trc, t);
    }
    pool_release(h); /* before the saver may learn that the save's work ended */
    set_flag(h, &h->durable_done);
    if (h->q && !h->bg)
        st_committer_end(h->q); /* the handle is freed only after this thread is joined */
    return NULL;
}

static void handle_free(strata_handle *h)
{
    st_save_plan_free(&h->sp);
    st_io_plan_free(&h->lay);
    for (int t = 0; t < h->ntiers; t++)
        free(h->files[t]);
    pool_release(h);
    if (h->own_pool)
        strata_pool_free(h->pool);
    h->ops->release(h->ctx);
    st_committer_unref(h->q);
    free(h->flushers);
    free(h->q_task);
    free(h->q_buf);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
}

static void bg_commit(void *arg);

int st_async_start(strata_handle **out, st_save_plan *sp, const strata_save_opts *o,
                   strata_pool **pool_slot, const st_commit_ops *ops, void *ctx, int failed,
                   st_committer *q, int bg)
{
    *out = NULL;
    strata_handle *h = calloc(1, sizeof *h);
    if (!h) {
        st_save_plan_free(sp);
        ops->release(ctx);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    atomic_init(&h->next_task, 0);
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    h->t0 = st_now();
    h->o = *o;
    h->sp = *sp;
    h->ops = ops;
    h->ctx = ctx;
    h->dst = ops->dests(ctx);
    h->ntiers = h->dst->n;
    if (q) { /* the saver counts the save until its background work has ended */
        st_committer_ref(q);
        st_committer_begin(q);
        h->q = q;
        h->bg = bg;
    }
    memset(sp, 0, sizeof *sp);
    uint32_t chunk = o->chunk_bytes;
    int rc = failed;
    strata_pool *pool = pool_slot ? *pool_slot : NULL;
    if (!rc && !pool) { /* lazy: its buffers are allocated by the coordinator */
        rc = st_pool_own(&pool, h->sp.meta->data_bytes, chunk);
        if (!rc && pool_slot)
            *pool_slot = pool; /* the saver's from now on */
        h->own_pool = !rc && !pool_slot;
    }
    h->pool = pool;
    if (!rc && chunk > st_pool_buffer_bytes(pool)) {
        uint64_t fit = ST_ALIGN; /* the largest chunk these buffers hold */
        while (fit * 2 <= st_pool_buffer_bytes(pool))
            fit *= 2;
        rc = st_fail(STRATA_EINVAL, "the pool's buffers (%zu bytes) are smaller than a checksum "
                     "chunk (chunk_bytes %u): use chunk_bytes of at most %llu, or a pool of at "
                     "least %llu bytes (strata_pool_new)", st_pool_buffer_bytes(pool), chunk,
                     (unsigned long long)fit, (unsigned long long)st_pool_bytes_for_chunk(chunk));
    }
    if (!rc) {
        st_pool_use(pool, 1);
        h->uses_pool = 1;
    }
    if (!rc)
        rc = st_layout_writes(&h->lay, &h->sp, st_pool_buffer_bytes(pool));
    h->nflush = st_io_threads(o->io_threads);
    if (!rc) {
        h->flushers = calloc((size_t)h->nflush, sizeof *h->flushers);
        h->q_task = calloc(st_pool_nbuf(pool), sizeof *h->q_task);
        h->q_buf = calloc(st_pool_nbuf(pool), sizeof *h->q_buf);
        if (!h->flushers || !h->q_task || !h->q_buf)
            rc = st_fail(STRATA_ENOMEM, "out of memory");
    }
    if (!rc && pthread_create(&h->coord, NULL, coordinator, h))
        rc = st_fail(STRATA_ENOMEM, "cannot start the save's thread");
    if (rc && ops->collective) {
        /* the rank must still take part in the commit's collectives: the handle carries
         * the failure there */
        fail(h, rc, -1);
        pool_release(h);
        h->snap_done = h->durable_done = 1;
        h->no_thread = 1;
        if (h->q && !h->bg)
            st_committer_end(h->q); /* nothing runs: the commit is wait_durable's */
    }
    if (rc && !ops->collective) {
        if (h->q)
            st_committer_end(h->q);
        handle_free(h);
        return rc;
    }
    if (h->bg) { /* committed on the saver's thread, in start order, once written */
        h->job = (st_commit_job){bg_commit, h, NULL};
        st_committer_push(h->q, &h->job);
    }
    *out = h;
    return 0;
}

static int wait_flag(strata_handle *h, int *flag)
{
    pthread_mutex_lock(&h->mu);
    while (!*flag)
        pthread_cond_wait(&h->cv, &h->mu);
    int rc = h->rc;
    if (rc)
        st_err_restore(rc, h->msg);
    pthread_mutex_unlock(&h->mu);
    return rc;
}

int strata_wait_snapshot(strata_handle *h) { return wait_flag(h, &h->snap_done); }

/* The save's outcome, once its threads are done: the commit hooks' finish (with a
 * communicator, the commit's collective), kept in the handle. Runs once: on the saver's
 * commit thread (bg), else in the first strata_wait_durable. */
static void finish_once(strata_handle *h)
{
    int trc[ST_MAX_TIERS];
    const char *tmsg[ST_MAX_TIERS];
    pthread_mutex_lock(&h->mu); /* the threads are done: a snapshot for form's sake */
    int rc = h->rc;
    for (int t = 0; t < h->ntiers; t++)
        trc[t] = h->tier_rc[t], tmsg[t] = h->tier_msg[t];
    pthread_mutex_unlock(&h->mu);
    strata_stats full = STRATA_STATS_INIT;
    if (h->ops->finish) {
        rc = h->ops->finish(h->ctx, trc, tmsg, &h->sp, h->lay.nios, &full);
    } else if (!rc) {
        st_save_stats(&full, &h->sp, h->lay.nios, h->t0);
    } else if (h->ntiers > 1) { /* say which destination failed (the others committed) */
        int t = 0;
        while (t < h->ntiers - 1 && !trc[t])
            t++;
        st_fail(rc, "destination %d (%s): %s", t, h->dst->uri[t], tmsg[t]);
        pthread_mutex_lock(&h->mu);
        st_err_keep(h->msg, rc);
        pthread_mutex_unlock(&h->mu);
    }
    st_committer *q = h->bg ? h->q : NULL; /* h may be freed once finished is set */
    pthread_mutex_lock(&h->mu);
    if (rc && h->ops->finish) { /* the save's outcome (on every rank) */
        h->rc = rc;
        st_err_keep(h->msg, rc);
    }
    h->final_rc = rc;
    h->stats = full;
    h->finished = 1; /* with bg, the handle may be freed from now on */
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    if (q) /* the save has ended: its saver may go (q lives until this thread is joined) */
        st_committer_end(q);
}

/* The commit thread's job: waits for the save's writes, then commits it. */
static void bg_commit(void *arg)
{
    strata_handle *h = arg;
    wait_flag(h, &h->durable_done);
    finish_once(h);
}

int strata_wait_durable(strata_stats *stats, strata_handle *h)
{
    if (h->bg) {
        wait_flag(h, &h->finished);
    } else {
        wait_flag(h, &h->durable_done);
        if (!h->finished)
            finish_once(h);
    }
    pthread_mutex_lock(&h->mu);
    int rc = h->final_rc;
    if (rc)
        st_err_restore(rc, h->msg);
    else
        st_stats_put(stats, &h->stats);
    pthread_mutex_unlock(&h->mu);
    return rc;
}

int strata_handle_status(const char **msg, strata_handle *h)
{
    pthread_mutex_lock(&h->mu);
    int rc = h->rc;
    if (msg)
        *msg = rc ? h->msg : "";
    pthread_mutex_unlock(&h->mu);
    return rc;
}

int strata_handle_level(const char **msg, strata_handle *h)
{
    if (msg)
        *msg = "";
    if (h->ops->level)
        return h->ops->level(h->ctx, msg);
    pthread_mutex_lock(&h->mu);
    int level = 0;
    for (int t = 0; h->finished && !h->final_rc && t < h->ntiers; t++)
        if (!h->tier_rc[t])
            level |= (t == 0 ? STRATA_LEVEL_LOCAL : 0) |
                     (strncmp(h->dst->uri[t], "mem://", 6) ? STRATA_LEVEL_DURABLE : 0);
    pthread_mutex_unlock(&h->mu);
    return level;
}

int strata_handle_done(strata_handle *h)
{
    pthread_mutex_lock(&h->mu);
    int done = h->bg ? h->finished : h->durable_done;
    pthread_mutex_unlock(&h->mu);
    return done;
}

void strata_handle_free(strata_handle *h)
{
    if (!h)
        return;
    if (h->ops->collective && !h->bg && !h->finished) /* the other ranks wait in the commit */
        strata_wait_durable(NULL, h);
    pthread_mutex_lock(&h->mu);
    while (!(h->bg ? h->finished : h->durable_done))
        pthread_cond_wait(&h->cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
    if (!h->no_thread)
        pthread_join(h->coord, NULL);
    handle_free(h);
}
