"""make bench-deepspeed (after bench_deepspeed.py): `strata export` of a DeepSpeed ZeRO-2
checkpoint written by DeepSpeed's DEFAULT engine (torch.save per file; 2 gloo processes, CPU),
beside DeepSpeed's own zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict, to
safetensors too). Each command runs under GNU time (/usr/bin/time:
wall time and the command's own peak RSS), ROUNDS times in turn; medians. Rows:

    strata export (weights)   --exclude 'optim.state.*': the same tensors zero_to_fp32 writes
    strata export (all)       the weights and every AdamW moment (3x the bytes)
    convert_zero_checkpoint_to_fp32_state_dict   DeepSpeed's own (what its zero_to_fp32.py
              runs), safe_serialization=True, max_shard_size=None (its sharding needs
              huggingface_hub; the model fits one file)

The files are in the page cache for every command (written just before; the machine is not
ours to drop caches on), so the times are of reading from memory and writing to disk.
Writes (or replaces) the section "Export of a DeepSpeed checkpoint" of
bench/results/deepspeed.md and prints it.

Environment: BENCH_DS_GB (training state GiB: fp32 weights, fp32 master, two Adam moments;
default 1), BENCH_DS_ROUNDS (default 3), BENCH_DIR (default build/bench-deepspeed),
BENCH_DS_OUT (default bench/results), STRATA (default build/strata).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from _launch import launch, wait  # noqa: E402  (the ranks as DeepSpeed's launcher starts them)
GIB = float(os.environ.get("BENCH_DS_GB", "1"))
ROUNDS = int(os.environ.get("BENCH_DS_ROUNDS", "3"))
BENCH_DIR = os.path.abspath(os.environ.get("BENCH_DIR", "build/bench-deepspeed"))
OUT_DIR = os.environ.get("BENCH_DS_OUT", os.path.join(HERE, "results"))
STRATA = os.environ.get("STRATA", os.path.join(ROOT, "build", "strata"))
WIDTH = 2048
SECTION = "## Export of a DeepSpeed checkpoint"


# DeepSpeed's own conversion (what zero_to_fp32.py runs), to one safetensors file:
# max_shard_size=None, since its sharding needs huggingface_hub (not installed here) and
# the model fits one 5 GB file anyway
CONVERT = (
    "import sys\n"
    "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c\n"
    "c(sys.argv[1], sys.argv[2], max_shard_size=None, safe_serialization=True)\n")


def layers():
    # 16 bytes of state a parameter (fp32 weights, fp32 master, two Adam moments)
    return max(1, round(GIB * (1 << 30) / 16 / (WIDTH * WIDTH + WIDTH)))


def rank_main(save_dir):
    """A rank: one ZeRO-2 step of a stack of Linear layers, then save_checkpoint through
    DeepSpeed's default engine."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers())])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 6,
           "zero_allow_untested_optimizer": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    x = torch.randn(2, WIDTH)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="step1")
    dist.barrier()
    dist.destroy_process_group()


def write_checkpoint(save_dir):
    log = lambda r: os.path.join(BENCH_DIR, "zero-write-%d.log" % r)  # noqa: E731
    rcs = wait(launch([__file__, "rank", save_dir], 2, log=log), timeout=None)
    for r, rc in enumerate(rcs):
        if rc != 0:
            raise RuntimeError("rank %d failed:\n%s" % (r, open(log(r)).read()[-3000:]))


def timed(cmd):
    """(seconds, peak RSS MiB) of cmd run from GNU time."""
    out = os.path.join(BENCH_DIR, "time.out")
    p = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", out] + cmd,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError("%s failed:\n%s" % (" ".join(cmd), p.stderr[-3000:]))
    with open(out) as f:
        e, kib = f.read().split()[-2:]
    os.unlink(out)
    return float(e), int(kib) / 1024.0


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def main():
    os.makedirs(BENCH_DIR, exist_ok=True)
    save_dir = os.path.join(BENCH_DIR, "zero2")
    shutil.rmtree(save_dir, ignore_errors=True)
    t0 = time.perf_counter()
    write_checkpoint(save_dir)
    wrote = time.perf_counter() - t0
    tag = os.path.join(save_dir, "step1")
    state = dir_bytes(tag)
    out = os.path.join(BENCH_DIR, "zero2-out")
    runs = {
        "strata export (weights)": [STRATA, "export", save_dir, out, "--quiet",
                                    "--exclude", "optim.state.*"],
        "strata export (all)": [STRATA, "export", save_dir, out, "--quiet"],
        "convert_zero_checkpoint_to_fp32_state_dict": [sys.executable, "-c", CONVERT, save_dir,
                                                       out],
    }
    res = {k: [] for k in runs}
    written = {}
    for _ in range(ROUNDS):
        for name, cmd in runs.items():
            shutil.rmtree(out, ignore_errors=True)
            res[name].append(timed(cmd))
            written[name] = dir_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    lines = [SECTION, "",
             "`strata export` of a ZeRO-2 checkpoint that DeepSpeed 0.19.8's default engine "
             "wrote on 2 gloo processes (%d x Linear(%d, %d), one AdamW step: %.2f GiB of "
             "files in the tag, written in %.0f s), beside DeepSpeed's zero_to_fp32 "
             "(`convert_zero_checkpoint_to_fp32_state_dict(..., safe_serialization=True, "
             "max_shard_size=None)`); each to safetensors, under GNU time, medians of %d "
             "(files in the page cache). `python bench/bench_zero_export.py` (make "
             "bench-deepspeed)." % (layers(), WIDTH, WIDTH, state / (1 << 30), wrote, ROUNDS),
             "",
             "| command | written | time s | peak RSS MiB | runs (s / MiB) |",
             "|---|---:|---:|---:|---|"]
    for name in runs:
        ts = [t for t, _ in res[name]]
        rs = [r for _, r in res[name]]
        lines.append("| %s | %.2f GiB | %.2f | %.0f | %s |" % (
            name, written[name] / (1 << 30), statistics.median(ts), statistics.median(rs),
            ", ".join("%.2f / %.0f" % x for x in res[name])))
    lines.append("")
    text = "\n".join(lines)
    print(text)
    print(json.dumps({k: v for k, v in res.items()}))
    os.makedirs(OUT_DIR, exist_ok=True)
    md = os.path.join(OUT_DIR, "deepspeed.md")
    old = open(md).read() if os.path.exists(md) else ""
    if SECTION in old:           # replace this script's section, keep the rest
        head, rest = old.split(SECTION, 1)
        nxt = rest.find("\n## ")
        old = head + (rest[nxt + 1:] if nxt >= 0 else "")
    with open(md, "w") as f:
        f.write(old.rstrip("\n") + ("\n\n" if old.strip() else "") + text)
    shutil.rmtree(save_dir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "rank":
        rank_main(sys.argv[2])
    else:
        main()
