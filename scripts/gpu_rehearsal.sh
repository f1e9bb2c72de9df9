#!/usr/bin/env bash
# The GPU check rehearsed on this CPU as the GPU machine runs it (`make gpu-rehearsal`): a
# fresh clone of HEAD plus the kit (as the device tool carries them), run by a venv of the
# machine's own packages (scripts/gpu_machine.txt) with nothing of the project installed,
# DEVICE=cpu: phase 1, then phase 2 with the GGUF's parts. Each phase must exit 0 and leave at
# most 8 files, as at most 8 come back from the machine. Not in CI (about 6 minutes).
#
#   scripts/gpu_rehearsal.sh [OUT_DIR]      (default: gpu_kit/rehearsal)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$root/.gpu-rehearsal
out=$(mkdir -p "${1:-gpu_kit/rehearsal}" && cd "${1:-gpu_kit/rehearsal}" && pwd)

if [ ! -f "$venv/.installed" ] || [ scripts/gpu_machine.txt -nt "$venv/.installed" ]; then
    rm -rf "$venv"
    python3.11 -m venv "$venv"
    "$venv/bin/pip" install -q -r scripts/gpu_machine.txt
    touch "$venv/.installed"
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git clone -q "$root" "$scratch/repo"
# the kit as for the machine, its wheels for this venv's Python
KIT="$scratch/repo/gpu_kit" KIT_PYTHON=3.11 scripts/gpu_kit.sh > /dev/null

for phase in phase1 phase2; do
    rm -rf "${out:?}/$phase"
    (cd "$scratch/repo" && DEVICE=cpu PYTHON="$venv/bin/python" SITE="$scratch/site" \
        SPLITDEC_CACHE="$scratch/cache" scripts/gpu_check.sh "$phase" "$out/$phase")
    files=$(find "$out/$phase" -type f | wc -l)
    if [ "$files" -gt 8 ]; then
        echo "gpu_rehearsal: $phase left $files files, more than the 8 that come back" >&2
        exit 1
    fi
    echo "gpu_rehearsal: $phase green, $files files in $out/$phase"
done
