#!/usr/bin/env bash
# Builds gpu_kit/ (ignored by git): what the GPU machine lacks for scripts/gpu_check.sh, in
# pieces that each fit one transfer beside the working tree (docs/usage.md, "On a GPU node"):
#   gpu_kit/base     the wheels the machine lacks, for its Python 3.12, pinned as
#                    constraints.txt pins them; the default target's config and tokenizer (its
#                    shape, for phase 1's random-weight checkpoint); the evaluation prompts the
#                    check reads, at the paths their packages install them to; the GGUF's hash
#   gpu_kit/gguf.N   the default target's GGUF in parts, for phase 2
# Then it checks the sizes and prints the commands to run there.
#
#   scripts/gpu_kit.sh
# Settings (environment), with their defaults: PYTHON (.venv/bin/python, which builds it), KIT
# (gpu_kit, relative to the repository), KIT_PYTHON (3.12, the machine's: the wheels' Python;
# the CPU rehearsal's venv is 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
kit=${KIT:-gpu_kit}
abi=${KIT_PYTHON:-3.12}
transfer=$((64 * 1024 * 1024))  # the most one transfer carries: tree and named folders
budget=$((56 * 1024 * 1024))    # tree plus base kit, leaving room for what a session adds
wheels=(gguf grpcio grpcio-health-checking protobuf)

rm -rf "$kit"
mkdir -p "$kit/base/wheels"
pins=()
for name in "${wheels[@]}"; do
    pins+=("$(grep -i "^$name==" constraints.txt)")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$abi" \
    --platform manylinux_2_17_x86_64 -d "$kit/base/wheels" "${pins[@]}" \
    2> >(grep -v "^WARNING: Location" >&2)  # the machine's find-links, for other Pythons

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
PYTHONPATH=. "$py" - "$stage" <<'EOF'
import shutil, sys
from pathlib import Path
from benchmarks.random_target import copy_shape
from cloud_server import model_store
from shared import prompt_sets

stage = Path(sys.argv[1])
copy_shape(model_store.default_checkpoint(), stage / "shape")
for package, relative in prompt_sets.FILES.values():
    source = prompt_sets.package_file(package, relative)
    (stage / "site" / package / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, stage / "site" / package / relative)
shutil.copy2(model_store.gguf_path(), stage / "model.gguf")
EOF
tar -cJf "$kit/base/shape.tar.xz" -C "$stage" shape
tar -cJf "$kit/base/data.tar.xz" -C "$stage/site" .
(cd "$stage" && sha256sum model.gguf) | awk '{print $1}' > "$kit/base/gguf.sha256"

travels() {  # bytes of the working tree as it travels: tracked and untracked-not-ignored
    git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
        | awk '{s += $1} END {print s + 0}'
}
tree=$(travels)
base=$(du -sb "$kit/base" | cut -f1)
part=$((transfer - tree - 1024 * 1024))  # a part travels beside the tree alone
gguf=$(stat -c %s "$stage/model.gguf")
parts=$(((gguf + part - 1) / part))
split -d -a 1 -b "$part" "$stage/model.gguf" "$stage/gguf."
for f in "$stage"/gguf.[0-9]; do
    n=$((${f##*.} + 1))
    mkdir -p "$kit/gguf.$n"
    mv "$f" "$kit/gguf.$n/part"
done

mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "tree $(mib "$tree"), base kit $(mib "$base"): $(mib $((tree + base))) of $(mib "$budget")"
echo "GGUF $(mib "$gguf") in $parts parts of at most $(mib "$part"), each beside the tree"
if [ $((tree + base)) -gt "$budget" ]; then
    echo "gpu_kit: the tree and the base kit are over $(mib "$budget"): trim the tree" >&2
    exit 1
fi
if [ "$parts" -gt 3 ]; then
    echo "gpu_kit: the GGUF needs $parts transfers beside this tree, more than 3" >&2
    exit 1
fi
cat <<EOF

On the GPU machine (the device tool's run; one command each, while it stays warm):
  1. carry ["gpu_kit/base"], timeout_s 520 (its steps' limits: 480 s):
       bash scripts/gpu_check.sh phase1 "\$OUT"
EOF
for n in $(seq 1 "$parts"); do
    step=$((n + 1))
    if [ "$n" -lt "$parts" ]; then
        echo "  $step. carry [\"gpu_kit/gguf.$n\"], timeout_s 30:  ls gpu_kit"
    else
        echo "  $step. carry [\"gpu_kit/gguf.$n\"], timeout_s 260 (its steps' limits: 230 s):"
        echo "       bash scripts/gpu_check.sh phase2 \"\$OUT\""
    fi
done
echo "  (what a call wrote stays there while the machine is warm: the parts add up)"
