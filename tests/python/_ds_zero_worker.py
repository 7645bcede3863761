"""A rank of test_zero_source.py's DeepSpeed run (2 gloo processes, CPU): DeepSpeed's DEFAULT
checkpoint engine (torch.save per file) writes one checkpoint of each ZeRO stage 1, 2 and 3
of a small transformer with odd sizes (_ds_worker.Model) plus what zero_to_fp32 treats apart:
a tied weight (shared_params), a frozen parameter and a buffer; two AdamW param groups.

    python _ds_zero_worker.py OUT     -> OUT/z<stage>/ (save_dir: `latest`, tag step<STEPS>)

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch.distributed env://).
"""

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ds_worker import BATCH, VOCAB, Model, run_rank, train_step  # noqa: E402

STAGES = (1, 2, 3)
STEPS = 3


class ZModel(Model):
    def __init__(self):
        super().__init__()
        self.head.weight = self.emb.weight              # tied: one of them is a shared param
        self.frozen = nn.Linear(5, 3)                   # 18 elements: uneven over 2 ranks
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.arange(11, dtype=torch.float32) / 7)

    def forward(self, x):
        return super().forward(x) * self.scale[3] + self.frozen.bias.sum()


def make_engine(stage, seed):
    import deepspeed
    torch.manual_seed(seed)
    model = ZModel()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() <= 1]
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
           "zero_allow_untested_optimizer": True}
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def main(out):
    for stage in STAGES:
        engine = make_engine(stage, seed=stage)
        for step in range(STEPS):
            train_step(engine, step)
        engine.save_checkpoint(os.path.join(out, "z%d" % stage), tag="step%d" % STEPS)
        engine.destroy()


if __name__ == "__main__":
    run_rank(main, sys.argv[1])
