#!/usr/bin/env bash
# Side by side, alternating: `strata train` streaming its experts from the
# SSD, built from two commits (or two binaries), on the same settings. Per
# run it keeps metrics.jsonl (bytes read/written and bytes_ssd_min per
# step, tokens/s) and the process's resident memory sampled every second,
# and prints a line a run.
#
#   scripts/ssd_step_io.sh OLD_BIN NEW_BIN ROUNDS WORKDIR -- TRAIN_ARGS...
#
# e.g. (moe-s, host budget about an eighth of the experts' bytes):
#   scripts/ssd_step_io.sh /tmp/old/strata target/release/strata 2 /var/tmp/io -- \
#     --preset moe-s --batch 2 --seq-len 64 --host-mem 1.2GiB --steps 6 \
#     --eval-every 0 --checkpoint-every 0 --quiet
#
# Each run creates its store in WORKDIR/run (removed after the run): the
# file system needs room for one store.
set -euo pipefail

old=$1 new=$2 rounds=$3 work=$4
shift 4
[[ ${1:-} == -- ]] && shift
mkdir -p "$work"

summarize() {
    python3 - "$1" "$2" "$3" <<'EOF'
import json, sys
metrics, rss, name = sys.argv[1:]
steps = [json.loads(l) for l in open(metrics) if '"wall_s"' in l]
timed = steps[1:] or steps  # the first step fills the tiers
def med(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2
moved = sum(s["bytes_ssd_to_host"] + s["bytes_host_to_ssd"] for s in timed)
least = sum(s.get("bytes_ssd_min", 0) for s in timed)
mem = [int(l) for l in open(rss) if l.strip()]
gib = 1 << 30
print(json.dumps({
    "run": name,
    "steps": len(timed),
    "step_s_median": round(med([s["wall_s"] for s in timed]), 3),
    "tokens_per_s_median": round(med([s["tokens"] / s["wall_s"] for s in timed]), 1),
    "read_gib_per_step": round(sum(s["bytes_ssd_to_host"] for s in timed) / len(timed) / gib, 3),
    "written_gib_per_step": round(sum(s["bytes_host_to_ssd"] for s in timed) / len(timed) / gib, 3),
    "min_gib_per_step": round(least / len(timed) / gib, 3) if least else None,
    "moved_over_min": round(moved / least, 3) if least else None,
    "ssd_busy_share": round(sum(s["ssd_busy_s"] for s in timed) / sum(s["wall_s"] for s in timed), 3),
    "prediction_missed": sum(s.get("prediction_missed", 0) for s in timed),
    "prediction_unused": sum(s.get("prediction_unused", 0) for s in timed),
    "rss_peak_gib": round(max(mem) * 1024 / gib, 3) if mem else None,
}))
EOF
}

run_one() {
    local bin=$1 name=$2
    shift 2
    rm -rf "$work/run"
    "$bin" train --out "$work/run" "$@" &
    local pid=$!
    : > "$work/$name.rss"
    while kill -0 "$pid" 2>/dev/null; do
        awk '/^VmRSS/ {print $2}' "/proc/$pid/status" >> "$work/$name.rss" 2>/dev/null || true
        sleep 1
    done
    wait "$pid"
    cp "$work/run/metrics.jsonl" "$work/$name.metrics.jsonl"
    rm -rf "$work/run"
    summarize "$work/$name.metrics.jsonl" "$work/$name.rss" "$name"
}

for r in $(seq 1 "$rounds"); do
    run_one "$old" "old-$r" "$@"
    run_one "$new" "new-$r" "$@"
done
