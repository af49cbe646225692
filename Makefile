# areal-mega developer commands. Both targets create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# CI runs every test that does not need a GPU; slow tests included.
PYTEST_ARGS ?= -m "not gpu" -q

.PHONY: install test demo build clean-venv

$(STAMP): requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	mkdir -p build && touch build/.kernels-built
	touch $(STAMP)

# csrc kernels: `pip install -e .` builds them once; rebuild in place when a source changes.
KERNEL_SRC    := $(shell find csrc -type f 2>/dev/null)
KERNEL_STAMP  := build/.kernels-built

$(KERNEL_STAMP): $(STAMP) $(KERNEL_SRC)
	$(PY) setup.py -q build_ext --inplace
	mkdir -p build && touch $(KERNEL_STAMP)

install: $(STAMP)

build: $(KERNEL_STAMP)

test: $(STAMP) $(KERNEL_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP) $(KERNEL_STAMP)
	$(PY) -m areal_mega.demo

clean-venv:
	rm -rf $(VENV)
