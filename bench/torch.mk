# make bench-torch: strata beside torch.save and DCP (sync, async, every CPU staging option)
# in a real training loop, on one process and on 4 gloo processes (FSDP2 x TP), with the disk
# measured in the same run the way strata uses it (`strata bench disk`: its I/O buffers, the
# reference of every "of disk" figure) and by fio. Writes bench/results/torch.md and torch.png; the last line
# printed holds the ratios. Installs fio (Debian) and numpy + matplotlib (into $(VENV)).
# Env: BENCH_TORCH_GB (state GiB, default 2), ROUNDS (default 5), BENCH_TORCH_K (steps per
# checkpoint, default 10), BENCH_TORCH_CONFIGS (default 1p-fp32,1p-bf16,4p-fp32); the
# checkpoints go to BENCH_TORCH_DIR (default $(BUILD)/bench-torch, on the disk under test).
# make bench-unified (run by bench-torch after it): strata loading and exporting a checkpoint
# that PyTorch DCP wrote, beside DCP (bench/bench_unified.py; BENCH_UNIFIED_GB, default 2;
# BENCH_UNIFIED_ROUNDS, default 5; writes bench/results/unified.md).
# make bench-deepspeed (run by bench-torch after them): strata's DeepSpeed checkpoint engine
# beside DeepSpeed's own in a ZeRO-2 loop on 2 gloo processes (bench/bench_deepspeed.py;
# BENCH_DS_GB, default 1; writes bench/results/deepspeed.md), then `strata export` of a ZeRO-2
# checkpoint of DeepSpeed's default engine beside its zero_to_fp32.py (bench/bench_zero_export.py:
# time and peak RSS, its section of the same file).
# make bench-megatron (run by bench-torch after them): Megatron-Core's dist_checkpointing
# through strata's strategy (strata.megatron) beside its default torch_dist strategy, same
# state, 2 gloo processes: blocked time per asynchronous checkpoint, time to durable, a
# synchronous save, a resharded cold load (bench/bench_megatron.py; BENCH_MG_GB, default 1,
# BENCH_MG_ROUNDS 5, BENCH_MG_STEP_S 1.0; writes bench/results/megatron.md).
# make bench-crc: a cold load of a DCP checkpoint and a torch.save file with the zip CRC-32s
# checked and with skip_crc (bench/bench_crc.py; BENCH_CRC_GB, default 1, BENCH_CRC_ROUNDS 5).
.PHONY: bench-torch bench-unified bench-deepspeed bench-megatron bench-crc

BENCH_TORCH_DIR ?= $(BUILD)/bench-torch

$(VENV)/.bench-torch-deps: $(VENV)/.deps-installed
	$(VENV)/bin/pip install -q numpy matplotlib
	@touch $@

bench-torch: venv $(VENV)/.bench-torch-deps $(BUILD)/strata
	@$(APT) tool_need fio fio
	BENCH_DIR=$(BENCH_TORCH_DIR) PYTHONWARNINGS=ignore STRATA_CLI=$(BUILD)/strata \
	    $(VENV)/bin/python bench/bench_torch.py
	$(MAKE) --no-print-directory bench-unified
	$(MAKE) --no-print-directory bench-deepspeed
	$(MAKE) --no-print-directory bench-megatron

bench-unified: venv $(BUILD)/strata
	@$(APT) tool_need fio fio; tool_need /usr/bin/time time
	BENCH_DIR=$(BUILD)/bench-unified PYTHONWARNINGS=ignore GLOO_SOCKET_IFNAME=lo \
	    STRATA_CLI=$(BUILD)/strata $(VENV)/bin/python bench/bench_unified.py

bench-deepspeed: venv $(BUILD)/strata
	BENCH_DIR=$(BUILD)/bench-deepspeed PYTHONWARNINGS=ignore $(VENV)/bin/python bench/bench_deepspeed.py
	@$(APT) tool_need /usr/bin/time time
	BENCH_DIR=$(BUILD)/bench-deepspeed PYTHONWARNINGS=ignore STRATA=$(BUILD)/strata \
	    $(VENV)/bin/python bench/bench_zero_export.py

bench-megatron: venv
	BENCH_DIR=$(BUILD)/bench-megatron PYTHONWARNINGS=ignore $(VENV)/bin/python bench/bench_megatron.py

bench-crc: venv
	BENCH_DIR=$(BUILD)/bench-crc PYTHONWARNINGS=ignore $(VENV)/bin/python bench/bench_crc.py
