# Set-up and everyday commands. `make serve` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Without an NVIDIA driver, pin the CPU wheel so a fresh venv does not pull a multi-GB CUDA torch.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: install serve test lint bench-kernels clean

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

lint: install
	$(BIN)/ruff check .

bench-kernels: install
	$(BIN)/sangam-bench kernels

clean:
	rm -rf $(VENV) build *.egg-info
