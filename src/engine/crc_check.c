/* crc_check.c - the checks a foreign format carries (a zip entry's CRC-32), taken as a load
 * reads: each read takes the CRC-32 of the parts of checks it holds (st_plan_checks), and
 * the read that takes a check's last part combines them (zlib's crc32_combine) and compares,
 * before it scatters its own bytes. A check read in one read is compared before any of its
 * bytes reach a destination; one spread over several reads (an entry larger than a read)
 * is compared when the last is read, and the reads before it have scattered their bytes by
 * then: the load fails, and the destinations hold what they hold after any failed load.
 *
 * The ledger serves a loader whose loads each need part of an entry (export's windows):
 * those loads read only what they need, the CRC-32 of every run of bytes read is kept per
 * entry, and an entry is compared when the loads together covered it; st_crc_ledger_finish
 * reads what none read and compares the rest. A byte read twice goes into a second pass of
 * its entry, which is completed and compared the same way.
 *
 * Threading: st_crc_take runs on the I/O threads (one read each; the parts' counters are
 * atomic); everything else on the load's thread. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include "../core/crc32.h"
#include "../core/error.h"
#include "engine.h"

/* A run of bytes [lo, hi) of an entry and its CRC-32. */
typedef struct {
    uint64_t lo, hi;
    uint32_t crc;
} ivl;

struct st_crc_run {
    const st_io_plan *p;
    st_crc_ledger *later;
    uint32_t *crc;          /* per part */
    uint32_t *grp;          /* per part: its check's ordinal among the plan's checks */
    size_t *first;          /* per ordinal: its first part; [ngrp] = ncparts */
    atomic_uint *left;      /* per ordinal: parts not taken yet */
    size_t ngrp;
    atomic_uint_fast64_t checked;
};

/* What to call the bytes of check c in a message: the first tensor or blob of the index
 * whose extent holds some of them, as "tensor 'x'". */
static void holder(const st_meta *m, const st_mcheck *c, char *out, size_t cap)
{
    for (size_t k = 0; k < m->ntensors + m->nblobs; k++) {
        int blob = k >= m->ntensors;
        const st_mtensor *t = blob ? NULL : &m->tensors[k];
        size_t n = blob ? 1 : t->nshards;
        for (size_t s = 0; s < n; s++) {
            const st_extent *e = blob ? &m->blobs[k - m->ntensors].ext : &t->shards[s].ext;
            if (e->file == c->file && e->bytes && e->offset < c->offset + c->bytes &&
                e->offset + e->bytes > c->offset) {
                snprintf(out, cap, "%s '%.300s'", blob ? "blob" : "tensor",
                         blob ? m->blobs[k - m->ntensors].name : t->name);
                return;
            }
        }
    }
    snprintf(out, cap, "data");
}

static int mismatch(const st_dir *d, uint32_t check, uint32_t got)
{
    const st_mcheck *c = &d->meta->checks[check];
    char who[400];
    holder(d->meta, c, who, sizeof who);
    return st_fail(STRATA_ECHECKSUM,
                   "%s: zip entry '%.300s' (bytes %llu..%llu of %s file '%s' in '%s') fails "
                   "its CRC-32 (read %08x, the archive says %08x): the file is corrupt",
                   who, c->name, (unsigned long long)c->offset,
                   (unsigned long long)(c->offset + c->bytes),
                   d->src->name, d->meta->files[c->file].name, d->path,
                   (unsigned)got, (unsigned)c->crc);
}

/* ---- one load's reads ---------------------------------------------------------------- */

int st_crc_run_new(st_crc_run **out, const st_io_plan *p, st_crc_ledger *later)
{
    *out = NULL;
    if (!p->ncparts)
        return 0;
    st_crc_run *r = calloc(1, sizeof *r);
    size_t n = p->ncparts;
    if (!r || !(r->crc = malloc(n * sizeof *r->crc)) || !(r->grp = malloc(n * sizeof *r->grp)) ||
        !(r->first = malloc((n + 1) * sizeof *r->first)) ||
        !(r->left = malloc(n * sizeof *r->left))) {
        st_crc_run_free(r);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    r->p = p;
    r->later = later;
    for (size_t i = 0; i < n; i++) {
        if (i == 0 || p->cparts[i].check != p->cparts[i - 1].check) {
            r->first[r->ngrp] = i;
            atomic_init(&r->left[r->ngrp], 0);
            r->ngrp++;
        }
        r->grp[i] = (uint32_t)(r->ngrp - 1);
        atomic_fetch_add_explicit(&r->left[r->ngrp - 1], 1, memory_order_relaxed);
    }
    r->first[r->ngrp] = n;
    atomic_init(&r->checked, 0);
    *out = r;
    return 0;
}

void st_crc_run_free(st_crc_run *r)
{
    if (!r)
        return;
    free(r->crc);
    free(r->grp);
    free(r->first);
    free((void *)r->left);
    free(r);
}

uint64_t st_crc_run_checked(const st_crc_run *r)
{
    return r ? atomic_load(&r->checked) : 0;
}

/* Group g's parts, if they run over the whole of its check: their combined CRC-32 in *crc. */
static int whole(const st_crc_run *r, size_t g, uint32_t *crc)
{
    const st_io_plan *p = r->p;
    const st_cpart *c = &p->cparts[r->first[g]];
    uint64_t at = 0;
    for (size_t i = r->first[g]; i < r->first[g + 1]; i++) {
        if (p->cparts[i].lo != at)
            return 0;
        *crc = i == r->first[g] ? r->crc[i]
                                : st_crc32_join(*crc, r->crc[i], p->cparts[i].hi - p->cparts[i].lo);
        at = p->cparts[i].hi;
    }
    return at == p->meta->checks[c->check].bytes;
}

int st_crc_take(st_crc_run *r, const st_dir *d, size_t io, const char *buf, uint64_t got)
{
    const st_io_plan *p = r->p;
    const st_io *rd = &p->ios[io];
    const st_meta *m = p->meta;
    int rc = 0;
    for (size_t j = rd->cp0; j < rd->cp1; j++) {
        const st_cpart *c = &p->cparts[j];
        const st_mcheck *k = &m->checks[c->check];
        uint64_t at = k->offset + c->lo - rd->off;
        if (at + (c->hi - c->lo) > got) {
            rc = st_fail(STRATA_EFORMAT, "%s file '%s' of '%s' is truncated: it ends at byte "
                         "%llu, inside zip entry '%.300s' (bytes %llu..%llu)",
                         d->src->name, m->files[k->file].name, d->path,
                         (unsigned long long)(rd->off + got), k->name,
                         (unsigned long long)k->offset,
                         (unsigned long long)(k->offset + k->bytes));
            break;
        }
        r->crc[j] = st_crc32(0, buf + at, c->hi - c->lo);
    }
    /* the parts are counted down only once all of this read's were taken: a check whose
     * last part is here is compared after its CRC-32 is complete (release/acquire) */
    for (size_t j = rd->cp0; j < rd->cp1 && !rc; j++) {
        size_t g = r->grp[j];
        uint32_t crc;
        if (atomic_fetch_sub_explicit(&r->left[g], 1, memory_order_acq_rel) != 1)
            continue;
        if (!whole(r, g, &crc))
            continue; /* a part of an entry: the ledger takes it (st_crc_run_end) */
        atomic_fetch_add_explicit(&r->checked, 1, memory_order_relaxed);
        if (crc != m->checks[p->cparts[j].check].crc)
            rc = mismatch(d, p->cparts[j].check, crc);
    }
    return rc;
}

/* ---- the ledger ---------------------------------------------------------------------- */

typedef struct {
    ivl *v; /* sorted, disjoint, none touching another */
    size_t n, cap;
} pass;

typedef struct {
    pass *ps;
    size_t n;
} entry;

struct st_crc_ledger {
    entry *e; /* per check of the metadata */
    size_t ne;
    uint64_t checked, bytes;
};

int st_crc_ledger_new(st_crc_ledger **out, const st_meta *m)
{
    st_crc_ledger *l = calloc(1, sizeof *l);
    if (!l || !(l->e = calloc(m->nchecks + 1, sizeof *l->e))) {
        free(l);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    l->ne = m->nchecks;
    *out = l;
    return 0;
}

static void entry_clear(entry *e)
{
    for (size_t i = 0; i < e->n; i++)
        free(e->ps[i].v);
    free(e->ps);
    memset(e, 0, sizeof *e);
}

void st_crc_ledger_free(st_crc_ledger *l)
{
    if (!l)
        return;
    for (size_t i = 0; i < l->ne; i++)
        entry_clear(&l->e[i]);
    free(l->e);
    free(l);
}

void st_crc_ledger_counts(const st_crc_ledger *l, uint64_t *checked, uint64_t *bytes)
{
    *checked = l ? l->checked : 0;
    *bytes = l ? l->bytes : 0;
}

/* The index of the first run of s ending at or after lo. */
static size_t first_from(const pass *s, uint64_t lo)
{
    size_t a = 0, b = s->n;
    while (a < b) {
        size_t mid = a + (b - a) / 2;
        if (s->v[mid].hi < lo)
            a = mid + 1;
        else
            b = mid;
    }
    return a;
}

/* Adds x to s if none of s's bytes is in x (merging it with the runs it touches): 1 added,
 * 0 not (it overlaps), -1 out of memory. */
static int pass_add(pass *s, ivl x)
{
    size_t i = first_from(s, x.lo);
    /* the runs at i (ending at or after x.lo) start after x.hi, or touch it */
    if (i < s->n && s->v[i].lo < x.hi && s->v[i].hi > x.lo)
        return 0;
    if (i + 1 < s->n && s->v[i + 1].lo < x.hi)
        return 0;
    int left = i < s->n && s->v[i].hi == x.lo;
    size_t r = left ? i + 1 : i; /* the run that may follow x */
    int right = r < s->n && s->v[r].lo == x.hi;
    if (left) {
        ivl *a = &s->v[i];
        a->crc = st_crc32_join(a->crc, x.crc, x.hi - x.lo);
        a->hi = x.hi;
        if (right) {
            a->crc = st_crc32_join(a->crc, s->v[r].crc, s->v[r].hi - s->v[r].lo);
            a->hi = s->v[r].hi;
            memmove(&s->v[r], &s->v[r + 1], (s->n - r - 1) * sizeof *s->v);
            s->n--;
        }
        return 1;
    }
    if (right) {
        ivl *b = &s->v[r];
        b->crc = st_crc32_join(x.crc, b->crc, b->hi - b->lo);
        b->lo = x.lo;
        return 1;
    }
    if (st_grow(&s->v, &s->cap, s->n + 1, sizeof *s->v))
        return -1;
    memmove(&s->v[r + 1], &s->v[r], (s->n - r) * sizeof *s->v);
    s->v[r] = x;
    s->n++;
    return 1;
}

/* Compares a pass that covers its whole check, and drops it. */
static int pass_done(st_crc_ledger *l, const st_dir *d, entry *e, size_t pi, uint32_t check)
{
    uint32_t crc = e->ps[pi].v[0].crc;
    free(e->ps[pi].v);
    memmove(&e->ps[pi], &e->ps[pi + 1], (e->n - pi - 1) * sizeof *e->ps);
    if (!--e->n)
        entry_clear(e);
    l->checked++;
    return crc == d->meta->checks[check].crc ? 0 : mismatch(d, check, crc);
}

/* Adds the CRC-32 of bytes [x.lo, x.hi) of check `check` to the ledger: to the first pass
 * that has none of them. A pass then covering its check is compared. */
static int ledger_add(st_crc_ledger *l, const st_dir *d, uint32_t check, ivl x)
{
    entry *e = &l->e[check];
    size_t pi = 0;
    int added = 0;
    for (; pi < e->n && !added; pi++)
        if ((added = pass_add(&e->ps[pi], x)) < 0)
            return st_fail(STRATA_ENOMEM, "out of memory");
    if (added) {
        pi--;
    } else {
        pass *ps = realloc(e->ps, (e->n + 1) * sizeof *ps);
        if (!ps)
            return st_fail(STRATA_ENOMEM, "out of memory");
        e->ps = ps;
        e->ps[e->n] = (pass){NULL, 0, 0};
        pi = e->n++;
        if (pass_add(&e->ps[pi], x) < 0)
            return st_fail(STRATA_ENOMEM, "out of memory");
    }
    const pass *s = &e->ps[pi];
    if (s->n == 1 && s->v[0].lo == 0 && s->v[0].hi == d->meta->checks[check].bytes)
        return pass_done(l, d, e, pi, check);
    return 0;
}

int st_crc_run_end(st_crc_run *r, const st_dir *d)
{
    if (!r || !r->later)
        return 0;
    const st_io_plan *p = r->p;
    for (size_t g = 0; g < r->ngrp; g++) {
        uint32_t crc;
        if (whole(r, g, &crc)) /* compared by the read that completed it */
            continue;
        /* runs of touching parts, each one interval */
        for (size_t i = r->first[g]; i < r->first[g + 1];) {
            ivl x = {p->cparts[i].lo, p->cparts[i].hi, r->crc[i]};
            size_t j = i + 1;
            for (; j < r->first[g + 1] && p->cparts[j].lo == x.hi; j++) {
                x.crc = st_crc32_join(x.crc, r->crc[j], p->cparts[j].hi - p->cparts[j].lo);
                x.hi = p->cparts[j].hi;
            }
            int rc = ledger_add(r->later, d, p->cparts[i].check, x);
            if (rc)
                return rc;
            i = j;
        }
    }
    return 0;
}

#define FINISH_WINDOW (4u << 20)

/* Reads [lo, hi) of check c from f (the check's file, open) into its CRC-32. */
static int read_crc(const st_dir *d, st_file *f, const st_mcheck *c, uint64_t lo, uint64_t hi,
                    char *buf, uint32_t *crc)
{
    uint32_t x = 0;
    for (uint64_t at = lo; at < hi;) {
        size_t n = (size_t)ST_MIN((uint64_t)FINISH_WINDOW, hi - at);
        int64_t got = st_vfs_read_full(d->vfs, f, buf, n, c->offset + at);
        if (got < 0)
            return st_fail(st_from_errno((int)-got), "reading '%s' of '%s': %s",
                           d->meta->files[c->file].name, d->path, strerror((int)-got));
        if ((size_t)got != n)
            return st_fail(STRATA_EFORMAT, "%s file '%s' of '%s' is truncated inside zip entry "
                           "'%.300s'", d->src->name,
                           d->meta->files[c->file].name, d->path, c->name);
        x = st_crc32(x, buf, n);
        at += n;
    }
    *crc = x;
    return 0;
}

/* Opens file f of d for the ledger, still the file whose header was read. */
static int open_checked(const st_dir *d, uint32_t fi, st_file **f)
{
    char path[PATH_MAX];
    const st_meta *m = d->meta;
    int rc = st_path_join(path, d->path, m->files[fi].name);
    if (rc)
        return rc;
    int e = d->vfs->open(d->vfs, path, ST_O_READ | ST_O_FOLLOW, f);
    if (e)
        return st_fail(st_from_errno(-e), "%s file '%s' of '%s': %s",
                       d->src->name, m->files[fi].name, d->path,
                       strerror(-e));
    if (m->idents && (rc = st_check_same_file(d, &m->files[fi], &m->idents[fi], *f))) {
        d->vfs->close(*f);
        *f = NULL;
    }
    return rc;
}

/* Reads the gaps of the first pass of check k from f, then compares it. */
static int finish_pass(st_crc_ledger *l, const st_dir *d, st_file *f, uint32_t k, char *buf)
{
    entry *e = &l->e[k];
    const st_mcheck *c = &d->meta->checks[k];
    pass *s = &e->ps[0];
    size_t ng = 0;
    ivl *gaps = malloc((s->n + 1) * sizeof *gaps);
    if (!gaps)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i <= s->n; i++) {
        uint64_t lo = i ? s->v[i - 1].hi : 0, hi = i < s->n ? s->v[i].lo : c->bytes;
        if (lo < hi)
            gaps[ng++] = (ivl){lo, hi, 0};
    }
    int rc = 0;
    for (size_t i = 0; i < ng && !rc; i++) {
        if (!(rc = read_crc(d, f, c, gaps[i].lo, gaps[i].hi, buf, &gaps[i].crc))) {
            l->bytes += gaps[i].hi - gaps[i].lo;
            if (pass_add(s, gaps[i]) < 0)
                rc = st_fail(STRATA_ENOMEM, "out of memory");
        }
    }
    free(gaps);
    if (!rc && (s->n != 1 || s->v[0].lo != 0 || s->v[0].hi != c->bytes))
        rc = st_fail(STRATA_EINVAL, "zip entry '%.300s': its CRC-32 runs do not cover it (a "
                     "bug)", c->name);
    return rc ? rc : pass_done(l, d, e, 0, k);
}

int st_crc_ledger_finish(st_crc_ledger *l, const st_dir *d)
{
    const st_meta *m = d->meta;
    char *buf = NULL;
    st_file *f = NULL;
    uint32_t fi = UINT32_MAX;
    int rc = 0;
    for (size_t k = 0; k < l->ne && !rc; k++) {
        entry *e = &l->e[k];
        const st_mcheck *c = &m->checks[k];
        if (!e->n)
            continue;
        if (!buf && !(buf = malloc(FINISH_WINDOW))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            break;
        }
        if (fi != c->file) {
            if (f)
                d->vfs->close(f);
            f = NULL;
            fi = c->file;
            if ((rc = open_checked(d, fi, &f)))
                break;
        }
        while (e->n && !rc) /* each pass: its gaps read, then compared */
            rc = finish_pass(l, d, f, (uint32_t)k, buf);
    }
    if (f)
        d->vfs->close(f);
    free(buf);
    return rc;
}
