/* zero.h - DeepSpeed ZeRO checkpoints written by DeepSpeed's default checkpoint engine (one
 * torch.save file per rank and kind, DeepSpeed 0.19.8) read as named full tensors, each made
 * of flat element ranges at byte offsets in the rank files. Pure: works on archives opened
 * by torchsave.h (their pickles and tensors placed); no I/O; fuzzable.
 *
 * A tag directory holds, for model-parallel rank 00 (the only one strata reads):
 *   stage 1, 2: mp_rank_00_model_states.pt and one [bf16_]zero_pp_rank_<r>_mp_rank_00_
 *               optim_states.pt per data-parallel rank r;
 *   stage 3:    zero_pp_rank_<r>_mp_rank_00_model_states.pt and the optim file, per rank.
 * What it presents (docs/FORMAT.md, "DeepSpeed ZeRO as strata reads it"), zero_to_fp32's
 * result name for name:
 *   <fqn>                      the fp32 master weight of each parameter of param_shapes, cut
 *                              from the ranks' flat fp32 partitions (stage 1/2: the groups'
 *                              partitions concatenated over ranks, the parameters one after
 *                              the other with param_alignment_paddings; stage 3: each
 *                              parameter ceil(numel / ranks) elements on each rank); frozen
 *                              parameters (frozen_param_fragments), buffers (buffer_names,
 *                              from the module) and shared_params (an alias: the same pieces);
 *   optim.state.<fqn>.<key>    each per-element tensor of the base optimizer's state for the
 *                              parameter's group (AdamW: exp_avg, exp_avg_sq), cut the same way.
 * Errors, each naming the file and the tensor: STRATA_EUNFILLED (the partitions do not cover
 * a parameter), STRATA_EMISMATCH (param_shapes and the partitions' sizes disagree; ranks that
 * disagree), STRATA_ENOTSUP (a partition that is not fp32; model parallelism), STRATA_EFORMAT
 * (a key missing or of the wrong kind), STRATA_ENOMEM. Not thread-safe per call's objects. */
#ifndef STRATA_ZERO_H
#define STRATA_ZERO_H
#include <stddef.h>
#include <stdint.h>

#include "../meta/meta.h"
#include "torchsave.h"

#define ST_ZERO_LATEST "latest"      /* a save_dir's file naming its newest tag */
#define ST_ZERO_MAX_LATEST 4096      /* bytes of it a reader accepts */
#define ST_ZERO_MAX_RANKS 65536      /* data-parallel ranks a reader accepts */
#define ST_ZERO_MODEL12 "mp_rank_00_model_states.pt"
#define ST_ZERO_MODEL_FMT "zero_pp_rank_%u_mp_rank_00_model_states.pt"
#define ST_ZERO_OPTIM_FMT "%szero_pp_rank_%u_mp_rank_00_optim_states.pt" /* "" or "bf16_" */

/* What an optim file's pickle says of the checkpoint: its ZeRO stage (1, 2, 3) and the number
 * of data-parallel ranks (partition_count: the largest, when a list). Errors: STRATA_EFORMAT,
 * STRATA_ENOTSUP (a stage other than 1-3), naming file. */
int st_zero_optim_info(const st_ts_archive *a, int *stage, uint32_t *ranks, const char *file);

/* Builds the foreign metadata of a ZeRO checkpoint of `stage` over `ranks` data-parallel
 * ranks: files[0, nmodel) are its model-states files (1 for stage 1/2, `ranks` for stage 3,
 * in rank order), files[nmodel, nmodel + ranks) its optim files in rank order; the metadata's
 * files are these, in this order. Tensors sorted by name, empty ones left out; step is
 * global_steps; the check table holds the files' zip entries that hold a tensor's bytes
 * (their CRC-32s). Errors: as above, naming `where` and the file. */
int st_zero_meta(st_meta **out, const st_ts_file *files, size_t nmodel, int stage,
                 uint32_t ranks, const char *where);

#endif
