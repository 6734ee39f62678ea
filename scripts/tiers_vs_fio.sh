#!/usr/bin/env bash
# strata's SSD-tier reads against fio (io_uring, O_DIRECT) reading the very
# same blocks of the same store file, same block size, same queue depth.
#
# For each depth: `strata bench tiers --keep-file` writes a store; then
# ROUNDS times, alternating, fio reads every current record of that file
# (one record read, one skipped: each expert has two record copies) and
# strata reads it again (`--reuse-file`). The disk of a shared VM wanders
# by 2x within seconds, so the figure to read is the ratio of the medians.
#
# FIO_MODE=plain (default) runs `fio --ioengine=io_uring --direct=1` with
# fio's defaults; FIO_MODE=tuned adds the flags that made fio fastest here:
# registered buffers (--fixedbufs), non-vectored reads, mmap'd buffers.
# strata always registers its buffers with io_uring and verifies every
# record's checksums as it arrives (fio reads and discards).
#
#   DIR=/path/on/ssd DEPTHS="1 4 16 32" ROUNDS=5 RECORD_MIB=8 EXPERTS=128 \
#       FIO_MODE=tuned bash scripts/tiers_vs_fio.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${DIR:-/tmp/strata-fio}"
DEPTHS="${DEPTHS:-1 4 16 32}"
ROUNDS="${ROUNDS:-5}"
RECORD_MIB="${RECORD_MIB:-8}"
EXPERTS="${EXPERTS:-128}"
FIO_MODE="${FIO_MODE:-plain}"
case "$FIO_MODE" in
    plain) FIO_FLAGS=() ;;
    tuned) FIO_FLAGS=(--fixedbufs=1 --nonvectored=1 --mem=mmap) ;;
    *) echo "FIO_MODE is plain or tuned" >&2; exit 2 ;;
esac
PASSES="${PASSES:-2}"

if ! command -v fio >/dev/null; then
    echo "# installing fio" >&2
    apt-get update -qq >/dev/null && apt-get install -y -qq fio >/dev/null
fi
mkdir -p "$DIR"
cargo build --release --quiet

strata() {
    ./target/release/strata bench tiers --dir "$DIR" --engines io_uring --queue-depths "$1" \
        --record-mib "$RECORD_MIB" --experts "$EXPERTS" --passes "$PASSES" --keep-file \
        --json "${@:2}" 2>/dev/null | grep '"op":"read"'
}

for depth in $DEPTHS; do
    first="$(strata "$depth")"
    read -r file record_bytes first_offset < <(python3 -c '
import json, sys
r = json.loads(sys.argv[1])
print(r["file"], r["record_bytes"], r["first_offset"])' "$first")
    size=$(( 2 * EXPERTS * record_bytes - record_bytes ))
    results="$(mktemp)"
    for round in $(seq 1 "$ROUNDS"); do
        fio --name=records --filename="$file" --ioengine=io_uring --direct=1 \
            --rw=read:"$record_bytes" --bs="$record_bytes" --iodepth="$depth" \
            --offset="$first_offset" --size="$size" --loops="$PASSES" \
            "${FIO_FLAGS[@]}" \
            --output-format=json 2>/dev/null \
            | python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(json.dumps({"who":"fio","gb_per_s":j["read"]["bw_bytes"]/1e9}))' \
            >> "$results"
        strata "$depth" --reuse-file \
            | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(json.dumps({"who":"strata","gb_per_s":r["gb_per_s"],"cpu_s_per_gb":r["cpu_s_per_gb"],"registered":r["registered"]}))' \
            >> "$results"
    done
    rm -f "$file"
    python3 - "$results" "$depth" "$record_bytes" "$FIO_MODE" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ours = [r["gb_per_s"] for r in rows if r["who"] == "strata"]
fio = [r["gb_per_s"] for r in rows if r["who"] == "fio"]
print(json.dumps({
    "fio_mode": sys.argv[4],
    "queue_depth": int(sys.argv[2]),
    "record_bytes": int(sys.argv[3]),
    "rounds": len(ours),
    "strata_median_gb_per_s": round(statistics.median(ours), 3),
    "fio_median_gb_per_s": round(statistics.median(fio), 3),
    "strata_over_fio": round(statistics.median(ours) / statistics.median(fio), 3),
    "strata_cpu_s_per_gb": round(statistics.median(r["cpu_s_per_gb"] for r in rows if r["who"] == "strata"), 3),
    "strata_registered": all(r["registered"] for r in rows if r["who"] == "strata"),
    "strata_runs": [round(x, 2) for x in ours],
    "fio_runs": [round(x, 2) for x in fio],
}))
PY
    rm -f "$results"
done
