#!/usr/bin/env bash
# The GPU node checked end to end, in one run (at most 8 minutes on an H100 at the defaults):
#   1. the equivalence tests with the target on CUDA, through the static engine with CUDA graphs
#      (tree forwards against causal ones, batched sessions against each alone, split decoding
#      and server-side speculation against plain greedy decoding, the families, the sampling
#      rules);
#   2. forward time per bucket, transformers against the static engine eager and with graphs
#      (benchmarks/static_steps.py);
#   3. the capacity benchmark with 1, 4 and 16 edge clients on the node's other cores (batched
#      plain API, server-side speculation, split decoding at lock-step and auto pace), tokens/s
#      together and p50/p95 inter-token latency (benchmarks/capacity.py).
# Tables, plots, logs and a draft LOG entry land in OUT_DIR. `DEVICE=cpu` runs the same steps
# on the CPU at small sizes (the rehearsal: a GPU then adds only the device). CI never runs it.
#
#   scripts/gpu_check.sh OUT_DIR
#
# Settings (environment), with their defaults: PYTHON (python3), DEVICE (cuda), DTYPE (auto),
# CLIENTS (1,4,16; cpu: 1,2), PER_CLIENT (1), MAX_NEW_TOKENS (96; cpu: 24), START_DELAY_S (8),
# TESTS_TIMEOUT_S (180), STEPS_TIMEOUT_S (60), CAPACITY_TIMEOUT_S (220), CAPACITY (1; 0: skip).
set -uo pipefail

out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
mkdir -p "$out"
if [ "$device" = cpu ]; then
    clients=${CLIENTS:-1,2}; max_new=${MAX_NEW_TOKENS:-24}; sessions=1,2; tokens=1,9
    tests=(tests/test_static_engine.py "tests/test_target_families.py::test_split_greedy_is_plain_greedy")
else
    clients=${CLIENTS:-1,4,16}; max_new=${MAX_NEW_TOKENS:-96}; sessions=1,4,16; tokens=1,9,17,65
    tests=(tests/test_static_engine.py tests/test_target_tree_forward.py tests/test_batching.py
           tests/test_split_decoding_tiny.py tests/test_paced_tiny.py
           tests/test_split_sampling_tiny.py tests/test_target_families.py
           "tests/test_moa_real.py::test_committed_drafter_is_lossless_and_accepts[moa]")
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
fi

SPLITDEC_TEST_DEVICE=$device timeout "${TESTS_TIMEOUT_S:-180}" "$py" -m pytest -q \
    -p no:cacheprovider --durations=5 "${tests[@]}" 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}

timeout "${STEPS_TIMEOUT_S:-60}" "$py" -m benchmarks.static_steps --device "$device" \
    --dtype "${DTYPE:-auto}" --sessions "$sessions" --tokens "$tokens" \
    --name "gpu_check_steps_$device" 2>&1 | tee "$out/static_steps.log"
steps_rc=${PIPESTATUS[0]}

capacity_rc=0
if [ "${CAPACITY:-1}" != 0 ]; then
    # The server on two cores, each edge client process on the rest (laptops apart from the node).
    cores=$(nproc)
    timeout "${CAPACITY_TIMEOUT_S:-220}" "$py" -m benchmarks.capacity --device "$device" \
        --dtype "${DTYPE:-auto}" --weights fp32 --engine static --clients "$clients" --drafters moa \
        --paces lockstep,auto --servers batched \
        --per-client "${PER_CLIENT:-1}" --max-new-tokens "$max_new" \
        --start-delay-s "${START_DELAY_S:-8}" --server-cores 0 \
        --client-cores "$(seq -s, 1 $((cores - 1)))" --name "gpu_check_capacity_$device" \
        2>&1 | tee "$out/capacity.log"
    capacity_rc=${PIPESTATUS[0]}
fi

# A shape that failed to capture runs eagerly, correct but at eager speed: the check fails.
failed_captures=$(cat "$out/tests.log" "$out/static_steps.log" "$out/capacity.log" 2>/dev/null \
    | grep -c "failed, it runs eagerly")

for f in benchmarks/results/gpu_check_*_"$device".*; do
    [ -f "$f" ] && cp "$f" "$out/"
done
{
    echo "## gpu_check_$device"
    echo "- date: $(date -u +%F); commit: $(git rev-parse --short HEAD 2>/dev/null || echo none)"
    echo "- command: DEVICE=$device scripts/gpu_check.sh OUT_DIR"
    echo "- exits: tests $tests_rc, static_steps $steps_rc, capacity $capacity_rc;" \
        "failed captures $failed_captures"
    echo
    cat "$out/gpu_check_steps_$device.md" 2>/dev/null
    echo
    cat "$out/gpu_check_capacity_$device.md" 2>/dev/null
} > "$out/LOG_entry.md"
echo "equivalence tests: exit $tests_rc; static_steps: exit $steps_rc; capacity: exit" \
    "$capacity_rc; failed captures: $failed_captures"
[ "$tests_rc" -eq 0 ] && [ "$steps_rc" -eq 0 ] && [ "$capacity_rc" -eq 0 ] \
    && [ "$failed_captures" -eq 0 ]
