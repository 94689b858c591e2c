#!/usr/bin/env bash
# GPU check: the kernel tests in bf16 on CUDA and the CUDA-graph test, then `sangam-bench
# kernels` and `sangam-bench graphs` (decode iterations with and without CUDA graphs).
# Usage: microbench/gpu_check.sh [OUTDIR]   (default ./gpu-results; finishes in < 8 minutes)
# Needs only torch, triton, pytest and safetensors: runs from the checkout with PYTHONPATH=.
set -u
OUT=$(mkdir -p "${1:-./gpu-results}" && cd "${1:-./gpu-results}" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels on CUDA tensors
PY=${PYTHON:-$(command -v python3 || command -v python)}

# The C++ host extension (an ignored build output, so not in a fresh copy): built in place so
# that the engine benchmarks time the host path a user gets; where no compiler works, the
# Python host batcher is timed, and env.txt says so.
timeout 30 "$PY" setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  git status --short 2>/dev/null | head -20
  nvidia-smi 2>&1
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and \
torch.cuda.get_device_name())"
  "$PY" -c "from sangam.engine.host_batch import cext_available; print('C++ host extension:', \
cext_available())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# Tests: 3 minutes and 20 s at most; the benchmarks get the rest. Each step is cut by `timeout`.
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernel_*.py \
  tests/test_triton_backend.py tests/test_device_batch.py \
  "tests/test_engine.py::test_cuda_graphs_match_eager" \
  "tests/test_engine.py::test_block_length_flag_replays_graphs" \
  "tests/test_rules.py::test_scoring_with_known_sampled_rows_needs_no_sync" \
  --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

# The benchmark rewrites kernels.json after each suite, so a cut run keeps what it measured.
timeout 150 "$PY" -m sangam.bench.cli kernels --json "$OUT/kernels.json" 2>&1 \
  | tee "$OUT/kernels.log"
bench_rc=${PIPESTATUS[0]}

# LLaDA-8B's shape with random weights: two engines (graphs, eager) over one model.
timeout 90 "$PY" -m sangam.bench.cli graphs --json "$OUT/graphs.json" 2>&1 \
  | tee "$OUT/graphs.log"
graphs_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc  kernels rc=$bench_rc  graphs rc=$graphs_rc  (124 = timed out)" \
  | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$graphs_rc" -eq 0 ]
