#!/usr/bin/env bash
# Builds what a GPU machine without a Rust toolchain runs: the strata binary
# and the CUDA test binaries (release, --features cuda, debug info stripped)
# into gpu-bin/ (ignored by git), with scripts/gpu-check.sh to run there,
# and gpu-pack/bin.tar.xz, the same compressed; DeepSpeed's wheels and
# libaio's .debs into gpu-pack/wheels (the peer of `gpu-check.sh deepspeed`).
#   scripts/gpu-bundle.sh [BASE]   BASE (a commit) also builds that commit's
#                                  strata, in a worktree under target/, as
#                                  gpu-bin/strata-BASE, for
#                                  `gpu-check.sh ab 2 gpu-bin/strata gpu-bin/strata-BASE`
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --features cuda
mkdir -p gpu-bin
cp target/release/strata gpu-bin/strata
if [ -n "${1:-}" ]; then
    base=$(git rev-parse --short "$1")
    tree=target/gpu-base-$base
    [ -d "$tree" ] || git worktree add --detach "$tree" "$base"
    (cd "$tree" && cargo build --release --features cuda -p strata-cli)
    cp "$tree/target/release/strata" "gpu-bin/strata-$1"
fi
for pt in strata:backend strata:multi_device strata:equivalence strata:gpu_attention \
    strata:gpu_dense_layers strata:gpu_dense_step strata:routing_trace strata:gpu_slot_order \
    strata-cli:trainer; do
    p=${pt%%:*} t=${pt#*:}
    exe=$(cargo test --release -p "$p" --features cuda --no-run --test "$t" --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("target", {}).get("kind") == ["test"]:
        print(m["executable"])' | tail -1)
    cp "$exe" "gpu-bin/test-$t"
done
# GPU ranks over NCCL (gpu-check.sh finds PyTorch's libnccl).
exe=$(cargo test --release -p strata --features nccl --no-run --test nccl_ranks \
    --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("target", {}).get("kind") == ["test"]:
        print(m["executable"])' | tail -1)
cp "$exe" gpu-bin/test-nccl_ranks
exe=$(cargo test --release --features cuda --no-run -p strata-tiers --test device_arena \
    --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("target", {}).get("kind") == ["test"]:
        print(m["executable"])' | tail -1)
cp "$exe" gpu-bin/test-device_arena
strip --strip-debug gpu-bin/strata* gpu-bin/test-*
cp scripts/gpu-check.sh gpu-bin/
du -sh gpu-bin
# DeepSpeed for `gpu-check.sh deepspeed` (the GPU machine has no network):
# its wheel and those of what it needs that the machine's image lacks, for
# Python 3.12, and libaio's .debs, which its NVMe offload builds against.
wheels=gpu-pack/wheels
rm -rf "$wheels" && mkdir -p "$wheels"
if python3 -m pip wheel -q --no-deps -w "$wheels" "${DS_SPEC:-deepspeed==0.19.8}" &&
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$wheels" pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson
then
    (cd "$wheels" && apt-get download libaio1 libaio-dev >/dev/null 2>&1) ||
        echo "no libaio .debs: the GPU machine's DeepSpeed will offload to host memory, not NVMe" >&2
    du -sh "$wheels"
else
    echo "no DeepSpeed wheels (pip could not fetch them): gpu-check.sh deepspeed will not run" >&2
fi
# The same, xz-compressed (about a seventh of the size), for a GPU machine
# reached through a copy of limited size: `tar xJf gpu-pack/bin.tar.xz`
# there, from the repository root.
mkdir -p gpu-pack
tar cJf gpu-pack/bin.tar.xz gpu-bin
du -sh gpu-pack/bin.tar.xz
