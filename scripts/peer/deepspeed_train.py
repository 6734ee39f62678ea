#!/usr/bin/env python3
"""The offloading peer strata's GPU step is measured against: the same model
as scripts/peer/torch_train.py trains, under DeepSpeed ZeRO-3 with its
parameters offloaded to NVMe (or host memory) and its optimizer to the CPU
(DeepSpeedCPUAdam), on one GPU.

The model comes from the `config.json` that `strata train` writes into its
run directory and is built by transformers inside `deepspeed.zero.Init`
(`HfDeepSpeedConfig`), so its parameters are partitioned to where they are
offloaded as they are made and never stand whole on the GPU; each sparse MoE block is a ZeRO-3 leaf module
(`set_z3_leaf_modules`, as transformers' own DeepSpeed integration does for
MoE models), so a block's experts are gathered together. bf16 compute over
f32 master weights in the CPU optimizer, AdamW with strata's learning rate,
betas, eps and weight decay; the same tokens a step (batch x seq_len, in
--micro-batches accumulation steps) and the same loss as torch_train.py.

Each step is timed from its first forward to the end of the engine's step
at the accumulation boundary, with torch.cuda.synchronize() before both
clocks; the first --warmup-steps are not counted. The last line of stdout
is one JSON object (tokens/s median and mean, per-step seconds, what was
offloaded where, the bytes the process read from and wrote to the disk a
step, peak GPU memory).

DeepSpeed is not on the GPU machine's image: scripts/gpu-bundle.sh puts its
wheel and the few it needs into gpu-pack/wheels, and `scripts/gpu-check.sh
deepspeed` installs them there. NVMe offload needs DeepSpeed's async_io op,
which builds against libaio (its .deb comes in the same folder); where it
cannot build, --offload-param auto falls back to host memory and says so in
the JSON (`offload_param`).

  python3 scripts/peer/deepspeed_train.py --config runs/x/config.json \\
      --batch 16 --seq-len 512 --steps 8 --warmup-steps 3 --nvme-path /tmp/ds-nvme
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import add_run_args, describe, load_config, loss_of  # noqa: E402


def nvme_offload_builds():
    """Whether DeepSpeed's async_io op (NVMe offload) builds here, and why
    not where it does not."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return False, "DeepSpeed's async_io op is not compatible here (libaio missing?)"
        builder.load(verbose=False)
        return True, None
    except Exception as e:  # a failed JIT build raises whatever the toolchain did
        return False, f"DeepSpeed's async_io op did not build: {e}"


def zero3_config(a, hidden, micro_batch, offload_param):
    """The DeepSpeed config: ZeRO-3, parameters offloaded to
    `offload_param` ("nvme", "cpu" or "none"), the optimizer to the CPU
    unless --offload-optimizer none. The persistence threshold and the
    prefetch bucket are what transformers' Trainer makes of "auto" for a
    model of width `hidden`."""
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_param_persistence_threshold": 10 * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_max_live_parameters": 1e9,
    }
    if offload_param == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": a.nvme_path, "pin_memory": True,
                                 "buffer_count": 5, "buffer_size": int(a.nvme_buffer_bytes)}
    elif offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if a.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": a.micro_batches,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {
            "lr": a.lr, "betas": [a.beta1, a.beta2], "eps": a.eps, "weight_decay": a.weight_decay}},
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def as_one_rank():
    """torch.distributed's variables for a single process, where no
    launcher set them."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        os.environ.setdefault(k, v)


def moe_block_classes(model):
    """The classes of the model's sparse MoE blocks (MixtralSparseMoeBlock,
    Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock, ...)."""
    return sorted({type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")},
                  key=lambda c: c.__name__)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--offload-param", choices=["auto", "nvme", "cpu", "none"], default="auto",
                    help="where ZeRO-3 keeps the parameters: auto is nvme where DeepSpeed's async_io op "
                         "builds, else cpu")
    ap.add_argument("--offload-optimizer", choices=["cpu", "none"], default="cpu")
    ap.add_argument("--nvme-path", default="/tmp/ds-nvme", help="the folder NVMe offload swaps into")
    ap.add_argument("--nvme-buffer-bytes", type=float, default=2e8,
                    help="each of NVMe offload's 5 pinned buffers; at least the largest parameter's bytes")
    a = ap.parse_args()
    if a.batch % a.micro_batches:
        sys.exit("--batch must be a multiple of --micro-batches")
    micro_batch = a.batch // a.micro_batches

    import deepspeed
    import psutil
    import torch
    from deepspeed.utils import set_z3_leaf_modules
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    as_one_rank()
    dev = torch.device(a.device)
    deepspeed.init_distributed(dist_backend="nccl" if dev.type == "cuda" else "gloo")
    torch.manual_seed(a.seed)
    offload_param, why_not_nvme = a.offload_param, None
    if offload_param in ("auto", "nvme"):
        builds, why_not_nvme = nvme_offload_builds()
        if not builds and offload_param == "nvme":
            sys.exit(f"--offload-param nvme: {why_not_nvme}")
        offload_param = "nvme" if builds else "cpu"
        if why_not_nvme:
            print(f"deepspeed: parameters offloaded to host memory, not NVMe: {why_not_nvme}", file=sys.stderr)
    if offload_param == "nvme":
        os.makedirs(a.nvme_path, exist_ok=True)
    t0 = time.perf_counter()
    cfg, model_type = load_config(a.config)
    ds_config = zero3_config(a, cfg.hidden_size, micro_batch, offload_param)
    # transformers builds the model inside zero.Init, and initializes each
    # partitioned weight gathered, while this object lives.
    hf_zero3 = HfDeepSpeedConfig(ds_config)  # noqa: F841
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    leaves = moe_block_classes(model)
    if leaves:
        set_z3_leaf_modules(model, leaves)
    # ZeRO-3 partitions each parameter: its numel on the module is 0, the
    # whole count is ds_numel.
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.train()
    init_s = time.perf_counter() - t0
    describe("deepspeed", model, model_type, n_params, dev)

    V = cfg.vocab_size
    coef = getattr(cfg, "router_aux_loss_coef", 0.0)
    g = torch.Generator(device="cpu").manual_seed(a.seed)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    proc = psutil.Process()
    times, losses, reads, writes = [], [], [], []
    for step in range(1, a.steps + 1):
        seqs = torch.randint(0, V, (a.batch, a.seq_len + 1), generator=g).to(engine.device)
        sync()
        io0 = proc.io_counters()
        t = time.perf_counter()
        total = 0.0
        for m in range(a.micro_batches):
            chunk = seqs[m * micro_batch:(m + 1) * micro_batch]
            inp, tgt = chunk[:, :-1], chunk[:, 1:]
            out = engine(input_ids=inp, output_router_logits=True, use_cache=False)
            loss = loss_of(out, tgt, V, coef)
            engine.backward(loss)  # scaled by 1 / accumulation steps inside
            engine.step()  # the optimizer's step at the accumulation boundary only
            total += loss.item() / a.micro_batches
        sync()
        dt = time.perf_counter() - t
        io1 = proc.io_counters()
        times.append(dt)
        losses.append(total)
        reads.append(io1.read_bytes - io0.read_bytes)
        writes.append(io1.write_bytes - io0.write_bytes)
        print(f"step {step} loss {total:.4f} {dt * 1000:.1f} ms {a.batch * a.seq_len / dt:.0f} tok/s",
              file=sys.stderr)

    timed = times[a.warmup_steps:] or times
    tokens = a.batch * a.seq_len
    summary = dict(
        impl="deepspeed", deepspeed=deepspeed.__version__, torch=torch.__version__, model_type=model_type,
        device=str(dev), zero_stage=3, offload_param=offload_param, offload_optimizer=a.offload_optimizer,
        why_not_nvme=why_not_nvme, moe_leaf_modules=[c.__name__ for c in leaves], params=n_params,
        tokens_per_step=tokens, micro_batches=a.micro_batches, steps=a.steps, warmup_steps=a.warmup_steps,
        tok_s_median=statistics.median(tokens / t for t in timed), tok_s_mean=tokens * len(timed) / sum(timed),
        step_s=[round(t, 5) for t in times], first_loss=losses[0], last_loss=losses[-1], init_s=init_s,
        disk_read_bytes_median=statistics.median(reads[a.warmup_steps:] or reads),
        disk_write_bytes_median=statistics.median(writes[a.warmup_steps:] or writes),
        peak_gpu_mib=torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
