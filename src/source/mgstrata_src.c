/* mgstrata_src.c - a Megatron-Core checkpoint saved through strata.megatron as a source
 * (source.h): the checkpoint directory (Megatron's metadata.json naming the sharded backend
 * "strata", its common.pt) whose data is the strata checkpoint dir/strata. What is read is
 * that strata checkpoint, by strata's own source (strata_src.c: its metadata, commit record
 * and checksums); this source only finds it. The description for other ranks is strata's
 * own. docs/FORMAT.md, "Megatron checkpoints saved through strata (strata.megatron)".
 *
 * here: a directory without strata's metadata or commit record whose metadata.json parses
 * (megatron.h) with sharded_backend "strata"; tried before the torch_dist source, which
 * refuses such a directory. open: the strata checkpoint's errors (STRATA_ENOENT naming
 * dir/strata when it is missing, STRATA_EINCOMPLETE for a save that did not commit). No
 * threads. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "megatron.h"
#include "readers.h"

static int mgstrata_here(const st_vfs *v, const char *path, int kind)
{
    char p[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    st_mg_config cfg;
    int yes = kind == 1 && !st_source_has_file(v, path, ST_META_FILE) &&
              !st_source_has_file(v, path, ST_COMMIT_FILE) &&
              st_source_has_file(v, path, ST_MG_CONFIG) &&
              st_path_join(p, path, ST_MG_CONFIG) == 0 &&
              st_vfs_read_all(v, p, ST_MG_MAX_CONFIG, ST_O_FOLLOW, &buf, &len) == 0 &&
              st_mg_parse_config(&cfg, buf, len, p) == 0 &&
              strcmp(cfg.sharded_backend, ST_MG_STRATA) == 0;
    free(buf);
    st_clear_error();
    return yes;
}

/* ix->path, the Megatron checkpoint directory, becomes its strata checkpoint's. */
static int to_ckpt(st_index *ix)
{
    char p[PATH_MAX];
    int rc = st_path_join(p, ix->path, ST_MG_SUBDIR);
    if (!rc)
        memcpy(ix->path, p, strlen(p) + 1);
    return rc;
}

static int mgstrata_open(st_index *ix, int allow_incomplete, unsigned char **desc,
                         size_t *desclen)
{
    int kind = -1;
    int rc = to_ckpt(ix);
    if (rc)
        return rc;
    if (ix->vfs->stat(ix->vfs, ix->path, NULL, &kind) != 0 || kind != 1)
        return st_fail(STRATA_ENOENT, "Megatron checkpoint saved through strata: its strata "
                       "checkpoint '%s' is missing", ix->path);
    return st_source_strata.open(ix, allow_incomplete, desc, desclen);
}

static int mgstrata_adopt(st_index *ix, const unsigned char *desc, size_t len)
{
    int rc = to_ckpt(ix);
    return rc ? rc : st_source_strata.adopt(ix, desc, len);
}

const st_source st_source_mgstrata = {"strata.megatron", STRATA_FORMAT_STRATA_MEGATRON,
                                      mgstrata_here, mgstrata_open, mgstrata_adopt, NULL};
