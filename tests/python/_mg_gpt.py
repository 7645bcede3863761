"""A small GPT built with Megatron-Core 0.16.1's own layers, its DDP wrapper and its
DistributedOptimizer, on CPU torch and gloo (tests of strata.megatron and the
Megatron benchmark).

megatron-core is written for GPUs. On CPU torch it runs with these stand-ins, all here:
  - torch.cuda.synchronize() a no-op and torch.cuda.current_device() "cpu" (the tensors are
    on the CPU already; Megatron's all_reduce flags made "on the current device" land on
    the CPU, where gloo reduces them), as tests/python/test_megatron_source.py does;
  - CpuAsCuda, a TorchFunctionMode around the optimizer's construction and step: a tensor
    made with device="cuda" (MixedPrecisionOptimizer's flags) is made on the CPU, .cuda()
    is the tensor itself, and a CPU tensor's .type() says "torch.cuda.FloatTensor" (the
    DistributedOptimizer accepts parameters of those types only).
Nothing else is changed: the layers, the gradient buffers, the optimizer's partition, its
sharded_state_dict (dp_reshardable, fully_reshardable) and dist_checkpointing are Megatron's.
No forward pass runs (its attention needs the CUDA RNG tracker): a step's gradients are
seeded random numbers written into the DDP gradient buffers, then Megatron's own
finish_grad_sync and DistributedOptimizer.step give the Adam moments.

    m = build(tp=2, pp=1, seed=1)       # in each gloo rank; world = tp * pp * dp
    sd = m.sharded_state_dict("dp_reshardable")
    m.load(loaded)                       # what dist_checkpointing.load returned
    state = m.snapshot()                 # {name: tensor}: this rank's weights and moments
"""

import warnings

import torch
from torch.overrides import TorchFunctionMode

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 64, 8, 16, 4, 2


def cpu_only_megatron():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


class CpuAsCuda(TorchFunctionMode):
    """See the module's docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = kwargs.get("device")
        if d is not None and (d == "cuda" or (isinstance(d, torch.device) and d.type == "cuda")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            r = func(*args)
            return r if r.startswith("torch.cuda.") else r.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _imports():
    cpu_only_megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state  # noqa: F401
        from megatron.core.distributed import DistributedDataParallel  # noqa: F401
        from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: F401
        from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401


class Model:
    """One rank's GPT chunk (its pipeline stage, its tensor-parallel slice) in Megatron's
    DDP, and its DistributedOptimizer after one step."""

    def __init__(self, tp, pp, seed, hidden=HIDDEN, layers=LAYERS, vocab=VOCAB):
        _imports()
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_config import TransformerConfig
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                         pipeline_model_parallel_size=pp)
        self.rank = dist.get_rank()
        # one seed on every rank: Megatron's CPU initialisation makes each weight whole
        # and takes this rank's slice, so replicas are equal (Megatron's contract)
        torch.manual_seed(seed)
        cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=HEADS,
                                use_cpu_initialization=True, bias_activation_fusion=False,
                                gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                                bias_dropout_fusion=False, apply_rope_fusion=False,
                                persist_layer_norm=False, pipeline_dtype=torch.float32,
                                tensor_model_parallel_size=tp,
                                pipeline_model_parallel_size=pp)
        gpt = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=vocab,
                       max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                       post_process=ps.is_pipeline_last_stage())
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            grad_reduce_in_fp32=True)
        self.ddp = DistributedDataParallel(cfg, ddp, gpt)
        self.gpt = gpt
        with CpuAsCuda():
            self.opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2,
                                                              use_distributed_optimizer=True),
                                              [self.ddp])
        self.step(seed)

    def step(self, seed):
        """One optimizer step on seeded gradients: the same on every rank of a pipeline
        stage (a replicated parameter's are equal on its replicas, as all-reduced ones are)."""
        from megatron.core import parallel_state as ps
        g = torch.Generator().manual_seed(seed * 7919 + 100 * ps.get_pipeline_model_parallel_rank())
        with CpuAsCuda():
            for p in self.ddp.parameters():
                p.main_grad.copy_(torch.randn(p.shape, generator=g))
            self.ddp.finish_grad_sync()
            ok, _, _ = self.opt.step()
        assert ok

    def sharded_state_dict(self, sharding="dp_reshardable", is_loading=False):
        model = self.gpt.sharded_state_dict()
        with CpuAsCuda():
            opt = self.opt.sharded_state_dict(model, is_loading=is_loading,
                                              metadata={"distrib_optim_sharding_type": sharding})
        return {"model": model, "optimizer": opt, "iteration": 7, "args": {"tp": 2, "lr": 0.01}}

    def load(self, loaded):
        with CpuAsCuda(), torch.no_grad():
            self.gpt.load_state_dict(loaded["model"])
            self.opt.load_state_dict(loaded["optimizer"])

    def snapshot(self):
        """{name: tensor (a copy)}: this rank's model weights, and for each of its
        parameters the fp32 main weight and Adam moments of the piece this rank's optimizer
        holds."""
        out = {"model." + k: v.detach().clone() for k, v in self.gpt.state_dict().items()
               if isinstance(v, torch.Tensor)}
        dopt = self.opt.chained_optimizers[0] if hasattr(self.opt, "chained_optimizers") \
            else self.opt
        names = {p: n for n, p in self.gpt.named_parameters()}
        for p, n in names.items():
            try:
                st = dopt._get_main_param_and_optimizer_states(p)
            except KeyError:         # no piece of it on this rank
                continue
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    out["opt.%s.%s" % (n, k)] = v.detach().clone()
        return out


def build(tp, pp, seed):
    return Model(tp, pp, seed)
