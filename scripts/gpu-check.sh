#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with gpu-bin/ carried:
# the CUDA tests (which must not report "skipped" there), then the GPU
# benches. Output under $OUT when set.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
status=0
for t in gpu-bin/test-*; do
    echo "== $t"
    "$t" --nocapture 2>&1 | tee "$out/$(basename "$t").log" || status=1
done
if grep -h "cuda case skipped" "$out"/test-*.log; then
    echo "the cuda cases skipped on a GPU machine"
    status=1
fi
gpu-bin/strata bench upload --json | tee "$out/bench-upload.jsonl" || status=1
gpu-bin/strata bench step --json --backend cuda --dir /tmp | tee "$out/bench-step-cuda.jsonl" || status=1
gpu-bin/strata bench step --json --dir /tmp | tee "$out/bench-step-cpu.jsonl" || status=1
# Every record in host memory, larger experts: uploads are the only tier
# traffic, so stall_upload_s against step_s shows whether the next expert's
# upload hides behind this one's compute.
gpu-bin/strata bench step --json --backend cuda --host-fraction 1.0 --d-model 1024 \
    --d-ff 4096 --tokens 4096 --dir /tmp | tee "$out/bench-step-cuda-resident.jsonl" || status=1
exit $status
