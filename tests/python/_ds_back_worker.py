"""A rank of test_ds_both_ways.py's DeepSpeed runs (2 gloo processes, CPU), one mode a launch:

    save OUT   strata.deepspeed enabled: each ZeRO stage of STAGES trains the model of
               _ds_zero_worker (odd sizes, a tied weight, a frozen parameter, a buffer, two
               AdamW param groups), saving tags step1 and step3 into OUT/s<stage> (latest:
               step3); dumps the state at step 3 (OUT/state<stage>-<rank>.pt) and the losses
               of AFTER more steps (OUT/losses<stage>.json)
    back OUT   DeepSpeed's own checkpoint engine (strata.deepspeed not enabled): each stage, a
               new engine (other initial weights) loads OUT/back<stage> (step3 of s<stage>,
               written back by `python -m strata.deepspeed convert`); its state must equal
               the dump bitwise and training on must give the same losses bitwise. Writes
               OUT/back-<rank>.json.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch.distributed env://).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ds_worker import diff, flat_state, run_rank, train_step  # noqa: E402
from _ds_zero_worker import make_engine  # noqa: E402

STAGES = (1, 2, 3)
SAVED, AFTER = 3, 2      # tags step1 and step<SAVED>; AFTER steps trained on after it


def save(out):
    import strata.deepspeed
    strata.deepspeed.enable()
    rank = dist.get_rank()
    for stage in STAGES:
        engine = make_engine(stage, seed=stage)
        for step in range(SAVED):
            train_step(engine, step)
            if step in (0, SAVED - 1):
                engine.save_checkpoint(os.path.join(out, "s%d" % stage), tag="step%d" % (step + 1),
                                       client_state={"step": step + 1})
        torch.save(flat_state(engine), os.path.join(out, "state%d-%d.pt" % (stage, rank)))
        losses = [train_step(engine, step) for step in range(SAVED, SAVED + AFTER)]
        if rank == 0:
            with open(os.path.join(out, "losses%d.json" % stage), "w") as f:
                json.dump(losses, f)
        engine.destroy()          # waits for the last tag's commit


def back(out):
    rank = dist.get_rank()
    report = {}
    for stage in STAGES:
        engine = make_engine(stage, seed=100 + stage)
        path, client = engine.load_checkpoint(os.path.join(out, "back%d" % stage))
        r = {"path": path, "client": client.get("step") if client else None}
        r["state_diff"] = diff(flat_state(engine),
                               torch.load(os.path.join(out, "state%d-%d.pt" % (stage, rank)),
                                          weights_only=False))
        r["losses"] = [train_step(engine, step) for step in range(SAVED, SAVED + AFTER)]
        with open(os.path.join(out, "losses%d.json" % stage)) as f:
            r["losses_want"] = json.load(f)
        engine.destroy()
        report[stage] = r
    with open(os.path.join(out, "back-%d.json" % rank), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    run_rank({"save": save, "back": back}[sys.argv[1]], sys.argv[2])
