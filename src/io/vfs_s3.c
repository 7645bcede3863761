/* vfs_s3.c - the s3:// backend (docs/FORMAT.md, "Ownership on S3"): objects under
 * s3://bucket/prefix seen as files in directories. A file written is a multipart upload
 * (parts uploaded by the writing threads, straight from their buffers when a write covers
 * a whole part, completed at sync or close, aborted on failure); a file read is ranged GETs
 * of exactly what is asked, pinned to the object's ETag. There is no rename: a "*.tmp"
 * file (the commit's metadata.bin.tmp, COMMIT.tmp) is kept in memory when closed and PUT
 * under its new name by the rename, with If-None-Match: * (so the commit record is created
 * once, by one save); any other rename copies the object. A lock is a lease: the LOCK
 * object created with If-None-Match: *, renewed by a thread while held, free to take once
 * it is older than the lease ($STRATA_S3_LEASE_S, default 60 s). Paths are the URIs
 * themselves ("s3://bucket/prefix/name"). Built only with libcurl (ST_HAVE_CURL). */
#include "vfs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"

#ifndef ST_HAVE_CURL
int st_vfs_s3_resolve(const char *uri, const st_vfs **vfs, char *path_out, size_t cap)
{
    (void)vfs, (void)path_out, (void)cap;
    return st_fail(STRATA_ENOTSUP,
                   "'%s': this libstrata was built without libcurl, which s3:// needs: "
                   "install libcurl4-openssl-dev (make deps) and rebuild",
                   uri);
}
#else
#include <pthread.h>
#include <stdatomic.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "../core/checksum.h"
#include "../core/util.h"
#include "pool.h"
#include "s3_http.h"

#define MIB (1024ull * 1024)
#define MAX_PARTS 10000

/* A "<name>.tmp" file written and closed: kept here, not uploaded, until it is renamed (the
 * commit's metadata.bin and COMMIT: created under their names directly, from these bytes). */
typedef struct held {
    struct held *next;
    char *path, *buf;
    size_t len;
} held;

typedef struct {
    st_vfs base;
    s3_conn *conn;
    char root[300]; /* "s3://bucket" */
    uint64_t part;  /* part size */
    uint64_t copy_max; /* the largest object copied by one CopyObject (s3_link) */
    int conn_ok;       /* the bucket answered (else the shared connection rechecks it) */
    int lease_s;
    pthread_mutex_t mu; /* held */
    held *held;
} s3_vfs;

typedef struct part {
    char *buf;      /* staged bytes of a part written piecewise, or NULL */
    uint64_t filled;
    int done;       /* uploaded */
    char etag[128];
} part;

typedef struct {
    st_file base;
    char key[1024];
    int write, lock;
    int hold; /* a "*.tmp" file: its bytes kept in memory (buf) for the rename */
    char *buf;
    /* reading */
    uint64_t size;
    int64_t mtime;
    char etag[128];
    /* writing */
    pthread_mutex_t mu;
    part *parts;
    uint32_t nparts;
    char upload[512]; /* multipart upload id, "" until the first part goes */
    int failed, finished;
    /* a lock: its lease renewed by a thread until closed */
    pthread_t renewer;
    pthread_cond_t cv;
    int stop, renewing;
    char body[160];
} s3_file;

#define SV(v) ((s3_vfs *)(v))
#define SF(f) ((s3_file *)(f))
#define CONN(f) (SV((f)->vfs)->conn)

/* The key of a path "s3://bucket/key" of this backend; NULL for another bucket. */
static const char *key_of(const st_vfs *v, const char *path)
{
    size_t n = strlen(SV(v)->root);
    if (strncmp(path, SV(v)->root, n) != 0 || (path[n] && path[n] != '/'))
        return NULL;
    return path[n] ? path + n + 1 : "";
}

static int head(const st_vfs *v, const char *key, s3_resp *r)
{
    s3_req q = {.method = "HEAD", .key = key};
    int e = s3_do(SV(v)->conn, &q, r);
    return e ? e : s3_status_errno(r->status);
}

/* 1 if some key starts with prefix "key/", 0 if none, or -errno. */
static int has_children(const st_vfs *v, const char *key)
{
    char q[1200] = "list-type=2&max-keys=1&prefix=", pre[1100];
    snprintf(pre, sizeof pre, "%s%s", key, *key ? "/" : "");
    int e = s3_uri_encode(q, sizeof q, pre, 0);
    s3_resp r;
    s3_req rq = {.method = "GET", .key = "", .query = q};
    if (e || (e = s3_do(SV(v)->conn, &rq, &r)))
        return e;
    e = s3_status_errno(r.status);
    if (!e)
        e = r.body && strstr(r.body, "<Key>") ? 1 : 0;
    s3_resp_free(&r);
    return e;
}

/* ---- writing: multipart uploads ---- */

static int put_simple(s3_conn *c, const char *key, const void *buf, size_t n, const char *hdr,
                      s3_resp *out)
{
    s3_req q = {.method = "PUT", .key = key, .hdr = {hdr}, .body = buf, .blen = n};
    s3_resp r;
    int e = s3_do(c, &q, &r);
    if (!e)
        e = s3_status_errno(r.status);
    if (out)
        *out = r;
    else
        s3_resp_free(&r);
    return e;
}

/* PUTs buf as key only if there is no such object (If-None-Match: *); -EEXIST when there is,
 * unless it holds these very bytes (put by an attempt whose answer was lost: curl itself
 * resends a request whose reused connection died, so the attempts cannot tell). The
 * object's ETag into etag (if not NULL: 128 bytes). */
static int put_new(const st_vfs *v, const char *key, const void *buf, size_t n, char *etag)
{
    s3_resp r;
    int e = put_simple(SV(v)->conn, key, buf ? buf : "", n, "If-None-Match: *", &r);
    if (e == -EEXIST) {
        s3_resp_free(&r);
        s3_req g = {.method = "GET", .key = key};
        if (s3_do(SV(v)->conn, &g, &r) == 0 && r.status == 200 && r.len == n &&
            (n == 0 || memcmp(r.body, buf, n) == 0))
            e = 0;
    }
    if (!e && etag)
        snprintf(etag, sizeof r.etag, "%s", r.etag);
    s3_resp_free(&r);
    return e;
}

static int start_upload(s3_file *f)
{
    s3_req q = {.method = "POST", .key = f->key, .query = "uploads="};
    s3_resp r;
    int e = s3_do(CONN(&f->base), &q, &r);
    if (!e && !(e = s3_status_errno(r.status))) {
        const char *pos = NULL;
        if (!r.body || s3_xml_next(r.body, &pos, "UploadId", f->upload, sizeof f->upload))
            e = -EIO;
    }
    s3_resp_free(&r);
    return e;
}

static int upload_part(s3_file *f, uint32_t i, const void *buf, size_t n, char *etag)
{
    char q[700];
    snprintf(q, sizeof q, "partNumber=%u&uploadId=", i + 1);
    int e = s3_uri_encode(q, sizeof q, f->upload, 0);
    s3_req rq = {.method = "PUT", .key = f->key, .query = q, .body = buf, .blen = n};
    s3_resp r;
    if (e || (e = s3_do(CONN(&f->base), &rq, &r)))
        return e ? e : -EIO;
    if (!(e = s3_status_errno(r.status)))
        snprintf(etag, 128, "%s", r.etag);
    s3_resp_free(&r);
    return e;
}

static uint64_t part_len(const s3_file *f, uint32_t i)
{
    uint64_t p = SV(f->base.vfs)->part, end = (uint64_t)(i + 1) * p;
    return (end > f->size ? f->size : end) - (uint64_t)i * p;
}

/* Makes room for parts [0, n); the file's size grows to at least `size`. Under f->mu. */
static int grow(s3_file *f, uint64_t size)
{
    uint64_t p = SV(f->base.vfs)->part, n = (size + p - 1) / p;
    if (n > MAX_PARTS)
        return -EFBIG;
    if (n > f->nparts) {
        part *np = realloc(f->parts, n * sizeof *np);
        if (!np)
            return -ENOMEM;
        memset(np + f->nparts, 0, (n - f->nparts) * sizeof *np);
        f->parts = np;
        f->nparts = (uint32_t)n;
    }
    if (size > f->size)
        f->size = size;
    return 0;
}

/* A part's staging buffer (huge pages where large: it is copied into and sent from), zeroed:
 * bytes never written are the gaps of a data file. Freed with part_free. */
static char *part_alloc(uint64_t p)
{
    char *b = st_io_alloc((size_t)p);
    if (b)
        memset(b, 0, (size_t)p);
    return b;
}

static void part_free(s3_file *f, char *b) { st_io_free(b, (size_t)SV(f->base.vfs)->part); }

/* Uploads part i from buf (the caller's or its staging buffer); the upload is started if
 * it is the first part. Not under f->mu but for the start. */
static int send_part(s3_file *f, uint32_t i, const void *buf, size_t n)
{
    pthread_mutex_lock(&f->mu);
    int e = f->upload[0] ? 0 : start_upload(f);
    pthread_mutex_unlock(&f->mu);
    char etag[128];
    if (!e)
        e = upload_part(f, i, buf, n, etag);
    pthread_mutex_lock(&f->mu);
    if (e)
        f->failed = e;
    else {
        snprintf(f->parts[i].etag, sizeof f->parts[i].etag, "%s", etag);
        f->parts[i].done = 1;
    }
    pthread_mutex_unlock(&f->mu);
    return e;
}

static int64_t s3_pwrite(st_file *base, const void *buf, size_t n, uint64_t off)
{
    s3_file *f = SF(base);
    uint64_t p = SV(base->vfs)->part;
    const char *src = buf;
    pthread_mutex_lock(&f->mu);
    int e = f->failed ? f->failed : f->finished ? -EBADF : 0;
    if (!e && f->hold) { /* in memory until renamed */
        if (off + n > f->size) {
            char *nb = off + n > ((uint64_t)1 << 34) ? NULL : realloc(f->buf, off + n);
            if (!nb)
                e = -EFBIG;
            else {
                memset(nb + f->size, 0, off + n - f->size);
                f->buf = nb;
                f->size = off + n;
            }
        }
        if (!e)
            memcpy(f->buf + off, buf, n);
        pthread_mutex_unlock(&f->mu);
        return e ? e : (int64_t)n;
    }
    if (!e)
        e = grow(f, off + n);
    pthread_mutex_unlock(&f->mu);
    for (uint64_t at = off; !e && at < off + n;) {
        uint32_t i = (uint32_t)(at / p);
        uint64_t pstart = (uint64_t)i * p, in = at - pstart;
        uint64_t k = p - in < off + n - at ? p - in : off + n - at;
        if (in == 0 && k == p) { /* a whole part: straight from the caller's buffer */
            e = send_part(f, i, src + (at - off), (size_t)k);
        } else {
            char *full = NULL;
            pthread_mutex_lock(&f->mu);
            part *pt = &f->parts[i];
            if (!pt->buf && !(pt->buf = part_alloc(p)))
                e = -ENOMEM;
            if (!e) {
                memcpy(pt->buf + in, src + (at - off), k);
                pt->filled += k;
                if (pt->filled >= p) { /* every byte of it written: it goes now */
                    full = pt->buf;
                    pt->buf = NULL;
                }
            }
            pthread_mutex_unlock(&f->mu);
            if (full) {
                e = send_part(f, i, full, (size_t)p);
                part_free(f, full);
            }
        }
        at += k;
    }
    return e ? e : (int64_t)n;
}

static int abort_upload(s3_conn *c, const char *key, const char *id)
{
    char q[700] = "uploadId=";
    int e = s3_uri_encode(q, sizeof q, id, 0);
    s3_req rq = {.method = "DELETE", .key = key, .query = q};
    s3_resp r;
    if (!e && !(e = s3_do(c, &rq, &r))) {
        e = r.status == 404 ? 0 : s3_status_errno(r.status);
        s3_resp_free(&r);
    }
    return e;
}

static int complete_upload(s3_file *f)
{
    size_t cap = 128 + (size_t)f->nparts * 200, n = 0;
    char *x = malloc(cap);
    if (!x)
        return -ENOMEM;
    n += (size_t)snprintf(x, cap, "<CompleteMultipartUpload>");
    for (uint32_t i = 0; i < f->nparts; i++)
        n += (size_t)snprintf(x + n, cap - n, "<Part><PartNumber>%u</PartNumber><ETag>%s</ETag></Part>",
                              i + 1, f->parts[i].etag);
    n += (size_t)snprintf(x + n, cap - n, "</CompleteMultipartUpload>");
    char q[700] = "uploadId=";
    int e = s3_uri_encode(q, sizeof q, f->upload, 0);
    s3_req rq = {.method = "POST", .key = f->key, .query = q, .body = x, .blen = n};
    s3_resp r;
    if (!e && !(e = s3_do(CONN(&f->base), &rq, &r))) {
        e = s3_status_errno(r.status);
        if (!e && r.body && strstr(r.body, "<Error>")) /* S3 may fail it inside a 200 */
            e = -EIO;
        if (e == -ENOENT) { /* done by an attempt whose answer was lost? */
            s3_resp h;
            e = head(f->base.vfs, f->key, &h);
            s3_resp_free(&h);
        }
        s3_resp_free(&r);
    }
    free(x);
    return e;
}

/* Sends what is left and completes the upload (or PUTs a file of one part). */
static int finish(s3_file *f)
{
    if (f->finished || f->failed)
        return f->failed;
    int e = 0;
    if (!f->upload[0] && f->nparts <= 1) { /* small: one PUT */
        if (f->nparts && !f->parts[0].buf && !(f->parts[0].buf = part_alloc(SV(f->base.vfs)->part)))
            e = -ENOMEM; /* sized, never written: zeros */
        if (!e)
            e = put_simple(CONN(&f->base), f->key, f->nparts ? f->parts[0].buf : "",
                           (size_t)f->size, NULL, NULL);
    } else {
        for (uint32_t i = 0; i < f->nparts && !e; i++) {
            if (f->parts[i].done)
                continue;
            char *b = f->parts[i].buf;
            if (!b && !(b = f->parts[i].buf = part_alloc(SV(f->base.vfs)->part)))
                e = -ENOMEM; /* never written: zeros (the gaps of a data file) */
            else
                e = send_part(f, i, b, (size_t)part_len(f, i));
        }
        if (!e)
            e = complete_upload(f);
    }
    if (e)
        f->failed = e;
    f->finished = 1;
    return e;
}

/* ---- leases (LOCK objects) ---- */

static void *renew_main(void *arg)
{
    s3_file *f = arg;
    s3_vfs *v = SV(f->base.vfs);
    pthread_mutex_lock(&f->mu);
    while (!f->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += v->lease_s / 3 > 0 ? v->lease_s / 3 : 1;
        pthread_cond_timedwait(&f->cv, &f->mu, &ts);
        if (f->stop)
            break;
        char hdr[200];
        snprintf(hdr, sizeof hdr, "If-Match: %s", f->etag);
        pthread_mutex_unlock(&f->mu);
        /* the same bytes: a new Last-Modified, the same ETag; refused if it is not ours */
        put_simple(v->conn, f->key, f->body, strlen(f->body), hdr, NULL);
        pthread_mutex_lock(&f->mu);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

static int s3_lock(const st_vfs *v, const char *path, st_file **out)
{
    const char *key = key_of(v, path);
    if (!key)
        return -EXDEV;
    s3_file *f = calloc(1, sizeof *f);
    if (!f)
        return -ENOMEM;
    f->base.vfs = v;
    f->lock = 1;
    snprintf(f->key, sizeof f->key, "%s", key);
    uint64_t tok[2] = {0, 0};
    if (getrandom(tok, sizeof tok, 0) != (ssize_t)sizeof tok)
        tok[0] = st_mix64((uint64_t)time(NULL) ^ (uint64_t)getpid() << 20);
    char host[64] = "";
    gethostname(host, sizeof host - 1);
    snprintf(f->body, sizeof f->body, "strata lease %016llx%016llx host %s pid %d\n",
             (unsigned long long)tok[0], (unsigned long long)tok[1], host, (int)getpid());
    int e = -EBUSY;
    for (int tries = 0; tries < 2 && e == -EBUSY; tries++) {
        s3_resp r;
        e = put_new(v, key, f->body, strlen(f->body), f->etag);
        if (e == -EEXIST) { /* held, or a dead owner's: free once older than the lease */
            e = head(v, key, &r);
            s3_resp_free(&r);
            if (e == -ENOENT) {
                e = -EBUSY; /* let go meanwhile: try again */
            } else if (!e && r.mtime >= 0 && /* by the server's clock: no skew */
                       (r.date >= 0 ? r.date : (int64_t)time(NULL)) - r.mtime > SV(v)->lease_s) {
                char hdr[200];
                snprintf(hdr, sizeof hdr, "If-Match: %s", r.etag);
                s3_req d = {.method = "DELETE", .key = key, .hdr = {hdr}};
                if (s3_do(SV(v)->conn, &d, &r) == 0)
                    s3_resp_free(&r);
                e = -EBUSY;
            } else if (!e) {
                e = -EBUSY;
                break;
            }
        }
    }
    if (!e) {
        pthread_mutex_init(&f->mu, NULL);
        pthread_cond_init(&f->cv, NULL);
        f->renewing = pthread_create(&f->renewer, NULL, renew_main, f) == 0;
        *out = &f->base;
        return 0;
    }
    free(f);
    return e;
}

static void unlock(s3_file *f)
{
    if (f->renewing) {
        pthread_mutex_lock(&f->mu);
        f->stop = 1;
        pthread_cond_signal(&f->cv);
        pthread_mutex_unlock(&f->mu);
        pthread_join(f->renewer, NULL);
    }
    char hdr[200];
    snprintf(hdr, sizeof hdr, "If-Match: %s", f->etag); /* only ours (it may be gone) */
    s3_req d = {.method = "DELETE", .key = f->key, .hdr = {hdr}};
    s3_resp r;
    if (s3_do(CONN(&f->base), &d, &r) == 0)
        s3_resp_free(&r);
    pthread_cond_destroy(&f->cv);
}

/* Takes the held file at path out of the list (NULL if none). */
static held *take_held(s3_vfs *v, const char *path)
{
    pthread_mutex_lock(&v->mu);
    held **pp = &v->held, *h;
    while ((h = *pp) && strcmp(h->path, path) != 0)
        pp = &h->next;
    if (h)
        *pp = h->next;
    pthread_mutex_unlock(&v->mu);
    return h;
}

static void free_held(held *h)
{
    if (h) {
        free(h->path);
        free(h->buf);
        free(h);
    }
}

static int forget_held(s3_vfs *v, const char *path)
{
    held *h = take_held(v, path);
    free_held(h);
    return h != NULL;
}

/* ---- files ---- */

static int s3_open(const st_vfs *v, const char *path, int flags, st_file **out)
{
    const char *key = key_of(v, path);
    if (!key || !*key)
        return key ? -EISDIR : -EXDEV;
    s3_file *f = calloc(1, sizeof *f);
    if (!f)
        return -ENOMEM;
    f->base.vfs = v;
    snprintf(f->key, sizeof f->key, "%s", key);
    if (flags & ST_O_WRITE) {
        size_t kn = strlen(key);
        f->write = 1;
        f->hold = kn > 4 && strcmp(key + kn - 4, ".tmp") == 0;
    } else {
        s3_resp r;
        int e = head(v, key, &r);
        s3_resp_free(&r);
        if (e) {
            free(f);
            return e;
        }
        f->size = r.length;
        f->mtime = r.mtime;
        snprintf(f->etag, sizeof f->etag, "%s", r.etag);
    }
    pthread_mutex_init(&f->mu, NULL);
    *out = &f->base;
    return 0;
}

static int64_t s3_pread(st_file *base, void *buf, size_t n, uint64_t off)
{
    s3_file *f = SF(base);
    if (f->write)
        return -EBADF;
    if (off >= f->size || n == 0)
        return 0;
    if (n > f->size - off)
        n = (size_t)(f->size - off);
    char range[80], match[160];
    snprintf(range, sizeof range, "Range: bytes=%llu-%llu", (unsigned long long)off,
             (unsigned long long)(off + n - 1));
    snprintf(match, sizeof match, "If-Match: %s", f->etag); /* the object opened, no other */
    s3_req q = {.method = "GET", .key = f->key, .hdr = {range, match}, .out = buf, .out_cap = n};
    s3_resp r;
    int e = s3_do(CONN(base), &q, &r);
    if (!e)
        e = r.status == 412 ? -ESTALE : s3_status_errno(r.status);
    s3_resp_free(&r);
    if (e)
        return e;
    return r.len ? (int64_t)r.len : -EIO;
}

static int s3_sync(st_file *base)
{
    s3_file *f = SF(base);
    if (!f->write || f->hold) /* a held file is made durable by its rename */
        return 0;
    pthread_mutex_lock(&f->mu);
    int failed = f->failed, fin = f->finished;
    pthread_mutex_unlock(&f->mu);
    return fin || failed ? failed : finish(f);
}

static int s3_size(st_file *f, uint64_t *out)
{
    *out = SF(f)->size;
    return 0;
}

static int s3_truncate(st_file *base, uint64_t size)
{
    s3_file *f = SF(base);
    if (f->hold)
        return -EOPNOTSUPP;
    pthread_mutex_lock(&f->mu);
    int e = size < f->size ? -EOPNOTSUPP : grow(f, size);
    pthread_mutex_unlock(&f->mu);
    return e;
}

static int s3_allocate(st_file *base, uint64_t size) { return s3_truncate(base, size); }

static int s3_close(st_file *base)
{
    s3_file *f = SF(base);
    int e = 0;
    if (f->lock) {
        unlock(f);
    } else if (f->hold) { /* kept for the rename (an earlier one of that name replaced) */
        s3_vfs *v = SV(base->vfs);
        held *h = calloc(1, sizeof *h);
        char full[1400];
        snprintf(full, sizeof full, "%s/%s", v->root, f->key);
        if (!h || !(h->path = strdup(full))) {
            free(h);
            e = -ENOMEM;
        } else {
            h->buf = f->buf;
            h->len = (size_t)f->size;
            f->buf = NULL;
            forget_held(v, full);
            pthread_mutex_lock(&v->mu);
            h->next = v->held;
            v->held = h;
            pthread_mutex_unlock(&v->mu);
        }
    } else if (f->write && !f->finished && !f->failed) {
        e = finish(f);
    }
    free(f->buf);
    if (f->write && f->upload[0] && f->failed) /* nothing half-made stays behind */
        abort_upload(CONN(base), f->key, f->upload);
    for (uint32_t i = 0; i < f->nparts; i++)
        part_free(f, f->parts[i].buf);
    free(f->parts);
    pthread_mutex_destroy(&f->mu);
    free(f);
    return e;
}

static int s3_direct(st_file *f)
{
    (void)f;
    return 0;
}

static int s3_undirect(st_file *f)
{
    (void)f;
    return 0;
}

static int s3_ident(st_file *base, st_file_id *out)
{
    s3_file *f = SF(base);
    uint64_t ns = f->mtime >= 0 ? (uint64_t)f->mtime * 1000000000ull : 0;
    *out = (st_file_id){0, st_hash(f->key, strlen(f->key)), f->size, ns,
                        st_hash(f->etag, strlen(f->etag))};
    return 0;
}

/* ---- names ---- */

static int s3_stat(const st_vfs *v, const char *path, uint64_t *size, int *kind)
{
    const char *key = key_of(v, path);
    if (!key) { /* above the bucket ("s3:", "s3:/"): a directory, as the parents of a path */
        if (kind)
            *kind = 1;
        return 0;
    }
    int k = 1, e = 0;
    uint64_t sz = 0;
    if (*key) {
        s3_resp r;
        e = head(v, key, &r);
        s3_resp_free(&r);
        if (!e) {
            k = 0;
            sz = r.length;
        } else if (e == -ENOENT) {
            e = has_children(v, key);
            e = e == 1 ? 0 : e == 0 ? -ENOENT : e;
        }
    }
    if (e)
        return e;
    if (size)
        *size = sz;
    if (kind)
        *kind = k;
    return 0;
}

static int s3_mtime(const st_vfs *v, const char *path, uint64_t *ns)
{
    const char *key = key_of(v, path);
    if (!key || !*key)
        return -EISDIR;
    s3_resp r;
    int e = head(v, key, &r);
    s3_resp_free(&r);
    if (!e && r.mtime < 0)
        e = -EIO;
    if (!e)
        *ns = (uint64_t)r.mtime * 1000000000ull;
    return e;
}

static int s3_mkdir(const st_vfs *v, const char *path)
{
    int kind, e = s3_stat(v, path, NULL, &kind);
    return e == 0 ? -EEXIST : e == -ENOENT ? 0 : e; /* no directories: a prefix is made by its files */
}

static int s3_sync_dir(const st_vfs *v, const char *path)
{
    (void)v, (void)path;
    return 0;
}

static int s3_unlink(const st_vfs *v, const char *path)
{
    const char *key = key_of(v, path);
    if (!key || !*key)
        return -EISDIR;
    if (forget_held(SV(v), path))
        return 0; /* never uploaded */
    s3_req d = {.method = "DELETE", .key = key};
    s3_resp r;
    int e = s3_do(SV(v)->conn, &d, &r);
    if (!e) {
        e = s3_status_errno(r.status);
        s3_resp_free(&r);
    }
    return e;
}

/* Aborts the multipart uploads of the files directly in directory key (left by saves that
 * died; only their owner writes there, and whoever calls this owns it). */
static void abort_dead_uploads(const st_vfs *v, const char *key)
{
    char q[1400] = "prefix=", pre[1100];
    snprintf(pre, sizeof pre, "%s/", key);
    if (s3_uri_encode(q, sizeof q, pre, 0))
        return;
    size_t qn = strlen(q);
    snprintf(q + qn, sizeof q - qn, "&uploads=");
    s3_req rq = {.method = "GET", .key = "", .query = q};
    s3_resp r;
    if (s3_do(SV(v)->conn, &rq, &r))
        return;
    char k[1100], id[512];
    for (const char *u = r.status == 200 && r.body ? strstr(r.body, "<Upload>") : NULL; u;
         u = strstr(u + 1, "<Upload>")) { /* Key and UploadId in either order */
        const char *end = strstr(u, "</Upload>"), *p1 = u, *p2 = u;
        if (end && s3_xml_next(r.body, &p1, "Key", k, sizeof k) == 0 && p1 <= end &&
            s3_xml_next(r.body, &p2, "UploadId", id, sizeof id) == 0 && p2 <= end &&
            !strchr(k + strlen(pre), '/'))
            abort_upload(SV(v)->conn, k, id);
    }
    s3_resp_free(&r);
}

static int s3_rmdir(const st_vfs *v, const char *path)
{
    const char *key = key_of(v, path);
    if (!key || !*key)
        return -EBUSY;
    int e = has_children(v, key);
    if (e == 1)
        return -ENOTEMPTY;
    if (e == 0)
        abort_dead_uploads(v, key);
    return e;
}

/* Copies the object `from` to `to`, created only if there is none (If-None-Match: *), then
 * removes `from`. -EEXIST when `to` exists, unless it holds these very bytes (put by an
 * attempt whose answer was lost; a commit record carries its save's random id). */
static int s3_rename(const st_vfs *v, const char *from, const char *to)
{
    const char *kf = key_of(v, from), *kt = key_of(v, to);
    if (!kf || !kt || !*kf || !*kt)
        return -EXDEV;
    held *h = take_held(SV(v), from);
    if (h) { /* written here, kept in memory: put under its name at once */
        int e = put_new(v, kt, h->buf, h->len, NULL);
        free_held(h);
        return e;
    }
    s3_req g = {.method = "GET", .key = kf};
    s3_resp r;
    int e = s3_do(SV(v)->conn, &g, &r);
    if (!e)
        e = s3_status_errno(r.status);
    if (!e)
        e = put_new(v, kt, r.body, r.len, NULL);
    s3_resp_free(&r);
    if (!e)
        s3_unlink(v, from);
    return e;
}

/* The headers of a server-side copy of key `from` (pinned to its ETag) into hdr[0..1]. */
static int copy_source(const st_vfs *v, const char *from, const char *etag, char *src,
                       size_t cap, char *match, size_t mcap)
{
    snprintf(src, cap, "x-amz-copy-source: /%s/", SV(v)->root + 5);
    snprintf(match, mcap, "x-amz-copy-source-if-match: %s", etag);
    return s3_uri_encode(src, cap, from, 1);
}

/* A copy of more than one CopyObject may make (5 GiB): a multipart upload of parts copied
 * by the server (UploadPartCopy), aborted on failure. */
static int copy_parts(const st_vfs *v, const char *kt, const char *src, const char *match,
                      uint64_t size)
{
    s3_file f = {.base.vfs = v, .write = 1, .size = size};
    uint64_t p = SV(v)->part;
    while ((size + p - 1) / p > MAX_PARTS)
        p *= 2;
    f.nparts = (uint32_t)((size + p - 1) / p);
    snprintf(f.key, sizeof f.key, "%s", kt);
    if (!(f.parts = calloc(f.nparts, sizeof *f.parts)))
        return -ENOMEM;
    int e = start_upload(&f);
    for (uint32_t i = 0; !e && i < f.nparts; i++) {
        char q[700], range[100];
        uint64_t a = (uint64_t)i * p, b = a + p < size ? a + p : size;
        snprintf(q, sizeof q, "partNumber=%u&uploadId=", i + 1);
        snprintf(range, sizeof range, "x-amz-copy-source-range: bytes=%llu-%llu",
                 (unsigned long long)a, (unsigned long long)(b - 1));
        s3_req rq = {.method = "PUT", .key = kt, .query = q, .hdr = {src, match, range}};
        s3_resp r;
        if ((e = s3_uri_encode(q, sizeof q, f.upload, 0)) || (e = s3_do(CONN(&f.base), &rq, &r)))
            break;
        const char *pos = NULL;
        if (!(e = s3_status_errno(r.status)) &&
            (!r.body || s3_xml_next(r.body, &pos, "ETag", f.parts[i].etag, sizeof f.parts[i].etag)))
            e = -EIO;
        s3_resp_free(&r);
    }
    if (!e)
        e = complete_upload(&f);
    if (e && f.upload[0])
        abort_upload(CONN(&f.base), kt, f.upload);
    free(f.parts);
    return e;
}

/* A hard link on a store without links: `to` becomes a copy of `from` made by the server
 * (CopyObject, or UploadPartCopy above $STRATA_S3_COPY_MAX_MB, default 5120), no byte
 * through this process; -EEXIST if `to` exists (the caller owns its prefix). The two are
 * separate objects from then on: removing one frees nothing of the other's. */
static int s3_link(const st_vfs *v, const char *from, const char *to)
{
    const char *kf = key_of(v, from), *kt = key_of(v, to);
    if (!kf || !kt || !*kf || !*kt)
        return -EXDEV;
    s3_resp r;
    int e = head(v, kt, &r);
    s3_resp_free(&r);
    if (e != -ENOENT)
        return e ? e : -EEXIST;
    e = head(v, kf, &r);
    s3_resp_free(&r);
    if (e)
        return e;
    char src[1200], match[200];
    if ((e = copy_source(v, kf, r.etag, src, sizeof src, match, sizeof match)))
        return e;
    if (r.length > SV(v)->copy_max) {
        e = copy_parts(v, kt, src, match, r.length);
        return e == -EEXIST ? -ENOENT : e; /* 412: the source is no longer the object seen */
    }
    s3_req q = {.method = "PUT", .key = kt, .hdr = {src, match}};
    if ((e = s3_do(SV(v)->conn, &q, &r)))
        return e;
    e = s3_status_errno(r.status);
    if (!e && (!r.body || strstr(r.body, "<Error>"))) /* S3 may fail it inside a 200 */
        e = -EIO;
    if (e == -EEXIST) /* 412: the source is no longer the object seen */
        e = -ENOENT;
    s3_resp_free(&r);
    return e;
}

static int s3_exchange(const st_vfs *v, const char *a, const char *b)
{
    (void)v, (void)a, (void)b;
    return -EOPNOTSUPP; /* no atomic swap of two prefixes: a replacing save is refused */
}

static int s3_list(const st_vfs *v, const char *dir, st_list_fn fn, void *ctx)
{
    const char *key = key_of(v, dir);
    if (!key)
        return -ENOENT;
    char pre[1100], token[1024] = "", name[1100], size[32];
    snprintf(pre, sizeof pre, "%s%s", key, *key ? "/" : "");
    int rc = 0, stop = 0;
    do {
        char q[3400] = "";
        if (token[0]) {
            strcat(q, "continuation-token=");
            if (s3_uri_encode(q, sizeof q, token, 0))
                return -ENAMETOOLONG;
            strcat(q, "&");
        }
        strcat(q, "delimiter=%2F&list-type=2&prefix=");
        if (s3_uri_encode(q, sizeof q, pre, 0))
            return -ENAMETOOLONG;
        s3_req rq = {.method = "GET", .key = "", .query = q};
        s3_resp r;
        int e = s3_do(SV(v)->conn, &rq, &r);
        if (!e && !(e = s3_status_errno(r.status)) && !r.body)
            e = -EIO;
        if (e) {
            s3_resp_free(&r);
            return e;
        }
        token[0] = 0;
        const char *pos = r.body;
        char trunc[8] = "";
        if (s3_xml_next(r.body, &pos, "IsTruncated", trunc, sizeof trunc) == 0 &&
            strcmp(trunc, "true") == 0) {
            pos = r.body;
            s3_xml_next(r.body, &pos, "NextContinuationToken", token, sizeof token);
        }
        for (const char *c = strstr(r.body, "<Contents>"); c && !stop;
             c = strstr(c + 1, "<Contents>")) {
            const char *p1 = c, *p2 = c;
            if (s3_xml_next(r.body, &p1, "Key", name, sizeof name) ||
                s3_xml_next(r.body, &p2, "Size", size, sizeof size))
                continue;
            const char *base = name + strlen(pre);
            if (!s3_key_ok(name, strlen(name)))
                continue; /* never a name of strata's (see make_url) */
            int what = fn(ctx, base, strtoull(size, NULL, 10), 0);
            if (what == ST_LIST_STOP)
                stop = 1;
            else if (what == ST_LIST_REMOVE && strcmp(base, "COMMIT") != 0) {
                /* a commit record goes only by name (unlink): a sweep of a prefix by a
                 * save that believes it owns it never takes another save's commit */
                char full[1500];
                snprintf(full, sizeof full, "%s/%s", SV(v)->root, name);
                if ((e = s3_unlink(v, full)) && !rc)
                    rc = e;
            }
        }
        for (const char *c = strstr(r.body, "<CommonPrefixes>"); c && !stop;
             c = strstr(c + 1, "<CommonPrefixes>")) {
            const char *p1 = c;
            if (s3_xml_next(r.body, &p1, "Prefix", name, sizeof name))
                continue;
            size_t n = strlen(name);
            if (n && name[n - 1] == '/')
                name[n - 1] = 0;
            if (!s3_key_ok(name, strlen(name)))
                continue;
            if (fn(ctx, name + strlen(pre), 0, 1) == ST_LIST_STOP)
                stop = 1;
        }
        s3_resp_free(&r);
    } while (token[0] && !stop);
    return rc; /* an empty prefix lists as an empty directory */
}

static void s3_release(const st_vfs *v)
{
    for (held *h = SV(v)->held, *n; h; h = n) {
        n = h->next;
        free_held(h);
    }
    pthread_mutex_destroy(&SV(v)->mu);
    s3_conn_put(SV(v)->conn, SV(v)->conn_ok);
    free(SV(v));
}

/* ---- configuration ---- */

static long env_num(const char *name, long dflt, long lo, long hi)
{
    const char *s = getenv(name);
    char *end;
    long n = s && *s ? strtol(s, &end, 10) : dflt;
    return s && *s && (*end || n < lo || n > hi) ? -1 : n;
}

static int env_str(char *out, size_t cap, const char *name, const char *dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        s = dflt;
    return snprintf(out, cap, "%s", s ? s : "") >= (int)cap ? -1 : 0;
}

int st_vfs_s3_resolve(const char *uri, const st_vfs **vfs, char *path_out, size_t cap)
{
    const char *b = uri + 5, *slash = strchr(b, '/');
    size_t blen = slash ? (size_t)(slash - b) : strlen(b);
    s3_cfg cfg = {.retries = 0};
    if (blen < 3 || blen > 63 || strcspn(b, "?#") < blen)
        return st_fail(STRATA_EINVAL, "'%s': an S3 URI is s3://BUCKET/PREFIX, with a bucket "
                       "name of 3 to 63 characters", uri);
    memcpy(cfg.bucket, b, blen);
    const char *prefix = slash ? slash + 1 : "";
    size_t plen = strlen(prefix);
    while (plen && prefix[plen - 1] == '/')
        plen--;
    if (!s3_key_ok(prefix, plen))
        return st_fail(STRATA_EINVAL, "'%s': an S3 key has no empty, '.' or '..' segments: S3 "
                       "keeps them as they are ('run/x/..' is another key than 'run'), while "
                       "HTTP clients remove them; name the prefix itself", uri);
    long lease = env_num("STRATA_S3_LEASE_S", 60, 1, 86400);
    long part = env_num("STRATA_S3_PART_MB", 8, 5, 5120);
    long retries = env_num("STRATA_S3_RETRIES", 6, 0, 100);
    long timeout = env_num("STRATA_S3_TIMEOUT_S", 30, 1, 3600);
    long copy_max = env_num("STRATA_S3_COPY_MAX_MB", 5120, 5, 5120);
    if (lease < 0 || part < 0 || retries < 0 || timeout < 0 || copy_max < 0)
        return st_fail(STRATA_EINVAL, "'%s': $STRATA_S3_LEASE_S (1..86400), $STRATA_S3_PART_MB "
                       "(5..5120), $STRATA_S3_RETRIES (0..100), $STRATA_S3_TIMEOUT_S "
                       "(1..3600) or $STRATA_S3_COPY_MAX_MB (5..5120) is not a number in "
                       "range", uri);
    cfg.retries = (int)retries;
    cfg.timeout_s = timeout;
    const char *ep = getenv("AWS_ENDPOINT_URL_S3");
    if (!ep || !*ep)
        ep = getenv("AWS_ENDPOINT_URL");
    if (env_str(cfg.region, sizeof cfg.region, "AWS_REGION",
                getenv("AWS_DEFAULT_REGION") ? getenv("AWS_DEFAULT_REGION") : "us-east-1") ||
        env_str(cfg.key_id, sizeof cfg.key_id, "AWS_ACCESS_KEY_ID", NULL) ||
        env_str(cfg.secret, sizeof cfg.secret, "AWS_SECRET_ACCESS_KEY", NULL) ||
        env_str(cfg.token, sizeof cfg.token, "AWS_SESSION_TOKEN", NULL))
        return st_fail(STRATA_EINVAL, "'%s': an AWS_* variable is too long", uri);
    if (!cfg.key_id[0] || !cfg.secret[0])
        return st_fail(STRATA_EINVAL, "'%s': no credentials for bucket '%s': set "
                       "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", uri, cfg.bucket);
    const char *style = getenv("STRATA_S3_ADDRESSING");
    if (ep && *ep) { /* a server of one's own (MinIO, Ceph, moto): path-style unless asked */
        size_t n = strlen(ep);
        while (n && ep[n - 1] == '/')
            n--;
        if (n >= sizeof cfg.endpoint || !strstr(ep, "://"))
            return st_fail(STRATA_EINVAL, "'%s': AWS_ENDPOINT_URL '%s' is no http(s):// URL",
                           uri, ep);
        memcpy(cfg.endpoint, ep, n);
        cfg.virtual_host = style && strcmp(style, "virtual") == 0;
    } else {
        snprintf(cfg.endpoint, sizeof cfg.endpoint, "https://s3.%s.amazonaws.com", cfg.region);
        cfg.virtual_host = !(style && strcmp(style, "path") == 0);
    }
    int n = snprintf(path_out, cap, "s3://%s/%.*s", cfg.bucket, (int)plen, prefix);
    if (n < 0 || (size_t)n >= cap)
        return st_fail(STRATA_EINVAL, "URI too long: '%s'", uri);
    s3_vfs *v = calloc(1, sizeof *v);
    int check = 1;
    if (!v || s3_conn_get(&cfg, &v->conn, &check)) {
        free(v);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    snprintf(v->root, sizeof v->root, "s3://%s", cfg.bucket);
    pthread_mutex_init(&v->mu, NULL);
    v->part = (uint64_t)part * MIB;
    v->lease_s = (int)lease;
    v->copy_max = (uint64_t)copy_max * MIB;
    v->base = (st_vfs){
        .version = ST_VFS_VERSION, .scheme = "s3", .caps = 0, .open = s3_open,
        .pread = s3_pread, .pwrite = s3_pwrite, .sync = s3_sync, .size = s3_size,
        .truncate = s3_truncate, .close = s3_close, .direct = s3_direct, .mkdir = s3_mkdir,
        .rename = s3_rename, .unlink = s3_unlink, .rmdir = s3_rmdir, .sync_dir = s3_sync_dir,
        .list = s3_list, .stat = s3_stat, .allocate = s3_allocate, .release = s3_release,
        .mtime = s3_mtime, .lock = s3_lock, .ident = s3_ident, .exchange = s3_exchange,
        .undirect = s3_undirect, .link = s3_link};
    v->conn_ok = 1;
    if (!check) { /* this connection's bucket answered a HEAD lately */
        *vfs = &v->base;
        return 0;
    }
    /* the bucket answers, and to these credentials: else a clear error now, naming it */
    s3_req q = {.method = "HEAD", .key = ""};
    s3_resp r;
    int e = s3_do(v->conn, &q, &r);
    s3_resp_free(&r);
    int rc = 0;
    if (e)
        rc = st_fail(STRATA_EIO, "s3://%s: no answer from %s after %d attempts (%s)",
                     cfg.bucket, cfg.endpoint, r.attempts, e == -ETIMEDOUT ? "timed out" :
                     "connection failed");
    else if (r.status == 403 || r.status == 401)
        rc = st_fail(STRATA_EIO, "s3://%s: access denied (HTTP %ld) for access key '%s' "
                     "at %s: check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN "
                     "and the bucket's policy", cfg.bucket, r.status, cfg.key_id, cfg.endpoint);
    else if (r.status == 404)
        rc = st_fail(STRATA_ENOENT, "s3://%s: no such bucket at %s", cfg.bucket, cfg.endpoint);
    else if (r.status / 100 != 2)
        rc = st_fail(STRATA_EIO, "s3://%s: HTTP %ld from %s", cfg.bucket, r.status,
                     cfg.endpoint);
    if (rc) {
        v->conn_ok = 0;
        s3_release(&v->base);
        return rc;
    }
    s3_conn_checked(v->conn);
    *vfs = &v->base;
    return 0;
}
#endif
