/* s3_http.c - S3 requests over libcurl: signing (CURLOPT_AWS_SIGV4), a pool of easy handles
 * (each keeps its connection alive), retries with backoff, and a little XML. See s3_http.h. */
#ifdef ST_HAVE_CURL
#include "s3_http.h"

#include <curl/curl.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BODY_MAX (64u << 20)
#define IDLE_KEEP 4      /* unreferenced connections kept for the next resolve */
#define RECHECK_S 60     /* a connection's bucket is HEADed again after this long */

struct s3_conn {
    s3_cfg cfg;
    char sigv4[96];
    int debug; /* $STRATA_S3_DEBUG: every attempt on stderr (part of the key) */
    pthread_mutex_t mu;
    CURL **idle; /* easy handles not in use (their connections stay open) */
    int nidle, capidle;
    /* in the registry (under reg_mu) */
    struct s3_conn *next;
    int refs;
    pid_t pid;       /* the process that made it: a forked child never uses its sockets */
    time_t checked;  /* when its bucket last answered a HEAD (0: never) */
};

/* The process's connections, one per configuration, most recently used first: shared by
 * every backend instance resolved with that configuration (reference-counted), and up to
 * IDLE_KEEP kept when no instance holds them, so that consecutive resolves (probe, list)
 * reuse their connections. */
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static s3_conn *reg;

static pthread_once_t global_once = PTHREAD_ONCE_INIT;
static void global_init(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

static int same_cfg(const s3_cfg *a, const s3_cfg *b)
{
    return strcmp(a->bucket, b->bucket) == 0 && strcmp(a->endpoint, b->endpoint) == 0 &&
           strcmp(a->region, b->region) == 0 && strcmp(a->key_id, b->key_id) == 0 &&
           strcmp(a->secret, b->secret) == 0 && strcmp(a->token, b->token) == 0 &&
           a->virtual_host == b->virtual_host && a->retries == b->retries &&
           a->timeout_s == b->timeout_s;
}

static void conn_free(s3_conn *c);

int s3_conn_get(const s3_cfg *cfg, s3_conn **out, int *check)
{
    pthread_once(&global_once, global_init);
    pid_t pid = getpid();
    int debug = getenv("STRATA_S3_DEBUG") && *getenv("STRATA_S3_DEBUG") == '1';
    pthread_mutex_lock(&reg_mu);
    for (s3_conn **pp = &reg, *c; (c = *pp); pp = &c->next)
        if (c->pid == pid && c->debug == debug && same_cfg(&c->cfg, cfg)) {
            c->refs++;
            *check = time(NULL) - c->checked > RECHECK_S;
            *pp = c->next; /* to the front: the most recently used */
            c->next = reg;
            reg = c;
            pthread_mutex_unlock(&reg_mu);
            *out = c;
            return 0;
        }
    pthread_mutex_unlock(&reg_mu);
    s3_conn *c = calloc(1, sizeof *c);
    if (!c)
        return -ENOMEM;
    c->cfg = *cfg;
    snprintf(c->sigv4, sizeof c->sigv4, "aws:amz:%s:s3", cfg->region);
    c->debug = debug;
    c->refs = 1;
    c->pid = pid;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_lock(&reg_mu);
    c->next = reg;
    reg = c;
    pthread_mutex_unlock(&reg_mu);
    *check = 1;
    *out = c;
    return 0;
}

void s3_conn_checked(s3_conn *c)
{
    pthread_mutex_lock(&reg_mu);
    c->checked = time(NULL);
    pthread_mutex_unlock(&reg_mu);
}

void s3_conn_put(s3_conn *c, int keep)
{
    if (!c)
        return;
    pid_t pid = getpid();
    s3_conn *drop = NULL;
    pthread_mutex_lock(&reg_mu);
    c->refs--;
    if (!keep && c->refs == 0)
        c->checked = 0; /* its bucket did not answer as it should: asked again next time */
    int idle = 0;
    for (s3_conn **pp = &reg, *x; (x = *pp);) {
        if (x->refs == 0 && (x->pid != pid || ++idle > IDLE_KEEP)) {
            *pp = x->next; /* unlinked; another process's is left as it is (its sockets) */
            if (x->pid == pid) {
                x->next = drop;
                drop = x;
            }
        } else {
            pp = &x->next;
        }
    }
    pthread_mutex_unlock(&reg_mu);
    while (drop) {
        s3_conn *n = drop->next;
        conn_free(drop);
        drop = n;
    }
}

static void conn_free(s3_conn *c)
{
    if (!c)
        return;
    for (int i = 0; i < c->nidle; i++)
        curl_easy_cleanup(c->idle[i]);
    free(c->idle);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

const s3_cfg *s3_conn_cfg(const s3_conn *c) { return &c->cfg; }

static CURL *take(s3_conn *c)
{
    CURL *h = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->nidle)
        h = c->idle[--c->nidle];
    pthread_mutex_unlock(&c->mu);
    if (h)
        curl_easy_reset(h);
    else
        h = curl_easy_init();
    return h;
}

static void give(s3_conn *c, CURL *h)
{
    pthread_mutex_lock(&c->mu);
    if (c->nidle == c->capidle) {
        int cap = c->capidle ? 2 * c->capidle : 8;
        CURL **n = realloc(c->idle, (size_t)cap * sizeof *n);
        if (n) {
            c->idle = n;
            c->capidle = cap;
        }
    }
    if (c->nidle < c->capidle) {
        c->idle[c->nidle++] = h;
        h = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    if (h)
        curl_easy_cleanup(h);
}

int s3_uri_encode(char *out, size_t cap, const char *s, int keep_slash)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t n = strlen(out);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        int keep = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') ||
                   (ch >= '0' && ch <= '9') || ch == '-' || ch == '_' || ch == '.' ||
                   ch == '~' || (keep_slash && ch == '/');
        if (n + 4 >= cap)
            return -ENAMETOOLONG;
        if (keep) {
            out[n++] = (char)ch;
        } else {
            out[n++] = '%';
            out[n++] = hex[ch >> 4];
            out[n++] = hex[ch & 15];
        }
    }
    out[n] = 0;
    return 0;
}

int s3_key_ok(const char *key, size_t n)
{
    for (size_t i = 0; i < n;) { /* each segment */
        size_t j = i;
        while (j < n && key[j] != '/')
            j++;
        if (j == i || (j - i == 1 && key[i] == '.') ||
            (j - i == 2 && key[i] == '.' && key[i + 1] == '.') || (j == n - 1 && key[j] == '/'))
            return 0;
        i = j + 1;
    }
    return 1;
}

static int make_url(const s3_cfg *cfg, const s3_req *r, char *url, size_t cap)
{
    const char *hostpart = strstr(cfg->endpoint, "://");
    int n;
    if (!hostpart || !s3_key_ok(r->key, strlen(r->key)))
        return -EINVAL; /* a dot segment would be removed by a client or proxy on the way */
    if (cfg->virtual_host)
        n = snprintf(url, cap, "%.*s://%s.%s/", (int)(hostpart - cfg->endpoint), cfg->endpoint,
                     cfg->bucket, hostpart + 3);
    else
        n = snprintf(url, cap, "%s/%s/", cfg->endpoint, cfg->bucket);
    if (n < 0 || (size_t)n >= cap)
        return -ENAMETOOLONG;
    int e = s3_uri_encode(url, cap, r->key, 1);
    if (e)
        return e;
    if (r->query && *r->query) {
        size_t k = strlen(url);
        n = snprintf(url + k, cap - k, "?%s", r->query);
        if (n < 0 || (size_t)n >= cap - k)
            return -ENAMETOOLONG;
    }
    return 0;
}

typedef struct {
    const s3_req *r;
    s3_resp *resp;
    size_t cap;
    int overflow;
} sink;

static size_t on_body(char *p, size_t sz, size_t nm, void *ud)
{
    sink *s = ud;
    size_t n = sz * nm;
    s3_resp *resp = s->resp;
    if (s->r->out && resp->status / 100 == 2) { /* a ranged read: into the caller's buffer */
        if (resp->len + n > s->r->out_cap) {
            s->overflow = 1;
            return 0;
        }
        memcpy((char *)s->r->out + resp->len, p, n);
        resp->len += n;
        return n;
    }
    if (resp->len + n + 1 > BODY_MAX) {
        s->overflow = 1;
        return 0;
    }
    if (resp->len + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap : 4096;
        while (cap < resp->len + n + 1)
            cap *= 2;
        char *b = realloc(resp->body, cap);
        if (!b)
            return 0;
        resp->body = b;
        s->cap = cap;
    }
    memcpy(resp->body + resp->len, p, n);
    resp->len += n;
    resp->body[resp->len] = 0;
    return n;
}

static size_t on_header(char *p, size_t sz, size_t nm, void *ud)
{
    sink *s = ud;
    size_t n = sz * nm;
    if (n > 5 && strncmp(p, "HTTP/", 5) == 0) { /* a new status line: forget the last */
        s->resp->status = strtol(p + 9 > p + n ? p + n : p + 9, NULL, 10);
        s->resp->etag[0] = 0;
        s->resp->date = -1;
    } else if (n > 5 && n < 128 && strncasecmp(p, "date:", 5) == 0) {
        char d[128];
        memcpy(d, p + 5, n - 5);
        d[n - 5] = 0;
        time_t t = curl_getdate(d, NULL);
        s->resp->date = t > 0 ? (int64_t)t : -1;
    } else if (n > 5 && strncasecmp(p, "etag:", 5) == 0) {
        const char *v = p + 5;
        while (v < p + n && (*v == ' ' || *v == '\t'))
            v++;
        size_t k = (size_t)(p + n - v);
        while (k && (v[k - 1] == '\r' || v[k - 1] == '\n' || v[k - 1] == ' '))
            k--;
        if (k < sizeof s->resp->etag) {
            memcpy(s->resp->etag, v, k);
            s->resp->etag[k] = 0;
        }
    }
    return n;
}

static int transient(CURLcode e)
{
    return e == CURLE_COULDNT_CONNECT || e == CURLE_OPERATION_TIMEDOUT || e == CURLE_SEND_ERROR ||
           e == CURLE_RECV_ERROR || e == CURLE_GOT_NOTHING || e == CURLE_PARTIAL_FILE ||
           e == CURLE_COULDNT_RESOLVE_HOST || e == CURLE_HTTP2 || e == CURLE_HTTP2_STREAM ||
           e == CURLE_SSL_CONNECT_ERROR || e == CURLE_WEIRD_SERVER_REPLY;
}

static void backoff(int attempt)
{
    long ms = 25L << (attempt < 7 ? attempt : 7); /* 25 ms .. 3.2 s, with jitter */
    ms = ms / 2 + (long)((unsigned)rand() % (unsigned)(ms / 2 + 1));
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static CURLcode attempt(s3_conn *c, CURL *h, const s3_req *r, const char *url, s3_resp *resp,
                        sink *s)
{
    const s3_cfg *cfg = &c->cfg;
    struct curl_slist *hl = NULL;
    char tok[4200];
    hl = curl_slist_append(hl, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    hl = curl_slist_append(hl, "Expect:");
    hl = curl_slist_append(hl, "Content-Type:");
    if (cfg->token[0]) {
        snprintf(tok, sizeof tok, "x-amz-security-token: %s", cfg->token);
        hl = curl_slist_append(hl, tok);
    }
    for (int i = 0; i < 4 && r->hdr[i]; i++)
        hl = curl_slist_append(hl, r->hdr[i]);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_PATH_AS_IS, 1L); /* the key as it is: no dot segments removed */
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, c->sigv4);
    curl_easy_setopt(h, CURLOPT_USERNAME, cfg->key_id);
    curl_easy_setopt(h, CURLOPT_PASSWORD, cfg->secret);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, 10L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L); /* stalled this long: a timeout */
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, cfg->timeout_s);
    curl_easy_setopt(h, CURLOPT_FILETIME, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, s);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, s);
    if (strcmp(r->method, "HEAD") == 0) {
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (strcmp(r->method, "PUT") == 0 || strcmp(r->method, "POST") == 0) {
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, r->body ? r->body : "");
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)r->blen);
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, r->method);
    } else if (strcmp(r->method, "GET") != 0) {
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, r->method);
    }
    CURLcode e = curl_easy_perform(h);
    curl_slist_free_all(hl);
    if (e == CURLE_OK) {
        long st = 0;
        curl_off_t len = -1, ft = -1;
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &st);
        curl_easy_getinfo(h, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &len);
        curl_easy_getinfo(h, CURLINFO_FILETIME_T, &ft);
        resp->status = st;
        resp->length = len > 0 ? (uint64_t)len : 0;
        resp->mtime = (int64_t)ft;
    }
    return e;
}

int s3_do(s3_conn *c, const s3_req *r, s3_resp *resp)
{
    char url[4096] = "";
    *resp = (s3_resp){.mtime = -1, .date = -1};
    int e = make_url(&c->cfg, r, url, sizeof url);
    if (e)
        return e;
    CURL *h = take(c);
    if (!h)
        return -ENOMEM;
    int rc = 0;
    for (int a = 0;; a++) {
        sink s = {.r = r, .resp = resp};
        free(resp->body);
        *resp = (s3_resp){.mtime = -1, .date = -1, .attempts = a + 1};
        CURLcode ce = attempt(c, h, r, url, resp, &s);
        if (s.overflow) {
            rc = -EFBIG;
            break;
        }
        resp->curl_err = (int)ce;
        if (c->debug)
            fprintf(stderr, "strata s3: %s %s: attempt %d: %s, HTTP %ld\n", r->method, url, a + 1,
                    ce == CURLE_OK ? "answered" : curl_easy_strerror(ce), resp->status);
        int again = ce != CURLE_OK ? transient(ce)
                                   : resp->status >= 500 || resp->status == 429;
        if (!again || a >= c->cfg.retries) {
            if (ce != CURLE_OK) {
                resp->status = 0;
                rc = ce == CURLE_OPERATION_TIMEDOUT ? -ETIMEDOUT : -EIO;
            }
            break;
        }
        backoff(a);
    }
    give(c, h);
    return rc;
}

void s3_resp_free(s3_resp *r)
{
    free(r->body);
    r->body = NULL;
}

int s3_status_errno(long status)
{
    switch (status) {
    case 400: return -EINVAL;
    case 401:
    case 403: return -EACCES;
    case 404: return -ENOENT;
    case 409: return -EBUSY;
    case 412: return -EEXIST;
    case 416: return -ERANGE;
    default: return status >= 200 && status < 300 ? 0 : -EIO;
    }
}

static void xml_decode(char *s)
{
    static const struct { const char *ent; char ch; } ents[] = {
        {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
    char *w = s;
    for (const char *p = s; *p;) {
        int done = 0;
        for (size_t i = 0; *p == '&' && i < sizeof ents / sizeof ents[0] && !done; i++) {
            size_t k = strlen(ents[i].ent);
            if (strncmp(p, ents[i].ent, k) == 0) {
                *w++ = ents[i].ch;
                p += k;
                done = 1;
            }
        }
        if (!done)
            *w++ = *p++;
    }
    *w = 0;
}

int s3_xml_next(const char *xml, const char **pos, const char *tag, char *out, size_t cap)
{
    char open[64], close[64];
    snprintf(open, sizeof open, "<%s>", tag);
    snprintf(close, sizeof close, "</%s>", tag);
    const char *a = strstr(*pos ? *pos : xml, open);
    if (!a)
        return -1;
    a += strlen(open);
    const char *b = strstr(a, close);
    if (!b)
        return -1;
    size_t n = (size_t)(b - a);
    if (n >= cap)
        n = cap - 1;
    memcpy(out, a, n);
    out[n] = 0;
    xml_decode(out);
    *pos = b + strlen(close);
    return 0;
}
#else
typedef int s3_http_unused; /* ISO C wants something in a translation unit */
#endif
