/* synth.h - the synthetic GPT-style training state of `strata demo` and `strata bench`:
 * model, Megatron-style layouts (tp, pp, dp, zero), deterministic values. Uses only the
 * public API. Not thread-safe. */
#ifndef STRATA_SYNTH_H
#define STRATA_SYNTH_H
#include <stdint.h>

#include "strata.h"

typedef struct {
    int tp, pp, dp, zero;
} layout;

/* Parses "tp=2,pp=2,dp=2[,zero=1]" (missing keys are 1, zero 0). 0 or -1 with a message
 * in err. */
int layout_parse(layout *out, const char *s, char *err, size_t errlen);
int layout_world(const layout *l);
void layout_format(const layout *l, char *out, size_t cap);

typedef struct {
    char name[128];
    strata_dtype dtype;
    int ndim;
    uint64_t shape[2];
    int split;     /* tensor-parallel split dim: 0, 1, or -1 replicated */
    int stage;     /* pipeline stage holding it (-1: computed from layer) */
    int layer;     /* -1 for embedding/final */
    int param;     /* index of the model parameter it belongs to */
    int is_optim;
} synth_tensor;

typedef struct {
    int layers;
    uint64_t hidden, ffn, vocab;
    int ntensors, nparams;
    synth_tensor *t; /* params first (nparams), then optimizer state */
} synth_model;

/* A model whose distinct state (bf16 params + fp32 master, exp_avg, exp_avg_sq) is about
 * size_mb MiB, with deliberately odd sizes. */
int synth_model_build(synth_model *m, uint64_t size_mb);
/* The same with a given number of layers (4 * (3 + 12 * layers) tensors). */
int synth_model_build_layers(synth_model *m, uint64_t size_mb, int layers);
void synth_model_free(synth_model *m);
uint64_t synth_model_bytes(const synth_model *m);

/* One shard a rank holds. */
typedef struct {
    int tensor;
    uint64_t off[2], len[2];
    int flat;
    uint64_t fs, fe;
    void *data;
    int replica; /* registered STRATA_SHARD_REPLICA: another rank holds the main copy */
} synth_shard;

typedef struct {
    int nranks;
    int *nshards;
    synth_shard **shards;
} synth_ranks;

/* Lays the model out as l: the shards each rank holds (data not yet allocated), one main
 * copy of each piece and the others marked replicas, as Megatron registers them. */
int synth_layout(synth_ranks *out, const synth_model *m, const layout *l);
/* The same for rank r alone: its shards into v (room for m->ntensors), their number
 * returned; base: scratch of m->nparams entries. l may have more than 4096 ranks. */
int synth_layout_rank(synth_shard *v, const synth_model *m, const layout *l, int r,
                      uint64_t *base);
void synth_ranks_free(synth_ranks *r);

/* Fills a shard with the deterministic values of its tensor. */
void synth_fill(const synth_model *m, const synth_shard *s);
/* Counts the elements that differ from the deterministic values; *first gets the first
 * bad global index. */
uint64_t synth_check(const synth_model *m, const synth_shard *s, uint64_t *first);
uint64_t synth_shard_bytes(const synth_model *m, const synth_shard *s);

/* Registers n shards (their data must be set) with a strata_state. */
int synth_register(strata_state *st, const synth_model *m, const synth_shard *sh, int n);

/* Deterministic bytes of a blob (name, owner rank or -1). */
void synth_blob(const char *name, int owner, unsigned char *out, uint64_t n);

/* The demo's per-rank blobs: "rng" and "dataloader" bytes (synth_blob of these sizes). */
#define SYNTH_RNG_BYTES 5003
#define SYNTH_LOADER_BYTES 777
/* The demo's global "train.config" blob: a JSON description of m. */
void synth_config(const synth_model *m, char *out, size_t cap);

#endif
