#!/usr/bin/env bash
# The GPU path, checked on a machine with a CUDA GPU: the equivalence tests with the target on
# CUDA (tree forwards against causal ones, batched sessions against each alone, split decoding
# and server-side speculation against plain greedy decoding, bf16/fp16 batching, the sampling
# rules), then the capacity benchmark with the server's target on the GPU. CI has no GPU and
# never runs this. Run it from the repository root with the project importable (`make install`,
# or the packages on PYTHONPATH):
#
#   scripts/gpu_check.sh [LOG_DIR]
#
# Settings (environment), with their defaults: PYTHON (python3), CLIENTS (1,4,16), PER_CLIENT
# (1), MAX_NEW_TOKENS (96), DTYPE (fp32), START_DELAY_S (8), TESTS_TIMEOUT_S (300),
# CAPACITY_TIMEOUT_S (420), CAPACITY (1; 0 runs the tests alone). Logs go to LOG_DIR
# (benchmarks/results); the capacity table and plot to benchmarks/results/capacity_gpu.{md,png}.
set -uo pipefail

logs=${1:-benchmarks/results}
py=${PYTHON:-python3}
mkdir -p "$logs"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$logs/gpu_device.txt"

SPLITDEC_TEST_DEVICE=cuda timeout "${TESTS_TIMEOUT_S:-300}" "$py" -m pytest -q \
    -p no:cacheprovider --durations=5 \
    tests/test_target_tree_forward.py tests/test_batching.py tests/test_split_decoding_tiny.py \
    tests/test_paced_tiny.py tests/test_split_sampling_tiny.py tests/test_split_decoding_real.py \
    "tests/test_moa_real.py::test_committed_drafter_is_lossless_and_accepts[moa]" \
    tests/test_large_payloads_real.py tests/test_kv_cache.py tests/test_target_families.py 2>&1 | tee "$logs/gpu_tests.log"
tests=$?

if [ "${CAPACITY:-1}" = 0 ]; then
    echo "equivalence tests: exit $tests"
    exit "$tests"
fi

# The server on two cores, each edge client process on the rest (laptops apart from the node).
cores=$(nproc)
clients=$(seq -s, 2 $((cores - 1)))
timeout "${CAPACITY_TIMEOUT_S:-420}" "$py" -m benchmarks.capacity --device cuda \
    --dtype "${DTYPE:-fp32}" --clients "${CLIENTS:-1,4,16}" --drafters moa \
    --per-client "${PER_CLIENT:-1}" --max-new-tokens "${MAX_NEW_TOKENS:-96}" \
    --start-delay-s "${START_DELAY_S:-8}" --server-cores 0,1 --client-cores "$clients" \
    --name capacity_gpu 2>&1 | tee "$logs/capacity_gpu.log"
capacity=$?

echo "equivalence tests: exit $tests; capacity benchmark: exit $capacity"
[ "$tests" -eq 0 ] && [ "$capacity" -eq 0 ]
