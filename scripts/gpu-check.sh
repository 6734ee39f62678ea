#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with gpu-bin/ carried
# (built by scripts/gpu-bundle.sh). Two phases, each well inside a
# ten-minute command:
#   scripts/gpu-check.sh tests   the CUDA tests (which must not report
#                                "skipped" there), `bench upload`, and the
#                                trainer's default run on the cuda and cpu
#                                backends
#   scripts/gpu-check.sh bench   `bench overlap` (whether this host's disk
#                                I/O hides behind CPU work), then `bench step
#                                --backend cuda`: the default SSD case (at
#                                the tokens a step where compute-only and
#                                I/O-only steps balance), then every record
#                                in host memory
#   scripts/gpu-check.sh sweep   `bench step --backend cuda` (the SSD case)
#                                at 8192, 12288 and 16384 tokens a step,
#                                around where compute meets the I/O on an
#                                H100 host (expert-wise over naive peaks
#                                where the two balance)
#   scripts/gpu-check.sh kept [N]  `bench step --backend cuda --tokens
#                                12288` (near an H100 host's balance)
#                                streaming through every host slot
#                                (`--host-stream-slots all`), then keeping
#                                records resident in all but 4 (the
#                                default): one alternating pair, its files
#                                suffixed N (run it twice for two pairs)
#   scripts/gpu-check.sh defer [N]  the same at 12288 tokens with the last
#                                layer's updates applied as each backward
#                                ends (`--defer-updates off`), then held
#                                for the next forward (`on`, the default):
#                                one alternating pair, its files suffixed N
#   scripts/gpu-check.sh tune [N]  the same at 12288 tokens with the
#                                engine's split of the host tier (4
#                                streaming slots, no compute cells), then 5
#                                streaming without and with a slot split
#                                into compute cells, then 6 with cells:
#                                the settings a modeled device
#                                (`--modeled-device-gflops`) ranked on the
#                                development machine; files suffixed N
#   scripts/gpu-check.sh modeled  `bench step --modeled-device-gflops` at
#                                1000 and 2000 on this host's cores and
#                                disk, at 12288 tokens: set against the
#                                cuda runs, how far the modeled device
#                                stands for the GPU
#   scripts/gpu-check.sh peer [PRESET BATCH SEQ STEPS]...  `strata train
#                                --backend cuda` and the same model in
#                                PyTorch + transformers on the same GPU
#                                (scripts/peer/torch_train.py: bf16
#                                autocast, fused AdamW), the same tokens a
#                                step, alternating; by default the tiny
#                                preset at the trainer's 16 x 64 and moe-s
#                                at 16 x 512 with every expert resident;
#                                strata's step 6 recorded as a timeline
#   scripts/gpu-check.sh quick   what a short GPU loan affords, in one
#                                command of about seven minutes: the backend
#                                tests (every kernel against its CPU
#                                function), the peer comparison on moe-s at
#                                16 x 512, one `ab` pair of bf16 and f32
#                                dense GEMMs, the equivalence and trainer
#                                GPU tests, then the peer on the tiny preset
#   scripts/gpu-check.sh offload  moe-s at 16 x 512 with 24 of its 96
#                                experts' slots on the GPU, 48 records in
#                                host memory, the rest on the SSD: tokens/s,
#                                stalls, step 6's timeline summed
#   scripts/gpu-check.sh deepspeed  `offload`, then the same model under
#                                DeepSpeed ZeRO-3 with its parameters on
#                                NVMe and its optimizer on the CPU
#                                (scripts/peer/deepspeed_train.py; its
#                                wheels in gpu-pack/wheels, so carry
#                                gpu-pack): about five minutes, a loan's
#                                second call
#   scripts/gpu-check.sh groups  experts a group at a time (grouped GEMMs,
#                                the default) against one at a time
#                                (--expert-group 1): tiny with 64 experts a
#                                layer, two alternating pairs, then one
#                                `ab` pair on moe-s
#   scripts/gpu-check.sh loan    a fifteen-minute loan's first call (about
#                                five minutes): the bf16 rate of cuBLAS on
#                                a square product and the preset's shapes
#                                (scripts/peer/gemm_rate.py), the kernel
#                                and device-resident step tests, peer on
#                                moe-s, offload, peer on tiny, the
#                                equivalence and trainer GPU tests
#   scripts/gpu-check.sh ab ROUNDS BIN[:FLAG,...]...  strata binaries
#                                (paths on this machine), each with its own
#                                extra train flags after a colon (commas
#                                for spaces: gpu-bin/strata:--dense-on-host),
#                                in turn, ROUNDS times, each
#                                `train --backend cuda` on moe-s at 16 x
#                                512 for 8 steps: per run the median step,
#                                tokens/s and minor page faults a step over
#                                steps 4-8, and step 6's timeline summed by
#                                thread and name
#   scripts/gpu-check.sh cpu [N]  `bench step` as its defaults stand (the
#                                SSD case on the cpu backend, balanced) on
#                                this host's cores and disk, which overlap
#                                where the development machine's cannot;
#                                its files suffixed N (run it twice for two)
# Output goes under $OUT when set (else gpu-out/), a few files per phase.
set -uo pipefail
phase=${1:-tests}
out=${OUT:-gpu-out}
mkdir -p "$out"

# cudarc opens libcuda, libnvrtc and libcublas by name: put the toolkit's
# (or a Python wheel's) library folders on the loader's path.
libdirs=$(find /usr/local /opt /usr/lib -maxdepth 8 \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) \
    -printf '%h\n' 2>/dev/null | grep -v /stubs | sort -u | paste -sd:)
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

status=0
print_env() { # the GPU, the cores and the library path, into env.txt
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        nproc
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    } 2>&1 | tee "$out/env.txt"
}
run_test() { # binary, filter: one CUDA test binary, its summary printed
    echo "== $1 $2"
    STRATA_REQUIRE_CUDA=1 timeout "${TEST_TIMEOUT:-150}" "$1" $2 --nocapture > "$out/tests-$(basename "$1").log" 2>&1 \
        || { echo "FAILED: $1"; status=1; }
    grep -E "test result|FAILED|panicked|skipped|gpu vs cpu|gpu notes|bf16 attention|dense layers on|dense step on|gpu slot order|on nccl" \
        "$out/tests-$(basename "$1").log"
}
summarize_metrics() { # run directory, label: the timed steps' medians as one JSON line
    python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "wall_s" in r]
timed = rows[3:] or rows
keys = ("compute_s", "stall_upload_s", "stall_ssd_s", "stall_optimizer_s", "bytes_host_to_device",
        "bytes_device_to_host", "bytes_pcie_other")
print(json.dumps(dict(impl="strata", preset=sys.argv[2], steps=len(rows), tokens_per_step=rows[-1]["tokens"],
    tok_s_median=statistics.median(r["tokens"] / r["wall_s"] for r in timed),
    step_s=[round(r["wall_s"], 4) for r in rows], first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"],
    **{k: statistics.median(r[k] for r in timed) for k in keys if k in rows[-1]})))
PY
}
case "$phase" in
tests)
    print_env
    for t in gpu-bin/test-*; do
        # The trainer's other tests run the strata binary at the path cargo
        # built it to, which is not on this machine; they need no GPU and
        # run in CI. Its GPU test is `the_trainer_runs_on_the_gpus`.
        filter=
        [ "$t" = gpu-bin/test-trainer ] && filter=gpus
        echo "== $t $filter"
        STRATA_REQUIRE_CUDA=1 timeout 240 "$t" $filter --nocapture 2>&1 \
            || { echo "FAILED: $t"; status=1; }
    done > "$out/tests.log"
    grep -E "^== |test result|FAILED|panicked|cuda case|gpu vs cpu|gpu notes" "$out/tests.log"
    if grep -h "cuda case skipped" "$out/tests.log"; then
        echo "the cuda cases skipped on a GPU machine"
        status=1
    fi
    timeout 120 gpu-bin/strata bench upload --json | tee "$out/bench-upload.jsonl" || status=1
    for backend in cuda cpu; do
        echo "== train --backend $backend"
        rm -rf /tmp/strata-train
        start=$SECONDS
        timeout 200 gpu-bin/strata train --backend "$backend" --out /tmp/strata-train 2>&1 | tail -12
        echo "wall: $((SECONDS - start)) s"
    done > "$out/train.log" 2>&1
    cat "$out/train.log"
    ;;
bench)
    timeout 50 gpu-bin/strata bench overlap --json --rounds 3 --dir /tmp \
        > "$out/bench-overlap.jsonl" 2> "$out/bench-overlap.log" || status=1
    cat "$out/bench-overlap.jsonl"
    timeout 300 gpu-bin/strata bench step --json --backend cuda --dir /tmp \
        --timeline "$out/timeline-cuda" \
        > "$out/bench-step-cuda.jsonl" 2> "$out/bench-step-cuda.log" || status=1
    cat "$out/bench-step-cuda.jsonl"
    grep "balance" "$out/bench-step-cuda.log"
    tail -5 "$out/bench-step-cuda.log"
    # Every record in host memory, larger experts: uploads are the only tier
    # traffic, so stall_upload_s against step_s shows whether the next
    # expert's upload hides behind this one's compute.
    timeout 200 gpu-bin/strata bench step --json --backend cuda --host-fraction 1.0 --d-model 1024 \
        --d-ff 4096 --tokens 4096 --dir /tmp \
        > "$out/bench-step-cuda-resident.jsonl" 2> "$out/bench-step-cuda-resident.log" || status=1
    cat "$out/bench-step-cuda-resident.jsonl"
    tail -5 "$out/bench-step-cuda-resident.log"
    ;;
sweep)
    for tokens in 8192 12288 16384; do
        timeout 180 gpu-bin/strata bench step --json --backend cuda --tokens "$tokens" \
            --rounds 2 --dir /tmp --timeline "$out/timeline-cuda-t$tokens" \
            > "$out/bench-step-cuda-t$tokens.jsonl" 2> "$out/bench-step-cuda-t$tokens.log" || status=1
        echo "== --tokens $tokens"
        cat "$out/bench-step-cuda-t$tokens.jsonl"
    done
    ;;
kept)
    pair=${2:-1}
    for stream in all 4; do
        timeout 280 gpu-bin/strata bench step --json --backend cuda --tokens 12288 \
            --rounds 2 --host-stream-slots "$stream" --dir /tmp \
            > "$out/bench-step-cuda-stream-$stream-$pair.jsonl" \
            2> "$out/bench-step-cuda-stream-$stream-$pair.log" || status=1
        echo "== --host-stream-slots $stream (pair $pair)"
        cat "$out/bench-step-cuda-stream-$stream-$pair.jsonl"
    done
    ;;
defer)
    pair=${2:-1}
    for defer in off on; do
        timeout 280 gpu-bin/strata bench step --json --backend cuda --tokens 12288 \
            --rounds 2 --defer-updates "$defer" --dir /tmp \
            > "$out/bench-step-cuda-defer-$defer-$pair.jsonl" \
            2> "$out/bench-step-cuda-defer-$defer-$pair.log" || status=1
        echo "== --defer-updates $defer (pair $pair)"
        cat "$out/bench-step-cuda-defer-$defer-$pair.jsonl"
    done
    ;;
tune)
    run=${2:-1}
    for setting in "4 0" "5 0" "5 1" "6 1"; do
        set -- $setting
        name="$1-$2-$run"
        timeout 180 gpu-bin/strata bench step --json --backend cuda --tokens 12288 \
            --rounds 2 --host-stream-slots "$1" --host-cell-slots "$2" \
            --dir /tmp > "$out/bench-step-cuda-tune-$name.jsonl" \
            2> "$out/bench-step-cuda-tune-$name.log" || status=1
        echo "== --host-stream-slots $1 --host-cell-slots $2 (run $run)"
        cat "$out/bench-step-cuda-tune-$name.jsonl"
    done
    ;;
modeled)
    for gflops in 1000 2000; do
        timeout 240 gpu-bin/strata bench step --json --modeled-device-gflops "$gflops" \
            --tokens 12288 --rounds 2 --dir /tmp \
            > "$out/bench-step-modeled-$gflops.jsonl" \
            2> "$out/bench-step-modeled-$gflops.log" || status=1
        echo "== --modeled-device-gflops $gflops"
        cat "$out/bench-step-modeled-$gflops.jsonl"
    done
    ;;
peer)
    shift
    [ $# -eq 0 ] && set -- tiny 16 64 40 moe-s 16 512 10
    while [ $# -ge 4 ]; do
        preset=$1 batch=$2 seq=$3 steps=$4
        shift 4
        dir=/tmp/peer-$preset
        ts=$((steps < 6 ? steps : 6))
        rm -rf "$dir"
        echo "== strata train --backend cuda --preset $preset ($batch x $seq, $steps steps)"
        timeout 300 gpu-bin/strata train --backend cuda --preset "$preset" --batch "$batch" \
            --seq-len "$seq" --steps "$steps" --warmup 2 --eval-every 1000 --checkpoint-every 1000 \
            --device-mem 40GiB --host-mem 64GiB --out "$dir" --quiet --timeline-step "$ts" \
            > "$out/peer-strata-$preset.log" 2>&1 || status=1
        # Step 6's timeline (or the last step's): every dense kernel call,
        # expert loop, wait and update, on its thread (ui.perfetto.dev).
        cp "$dir/timeline-step-$ts.json" "$out/timeline-$preset.json" 2>/dev/null
        # Where that step's time went, by thread and name (the host's own
        # passes are category "host"), printed: the output may hold too many
        # files for all of them to come back.
        python3 scripts/peer/timeline_summary.py "$dir/timeline-step-$ts.json" 30 2>&1
        echo "-- the GPU's own time (CUDA events around each operation)"
        python3 scripts/peer/timeline_summary.py "$dir/timeline-step-$ts.json" 40 gpu 2>&1
        head -3 "$out/peer-strata-$preset.log"
        summarize_metrics "$dir" "$preset" | tee -a "$out/peer.jsonl"
        echo "== torch peer --preset $preset"
        timeout 300 "${PYTHON:-python3}" scripts/peer/torch_train.py --config "$dir/config.json" --batch "$batch" \
            --seq-len "$seq" --steps "$steps" --warmup-steps 3 \
            2> "$out/peer-torch-$preset.log" | tail -1 | tee -a "$out/peer.jsonl" || status=1
        tail -2 "$out/peer-torch-$preset.log"
        rm -rf "$dir" # moe-s's store (18 GiB) would crowd the next run's
    done
    ;;
offload)
    # moe-s at 16 x 512 with a quarter of its experts' slots on the GPU
    # (24 of 96), half its records in host memory (48) and the rest on the
    # SSD: tokens/s, the stalls, and step 6's timeline summed.
    dir=/tmp/offload-moe-s
    rm -rf "$dir"
    echo "== strata train --backend cuda --preset moe-s (16 x 512), --device-mem 6.75GiB --host-mem 4.7GiB"
    timeout "${OFFLOAD_TIMEOUT:-240}" gpu-bin/strata train --backend cuda --preset moe-s --batch 16 \
        --seq-len 512 --steps 8 --warmup 2 --eval-every 1000 --checkpoint-every 1000 \
        --device-mem 6.75GiB --host-mem 4.7GiB --out "$dir" --quiet --timeline-step 6 \
        > "$out/offload-moe-s.log" 2>&1 || status=1
    head -4 "$out/offload-moe-s.log"
    python3 scripts/peer/timeline_summary.py "$dir/timeline-step-6.json" 30 2>&1
    python3 scripts/peer/timeline_summary.py "$dir/timeline-step-6.json" 40 gpu 2>&1
    summarize_metrics "$dir" moe-s-offload | tee -a "$out/peer.jsonl"
    cp "$dir/config.json" "$out/config-moe-s.json"
    rm -rf "$dir"
    ;;
deepspeed)
    # `offload` (strata's moe-s streamed from host memory and the SSD),
    # then the same model under DeepSpeed ZeRO-3, its parameters offloaded
    # to NVMe and its optimizer to the CPU (scripts/peer/deepspeed_train.py),
    # the same tokens a step. DeepSpeed and what it needs come as wheels in
    # gpu-pack/wheels (scripts/gpu-bundle.sh; carry gpu-pack), libaio for
    # its NVMe offload as .debs unpacked under /tmp/aio; its ops build on
    # first use (a minute or two).
    OUT=$out "$0" offload || status=1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ds-site gpu-pack/wheels/*.whl || { echo "the DeepSpeed wheels did not install"; exit 1; }
    export PYTHONPATH=/tmp/ds-site${PYTHONPATH:+:$PYTHONPATH}
    for deb in gpu-pack/wheels/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" /tmp/aio; done
    aio_lib=/tmp/aio/usr/lib/x86_64-linux-gnu
    # The ops link -lcuda: the toolkit's stub serves for linking.
    stubs=$(find /usr/local -maxdepth 6 -name libcuda.so -path '*stubs*' -printf '%h\n' 2>/dev/null | head -1)
    export CFLAGS="-I/tmp/aio/usr/include" LDFLAGS="-L$aio_lib" CPATH=/tmp/aio/usr/include \
        LIBRARY_PATH="$aio_lib${stubs:+:$stubs}" LD_LIBRARY_PATH="$aio_lib:$LD_LIBRARY_PATH" \
        TORCH_EXTENSIONS_DIR=/tmp/ds-extensions
    echo "== deepspeed ZeRO-3, parameters to NVMe (/tmp/ds-nvme), optimizer to the CPU, moe-s 16 x 512"
    timeout "${DEEPSPEED_TIMEOUT:-420}" python3 scripts/peer/deepspeed_train.py \
        --config "$out/config-moe-s.json" --batch 16 --seq-len 512 --steps 8 --warmup-steps 3 \
        --nvme-path /tmp/ds-nvme 2> "$out/peer-deepspeed-moe-s.log" | tail -1 | tee -a "$out/peer.jsonl" \
        || status=1
    grep -E "^deepspeed|^step|Error|error:" "$out/peer-deepspeed-moe-s.log" | tail -14
    rm -rf /tmp/ds-nvme
    ;;
loan)
    # A fifteen-minute loan's first call (about five minutes): the bf16
    # rate cuBLAS reaches here, the kernels' and the device-resident
    # step's tests, the peer on moe-s and tiny, moe-s streamed from the
    # host and the SSD, then the equivalence and trainer GPU tests.
    print_env
    timeout 60 python3 scripts/peer/gemm_rate.py | tee "$out/gemm-rate.jsonl"
    TEST_TIMEOUT=90
    for t in backend gpu_attention gpu_dense_layers gpu_dense_step routing_trace gpu_slot_order; do
        run_test "gpu-bin/test-$t" ""
    done
    OUT=$out "$0" peer moe-s 16 512 10 || status=1
    OUT=$out "$0" offload || status=1
    OUT=$out "$0" peer tiny 16 64 40 || status=1
    run_test gpu-bin/test-equivalence ""
    run_test gpu-bin/test-trainer gpus
    ;;
quick)
    print_env
    run_test gpu-bin/test-backend ""
    # NCCL's ranks on the real GPUs (1 rank on one GPU, more where there
    # are more), with PyTorch's NCCL wheel's library as libnccl.so.
    nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
    mkdir -p /tmp/strata-nccl
    [ -n "$nccl_dir" ] && ln -sf "$nccl_dir/libnccl.so.2" /tmp/strata-nccl/libnccl.so
    LD_LIBRARY_PATH="/tmp/strata-nccl:$LD_LIBRARY_PATH" run_test gpu-bin/test-nccl_ranks ""
    run_test gpu-bin/test-gpu_attention ""
    run_test gpu-bin/test-gpu_dense_layers ""
    run_test gpu-bin/test-gpu_dense_step ""
    run_test gpu-bin/test-routing_trace ""
    run_test gpu-bin/test-gpu_slot_order ""
    OUT=$out "$0" peer moe-s 16 512 10 || status=1
    # The dense GEMMs' input type, bf16 (the default) against f32.
    OUT=$out "$0" ab 1 gpu-bin/strata gpu-bin/strata:--dense-gemm,f32 || status=1
    run_test gpu-bin/test-equivalence ""
    run_test gpu-bin/test-trainer gpus
    OUT=$out "$0" peer tiny 16 64 40 || status=1
    ;;
ab)
    rounds=$2
    shift 2
    for pair in $(seq "$rounds"); do
        for spec in "$@"; do
            bin=${spec%%:*}
            extra=""
            [ "$spec" != "$bin" ] && extra=${spec#*:}
            side=$(basename "$bin")${extra:+-$(echo "$extra" | tr -c 'A-Za-z0-9\n' '_')}
            dir=/tmp/ab-$side-$pair
            rm -rf "$dir"
            # shellcheck disable=SC2046 # the flags split on the commas
            timeout 200 "$bin" train --backend cuda --preset moe-s --batch 16 --seq-len 512 \
                --steps 8 --warmup 2 --eval-every 1000 --checkpoint-every 1000 \
                --device-mem 40GiB --host-mem 64GiB --out "$dir" --quiet --timeline-step 6 \
                $(echo "$extra" | tr ',' ' ') > "$out/ab-$side-$pair.log" 2>&1 || status=1
            python3 - "$dir/metrics.jsonl" "$side" "$pair" <<'PY' | tee -a "$out/ab.jsonl"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "wall_s" in r]
timed = rows[3:]
faults = [b["minor_faults"] - a["minor_faults"] for a, b in zip(rows[2:], rows[3:])
          if "minor_faults" in a and "minor_faults" in b]
print(json.dumps(dict(side=sys.argv[2], pair=int(sys.argv[3]),
    step_s_median=statistics.median(r["wall_s"] for r in timed),
    tok_s_median=statistics.median(r["tokens"] / r["wall_s"] for r in timed),
    step_s=[round(r["wall_s"], 4) for r in rows], last_loss=rows[-1]["loss"],
    faults_per_step=statistics.median(faults) if faults else None,
    bytes_pcie_other=rows[-1].get("bytes_pcie_other"))))
PY
            python3 scripts/peer/timeline_summary.py "$dir/timeline-step-6.json" 30 \
                > "$out/ab-timeline-$side-$pair.txt" 2>&1
            rm -rf "$dir" # its store (18 GiB) would leave the next run no disk
        done
    done
    cat "$out"/ab-timeline-*-1.txt
    ;;
groups)
    # Experts a group at a time (the default: each product of a group one
    # grouped GEMM) against one at a time (--expert-group 1), alternating:
    # tiny with 64 experts a layer (16 to a group) at 16 x 512, two rounds,
    # then moe-s (all 8 of a layer in a group), one `ab` pair. The losses
    # must agree to the bit, as on the driver model.
    for pair in 1 2; do
        for group in default 1; do
            dir=/tmp/groups-$group-$pair
            rm -rf "$dir"
            extra=""
            [ "$group" = 1 ] && extra="--expert-group 1"
            # shellcheck disable=SC2086 # no flag, or the flag and its value
            timeout 200 gpu-bin/strata train --backend cuda --preset tiny --experts 64 --batch 16 \
                --seq-len 512 --steps 12 --warmup 2 --eval-every 1000 --checkpoint-every 1000 \
                --out "$dir" --quiet $extra > "$out/groups-$group-$pair.log" 2>&1 || status=1
            summarize_metrics "$dir" "tiny-64-experts-group-$group" | tee -a "$out/groups.jsonl"
            rm -rf "$dir"
        done
    done
    OUT=$out "$0" ab 1 gpu-bin/strata gpu-bin/strata:--expert-group,1 || status=1
    ;;
cpu)
    run=${2:-1}
    timeout 400 gpu-bin/strata bench step --json --dir /tmp --timeline "$out/timeline-cpu-$run" \
        > "$out/bench-step-cpu-$run.jsonl" 2> "$out/bench-step-cpu-$run.log" || status=1
    echo "== bench step (cpu backend, defaults; run $run)"
    cat "$out/bench-step-cpu-$run.jsonl"
    grep "balance" "$out/bench-step-cpu-$run.log"
    tail -5 "$out/bench-step-cpu-$run.log"
    ;;
*)
    echo "usage: scripts/gpu-check.sh tests|loan|quick|offload|deepspeed|groups|ab ROUNDS BIN[:FLAG,...]...|bench|sweep|kept [N]|defer [N]|tune [N]|modeled|peer [PRESET BATCH SEQ STEPS]...|cpu [N]" >&2
    exit 2
    ;;
esac
exit $status
