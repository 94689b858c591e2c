# Set-up and everyday commands. `make serve` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Without an NVIDIA driver, pin the CPU wheel so a fresh venv does not pull a multi-GB CUDA torch.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PYTEST_ARGS ?=

# The GPU machine's Triton, in a venv of its own: the kernel tests under its interpreter and the
# cross-compile checks with its compiler. Triton 3.6's interpreter needs numpy < 2.4.
COMPAT_VENV ?= .venv-triton36
TRITON_COMPAT ?= triton==3.6.0

.PHONY: install serve test test-compat lint bench-kernels clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml $(wildcard csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-build-isolation -e ".[dev]"
	touch $@

serve: install
	$(BIN)/python -m sangam.serve

test: install
	$(BIN)/ruff check .
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-compat: $(COMPAT_VENV)/.installed
	TRITON_INTERPRET=1 PYTHONPATH=. $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		-W "ignore:Conversion of an array:DeprecationWarning" \
		tests/test_kernel_*.py tests/test_triton_backend.py

$(COMPAT_VENV)/.installed:
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/pip install -q "$(TORCH_SPEC)" "$(TRITON_COMPAT)" "numpy<2.4" pytest \
		safetensors transformers
	touch $@

lint: install
	$(BIN)/ruff check .

bench-kernels: install
	$(BIN)/sangam-bench kernels

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info
