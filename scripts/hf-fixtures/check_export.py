"""strata's forward and greedy continuation against transformers' on one
model directory, typically a strata export:

    scripts/hf-fixtures/check_export.py EXPORTED_DIR [NEW_TOKENS]

Runs `cargo run --release --example hub_greedy` (or the binary named by
HUB_GREEDY) on the directory and a fixed prompt, loads the same directory with transformers'
AutoModelForCausalLM.from_pretrained (float32, eager attention), and
checks that the prompt's logits agree within 1e-4 and that the greedy
continuations are the same tokens. Exits 1 otherwise.
"""

import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def main():
    model_dir = sys.argv[1]
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    vocab = model.config.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(12)]
    # HUB_GREEDY names a built example binary; else cargo builds it.
    command = os.environ.get("HUB_GREEDY", "").split() or [
        "cargo", "run", "-q", "--release", "--example", "hub_greedy", "--"]
    run = subprocess.run(
        command + [model_dir, str(new)] + [str(t) for t in prompt],
        cwd=ROOT, check=True, capture_output=True, text=True)
    strata = json.loads(run.stdout)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0]
        ids = torch.tensor([prompt])
        for _ in range(new):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    ours = torch.tensor(strata["logits"]).view(len(prompt), vocab)
    worst = float((ours - logits).abs().max())
    theirs = ids[0, len(prompt):].tolist()
    print(f"{model_dir}: logits within {worst:.2e}; continuation "
          f"strata {strata['continuation']} transformers {theirs}")
    if worst > 1e-4 or strata["continuation"] != theirs:
        sys.exit(1)


if __name__ == "__main__":
    main()
