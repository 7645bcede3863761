/* files.c - strata's files in a checkpoint directory (st_is_strata_file, meta.h: the names
 * strata writes), counted or removed: the ground the directory's owner (own.c, retain.c)
 * stands on. */
#include <stdio.h>
#include <string.h>

#include "../core/error.h"
#include "engine.h"

typedef struct {
    int strata, foreign, unlink;
    uint64_t bytes;
    const st_save_plan *keep; /* with unlink: the data files of this plan stay */
} scan_ctx;

/* Is name a data file of sp (data-<writer rank>.bin) or a base's file it links? */
static int in_plan(const st_save_plan *sp, const char *name)
{
    for (uint32_t f = 0; st_is_ref_file(name) && f < sp->meta->nfiles; f++)
        if (st_file_linked(sp->meta, f) && strcmp(sp->meta->files[f].name, name) == 0)
            return 1;
    long r = st_data_file_rank(name);
    if (r < 0 || r >= sp->nranks || sp->writer_file[r] < 0)
        return 0;
    return strcmp(sp->meta->files[sp->writer_file[r]].name, name) == 0;
}

static int scan_one(void *p, const char *name, uint64_t size, int kind)
{
    scan_ctx *c = p;
    if (!st_is_strata_file(name) || kind != 0) {
        c->foreign++; /* symlinks and directories with our names are not ours */
        return ST_LIST_NEXT;
    }
    c->strata++;
    c->bytes += size;
    /* the lock file is the owner's: removed only by st_remove_failed and the collector,
     * after everything else */
    int keep = strcmp(name, ST_LOCK_FILE) == 0 || (c->keep && in_plan(c->keep, name));
    return c->unlink && !keep ? ST_LIST_REMOVE : ST_LIST_NEXT;
}

int st_scan_dir(const st_vfs *v, const char *dir, int unlink, int *strata, int *foreign,
                uint64_t *bytes)
{
    scan_ctx c = {.unlink = unlink};
    int e = v->list(v, dir, scan_one, &c);
    if (e)
        return st_fail(st_from_errno(-e), "cannot %s '%s': %s",
                       unlink ? "remove the files in" : "list", dir, strerror(-e));
    if (strata)
        *strata = c.strata;
    if (foreign)
        *foreign = c.foreign;
    if (bytes)
        *bytes = c.bytes;
    return 0;
}

int st_scan_dir_keep(const st_vfs *v, const char *dir, const st_save_plan *keep)
{
    scan_ctx c = {.unlink = 1, .keep = keep};
    int e = v->list(v, dir, scan_one, &c);
    return e ? st_fail(st_from_errno(-e), "cannot clear stale files in '%s': %s", dir,
                       strerror(-e))
             : 0;
}
