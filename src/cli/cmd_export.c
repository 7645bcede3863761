/* cmd_export.c - `strata export`: a checkpoint to Hugging Face safetensors files, with
 * bounded memory. A thin wrapper of strata_export_safetensors (src/tools/export.c): the
 * arguments, --help, the progress line on a terminal, and SIGINT / SIGTERM / SIGHUP, which
 * stop the export through its progress callback (OUT is left as it was; progress.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char EXPORT_HELP[] =
    "usage: strata export CKPT OUT [--format safetensors] [--prefix P] [--max-file-gb N]\n"
    "                     [--dtype bf16] [--include GLOB]... [--exclude GLOB]...\n"
    "                     [--model-only[=P]] [--skip-crc] [--quiet]\n"
    "\n"
    "Writes the checkpoint's tensors, merged to their full global shapes from whatever\n"
    "shards, flat pieces and replicas were saved, as Hugging Face safetensors into the\n"
    "directory OUT (made if missing): model-0000i-of-0000N.safetensors files and\n"
    "model.safetensors.index.json ({\"metadata\": {\"total_size\": N}, \"weight_map\":\n"
    "{name: file}}); when everything fits one file, model.safetensors alone (no index, as\n"
    "Hugging Face writes it). Blobs (non-tensor state) are not exported.\n"
    "\n"
    "  --format F       only safetensors (the default)\n"
    "  --prefix P       strip P from the start of tensor names; names without P are\n"
    "                   exported unchanged\n"
    "  --max-file-gb N  the most tensor bytes per file, in GB of 10^9 bytes (default 5;\n"
    "                   a fraction such as 0.5 is allowed); a tensor larger than that gets\n"
    "                   a file of its own\n"
    "  --dtype bf16     convert floating tensors (f64, f32, f16) to bf16, rounding to\n"
    "                   nearest even; others are written as saved. Without it every tensor\n"
    "                   keeps its saved dtype\n"
    "  --include GLOB   export only tensors whose name in the checkpoint matches GLOB\n"
    "                   (repeatable: any of them); an fnmatch pattern on the whole name,\n"
    "                   where * and ? match any characters, '.' and '/' too: 'model.*'\n"
    "  --exclude GLOB   leave out tensors whose name matches GLOB (repeatable); exclude\n"
    "                   wins over include: --exclude '*.exp_avg*' --exclude '*@rank*'\n"
    "  --model-only[=P] export what the model's state_dict holds, for a state saved by\n"
    "                   strata.torch as {P: model, \"optim\": optimizer, ...} (P default\n"
    "                   model): only tensors named P.<name>, written as <name> (P.\n"
    "                   stripped), never a per-rank one (<key>@rank<r>); optimizer state\n"
    "                   (optim.*), the step and other entries are left out. Not with\n"
    "                   --prefix. With --include/--exclude, their patterns match the\n"
    "                   names in the checkpoint (model.layers.0.w)\n"
    "                   On a DeepSpeed checkpoint (its default engine's, or saved through\n"
    "                   strata.deepspeed): the model's tensors, as without options\n"
    "                   A selection that keeps no tensor is an error (exit 1), nothing written\n"
    "  --skip-crc       leave the zip CRC-32s of a DCP, torch.save, DeepSpeed or Megatron\n"
    "                   checkpoint unchecked (only the bytes exported are read; the last\n"
    "                   line says so). strata's own checksums are always verified\n"
    "  --quiet          no progress line (it is shown only when stderr is a terminal)\n"
    "\n"
    "A DeepSpeed checkpoint (a tag, or the save_dir whose `latest` names one) exports what\n"
    "zero_to_fp32 gives: its optimizer moments (optim.state.*) and, in a tag saved through\n"
    "strata.deepspeed, DeepSpeed's files as saved (<file>#<i>) only when --include names\n"
    "them.\n"
    "\n"
    "Memory stays bounded whatever the model size: tensors are loaded in windows of at\n"
    "most 64 MiB (flat element ranges of the tensor) into one reused buffer. Every\n"
    "checksum is verified while reading, before OUT is replaced: strata's own, and the\n"
    "zip CRC-32 of every entry of a DCP, torch.save, DeepSpeed or Megatron checkpoint\n"
    "that holds a byte exported (the rest of such an entry is read too). safetensors has\n"
    "no checksum. A corrupt or incomplete checkpoint exits 3, naming the tensor, the zip\n"
    "entry and the file.\n"
    "\n"
    "All or nothing: OUT is replaced as a whole. The files are written into a staging\n"
    "directory beside it (OUT.strata-export-<id>), and when all are complete and on disk\n"
    "they take OUT's place in one step; readers of OUT see its previous files or the new\n"
    "ones, never a mix. On any failure, or Ctrl-C (exit 1), OUT is left as it was; an export\n"
    "killed outright leaves only its staging directory, which the next export to OUT\n"
    "removes (so does strata gc of OUT's parent). So OUT must be missing, empty, or hold\n"
    "only an earlier export's files: any other file there (a config.json) is refused (exit\n"
    "1), nothing touched; put such files beside the export, or copy them in after it. A\n"
    "tensor named __metadata__ (the key safetensors keeps for the file's metadata) cannot\n"
    "be exported (exit 1).\n";

static int export_run(int argc, char **argv, const char **inc, const char **exc);

/* The --include / --exclude lists are NULL-terminated arrays of at most argc patterns. */
int cmd_export(int argc, char **argv)
{
    const char **inc = calloc((size_t)argc + 1, sizeof *inc),
               **exc = calloc((size_t)argc + 1, sizeof *exc);
    if (!inc || !exc) {
        free(inc);
        free(exc);
        fprintf(stderr, "strata export: out of memory\n");
        return EXIT_OPFAIL;
    }
    int rc = export_run(argc, argv, inc, exc);
    free(inc);
    free(exc);
    return rc;
}

static int export_run(int argc, char **argv, const char **inc, const char **exc)
{
    const char *ckpt = NULL, *out = NULL;
    strata_export_opts o = STRATA_EXPORT_OPTS_INIT;
    double max_gb = 5;
    int quiet = 0, ninc = 0, nexc = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(EXPORT_HELP, stdout);
            return 0;
        } else if (strcmp(a, "--quiet") == 0 || strcmp(a, "-q") == 0) {
            quiet = 1;
        } else if (strcmp(a, "--skip-crc") == 0) {
            o.flags |= STRATA_EXPORT_SKIP_CRC;
        } else if (strcmp(a, "--format") == 0 && has_val) {
            if (strcmp(argv[++i], "safetensors") != 0) {
                fprintf(stderr, "strata export: unknown --format '%s' (only safetensors)\n",
                        argv[i]);
                return EXIT_USAGE;
            }
        } else if (strcmp(a, "--include") == 0 && has_val) {
            inc[ninc++] = argv[++i];
            o.include = inc;
        } else if (strcmp(a, "--exclude") == 0 && has_val) {
            exc[nexc++] = argv[++i];
            o.exclude = exc;
        } else if (strcmp(a, "--model-only") == 0) {
            o.model_only = "model";
        } else if (strncmp(a, "--model-only=", 13) == 0) {
            o.model_only = a + 13;
        } else if (strcmp(a, "--prefix") == 0 && has_val) {
            o.prefix = argv[++i];
        } else if (strcmp(a, "--dtype") == 0 && has_val) {
            if (strcmp(argv[++i], "bf16") != 0) {
                fprintf(stderr, "strata export: unsupported --dtype '%s' (only bf16)\n",
                        argv[i]);
                return EXIT_USAGE;
            }
            o.flags |= STRATA_EXPORT_BF16;
        } else if (strcmp(a, "--max-file-gb") == 0 && has_val) {
            char *end;
            max_gb = strtod(argv[++i], &end);
            if (*end || !(max_gb > 0) || max_gb > 1e9) {
                fprintf(stderr, "strata export: bad --max-file-gb '%s' (a number > 0)\n",
                        argv[i]);
                return EXIT_USAGE;
            }
        } else if (a[0] != '-' && !ckpt) {
            ckpt = a;
        } else if (a[0] != '-' && !out) {
            out = a;
        } else {
            fprintf(stderr, "strata export: unexpected argument '%s' (see --help)\n", a);
            return EXIT_USAGE;
        }
    }
    if (!ckpt || !out) {
        fputs(EXPORT_HELP, stderr);
        return EXIT_USAGE;
    }
    o.max_file_bytes = (uint64_t)(max_gb * 1e9);
    if (o.max_file_bytes == 0)
        o.max_file_bytes = 1;
    cli_progress p;
    cli_progress_start(&p, "export", "the export stopped and its output directory is as it was",
                       quiet);
    o.progress = cli_progress_cb;
    o.progress_ctx = &p;
    /* a DeepSpeed save_dir: the tag its `latest` names now is the one exported (by its
     * path: a `latest` that moves meanwhile changes nothing) and said */
    char tag[256] = "", *by_tag = NULL;
    strata_ckpt *ck;
    if (strata_ckpt_open(&ck, ckpt, 0) == 0) {
        if (strata_ckpt_tag(ck) && asprintf(&by_tag, "%s/%s", ckpt, strata_ckpt_tag(ck)) > 0)
            snprintf(tag, sizeof tag, " from tag %s (named by its latest)",
                     cli_esc(strata_ckpt_tag(ck)));
        strata_ckpt_free(ck);
    }
    strata_stats st = STRATA_STATS_INIT;
    int rc = strata_export_safetensors(&st, by_tag ? by_tag : ckpt, out, &o);
    free(by_tag);
    cli_progress_end(&p, !rc);
    if (rc)
        return cli_fail("export", rc);
    if (!quiet)
        printf("exported %llu tensor bytes (%llu read)%s to %s in %.2f s%s\n",
               (unsigned long long)st.bytes, (unsigned long long)st.data_bytes, tag,
               cli_esc(out), st.seconds,
               st.crc_skipped ? " (zip CRC-32s not checked: --skip-crc)" : "");
    return 0;
}
