/* source.c - the table of load sources (source.h): the one file that names them. */
#include "readers.h"

/* The order they are tried in: a source's here refuses what one before it claims (a
 * strata.megatron checkpoint before torch_dist's: both hold a metadata.json); strata's own
 * last (a directory holding its commit record or files). A source's index travels in
 * broadcasts (st_source_id): a new one goes before st_source_strata. */
static const st_source *const sources[] = {
    &st_source_safetensors, &st_source_mgstrata, &st_source_megatron, &st_source_dcp,
    &st_source_torchsave,   &st_source_zero,     &st_source_dstag,    &st_source_strata};
#define NSOURCES (sizeof sources / sizeof sources[0])

const st_source *st_source_find(const st_vfs *v, const char *path, int kind)
{
    for (size_t i = 0; i < NSOURCES; i++)
        if (sources[i]->here(v, path, kind))
            return sources[i];
    return NULL;
}

uint32_t st_source_id(const st_source *s)
{
    for (size_t i = 0; s && i < NSOURCES; i++)
        if (sources[i] == s)
            return (uint32_t)i + 1;
    return 0;
}

const st_source *st_source_by_id(uint32_t id)
{
    return id >= 1 && id <= NSOURCES ? sources[id - 1] : NULL;
}
