/* peer_io.c - a peer operation's node copy (peer.h): its files read and written whole,
 * and the agreement of every rank's outcome. Below peer.c and peer_rs.c, which both use
 * it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "peer.h"

/* ---- the files of this node's copy ---- */

int st_peer_path(const peer_ctx *c, const char *name, char *out)
{
    return st_path_join(out, c->dir, name);
}

int st_peer_read(const peer_ctx *c, const char *name, size_t max, unsigned char **out,
                 size_t *len)
{
    char p[PATH_MAX];
    int rc = st_peer_path(c, name, p);
    if (rc || (rc = st_vfs_read_all(c->vfs, p, max, 0, out, len)) == 0)
        return rc;
    return st_fail(st_from_errno(-rc), "cannot read %s: %s", p, strerror(-rc));
}

int st_peer_read_into(const peer_ctx *c, const char *name, void *buf, size_t n)
{
    char p[PATH_MAX];
    st_file *f;
    uint64_t size = 0;
    int rc = st_peer_path(c, name, p);
    if (rc)
        return rc;
    int e = c->vfs->open(c->vfs, p, ST_O_READ, &f);
    if (e)
        return st_fail(st_from_errno(-e), "cannot read %s: %s", p, strerror(-e));
    int64_t r = (e = c->vfs->size(f, &size)) ? e : st_vfs_read_full(c->vfs, f, buf, n, 0);
    c->vfs->close(f);
    if (r < 0)
        return st_fail(st_from_errno((int)-r), "cannot read %s: %s", p, strerror((int)-r));
    if ((uint64_t)r != n || size != n)
        return st_fail(STRATA_EINCOMPLETE, "%s has %llu bytes, the metadata says %zu", p,
                       (unsigned long long)size, n);
    return 0;
}

/* Writes a whole file; through name.tmp and a rename when atomic (the records). */
int st_peer_write(const peer_ctx *c, const char *name, const void *buf, size_t n,
                  int atomic)
{
    char p[PATH_MAX], t[PATH_MAX + 8];
    int rc = st_peer_path(c, name, p);
    if (rc)
        return rc;
    snprintf(t, sizeof t, "%s.tmp", p);
    st_file *f;
    int e = c->vfs->open(c->vfs, atomic ? t : p, ST_O_WRITE, &f);
    if (e)
        return st_fail(STRATA_EIO, "cannot create %s: %s", atomic ? t : p, strerror(-e));
    e = st_vfs_write_full(c->vfs, f, buf, n, 0);
    int ce = c->vfs->close(f);
    if (!e)
        e = ce;
    if (!e && atomic) { /* a record replaced: swapped in at once where the storage can */
        e = c->vfs->rename(c->vfs, t, p);
        if (e == -EEXIST && c->vfs->exchange && c->vfs->exchange(c->vfs, t, p) == 0)
            e = c->vfs->unlink(c->vfs, t);
        else if (e == -EEXIST && (e = c->vfs->unlink(c->vfs, p)) == 0)
            e = c->vfs->rename(c->vfs, t, p);
    }
    if (e)
        return st_fail(e == -ENOSPC ? STRATA_ENOSPC : STRATA_EIO, "cannot write %s: %s", p,
                       strerror(-e));
    return 0;
}

/* Every rank's outcome agreed on: 0 where all succeeded, else the first failure's. */
int st_peer_agree(strata_comm *comm, const char *what, int rc)
{
    size_t *lens = calloc((size_t)comm->size, sizeof *lens);
    unsigned char *out = NULL;
    if (!lens)
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* still calls: the others wait */
    size_t one;
    int arc = strata_comm_agree(&out, lens ? lens : &one, comm, what, rc, NULL, 0, 0, 0);
    free(out);
    free(lens);
    return arc;
}

int st_peer_steps(strata_comm *comm, const st_peer_step *steps, size_t n, void *s, int *local)
{
    *local = 0;
    for (size_t i = 0; i < n; i++) {
        if (steps[i].when && !steps[i].when(s))
            continue;
        int mine = 0, rc = steps[i].run(s, &mine);
        if (!rc && steps[i].agree)
            rc = st_peer_agree(comm, steps[i].agree, mine);
        if (rc)
            return rc;
        if (mine) /* a step the caller agrees on */
            return *local = mine, 0;
    }
    return 0;
}
