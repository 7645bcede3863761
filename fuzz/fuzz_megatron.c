/* fuzz_megatron.c - libFuzzer target for the Megatron torch_dist readers (src/source/megatron.c):
 * the input is read as a metadata.json (st_mg_parse_config) and as a DCP .metadata whose
 * mcore_data is looked up (st_mg_reforms). An accepted config names torch_dist (version 1 or
 * none, common backend torch or none); a refusal must be STRATA_EFORMAT or STRATA_ENOTSUP
 * naming the file. Accepted mcore_data entries have 1..STRATA_MAX_DIMS-1 dims and distinct
 * names, and are applied to a metadata of one matching tensor (st_mg_unflatten): on success
 * every shard's flat range lies inside its box. Any violation is abort(). Also replayed by
 * tests/test_fuzz_replay.c (seed-valid-* must be accepted as a config, seed-reject-*
 * refused). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "source/megatron.h"

#define FMG_FAIL(...)                                                                        \
    do {                                                                                     \
        fprintf(stderr, "fuzz_megatron: " __VA_ARGS__);                                     \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

static void fmg_refused(int rc, const char *what)
{
    const char *m = strata_error_last();
    if (rc != STRATA_EFORMAT && rc != STRATA_ENOTSUP && rc != STRATA_ENOMEM)
        FMG_FAIL("%s refused with %d", what, rc);
    if (rc != STRATA_ENOMEM && (!m || !strstr(m, "in.json")))
        FMG_FAIL("%s: the message does not name the file: %s", what, m ? m : "(none)");
}

/* One tensor shaped as the reformulation of r would be, one (1..1, l) chunk per box. */
static void fmg_apply(const st_mg_reform *r)
{
    st_meta m = {0};
    st_mtensor t = {0};
    st_mshard s[4];
    uint64_t off[4][STRATA_MAX_DIMS] = {{0}}, len[4][STRATA_MAX_DIMS] = {{0}};
    t.name = (char *)r->name;
    t.ndim = r->ndim + 1;
    uint64_t numel = 1;
    for (int d = 0; d < r->ndim; d++) {
        t.shape[d] = r->orig[d] ? 1 + r->orig[d] % 3 : 1;
        numel *= r->orig[d] / t.shape[d] + (r->orig[d] % t.shape[d] != 0);
        if (numel > (1u << 20))
            return;
    }
    t.shape[r->ndim] = numel;
    t.nshards = 1;
    for (int d = 0; d <= r->ndim; d++)
        len[0][d] = 1;
    len[0][r->ndim] = numel;
    s[0] = (st_mshard){off[0], len[0], 0, numel, 0, {0, 0, numel * 4, NULL}, 0};
    t.shards = s;
    m.ntensors = 1;
    m.tensors = &t;
    int rc = st_mg_unflatten(&m, r, 1, "in.json");
    if (rc) {
        fmg_refused(rc, "unflatten");
        return;
    }
    if (t.ndim != r->ndim || s[0].fs > s[0].fe)
        FMG_FAIL("unflatten: %d dims, flat range %llu..%llu", t.ndim,
                 (unsigned long long)s[0].fs, (unsigned long long)s[0].fe);
    uint64_t box = 1;
    for (int d = 0; d < t.ndim; d++) {
        if (s[0].off[d] + s[0].len[d] > t.shape[d])
            FMG_FAIL("unflatten: a box outside the tensor");
        box *= s[0].len[d];
    }
    if (s[0].fe > box)
        FMG_FAIL("unflatten: a flat range past its box");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_mg_config c;
    int rc = st_mg_parse_config(&c, data, size, "in.json");
    if (rc == 0) {
        if ((strcmp(c.sharded_backend, "torch_dist") != 0 &&
             strcmp(c.sharded_backend, ST_MG_STRATA) != 0) ||
            (c.sharded_backend_version != -1 && c.sharded_backend_version != 1) ||
            (c.common_backend[0] && strcmp(c.common_backend, "torch") != 0))
            FMG_FAIL("accepted backend '%s' v%lld, common '%s'", c.sharded_backend,
                     (long long)c.sharded_backend_version, c.common_backend);
    } else {
        fmg_refused(rc, "config");
    }
    pk_doc doc;
    st_mg_reform *r = NULL;
    size_t n = 0;
    rc = st_mg_reforms(&doc, &r, &n, data, size, "in.json");
    if (rc == 0) {
        for (size_t i = 0; i < n; i++) {
            if (r[i].ndim < 1 || r[i].ndim >= STRATA_MAX_DIMS)
                FMG_FAIL("mcore_data: %d dims", r[i].ndim);
            for (size_t k = 0; k < i; k++)
                if (strcmp(r[i].name, r[k].name) == 0)
                    FMG_FAIL("mcore_data: '%s' twice", r[i].name);
            fmg_apply(&r[i]);
        }
    }
    free(r);
    pk_free(&doc);
    return 0;
}
