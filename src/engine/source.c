/* source.c - the table of load sources (source.h) and what they share. */
#include "source.h"

#include "../core/error.h"

const st_source *const st_sources[] = {&st_source_safetensors, &st_source_megatron,
                                         &st_source_dcp};
const size_t st_nsources = sizeof st_sources / sizeof st_sources[0];

const st_source *st_source_find(const st_vfs *v, const char *path, int kind)
{
    for (size_t i = 0; i < st_nsources; i++)
        if (st_sources[i]->here(v, path, kind))
            return st_sources[i];
    return NULL;
}

uint32_t st_source_id(const st_source *s)
{
    for (size_t i = 0; s && i < st_nsources; i++)
        if (st_sources[i] == s)
            return (uint32_t)i + 1;
    return 0;
}

const st_source *st_source_by_id(uint32_t id)
{
    return id >= 1 && id <= st_nsources ? st_sources[id - 1] : NULL;
}

int st_source_describe(const st_dir *d, unsigned char **desc, size_t *desclen)
{
    return st_meta_encode(d->meta, desc, desclen);
}

int st_source_adopt_meta(st_dir *d, const unsigned char *desc, size_t len)
{
    int rc = st_meta_decode_foreign(&d->meta, desc, len);
    if (rc)
        return st_wrap(rc, "checkpoint '%s': the index another rank read", d->path);
    d->committed = 1;
    return 0;
}
