#!/usr/bin/env bash
# The prepared GPU run, in one script: the kernel and CUDA-graph tests in bf16 on CUDA (the
# mixture-of-experts kernels' among them, GeGLU experts, per-query key bounds and the FP8
# GEMM and experts too), the FP8 kernels timed against the bf16 layers they replace,
# DiffusionGemma's demo decoded on the device and a random-weight DiffusionGemma of Gemma 4
# 26B-A4B's geometry served (canvas-step graphs, the hybrid KV pool), `sangam-bench kernels` (with its canvas and MoE rows) and
# `graphs`, a receiving worker killed mid-transfer under NCCL and tensor parallelism over two
# GPUs and a trainer's weight broadcast over NCCL (two GPUs only: each skips in seconds on
# one), `sangam-bench calibrate` (the simulator's coefficients), an end-to-end `sangam-bench serve` on a
# random-weight model of LLaDA-8B's shape (deficit tau=1024 against fastdllm on a short
# ShareGPT-shaped trace at two QPS), and `sangam-bench sim` on the same trace with that
# calibration and the serve run's step profile, against the measured latencies.
#
# Usage: microbench/gpu_check.sh [--dry-run] [OUTDIR]   (default OUTDIR ./gpu-results)
# On the GPU it takes at most 10 minutes: each step is cut by `timeout`, 570 s in all, and
# building the C++ extension 30 s (on one GPU, about 90 s less: the two-GPU steps skip).
# --dry-run runs every step on the CPU at tiny shapes (the Triton interpreter; the tests
# collected, not run) with the serving extras the GPU machine lacks made unimportable: what
# would fail there for a reason a CPU can show fails here. tests/test_gpu_check.py runs it in CI.
# Needs only torch, triton, numpy, safetensors and pytest: runs from the checkout
# (PYTHONPATH=.). Random weights are never confident, so every request commits a fixed 3 tokens
# per step (topk; threshold 0.9 commits about 3.25 on real weights).
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=$(mkdir -p "${1:-./gpu-results}" && cd "${1:-./gpu-results}" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python3 || command -v python)}
BENCH=("$PY" -m sangam.bench.cli)

# What the GPU machine's python lacks (it has torch, triton, transformers and pytest).
GPU_MACHINE_LACKS="zmq fastapi uvicorn prometheus_client httpx hypothesis matplotlib openai
pytest_benchmark llguidance jsonschema"

if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
  mkdir -p "$OUT/lacking"
  for name in $GPU_MACHINE_LACKS; do
    echo "raise ImportError('$name is not on the GPU machine')" >"$OUT/lacking/$name.py"
  done
  export PYTHONPATH="$PYTHONPATH:$OUT/lacking"  # after the checkout, before site-packages
  TESTS_MODE=(--collect-only)
  SHAPE=(--config-only)  # the tiny LLaDA layout
  CALIBRATE=(--device cpu --max-len 128 --block-length 8 --reps 2 --torch-threads 1)
  # A tiny model's steps take milliseconds: loads high enough to batch.
  TRACE=(--num-requests 6 --qps 8,16 --length-scale 0.03)
  ENGINE=(--device cpu --torch-threads 1 --block-length 8 --token-budget 64 --num-pages 512
          --max-batch-size 16)
  SIM_ENGINE=(--block-length 8 --token-budget 64 --num-pages 512 --max-batch-size 16)
  TP_DEVICE=(--device cpu)
  GEMMA=(--device cpu --dtype float32 --torch-threads 1)
  GEMMA_SERVE=(--model sangam-demo-gemma --device cpu --torch-threads 1 --num-pages 256
               --token-budget 64 --length-scale 0.03 --kv-pool hybrid)
else
  unset TRITON_INTERPRET  # compiled kernels on CUDA tensors
  # The C++ host extension (an ignored build output, so not in a fresh copy): built in place
  # so that the engine benchmarks time the host path a user gets; where no compiler works, the
  # Python host batcher is timed, and env.txt says so.
  timeout 30 "$PY" setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1
  TESTS_MODE=()
  SHAPE=(--shape llada --config-only)
  CALIBRATE=()
  TRACE=(--num-requests 16 --qps 1,2)
  # 4096 pages of 16 tokens (32 GiB at LLaDA-8B's 0.5 MiB per token) hold the whole trace;
  # batches stay within 16, so 5 decode graphs are captured per engine, not 20.
  ENGINE=(--block-length 32 --token-budget 1024 --num-pages 4096 --max-batch-size 16)
  SIM_ENGINE=("${ENGINE[@]}")
  TP_DEVICE=()
  GEMMA=(--device cuda --dtype bfloat16)
  # Four canvases a forward, 32K positions each in the hybrid pool (its sliding layers keep a
  # ring a request): what one H100 holds beside the weights (docs/memory.md).
  GEMMA_SERVE=(--model "$OUT/gemma-26b" --load-format dummy --max-batch-size 4
               --max-model-len 32768 --length-scale 0.5 --kv-pool hybrid)
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  [ "$DRY" = 1 ] && echo "dry run: CPU, tiny shapes, tests collected only"
  git status --short 2>/dev/null | head -20
  nvidia-smi 2>&1
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available() and \
torch.cuda.get_device_name())"
  "$PY" -c "from sangam.engine.host_batch import cext_available; print('C++ host extension:', \
cext_available())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# Each step: a name, its time limit in seconds, the command; its output is kept in NAME.log
# and its exit status in summary.txt (124: cut by the time limit). The limit strikes with
# SIGINT, which Python steps take as KeyboardInterrupt: pytest still writes its report, and
# every benchmark has written its JSON after each point it measured.
SUMMARY=()
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("$name rc=$rc")
}

# The tests, in shards run side by side (tests-engine: CUDA graphs against eager, and a weight
# update in place and a memory release and resume under them): on an empty Triton cache most of their time is
# compiling kernel variants, one CPU core per process, and the machine has 16. Each shard
# prints every test's outcome as it ends (-v) and writes its own report.
shard() {
  local name=$1
  shift
  timeout -s INT -k 15 135 "$PY" -m pytest -v -p no:cacheprovider "${TESTS_MODE[@]}" "$@" \
    --junitxml="$OUT/$name.xml" >"$OUT/$name.log" 2>&1
  echo $? >"$OUT/$name.rc"
}
OTHER_KERNEL_TESTS=()
for f in tests/test_kernel_*.py; do
  case $f in tests/test_kernel_attention.py|tests/test_kernel_moe.py) ;;
    *) OTHER_KERNEL_TESTS+=("$f") ;; esac
done
echo "== tests (4 shards side by side)"
shard tests-attention tests/test_kernel_attention.py &
shard tests-moe tests/test_kernel_moe.py &
shard tests-kernels "${OTHER_KERNEL_TESTS[@]}" &
shard tests-engine tests/test_triton_backend.py tests/test_device_batch.py \
  "tests/test_engine.py::test_cuda_graphs_match_eager" \
  "tests/test_engine.py::test_block_length_flag_replays_graphs" \
  "tests/test_engine.py::test_block_causal_graphs_match_eager" \
  "tests/test_canvas_graphs.py::test_canvas_graphs_match_eager" \
  "tests/test_rules.py::test_scoring_with_known_sampled_rows_needs_no_sync" \
  tests/test_rollout_gpu.py &
wait
for name in tests-attention tests-moe tests-kernels tests-engine; do
  tail -n 5 "$OUT/$name.log"
  SUMMARY+=("$name rc=$(cat "$OUT/$name.rc")")
done

# Each benchmark rewrites its JSON after each suite or run, so a cut one keeps what it measured.
# The kernels' suites include moe: LLaDA2.0-mini's and -flash's experts (--moe-models).
step kernels 70 "${BENCH[@]}" kernels --models llada,dream \
  --suites attention,refresh,canvas,unmask,gather,moe --json "$OUT/kernels.json"
# FP8: the GEMM at LLaDA-8B's projections and the FP8 experts of LLaDA2.0-flash, against the
# bf16 layers they replace (on a CPU the kernels step above cross-compiles them already).
if [ "$DRY" = 0 ]; then
  step fp8 20 "${BENCH[@]}" kernels --suites fp8 --moe-models llada2-flash \
    --json "$OUT/kernels-fp8.json"
fi
step graphs 45 "${BENCH[@]}" graphs --json "$OUT/graphs.json"
# A receiving worker killed mid-transfer under NCCL: the survivor goes on (two GPUs and pyzmq
# needed; on one GPU it prints why it skips and exits 0).
step nccl-fault 40 "$PY" microbench/nccl_transfer_fault.py
# Tensor parallelism over two GPUs: shards joined by NCCL all-reduces against the whole model,
# TP1 against TP2 forward time at LLaDA-8B's shape, and the engine at TP2 where pyzmq is (two
# GPUs; on one it prints why it skips; the dry run checks the same on CPU over gloo).
step tp 45 "$PY" microbench/tp_check.py "${TP_DEVICE[@]}"
# A trainer's weight broadcast over NCCL into the engine on another GPU (two GPUs; on one it
# prints why it skips; the dry run checks the same over gloo on CPU).
step weight-nccl 15 "$PY" microbench/weight_update_nccl.py "${TP_DEVICE[@]}"
# DiffusionGemma end to end (uniform-state): the shipped Gemma-layout demo on the device, its
# canvas rows' per-query key bounds in the Triton attention, its GeGLU experts in fused_moe.
step gemma 20 "${BENCH[@]}" quality --model sangam-demo-gemma "${GEMMA[@]}" \
  --num-instances 24 --entropy-bounds 0.5 --denoising-steps 16 --json "$OUT/gemma.json"
# DiffusionGemma at its release geometry (Gemma 4 26B-A4B's, assumed; random weights, 47 GiB
# in bf16): canvases of 256 through the 256- and 512-wide attention and 128 GeGLU experts,
# their later steps in CUDA graphs, the sliding layers in the hybrid pool's rings, served (the
# dry run serves the demo instead: no 26B model is built on a CPU).
if [ "$DRY" = 0 ]; then
  step gemma-config 5 "$PY" scripts/diffusion_gemma_26b_config.py "$OUT/gemma-26b"
fi
step gemma-serve 35 "${BENCH[@]}" serve "${GEMMA_SERVE[@]}" --num-requests 8 --qps 2 \
  --out "$OUT/gemma-serve"
step model 20 "$PY" -m sangam.testing "$OUT/model" "${SHAPE[@]}"
step calibrate 30 "${BENCH[@]}" calibrate --model "$OUT/model" --load-format dummy \
  "${CALIBRATE[@]}" --out "$OUT/calibration.json"
step serve 60 "${BENCH[@]}" serve --model "$OUT/model" --load-format dummy "${ENGINE[@]}" \
  --policies deficit,fastdllm --unmasking topk --tokens-per-step 3 --cache dual \
  "${TRACE[@]}" --out "$OUT/serve"
step sim 30 "${BENCH[@]}" sim --gpu h200 --model calibrated "${SIM_ENGINE[@]}" \
  --policies deficit,fastdllm --cache dual "${TRACE[@]}" \
  --calibration "$OUT/calibration.json" --step-profile "$OUT/serve/profile.json" \
  --against "$OUT/serve" --out "$OUT/sim"

printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
! grep -qv "rc=0$" "$OUT/summary.txt"
