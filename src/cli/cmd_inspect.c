/* cmd_inspect.c - `strata inspect`, `strata ls`, `strata verify`, `strata gc`. Names, paths
 * and messages in text output go through cli_esc: a checkpoint cannot drive the terminal. */
#include <stdio.h>
#include <stdlib.h>
#include <limits.h>
#include <string.h>

#include "cli.h"

static void print_shape(FILE *f, int ndim, const uint64_t *v)
{
    fputc('[', f);
    for (int d = 0; d < ndim; d++)
        fprintf(f, d ? ",%llu" : "%llu", (unsigned long long)v[d]);
    fputc(']', f);
}

static const char INSPECT_HELP[] =
    "usage: strata inspect CKPT [--json] [--shards]\n"
    "\n"
    "Shows a checkpoint: step, commit state, files, and per tensor its dtype, global shape,\n"
    "shard count and bytes; --shards also lists each shard (box offsets and lengths, flat\n"
    "range, file, offset, bytes) and blob. --json prints everything, shards included, as one\n"
    "JSON object. An incomplete checkpoint is shown if its metadata is readable, marked so.\n"
    "CKPT may also be a Hugging Face safetensors directory (model.safetensors, or the files\n"
    "of model.safetensors.index.json) or one .safetensors file: shown the same way, each\n"
    "tensor one shard, and marked as having no checksums. So may a torch.save file (.pt,\n"
    "  .pth, .bin; zip format) or a Hugging Face directory of pytorch_model.bin or the files\n"
    "of pytorch_model.bin.index.json: each tensor one shard (its bytes in the archive), and\n"
    "each file's pickle of values one blob; no strata checksums (verify checks the zip's\n"
    "CRC-32s). So may a DeepSpeed ZeRO checkpoint of its default engine (a tag directory, or\n"
    "the save_dir whose `latest` names one): the fp32 weights and each optimizer moment as\n"
    "named full tensors, each made of the ranks' flat pieces; and a DeepSpeed tag saved\n"
    "through strata.deepspeed (or its save_dir): its strata checkpoint, tag/strata. Read\n"
    "through a save_dir, the tag `latest` named is shown.\n";

/* The bytes of the files an incremental checkpoint links from its base (ref-*.bin,
 * docs/FORMAT.md), from its metadata; 0 for a full one or unreadable metadata. */
static uint64_t linked_bytes(const char *path)
{
    strata_ckpt *ck;
    uint64_t n = 0;
    if (strata_ckpt_open(&ck, path, STRATA_OPEN_INCOMPLETE) != 0)
        return 0;
    for (size_t i = 0; strata_ckpt_format(ck) == STRATA_FORMAT_STRATA &&
                       i < strata_ckpt_nfiles(ck); i++) {
        strata_file_info fi;
        strata_ckpt_file(&fi, ck, i);
        if (strncmp(fi.name, "ref-", 4) == 0)
            n += fi.bytes;
    }
    strata_ckpt_free(ck);
    return n;
}

/* For a DeepSpeed save_dir read through its `latest`, "tag T (named by latest), "; for a
 * strata.deepspeed tag or a strata.megatron checkpoint, where its data was read ("read from
 * P/T/strata: "); else "". */
static const char *ds_tag(const strata_ckpt *ck, const char *path)
{
    static char buf[2 * PATH_MAX];
    const char *tag = strata_ckpt_tag(ck);
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        n--;
    int k = tag ? snprintf(buf, sizeof buf, "tag %s (named by latest), ", cli_esc(tag)) : 0;
    buf[k] = 0;
    if (strata_ckpt_format(ck) == STRATA_FORMAT_STRATA_DEEPSPEED ||
        strata_ckpt_format(ck) == STRATA_FORMAT_STRATA_MEGATRON)
        snprintf(buf + k, sizeof buf - k, "read from %.*s%s%s/strata: ", (int)n, cli_esc(path),
                 tag ? "/" : "", tag ? cli_esc(tag) : "");
    return buf;
}

/* --json: everything, shards included, as one JSON object. */
static void inspect_json(const strata_ckpt *ck, const char *path)
{
    size_t nt = strata_ckpt_ntensors(ck), nb = strata_ckpt_nblobs(ck), nf = strata_ckpt_nfiles(ck);
    printf("{\"path\":");
    cli_json_str(stdout, path);
    printf(",\"format\":\"%s\",\"checksums\":%s",
           strata_ckpt_format_name(ck),
           strata_ckpt_chunk_bytes(ck) ? "true" : "false");
    printf(",\"tag\":");
    if (strata_ckpt_tag(ck))
        cli_json_str(stdout, strata_ckpt_tag(ck));
    else
        printf("null");
    printf(",\"committed\":%s,\"step\":%llu,\"data_bytes\":%llu,\"chunk_bytes\":%u",
           strata_ckpt_committed(ck) ? "true" : "false",
           (unsigned long long)strata_ckpt_step(ck),
           (unsigned long long)strata_ckpt_data_bytes(ck), strata_ckpt_chunk_bytes(ck));
    uint64_t own;
    const char *base = strata_ckpt_base(ck, &own);
    printf(",\"base\":");
    if (base)
        cli_json_str(stdout, base);
    else
        printf("null");
    printf(",\"written_bytes\":%llu,\"linked_file_bytes\":%llu,\"files\":[",
           (unsigned long long)own, (unsigned long long)linked_bytes(path));
    for (size_t i = 0; i < nf; i++) {
        strata_file_info fi;
        strata_ckpt_file(&fi, ck, i);
        printf("%s{\"name\":", i ? "," : "");
        cli_json_str(stdout, fi.name);
        printf(",\"bytes\":%llu}", (unsigned long long)fi.bytes);
    }
    printf("],\"tensors\":[");
    for (size_t i = 0; i < nt; i++) {
        strata_tensor_info t;
        strata_ckpt_tensor(&t, ck, i);
        printf("%s{\"name\":", i ? "," : "");
        cli_json_str(stdout, t.name);
        printf(",\"dtype\":\"%s\",\"shape\":", strata_dtype_name(t.dtype));
        print_shape(stdout, t.ndim, t.shape);
        printf(",\"bytes\":%llu,\"shards\":[", (unsigned long long)t.bytes);
        for (size_t s = 0; s < t.nshards; s++) {
            strata_shard_info si;
            strata_ckpt_shard(&si, ck, i, s);
            printf("%s{\"offsets\":", s ? "," : "");
            print_shape(stdout, t.ndim, si.offsets);
            printf(",\"lengths\":");
            print_shape(stdout, t.ndim, si.lengths);
            if (si.flat)
                printf(",\"flat\":[%llu,%llu]", (unsigned long long)si.flat_start,
                       (unsigned long long)si.flat_end);
            printf(",\"file\":");
            cli_json_str(stdout, si.file);
            printf(",\"offset\":%llu,\"bytes\":%llu}", (unsigned long long)si.file_offset,
                   (unsigned long long)si.bytes);
        }
        printf("]}");
    }
    printf("],\"blobs\":[");
    for (size_t i = 0; i < nb; i++) {
        strata_blob_info b;
        strata_ckpt_blob(&b, ck, i);
        printf("%s{\"name\":", i ? "," : "");
        cli_json_str(stdout, b.name);
        printf(",\"owner\":%d,\"file\":", b.owner);
        cli_json_str(stdout, b.file);
        printf(",\"offset\":%llu,\"bytes\":%llu}", (unsigned long long)b.file_offset,
               (unsigned long long)b.bytes);
    }
    printf("]}\n");
}

/* The text form's first line: what the checkpoint is, and whether it carries checksums. */
static void inspect_head(const strata_ckpt *ck, const char *path)
{
    size_t nt = strata_ckpt_ntensors(ck), nb = strata_ckpt_nblobs(ck), nf = strata_ckpt_nfiles(ck);
    if (strata_ckpt_format(ck) == STRATA_FORMAT_SAFETENSORS)
        printf("safetensors %s: %zu tensors, %llu data bytes in %zu files; NO CHECKSUMS "
               "(safetensors has none: corrupted bytes cannot be detected)\n",
               cli_esc(path), nt, (unsigned long long)strata_ckpt_data_bytes(ck), nf);
    else if (strata_ckpt_format(ck) == STRATA_FORMAT_DCP ||
             strata_ckpt_format(ck) == STRATA_FORMAT_MEGATRON)
        printf("%s %s: %zu tensors, %zu blobs, %llu data bytes in %zu files; NO "
               "strata CHECKSUMS (verify checks the zip CRC-32 of each item)\n",
               strata_ckpt_format(ck) == STRATA_FORMAT_DCP ? "PyTorch DCP"
                                                           : "Megatron-Core torch_dist",
               cli_esc(path), nt, nb, (unsigned long long)strata_ckpt_data_bytes(ck), nf);
    else if (strata_ckpt_format(ck) == STRATA_FORMAT_DEEPSPEED)
        printf("DeepSpeed ZeRO %s: %sstep %llu, %zu tensors, %llu data bytes in %zu files; NO "
               "strata CHECKSUMS (verify checks the zip CRC-32 of each entry)\n",
               cli_esc(path), ds_tag(ck, path), (unsigned long long)strata_ckpt_step(ck), nt,
               (unsigned long long)strata_ckpt_data_bytes(ck), nf);
    else if (strata_ckpt_format(ck) == STRATA_FORMAT_TORCH_SAVE)
        printf("torch.save %s: %zu tensors, %zu pickle%s of values, %llu data bytes in %zu "
               "files; NO STRATA CHECKSUMS (only the zip's CRC-32 per entry, which verify "
               "checks)\n",
               cli_esc(path), nt, nb, nb == 1 ? "" : "s",
               (unsigned long long)strata_ckpt_data_bytes(ck), nf);
    else
        printf("%s %s: %s%s, step %llu, %zu tensors, %zu blobs, %llu data bytes in %zu files, "
               "checksum chunk %u bytes\n",
               strata_ckpt_format(ck) == STRATA_FORMAT_STRATA_DEEPSPEED
                   ? "DeepSpeed (strata.deepspeed)"
               : strata_ckpt_format(ck) == STRATA_FORMAT_STRATA_MEGATRON
                   ? "Megatron-Core (strata.megatron)"
                   : "checkpoint",
               cli_esc(path), ds_tag(ck, path),
               strata_ckpt_committed(ck) ? "committed" : "INCOMPLETE (no valid commit record)",
               (unsigned long long)strata_ckpt_step(ck), nt, nb,
               (unsigned long long)strata_ckpt_data_bytes(ck), nf, strata_ckpt_chunk_bytes(ck));
}

/* The text form's shards of tensor i (--shards). */
static void inspect_shards(const strata_ckpt *ck, size_t i, const strata_tensor_info *t)
{
    for (size_t s = 0; s < t->nshards; s++) {
        strata_shard_info si;
        strata_ckpt_shard(&si, ck, i, s);
        printf("      offsets ");
        print_shape(stdout, t->ndim, si.offsets);
        printf(" lengths ");
        print_shape(stdout, t->ndim, si.lengths);
        if (si.flat)
            printf(" flat [%llu,%llu)", (unsigned long long)si.flat_start,
                   (unsigned long long)si.flat_end);
        printf(" -> %s @%llu (%llu bytes)\n", cli_esc(si.file), (unsigned long long)si.file_offset,
               (unsigned long long)si.bytes);
    }
}

/* The text form: the head, the files, a row per tensor (and its shards), a row per blob. */
static void inspect_text(const strata_ckpt *ck, const char *path, int shards)
{
    size_t nt = strata_ckpt_ntensors(ck), nb = strata_ckpt_nblobs(ck), nf = strata_ckpt_nfiles(ck);
    inspect_head(ck, path);
    uint64_t own, all = strata_ckpt_data_bytes(ck);
    const char *base = strata_ckpt_base(ck, &own);
    if (base)
        printf("  incremental: base %s; %llu of %llu data bytes written by this save (%.2f%%), "
               "the rest in files linked from the base (%llu bytes of files, stored once)\n",
               cli_esc(base), (unsigned long long)own, (unsigned long long)all,
               all ? 100.0 * own / all : 0.0, (unsigned long long)linked_bytes(path));
    for (size_t i = 0; i < nf; i++) {
        strata_file_info fi;
        strata_ckpt_file(&fi, ck, i);
        printf("  file %-20s %14llu bytes%s\n", cli_esc(fi.name), (unsigned long long)fi.bytes,
               base && strncmp(fi.name, "ref-", 4) == 0 ? " (linked)" : "");
    }
    printf("\n  %-48s %-9s %-18s %7s %14s\n", "tensor", "dtype", "shape", "shards", "bytes");
    for (size_t i = 0; i < nt; i++) {
        strata_tensor_info t;
        strata_ckpt_tensor(&t, ck, i);
        char shape[64];
        FILE *m = fmemopen(shape, sizeof shape, "w");
        print_shape(m, t.ndim, t.shape);
        fclose(m);
        printf("  %-48s %-9s %-18s %7zu %14llu\n", cli_esc(t.name), strata_dtype_name(t.dtype), shape,
               t.nshards, (unsigned long long)t.bytes);
        if (shards)
            inspect_shards(ck, i, &t);
    }
    if (nb)
        printf("\n  %-48s %-9s %-18s %7s %14s\n", "blob", "owner", "file", "", "bytes");
    for (size_t i = 0; i < nb; i++) {
        strata_blob_info b;
        strata_ckpt_blob(&b, ck, i);
        char owner[16];
        snprintf(owner, sizeof owner, b.owner < 0 ? "global" : "rank %d", b.owner);
        printf("  %-48s %-9s %-18s %7s %14llu\n", cli_esc(b.name), owner, cli_esc(b.file), "",
               (unsigned long long)b.bytes);
    }
}

int cmd_inspect(int argc, char **argv)
{
    const char *path = NULL;
    int json = 0, shards = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(INSPECT_HELP, stdout);
            return 0;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--shards") == 0) {
            shards = 1;
        } else if (!path && argv[i][0] != '-') {
            path = argv[i];
        } else {
            fprintf(stderr, "strata inspect: unexpected argument '%s' (see --help)\n", argv[i]);
            return EXIT_USAGE;
        }
    }
    if (!path) {
        fputs(INSPECT_HELP, stderr);
        return EXIT_USAGE;
    }
    strata_ckpt *ck;
    int rc = strata_ckpt_open(&ck, path, STRATA_OPEN_INCOMPLETE);
    if (rc)
        return cli_fail("inspect", rc);
    if (json)
        inspect_json(ck, path);
    else
        inspect_text(ck, path, shards);
    strata_ckpt_free(ck);
    return 0;
}

static const char LS_HELP[] =
    "usage: strata ls DIR\n"
    "\n"
    "Lists every checkpoint directly under DIR (and DIR itself if it is one): its state,\n"
    "size on disk (bytes: all its files; written: those its save wrote; linked: the files\n"
    "an incremental checkpoint shares with its base by hard link, ref-*.bin, counted in\n"
    "every checkpoint that links them but stored once) and step. States: committed (valid commit record matching valid\n"
    "metadata), incomplete (no commit record: an interrupted or failed save), CORRUPT (a\n"
    "commit record that does not match; never removed by gc). Hugging Face safetensors\n"
    "directories are listed too, as safetensors (they have no checksums, nor a step), and\n"
    "torch.save files and directories (pytorch_model.bin), as torch.save; PyTorch DCP\n"
    "directories as dcp, or incomplete when .metadata is missing (dcp.save did not finish);\n"
    "DeepSpeed tags, a save_dir's tags with the one `latest` names marked (tags saved\n"
    "through strata.deepspeed with their strata checkpoint's state, size and step).\n"
    "DIR is a path or a file:// or mem:// URI (then the checkpoints are shown as URIs).\n";

/* Calls fn for DIR itself and each subdirectory that holds strata files; with `foreign`
 * set, for every other one too (pi->is_ckpt 0: fn tells what it is). */
typedef void (*ckpt_fn)(void *ctx, const char *path, const strata_probe_info *pi);

typedef struct {
    ckpt_fn fn;
    void *ctx;
    int foreign;
} walk_ctx;

static void visit(const char *path, const strata_probe_info *pi, const walk_ctx *w)
{
    if (pi->is_ckpt || w->foreign)
        w->fn(w->ctx, path, pi);
}

static int visit_child(void *ctx, const char *uri)
{
    const char *name = strrchr(uri, '/') + 1; /* uri is DIR "/" name */
    size_t len = strlen(name), k = strlen(STRATA_REPLACE_SUFFIX);
    if (name[0] == '.' && /* hidden, but for what a replacing save left */
        (len <= k || strcmp(name + len - k, STRATA_REPLACE_SUFFIX) != 0))
        return 0;
    strata_probe_info pi;
    if (strata_probe(&pi, uri) == 0)
        visit(uri, &pi, ctx);
    return 0;
}

/* DIR and its subdirectories, on any storage (a path, file://, mem://) */
static int for_each_ckpt(const char *cmd, const char *dir, ckpt_fn fn, void *ctx, int foreign)
{
    strata_probe_info pi;
    walk_ctx w = {fn, ctx, foreign};
    int rc = strata_probe(&pi, dir);
    if (rc)
        return cli_fail(cmd, rc);
    visit(dir, &pi, &w);
    rc = strata_list_dirs(dir, visit_child, &w);
    return rc ? cli_fail(cmd, rc) : 0;
}

typedef struct {
    const char *dir; /* DIR as given: visited first */
    int count;
    char latest[256]; /* DIR is a DeepSpeed save_dir: the tag its `latest` names */
    int dir_is_tag;   /* DIR is a strata.deepspeed tag (listed: not its strata/ again) */
} ls_ctx;

static void ls_header(ls_ctx *c)
{
    if (c->count++ == 0)
        printf("%-11s %14s %14s %14s %10s  %s\n", "state", "bytes", "written", "linked", "step",
               "checkpoint");
}

/* One strata checkpoint's row (path: its directory), shown as `shown` with a note. */
static void ls_row(ls_ctx *c, const char *path, const strata_probe_info *pi, const char *shown,
                   const char *note)
{
    ls_header(c);
    char step[24] = "-";
    uint64_t linked = 0;
    if (pi->committed || pi->has_metadata) {
        snprintf(step, sizeof step, "%llu", (unsigned long long)pi->step);
        linked = linked_bytes(path);
    }
    if (linked > pi->disk_bytes) /* a link's file gone since (a crash): not ours to count */
        linked = pi->disk_bytes;
    printf("%-11s %14llu %14llu %14llu %10s  %s%s\n",
           pi->committed ? "committed" : pi->has_commit ? "CORRUPT" : "incomplete",
           (unsigned long long)pi->disk_bytes, (unsigned long long)(pi->disk_bytes - linked),
           (unsigned long long)linked, step, cli_esc(shown), note);
}

/* " (latest)" when path is the tag DIR's `latest` names. */
static const char *latest_mark(const ls_ctx *c, const char *path)
{
    const char *name = strrchr(path, '/');
    return c->latest[0] && name && strcmp(name + 1, c->latest) == 0 ? " (latest)" : "";
}

/* A strata.deepspeed tag at path (or the tag `latest` names there): its strata checkpoint's
 * row, whatever its state. 0 if path/[tag/]strata holds no strata checkpoint. */
static int ls_dstag(ls_ctx *c, const char *path, const char *tag)
{
    char sub[8192], note[512];
    strata_probe_info si;
    snprintf(sub, sizeof sub, "%s/%s%sstrata", path, tag ? tag : "", tag ? "/" : "");
    if (strata_probe(&si, sub) != 0 || !si.is_ckpt)
        return 0;
    if (tag)
        snprintf(note, sizeof note, " (DeepSpeed, strata.deepspeed: its latest, tag %s)",
                 cli_esc(tag));
    else
        snprintf(note, sizeof note, " (DeepSpeed tag, strata.deepspeed)%s",
                 latest_mark(c, path));
    ls_row(c, sub, &si, path, note);
    return 1;
}

/* What is at path, which holds no strata files: another format's checkpoint (its files'
 * bytes, no step, no checksums), a strata.deepspeed tag, one that did not finish (a DCP
 * directory without .metadata: incomplete, why said), or nothing listed. */
static void ls_other(ls_ctx *c, const char *path)
{
    strata_ckpt *ck;
    int rc = strata_ckpt_open(&ck, path, STRATA_OPEN_INCOMPLETE);
    if (rc == STRATA_EINCOMPLETE) {
        char why[1024], is[8192];
        const char *msg = strata_error_last();
        snprintf(is, sizeof is, "'%s' is ", path);
        if (strncmp(msg, is, strlen(is)) == 0) /* "'P' is an incomplete ...": the rest */
            msg += strlen(is);
        snprintf(why, sizeof why, " (%s)", cli_esc(msg));
        if (!ls_dstag(c, path, NULL)) {
            ls_header(c);
            printf("%-11s %14s %14s %14s %10s  %s%s\n", "incomplete", "-", "-", "-", "-",
                   cli_esc(path), why);
        }
        return;
    }
    if (rc)
        return;
    int fmt = strata_ckpt_format(ck);
    const char *tag = strata_ckpt_tag(ck);
    if (fmt == STRATA_FORMAT_STRATA) {
        strata_ckpt_free(ck);
        return;
    }
    if (tag && strcmp(path, c->dir) == 0) { /* a save_dir: its tags are listed below */
        snprintf(c->latest, sizeof c->latest, "%s", tag);
        strata_ckpt_free(ck);
        return;
    }
    if (fmt == STRATA_FORMAT_STRATA_DEEPSPEED) {
        c->dir_is_tag |= !tag && strcmp(path, c->dir) == 0;
        ls_dstag(c, path, tag);
        strata_ckpt_free(ck);
        return;
    }
    if (fmt == STRATA_FORMAT_STRATA_MEGATRON) { /* its strata/ checkpoint's row */
        strata_probe_info si;
        char sub[8192];
        c->dir_is_tag |= strcmp(path, c->dir) == 0;
        snprintf(sub, sizeof sub, "%s/strata", path);
        if (strata_probe(&si, sub) == 0 && si.is_ckpt)
            ls_row(c, sub, &si, path, " (Megatron-Core, strata.megatron)");
        strata_ckpt_free(ck);
        return;
    }
    uint64_t bytes = 0;
    for (size_t i = 0; i < strata_ckpt_nfiles(ck); i++) {
        strata_file_info fi;
        strata_ckpt_file(&fi, ck, i);
        bytes += fi.bytes;
    }
    char note[512] = "";
    if (tag)
        snprintf(note, sizeof note, ", its latest: tag %s", cli_esc(tag));
    ls_header(c);
    printf("%-11s %14llu %14llu %14d %10s  %s (no checksums%s)%s\n", strata_ckpt_format_name(ck),
           (unsigned long long)bytes, (unsigned long long)bytes, 0, "-", cli_esc(path), note,
           latest_mark(c, path));
    strata_ckpt_free(ck);
}

static void ls_one(void *ctx, const char *path, const strata_probe_info *pi)
{
    ls_ctx *c = ctx;
    const char *name = strrchr(path, '/');
    if (c->dir_is_tag && name && strcmp(name + 1, "strata") == 0)
        return; /* the tag's own strata checkpoint: the tag's row shows it */
    if (pi->is_ckpt)
        ls_row(c, path, pi, path, "");
    else
        ls_other(c, path);
}

/* For commands that take exactly one operand: -1 to go on, else the exit status. */
static int one_operand(int argc, char **argv, const char *help)
{
    if (cli_wants_help(argc, argv)) {
        fputs(help, stdout);
        return 0;
    }
    if (argc != 2 || argv[1][0] == '-') {
        fputs(help, stderr);
        return EXIT_USAGE;
    }
    return -1;
}

int cmd_ls(int argc, char **argv)
{
    int st = one_operand(argc, argv, LS_HELP);
    if (st >= 0)
        return st;
    ls_ctx c = {.dir = argv[1]};
    int rc = for_each_ckpt("ls", argv[1], ls_one, &c, 1);
    if (rc || c.count)
        return rc;
    strata_ckpt *ck;
    int orc = strata_ckpt_open(&ck, argv[1], 0);
    if (orc == STRATA_EFORMAT) /* another framework's checkpoint: say which */
        printf("no checkpoints under %s: %s\n", cli_esc(argv[1]), cli_esc(strata_error_last()));
    else
        printf("no checkpoints under %s\n", cli_esc(argv[1]));
    if (!orc)
        strata_ckpt_free(ck);
    return 0;
}

static const char VERIFY_HELP[] =
    "usage: strata verify CKPT\n"
    "\n"
    "Reads every data byte of a committed checkpoint and checks every checksum chunk.\n"
    "Exit status 0 if everything matches; 3 if the checkpoint is corrupt or incomplete, with\n"
    "one line per bad chunk naming the tensor (or blob) and the file; 1 for other failures\n"
    "(a missing data file, an I/O error). A safetensors directory has no checksums: its\n"
    "bytes are read (a truncated file is found), not verified, and the output says so. A\n"
    "PyTorch DCP directory has no strata checksums either: every item's zip archive is read\n"
    "whole and its entries' CRC-32s checked. Nor has a torch.save source: the CRC-32 of\n"
    "every zip entry of every file is checked (one line per entry that differs); so is a\n"
    "DeepSpeed ZeRO checkpoint's.\n";

static void report_bad(void *ctx, const char *object, const char *file, const char *msg)
{
    const int *format = ctx;
    fprintf(stderr, "CORRUPT: %s '%s' in file '%s': %s\n",
            *format == STRATA_FORMAT_TORCH_SAVE || *format == STRATA_FORMAT_DEEPSPEED
                ? "zip entry"
                : "tensor", cli_esc(object),
            cli_esc(file), cli_esc(msg));
}

int cmd_verify(int argc, char **argv)
{
    int st = one_operand(argc, argv, VERIFY_HELP);
    if (st >= 0)
        return st;
    strata_ckpt *ck;
    int rc = strata_ckpt_open(&ck, argv[1], 0);
    if (rc)
        return cli_fail("verify", rc);
    int format = strata_ckpt_format(ck);
    rc = strata_ckpt_verify(ck, report_bad, &format);
    if (!rc && (format == STRATA_FORMAT_DCP || format == STRATA_FORMAT_MEGATRON))
        printf("ok: %s: %zu tensors, %zu blobs, %llu data bytes read; every zip CRC-32 matches "
               "(%s has no strata checksums)\n", cli_esc(argv[1]),
               strata_ckpt_ntensors(ck), strata_ckpt_nblobs(ck),
               (unsigned long long)strata_ckpt_data_bytes(ck),
               format == STRATA_FORMAT_DCP ? "PyTorch DCP" : "Megatron torch_dist");
    else if (!rc && (format == STRATA_FORMAT_TORCH_SAVE || format == STRATA_FORMAT_DEEPSPEED))
        printf("ok: %s: %zu tensors in %zu files; every zip entry's CRC-32 matched (%s "
               "has no strata checksums: the CRC-32s are all there is)\n", cli_esc(argv[1]),
               strata_ckpt_ntensors(ck), strata_ckpt_nfiles(ck),
               format == STRATA_FORMAT_DEEPSPEED ? "DeepSpeed's torch.save" : "torch.save");
    else if (!rc && !strata_ckpt_chunk_bytes(ck))
        printf("read: %s: %zu tensors, %llu data bytes read; safetensors has no checksums, so "
               "they could not be verified\n", cli_esc(argv[1]), strata_ckpt_ntensors(ck),
               (unsigned long long)strata_ckpt_data_bytes(ck));
    else if (!rc)
        printf("ok: %s: %zu tensors, %zu blobs, %llu data bytes verified\n", cli_esc(argv[1]),
               strata_ckpt_ntensors(ck), strata_ckpt_nblobs(ck),
               (unsigned long long)strata_ckpt_data_bytes(ck));
    strata_ckpt_free(ck);
    return rc ? cli_fail("verify", rc) : 0;
}

static const char GC_HELP[] =
    "usage: strata gc DIR [--dry-run]\n"
    "       strata gc DIR --keep K\n"
    "\n"
    "Removes the incomplete checkpoints directly under DIR (interrupted or failed saves:\n"
    "no commit record). Committed checkpoints are never touched, nor corrupt ones (a commit\n"
    "record that does not match), nor files that are not strata's; symlinks are never\n"
    "followed.\n"
    "\n"
    "With --keep K (retention): keeps the K newest committed checkpoints under DIR (by commit\n"
    "time) and removes older committed ones, and the incomplete ones.\n"
    "\n"
    "A save in progress owns its directory (its LOCK file is locked): gc never removes it,\n"
    "whatever its age, and a save never writes where gc is removing. A checkpoint whose LOCK\n"
    "is not a lock file (a symlink, FIFO, socket or directory) is kept with a warning. What a\n"
    "replacing save left beside its target (." "<name>" STRATA_REPLACE_SUFFIX ") is removed\n"
    "once no save owns it.\n"
    "\n"
    "gc also removes the shared memory segments (/dev/shm/strata-load-*) that distributed\n"
    "loads of this user killed on this node left, never a live process's, and the staging\n"
    "directories that killed exports left directly under DIR (OUT.strata-export-*, beside\n"
    "an export's OUT), never a live export's (not with --dry-run).\n";

typedef struct {
    int dry, removed, failed;
} gc_ctx;

/* Is path a directory a replacing save left (".<name>" STRATA_REPLACE_SUFFIX)? */
static int replace_leftover(const char *path)
{
    const char *slash = strrchr(path, '/'), *name = slash ? slash + 1 : path;
    size_t len = strlen(name), k = strlen(STRATA_REPLACE_SUFFIX);
    return name[0] == '.' && len > k && strcmp(name + len - k, STRATA_REPLACE_SUFFIX) == 0;
}

static void gc_one(void *ctx, const char *path, const strata_probe_info *pi)
{
    gc_ctx *g = ctx;
    if (pi->committed && !replace_leftover(path))
        return;
    if (pi->has_commit && !replace_leftover(path)) {
        printf("kept %s: it has a commit record but does not verify; check it with strata "
               "verify\n", cli_esc(path));
        return;
    }
    if (g->dry) {
        printf("would remove %s (%llu bytes)\n", cli_esc(path), (unsigned long long)pi->disk_bytes);
        return;
    }
    int rc = strata_remove_incomplete(path);
    if (rc == STRATA_EBUSY) { /* a save in progress (or another gc) owns it */
        printf("kept %s: a live save or collector owns it\n", cli_esc(path));
        return;
    }
    if (rc == STRATA_EINVAL) { /* its LOCK is not a lock file: that one only is left */
        fprintf(stderr, "strata gc: warning: kept %s: %s\n", path, strata_error_last());
        return;
    }
    if (rc) {
        g->failed = cli_fail("gc", rc);
        return;
    }
    printf("removed %s (%llu bytes)\n", cli_esc(path), (unsigned long long)pi->disk_bytes);
    g->removed++;
}

static void gc_skipped(void *ctx, const char *path, int code, const char *message)
{
    (void)ctx;
    if (code == STRATA_EINVAL)
        fprintf(stderr, "strata gc: warning: kept %s: %s\n", path, message);
    else
        printf("kept %s: %s\n", path, message);
}

int cmd_gc(int argc, char **argv)
{
    gc_ctx g = {0};
    const char *dir = NULL;
    long long keep = -1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(GC_HELP, stdout);
            return 0;
        } else if (strcmp(argv[i], "--dry-run") == 0) {
            g.dry = 1;
        } else if (strcmp(argv[i], "--keep") == 0 && i + 1 < argc &&
                   (keep = cli_parse_num(argv[i + 1])) >= 0) {
            i++;
        } else if (!dir) {
            dir = argv[i];
        } else {
            fputs(GC_HELP, stderr);
            return EXIT_USAGE;
        }
    }
    if (!dir || (keep >= 0 && g.dry)) {
        fputs(GC_HELP, stderr);
        return EXIT_USAGE;
    }
    int segs = 0;
    if (!g.dry && strata_reclaim_load_segments(&segs) == 0 && segs)
        printf("removed %d shared memory segment(s) left by killed loads\n", segs);
    int staged = 0, src = g.dry ? 0 : strata_remove_export_staging(&staged, dir);
    if (src && src != STRATA_ENOENT) /* a missing DIR is said below */
        return cli_fail("gc", src);
    if (staged)
        printf("removed %d staging director%s left by killed exports\n", staged,
               staged == 1 ? "y" : "ies");
    if (keep >= 0) {
        int removed = 0, rc = strata_retain_report(&removed, dir, (int)keep, gc_skipped, NULL);
        if (rc)
            return cli_fail("gc", rc);
        printf("kept the %lld newest committed checkpoints under %s; removed %d\n", keep,
               cli_esc(dir), removed);
        return 0;
    }
    int rc = for_each_ckpt("gc", dir, gc_one, &g, 0);
    return rc ? rc : g.failed;
}
