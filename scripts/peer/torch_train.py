#!/usr/bin/env python3
"""The peer strata's GPU step is measured against: the same model in
PyTorch + transformers, trained on the same GPU.

Reads the model from the `config.json` that `strata train` writes into its
run directory (any family strata writes: Mixtral, Qwen3-MoE, OLMoE,
Qwen2-MoE), builds it with transformers' AutoModelForCausalLM, and trains it
with the same tokens a step (batch x seq_len, in --micro-batches
accumulation steps): f32 master weights, the forward and backward under
torch.autocast(bfloat16), torch.optim.AdamW(fused=True) with strata's
learning rate, betas, eps and weight decay, the loss cross-entropy plus
router_aux_loss_coef x transformers' load-balancing loss.

Each step is timed from zero_grad to the end of optimizer.step, with
torch.cuda.synchronize() before both clocks; the first --warmup-steps are
not counted. The last line of stdout is one JSON object (tokens/s median
and mean, per-step seconds, peak GPU memory).

  python3 scripts/peer/torch_train.py --config runs/x/config.json \
      --batch 16 --seq-len 512 --steps 12 --warmup-steps 4
"""

import argparse
import json
import statistics
import sys
import time


def add_run_args(ap):
    """The arguments every peer takes: the model, the tokens a step, the
    steps, AdamW's hyperparameters (strata's defaults), the seed."""
    ap.add_argument("--config", required=True, help="the config.json strata wrote")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)


def load_config(path):
    """transformers' config of the model in strata's `config.json`, with
    the router's logits returned (for the load-balancing loss) and no KV
    cache; and its model_type."""
    from transformers import AutoConfig

    with open(path) as f:
        raw = json.load(f)
    model_type = raw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **raw)
    cfg.output_router_logits = True
    cfg.use_cache = False
    return cfg, model_type


def describe(impl, model, model_type, n_params, dev):
    """One stderr line: the versions, the model and the device."""
    import torch
    import transformers

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev
    print(f"{impl}: torch {torch.__version__} transformers {transformers.__version__} {model_type}"
          f" params {n_params / 1e6:.1f}M on {name}"
          f" experts_implementation {getattr(model.config, '_experts_implementation', None)}"
          f" attn_implementation {getattr(model.config, '_attn_implementation', None)}", file=sys.stderr)
def loss_of(out, tgt, vocab, coef):
    """strata's loss: the tokens' mean cross-entropy (in f32) plus
    router_aux_loss_coef x transformers' load-balancing loss."""
    import torch.nn.functional as F

    ce = F.cross_entropy(out.logits.float().reshape(-1, vocab), tgt.reshape(-1))
    return ce + coef * out.aux_loss if out.aux_loss is not None else ce


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--no-autocast", action="store_true", help="f32 compute instead of bf16 autocast")
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    cfg, model_type = load_config(a.config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dev)
    model.train()
    init_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    describe("torch", model, model_type, n_params, dev)

    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                            weight_decay=a.weight_decay, fused=fused)
    V = cfg.vocab_size
    if a.batch % a.micro_batches:
        sys.exit("--batch must be a multiple of --micro-batches")
    mb = a.batch // a.micro_batches
    coef = getattr(cfg, "router_aux_loss_coef", 0.0)
    g = torch.Generator(device="cpu").manual_seed(a.seed)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    times, losses = [], []
    for step in range(1, a.steps + 1):
        seqs = torch.randint(0, V, (a.batch, a.seq_len + 1), generator=g).to(dev)
        sync()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        for m in range(a.micro_batches):
            chunk = seqs[m * mb:(m + 1) * mb]
            inp, tgt = chunk[:, :-1], chunk[:, 1:]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not a.no_autocast):
                out = model(input_ids=inp, output_router_logits=True, use_cache=False)
            loss = loss_of(out, tgt, V, coef)
            (loss / a.micro_batches).backward()
            total += loss.detach() / a.micro_batches
        opt.step()
        sync()
        dt = time.perf_counter() - t
        times.append(dt)
        losses.append(total.item())
        print(f"step {step} loss {losses[-1]:.4f} {dt * 1000:.1f} ms {a.batch * a.seq_len / dt:.0f} tok/s",
              file=sys.stderr)

    timed = times[a.warmup_steps:] or times
    tokens = a.batch * a.seq_len
    summary = dict(
        impl="torch", model_type=model_type, torch=torch.__version__, transformers=transformers.__version__,
        device=str(dev), autocast_bf16=not a.no_autocast, adamw_fused=fused, params=n_params,
        tokens_per_step=tokens, micro_batches=a.micro_batches, steps=a.steps, warmup_steps=a.warmup_steps,
        tok_s_median=statistics.median(tokens / t for t in timed), tok_s_mean=tokens * len(timed) / sum(timed),
        step_s=[round(t, 5) for t in times], first_loss=losses[0], last_loss=losses[-1], init_s=init_s,
        peak_gpu_mib=torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
