/* s3_http.h - S3 requests over libcurl (SigV4 by CURLOPT_AWS_SIGV4), for vfs_s3.c: one
 * connection pool per backend instance, retries with backoff on 5xx, 429 and transport
 * errors, and the few XML fields the backend reads. Built only with libcurl (ST_HAVE_CURL). */
#ifndef STRATA_S3_HTTP_H
#define STRATA_S3_HTTP_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef struct s3_conn s3_conn;

/* Where and as whom: filled from the URI and the environment (s3_conn_new). */
typedef struct s3_cfg {
    char bucket[256];
    char endpoint[512]; /* scheme://host[:port], no trailing slash */
    char region[64];
    char key_id[256], secret[256], token[4096];
    int virtual_host;   /* bucket in the host name (else in the path) */
    int retries;        /* attempts after the first */
    long timeout_s;     /* per request, once connected */
} s3_cfg;

/* One request. body/blen: what is sent (PUT, POST); out/out_cap: a fixed buffer that a GET
 * fills (ranged reads; NULL: the body is collected into `resp`, at most 64 MiB). */
typedef struct s3_req {
    const char *method;    /* GET HEAD PUT POST DELETE */
    const char *key;       /* object key ("" for the bucket) */
    const char *query;     /* already encoded and sorted, or NULL */
    const char *hdr[4];    /* extra request headers, NULL-terminated */
    const void *body;
    size_t blen;
    void *out;
    size_t out_cap;
} s3_req;

typedef struct s3_resp {
    long status;      /* HTTP status; 0: no answer (transport error after every retry) */
    int curl_err;     /* the last transport error (CURLcode), 0 if none */
    int attempts;     /* how many were made */
    char *body;       /* collected body (NUL-terminated), or NULL; free() it */
    size_t len;       /* bytes of body, or written into out */
    uint64_t length;  /* Content-Length of a HEAD */
    int64_t mtime;    /* Last-Modified, s since the epoch, or -1 */
    int64_t date;     /* the server's clock (Date), s since the epoch, or -1 */
    char etag[128];
} s3_resp;

/* The process's connection for cfg (every field equal), shared and reference-counted:
 * made if there is none. *check: 1 if its bucket has not answered a HEAD lately (a new
 * connection, or one last checked over a minute ago): the caller HEADs it and, if it
 * answers, calls s3_conn_checked. Thread-safe. */
int s3_conn_get(const s3_cfg *cfg, s3_conn **out, int *check);
void s3_conn_checked(s3_conn *c);
/* Lets go of a reference (keep 0: the bucket did not answer as it should, so the next
 * get checks again). The last few unreferenced connections stay open for the next get; a
 * child process after fork never uses (nor closes) its parent's. */
void s3_conn_put(s3_conn *c, int keep);
const s3_cfg *s3_conn_cfg(const s3_conn *c);

/* Is key[0, n) a key strata sends: "" (the bucket) or segments joined by '/', none empty,
 * "." or ".."? (S3 keeps such segments as they are, so "a/x/.." is another key than "a",
 * while HTTP clients and proxies remove them from a URL's path.) */
int s3_key_ok(const char *key, size_t n);
/* Runs r (retried as above; sent exactly as given: CURLOPT_PATH_AS_IS). Returns 0 when an
 * answer came (any status: see resp->status), -EINVAL for a key s3_key_ok refuses (not
 * sent), or -EIO / -ETIMEDOUT / -ENOMEM when none did. */
int s3_do(s3_conn *c, const s3_req *r, s3_resp *resp);
void s3_resp_free(s3_resp *r);

/* The negative errno for an HTTP status (404 -ENOENT, 403 -EACCES, 412 -EEXIST, ...). */
int s3_status_errno(long status);

/* The text of the first <tag>...</tag> at or after *pos in xml (entities decoded) into out;
 * *pos moves past it. 0, or -1 when there is none. */
int s3_xml_next(const char *xml, const char **pos, const char *tag, char *out, size_t cap);

/* Appends the URI encoding of s to out (unreserved characters kept, '/' kept if keep_slash). */
int s3_uri_encode(char *out, size_t cap, const char *s, int keep_slash);

#endif
