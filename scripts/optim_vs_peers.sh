#!/usr/bin/env bash
# strata's CPU AdamW against DeepSpeed's CPU Adam, interleaved in one run.
#
# Each round runs `strata bench optim` and then shared/bench/peer_adam.py
# (DeepSpeed's fp32 step and its three-pass mixed path: upcast the bf16 grad,
# step, downcast the copy), at the same size and thread count, and prints
# the ratios of that round's medians. The peer venv is made by
# shared/bench/run_peers.sh (in /tmp/peerenv); run that once first.
#
#   ROUNDS=3 PARAMS=64M THREADS=2 STEPS=20 bash scripts/optim_vs_peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS="${ROUNDS:-3}"
PARAMS="${PARAMS:-64M}"
THREADS="${THREADS:-2}"
STEPS="${STEPS:-20}"
PEERENV="${PEERENV:-/tmp/peerenv}"
BENCH_DIR="${BENCH_DIR:-../shared/bench}"

if ! "$PEERENV/bin/python" -c 'import torch, deepspeed' >/dev/null 2>&1; then
    echo "no DeepSpeed venv at $PEERENV: run 'bash $BENCH_DIR/run_peers.sh' once first" >&2
    exit 1
fi
export PATH="$PEERENV/bin:$PATH" DS_BUILD_OPS=0 DS_ACCELERATOR=cpu \
    TORCH_EXTENSIONS_DIR="$PEERENV/torch_extensions"

cargo build --release --quiet
out="$(mktemp -d)"
for round in $(seq 1 "$ROUNDS"); do
    ./target/release/strata bench optim --params "$PARAMS" --threads "$THREADS" \
        --steps "$STEPS" --json 2>/dev/null > "$out/strata.$round"
    "$PEERENV/bin/python" "$BENCH_DIR/peer_adam.py" --n "$PARAMS" --threads "$THREADS" \
        --steps "$STEPS" --no-check --json --rep "$round" \
        --impls deepspeed_cpu_adam,deepspeed_cpu_adam_mixedpath 2>/dev/null \
        | grep '^{' > "$out/peer.$round"
    python3 - "$out/strata.$round" "$out/peer.$round" "$round" <<'PY'
import json, sys
ours = {r["variant"]: r for r in map(json.loads, open(sys.argv[1]))}
peer = {r["impl"]: r for r in map(json.loads, open(sys.argv[2]))}
for r in ours.values():
    print(json.dumps({"round": int(sys.argv[3]), "who": "strata", **r}))
for r in peer.values():
    print(json.dumps({"round": int(sys.argv[3]), "who": "peer", **r}))
ratio = lambda a, b: round(a / b, 3)
print(json.dumps({
    "round": int(sys.argv[3]),
    "strata_fp32_over_ceiling": ours["fp32"]["ceiling_ratio"],
    "strata_mixed_over_ceiling": ours["mixed"]["ceiling_ratio"],
    "strata_fp32_over_deepspeed_fp32": ratio(ours["fp32"]["params_per_s"], peer["deepspeed_cpu_adam"]["params_per_s"]),
    "strata_mixed_over_deepspeed_mixedpath": ratio(ours["mixed"]["params_per_s"], peer["deepspeed_cpu_adam_mixedpath"]["params_per_s"]),
}))
PY
done
rm -rf "$out"
