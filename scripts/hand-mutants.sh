#!/usr/bin/env bash
# Hand-made mutants of the gradient paths: each scales one gradient by 2
# (or halves a denominator) in one place, or turns RoPE the other way in
# both passes (which keeps norms, position 0 and the backward's transpose
# intact), and the script lists the default tests that fail on it. A
# mutant no test kills is a hole in the suite.
# docs/testing.md records the last run.
#
#   scripts/hand-mutants.sh            # every mutant
#   scripts/hand-mutants.sh aux        # those whose name contains "aux"
#
# It works on a copy of the tree (in $STRATA_MUTANTS_DIR, default
# /tmp/strata-mutants, with its own target directory), so the checkout is
# never touched; the first mutant builds from scratch, the rest build
# incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(pwd)
work=${STRATA_MUTANTS_DIR:-/tmp/strata-mutants}
filter=${1:-}
tests=(oracle_lm equivalence multi_device gradcheck gradcheck_lm)

# name ^ file ^ exact text ^ its replacement
mutants=(
    "expert accumulation over micro-batches^src/engine/updates.rs^for_each(|(s, g)| *s += g)^for_each(|(s, g)| *s += 2.0 * g)"
    "dense all-reduce over devices^src/comm.rs^for_each(|(b, p)| *b += p)^for_each(|(b, p)| *b += 2.0 * p)"
    "cross-entropy's micro-batch denominator^src/lm/network.rs^&f.targets, v, tokens_total)^&f.targets, v, tokens_total / 2)"
    "aux and z terms' micro-batch share^src/lm/network.rs^let share = 1.0 / micro_batches as f32;^let share = 2.0 / micro_batches as f32;"
    "aux term in the router's backward^src/math/router.rs^+= daux * R::from_f64(e as f64)^+= R::from_f64(2.0) * daux * R::from_f64(e as f64)"
    "z term in the router's backward^src/math/router.rs^let zscale = dz * R::from_f64(2.0)^let zscale = dz * R::from_f64(4.0)"
    "all-layers aux term's gradient^src/lm/network.rs^(e * c / (n * n)) as f32^(2.0 * e * c / (n * n)) as f32"
    "combine weights' gradient^src/math/permute.rs^dw[r * k + s] = dot;^dw[r * k + s] = dot + dot;"
    "SwiGLU gate's gradient (cpu backend)^src/backend/cpu.rs^da[i] = dh[i] * b[i] *^da[i] = 2.0 * dh[i] * b[i] *"
    "RMSNorm gain's gradient^src/math/mod.rs^block[j] += dy[j] * row[j] * inv;^block[j] += R::from_f64(2.0) * dy[j] * row[j] * inv;"
    "attention's value gradient^src/math/attention.rs^*d += p * o;^*d += R::from_f64(2.0) * p * o;"
    "RoPE turned the other way (forward and backward alike)^src/math/attention.rs^let s = if transpose {^let s = if !transpose {"
)

mkdir -p "$work"
rm -rf "$work/tree" && mkdir -p "$work/tree"
tar -C "$src" --exclude=./target --exclude=./.git --exclude=./fuzz/target --exclude=./fuzz/corpus --exclude=./fuzz/artifacts -cf - . | tar -C "$work/tree" -xf -
export CARGO_TARGET_DIR="$work/target"
cd "$work/tree"
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done

echo "baseline: ${tests[*]}"
cargo test -q "${args[@]}" >"$work/baseline.log" 2>&1 \
    || { echo "the unmutated tests fail: see $work/baseline.log"; exit 1; }

survivors=0
for m in "${mutants[@]}"; do
    IFS='^' read -r name file from to <<<"$m"
    [[ -z "$filter" || "$name" == *"$filter"* ]] || continue
    cp "$src/$file" "$file"
    FROM="$from" TO="$to" perl -0pi -e 's/\Q$ENV{FROM}\E/$ENV{TO}/' "$file"
    if cmp -s "$src/$file" "$file"; then
        echo "MISSING  $name: the text is no longer in $file"
        survivors=$((survivors + 1))
        continue
    fi
    log="$work/$(echo "$name" | tr -c 'A-Za-z0-9' '-').log"
    cargo test --no-fail-fast "${args[@]}" >"$log" 2>&1 || true
    killed=$(awk '/Running tests\// { sub(/.*Running tests\//, ""); sub(/\.rs.*/, ""); bin = $0 }
                  /^test .* FAILED$/ { print bin "::" $2 }' "$log" | sort -u | tr '\n' ' ')
    if grep -q "could not compile" "$log"; then
        echo "BUILD    $name: the mutant does not compile (see $log)"
        survivors=$((survivors + 1))
    elif [ -n "$killed" ]; then
        echo "killed   $name: $killed"
    else
        echo "SURVIVED $name"
        survivors=$((survivors + 1))
    fi
    cp "$src/$file" "$file"
done
echo "$survivors mutant(s) survived, were not found or did not build"
[ "$survivors" -eq 0 ]
