"""Builds the Hugging Face parity fixtures under tests/fixtures/hf/.

For each family, a tiny checkpoint in its Hub layout (config.json and
model.safetensors, written by transformers' own save_pretrained), once in
float32 and once in bfloat16, and what transformers computes on it for one
batch: the logits, the cross-entropy, the load-balancing loss and every
parameter's gradient of CE + router_aux_loss_coef * aux, in Hub names.

    scripts/hf-fixtures/run.sh        # makes a venv in /tmp, then runs this

The files are small (tens of KiB each) and committed; tests/hf_parity.rs
reads them. Remaking them with the pinned versions gives the same bytes.
"""

import copy
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "hf")

SEQS, SEQ_LEN = 2, 12
# f32 rounding moves a router probability by ~1e-7; a choice this far from
# a tie is the same in strata and in transformers.
MIN_MARGIN = 2e-5
# The families whose f32 fixture also holds the per-part reference.
PARTS_FAMILIES = ("mixtral", "qwen2_moe")
COMMON = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    output_router_logits=True,
    router_aux_loss_coef=0.05,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
)

FAMILIES = {
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(intermediate_size=24, num_local_experts=4, rope_theta=1e4),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        # heads x head_dim (64) differs from hidden_size (32), as in Qwen3.
        dict(moe_intermediate_size=24, intermediate_size=48, num_experts=4, head_dim=16,
             norm_topk_prob=True, rope_theta=1e4),
    ),
    "olmoe": (
        transformers.OlmoeConfig,
        transformers.OlmoeForCausalLM,
        # clip_qkv small enough that some projections are clipped.
        dict(intermediate_size=24, num_experts=4, norm_topk_prob=False, clip_qkv=1.0,
             rope_theta=1e4),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        # q/k/v biases (qkv_bias defaults to true), a shared expert.
        dict(moe_intermediate_size=24, shared_expert_intermediate_size=40,
             intermediate_size=48, num_experts=4, norm_topk_prob=False, rope_theta=1e4),
    ),
    # Qwen's dense layers: layers 0 and 2 have a plain MLP of width
    # intermediate_size, and the load-balancing loss spans layers 1 and 3.
    "qwen3_moe_dense_layers": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(moe_intermediate_size=24, intermediate_size=40, num_experts=4, head_dim=16,
             norm_topk_prob=True, rope_theta=1e4, num_hidden_layers=4,
             mlp_only_layers=[0, 2]),
    ),
    # GLM-4.5: sigmoid routing with a correction bias in 2 groups of 4 (one
    # kept) and scaled weights, a dense first layer, an ungated shared
    # expert, q/k/v biases, per-head q/k norms, half the head rotated.
    "glm4_moe": (
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        dict(moe_intermediate_size=24, intermediate_size=40, n_routed_experts=8,
             n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
             n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             attention_bias=True, use_qk_norm=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5}),
    ),
}
# Variants of a family checked in f32 alone (the bf16 import path is the
# family's own).
F32_ONLY = ("qwen3_moe_dense_layers",)
# The families whose routers score by sigmoid with a correction bias.
SIGMOID = ("glm4_moe",)


def fill(model, seed):
    """Weights well away from transformers' tiny init, so that every path
    carries a gradient of some size: matrices N(0, 0.2²) (routers 0.6²),
    norm gains 1 + N(0, 0.1²), biases N(0, 0.2²); a sigmoid router's
    correction bias (a buffer) N(0, 0.1²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                std = 0.6 if name.endswith("gate.weight") else 0.2
                p.copy_(std * torch.randn(p.shape, generator=g))


def routing_margin(router_logits, k):
    """The smallest gap between the k-th and (k+1)-th router probability of
    any token in any layer: a choice closer than this could flip under f32
    rounding differences."""
    worst = 1.0
    for logits in router_logits:
        p = torch.softmax(logits.detach().double(), dim=-1)
        top = torch.topk(p, k + 1, dim=-1).values
        worst = min(worst, float((top[:, k - 1] - top[:, k]).min()))
    return worst


def sigmoid_routing_margin(model, router_logits, config):
    """routing_margin for a sigmoid router with a correction bias and
    groups: the smallest gap, in biased scores, between the last kept and
    the first dropped group's score, and between the k-th and (k+1)-th
    expert within the kept groups."""
    k, groups, kept = config.num_experts_per_tok, config.n_group, config.topk_group
    biases = [m.e_score_correction_bias for n, m in model.named_modules()
              if n.endswith("mlp.gate") and hasattr(m, "e_score_correction_bias")]
    worst = 1.0
    for logits, bias in zip(router_logits, biases):
        choice = torch.sigmoid(logits.detach().double()) + bias.double()
        per_group = choice.view(-1, groups, choice.shape[-1] // groups)
        group_scores = per_group.topk(2, dim=-1).values.sum(-1)
        if kept < groups:
            top = torch.topk(group_scores, kept + 1, dim=-1).values
            worst = min(worst, float((top[:, kept - 1] - top[:, kept]).min()))
        idx = torch.topk(group_scores, kept, dim=-1).indices
        mask = torch.zeros_like(group_scores).scatter_(1, idx, 1).bool()
        mask = mask.unsqueeze(-1).expand_as(per_group).reshape(choice.shape)
        masked = choice.masked_fill(~mask, float("-inf"))
        top = torch.topk(masked, k + 1, dim=-1).values
        gaps = top[:, k - 1] - top[:, k]
        worst = min(worst, float(gaps[torch.isfinite(gaps)].min()) if gaps.isfinite().any() else worst)
    return worst


def hub_gradients(model, family, config):
    """Every parameter's gradient under its Hub name: fused expert tensors
    (transformers 5 keeps each layer's experts as one gate_up_proj and one
    down_proj) are split back into the names save_pretrained writes."""
    out = {}
    moe_width = family.startswith("qwen") or family in SIGMOID
    f = config.moe_intermediate_size if moe_width else config.intermediate_size
    for name, p in model.named_parameters():
        g = p.grad.detach().clone().float()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                gate, up = g[e, :f], g[e, f:]
                if family == "mixtral":
                    base = prefix.replace("mlp.experts.", "block_sparse_moe.experts.")
                    out[f"{base}{e}.w1.weight"] = gate.contiguous()
                    out[f"{base}{e}.w3.weight"] = up.contiguous()
                else:
                    out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                if family == "mixtral":
                    base = prefix.replace("mlp.experts.", "block_sparse_moe.experts.")
                    out[f"{base}{e}.w2.weight"] = g[e].contiguous()
                else:
                    out[f"{prefix}{e}.down_proj.weight"] = g[e].contiguous()
        elif family == "mixtral" and ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = g
        else:
            out[name] = g
    # A correction bias is a buffer: no gradient, as in strata (zero).
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            out[name] = torch.zeros_like(b).float()
    return out


def check_names(model_dir, grads):
    """The gradients' names are exactly the saved checkpoint's tensors."""
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    if saved != set(grads):
        sys.exit(f"{model_dir}: gradient names differ from the checkpoint's: "
                 f"{sorted(saved ^ set(grads))[:6]}")


def make(family, dtype, seed):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).float()
    fill(model, seed)
    if dtype == "bf16":
        # The checkpoint holds bf16 values; the reference computes in f32
        # on exactly those values, as strata does after importing them.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(b.to(torch.bfloat16).float())
    tokens = torch.randint(0, config.vocab_size, (SEQS, SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(seed + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model.train()
    out = model(input_ids=inputs, output_router_logits=True)
    if family in SIGMOID:
        margin = sigmoid_routing_margin(model, out.router_logits, config)
    else:
        margin = routing_margin(out.router_logits, config.num_experts_per_tok)
    if margin < MIN_MARGIN:
        return False
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, config.vocab_size),
                                           targets.reshape(-1))
    # GLM-4.5 has no load-balancing loss (its balance is the bias).
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros(())
    loss = ce + getattr(config, "router_aux_loss_coef", 0.0) * aux
    model.zero_grad()
    loss.backward()

    name = family if dtype == "f32" else f"{family}-bf16"
    case = os.path.join(OUT, name)
    shutil.rmtree(case, ignore_errors=True)
    model_dir = os.path.join(case, "model")
    grads = hub_gradients(model, family, config)
    to_save = model if dtype == "f32" else copy.deepcopy(model).to(torch.bfloat16)
    to_save.save_pretrained(model_dir)
    check_names(model_dir, grads)
    ref_dir = os.path.join(case, "reference")
    os.makedirs(ref_dir)
    tensors = {f"grad.{k}": v for k, v in grads.items()}
    tensors["logits"] = out.logits.detach().float().contiguous()
    # The same batch as one part a sequence (gradient accumulation, or one
    # DDP rank a sequence): the load-balancing term is each part's, averaged.
    # Two families are enough to hold several devices to it.
    parts = dtype == "f32" and family in PARTS_FAMILIES
    model.zero_grad()
    outs = [model(input_ids=inputs[i:i + 1], output_router_logits=True) for i in range(SEQS)]
    logits = torch.cat([o.logits for o in outs])
    parts_ce = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size),
                                                 targets.reshape(-1))
    parts_aux = sum(o.aux_loss if o.aux_loss is not None else torch.zeros(()) for o in outs) / SEQS
    parts_loss = parts_ce + getattr(config, "router_aux_loss_coef", 0.0) * parts_aux
    parts_loss.backward()
    if parts:
        for k, v in hub_gradients(model, family, config).items():
            tensors[f"parts.grad.{k}"] = v
    save_file(tensors, os.path.join(ref_dir, "reference.safetensors"))
    meta = {
        "family": family,
        "seed": seed,
        "dtype": dtype,
        "seq_len": SEQ_LEN,
        "tokens": tokens.reshape(-1).tolist(),
        "ce": float(ce.detach()),
        "aux": float(aux.detach()),
        "aux_coef": getattr(config, "router_aux_loss_coef", 0.0),
        "loss": float(loss.detach()),
        "parts": {"count": SEQS, "aux": float(parts_aux.detach()),
                  "loss": float(parts_loss.detach())} if parts else None,
        "routing_margin": margin,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
    }
    with open(os.path.join(ref_dir, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{name}: seed {seed}, ce {meta['ce']:.6f} aux {meta['aux']:.6f} margin {margin:.2e}")
    return True


def main():
    torch.use_deterministic_algorithms(True)
    families = sys.argv[1:] or list(FAMILIES)
    for i, family in enumerate(FAMILIES):
        if family in families:
            for dtype in ("f32",) if family in F32_ONLY else ("f32", "bf16"):
                # The first seed whose routing is clear of ties.
                seed = 100 + i
                while not make(family, dtype, seed):
                    seed += 1000


if __name__ == "__main__":
    main()
