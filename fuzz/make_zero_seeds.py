"""Writes the seeds of fuzz/corpus/fuzz_zero/ from DeepSpeed ZeRO checkpoints of its default
engine (tests/python/_ds_zero_worker.py OUT writes OUT/z1, z2, z3; 2 ranks), in fuzz_zero.c's
input form: "Z", stage - 1, ranks - 1, then each file as a u32 length and its bytes (the
model-states files, then the optim files, in rank order).

    .venv/bin/python fuzz/make_zero_seeds.py OUT fuzz/corpus/fuzz_zero

seed-valid-z<stage>-pkl: each file's data.pkl alone; seed-valid-z2-zip: the files whole;
seed-reject-<code>-*: variants the reader must refuse with that code (made with torch.load,
changed, torch.save'd again - their pickles as DeepSpeed's would be).
"""

import io
import os
import struct
import sys
import zipfile

import torch


def pkl(blob):
    z = zipfile.ZipFile(io.BytesIO(blob))
    return z.read([n for n in z.namelist() if n.endswith("/data.pkl")][0])


def files_of(tag, stage, ranks=2):
    model = (["mp_rank_00_model_states.pt"] if stage < 3 else
             ["zero_pp_rank_%d_mp_rank_00_model_states.pt" % r for r in range(ranks)])
    optim = ["zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r for r in range(ranks)]
    return [open(os.path.join(tag, f), "rb").read() for f in model + optim]


def seed(path, stage, blobs, ranks=2):
    with open(path, "wb") as f:
        f.write(b"Z" + bytes([stage - 1, ranks - 1]))
        for b in blobs:
            f.write(struct.pack("<I", len(b)) + b)


def edited(blob, fn):
    obj = torch.load(io.BytesIO(blob), weights_only=False)
    fn(obj)
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def resize(g, by):
    def cut(t):
        return t[:by].clone() if by < 0 else torch.cat([t, torch.zeros(by)])

    def fn(o):
        osd = o["optimizer_state_dict"]
        osd["single_partition_of_fp32_groups"][g] = cut(osd["single_partition_of_fp32_groups"][g])
        for k in ("exp_avg", "exp_avg_sq"):
            st = osd["base_optimizer_state"]["state"][g]
            st[k] = cut(st[k])
    return fn


def half(o):
    p = o["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    p[1] = p[1].half()


def main(src, out):
    os.makedirs(out, exist_ok=True)
    tags = {s: os.path.join(src, "z%d" % s, "step3") for s in (1, 2, 3)}
    for s, tag in tags.items():
        seed(os.path.join(out, "seed-valid-z%d-pkl" % s), s, [pkl(b) for b in files_of(tag, s)])
    z2 = files_of(tags[2], 2)
    seed(os.path.join(out, "seed-valid-z2-zip"), 2, z2)
    p2 = [pkl(b) for b in z2]
    seed(os.path.join(out, "seed-reject-eformat-stage3-of-z2"), 3, [p2[0], p2[0], p2[1], p2[2]])
    for code, fn, r in (("eunfilled-short-partition", resize(1, -40), 1),
                        ("emismatch-long-partition", resize(0, 40), 1),
                        ("enotsup-f16-partition", half, 0)):
        blobs = list(p2)
        blobs[1 + r] = pkl(edited(z2[1 + r], fn))
        seed(os.path.join(out, "seed-reject-" + code), 2, blobs)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
