"""``sangam-bench graphs``: what CUDA graphs save per decode iteration, measured side by side.

Two engines share one model: one replays CUDA graphs for decode batches (the default on GPU),
the other runs eagerly (``enforce_eager``). Each runs the same workload: B requests with
P-token prompts, DualCache, one token committed per step, so a block is one refresh and then
``block_length - 1`` iterations in which every request runs a cached step. Those decode-only
iterations are timed as the engine sees them (scheduling, batch assembly, the forward,
unmasking, the host copy of the results). The engines alternate (graphs, eager, graphs, eager)
so a noisy machine skews both alike; each cell is the median over all timed iterations.

On a GPU the model is LLaDA-8B's shape (``--geometry dream``: Dream-7B's) with random weights:
timings do not depend on the values. Without a GPU there are no graphs to time: the command
says so, times the eager engine on the demo model at its scale (prompts of at most 16 tokens,
blocks of 8, batches of at most 16: a check that the benchmark runs) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch

from sangam.bench.report import parse_int_list
from sangam.config import EngineConfig
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel, make_attention_backend
from sangam.engine.text import TextCodec
from sangam.sampling_params import SamplingParams

CPU_PROMPT, CPU_BLOCK, CPU_MAX_BATCH = 16, 8, 16  # the demo model's scale


def decode_iteration_seconds(engine: Engine, batch: int, prompt_len: int, blocks: int,
                             block_length: int, seed: int = 0) -> list[float]:
    """Run ``batch`` requests of ``blocks`` DualCache blocks to completion on ``engine``;
    return the seconds of each iteration in which all of them ran a cached step."""
    rng = np.random.default_rng(seed)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=blocks * block_length, block_length=block_length,
                            unmasking="topk", tokens_per_step=1, cache="dual",
                            stop_at_eos=False)
    for i in range(batch):
        prompt = rng.integers(2, vocab - 2, prompt_len).tolist()
        engine.add_request(f"graphs-{seed}-{i}", prompt, params)
    seconds = []
    log = engine.stats.iterations  # a bounded deque: compare its last entry, not its length
    while engine.has_unfinished_requests():
        last = log[-1] if log else None
        engine.step()
        if log and log[-1] is not last:
            it = log[-1]
            if it.num_prefills == 0 and it.batch_size == batch:
                seconds.append(it.seconds)
    return seconds


def _random_loaded(geometry: str, device: torch.device, block_length: int) -> LoadedModel:
    from sangam.bench.calibrate import random_model

    model, cfg = random_model(geometry, device, torch.bfloat16)
    model.attention_backend = make_attention_backend("triton", device)
    # The default block length is the span the decode graphs are captured for.
    return LoadedModel(f"random {geometry}", model, cfg, TextCodec(None),
                       frozenset({cfg.eos_token_id}), device, torch.bfloat16,
                       {"block_length": block_length})


def _engine(loaded: LoadedModel, args: argparse.Namespace, eager: bool) -> Engine:
    tokens = max(args.batch_sizes) * (args.prompt_len + args.blocks * args.block_length)
    pages = -(-tokens // args.page_size) + max(args.batch_sizes)  # whole pages per request
    config = EngineConfig(device=str(loaded.device), page_size=args.page_size, num_pages=pages,
                          max_batch_size=max(args.batch_sizes), enforce_eager=eager,
                          token_budget=float("inf"))
    return Engine(config, loaded)


def run(args: argparse.Namespace) -> int:
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        device = torch.device("cuda")
        loaded = _random_loaded(args.geometry, device, args.block_length)
        label = f"{args.geometry} shape, random weights, bf16, {torch.cuda.get_device_name()}"
    else:
        print("No CUDA GPU: CUDA graphs need one. Timing the eager engine on the demo model "
              "at small shapes instead (a check that the benchmark runs).")
        loaded = LoadedModel.load(EngineConfig(device="cpu"))
        args.prompt_len, args.block_length = min(args.prompt_len, CPU_PROMPT), CPU_BLOCK
        args.batch_sizes = [b for b in args.batch_sizes if b <= CPU_MAX_BATCH] or [1]
        label = "demo model, CPU, eager only"
    engines = {"graphs": _engine(loaded, args, eager=False)} if on_gpu else {}
    engines["eager"] = _engine(loaded, args, eager=True)
    if on_gpu:
        assert engines["graphs"].runner.graphs, "graphs were not captured"
    print(f"{label}; prompt {args.prompt_len}, block {args.block_length}, DualCache, "
          f"{args.blocks} blocks per run, {args.rounds} rounds")
    print(f"{'batch':>5} {'graphs ms':>10} {'eager ms':>10} {'saved ms':>9} {'eager/graphs':>12}")
    rows = []
    for batch in args.batch_sizes:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, engine in engines.items():
                times[name] += decode_iteration_seconds(engine, batch, args.prompt_len,
                                                        args.blocks, args.block_length, seed=r)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        g, e = ms.get("graphs"), ms["eager"]
        rows.append({"batch": batch, "graphs_ms": g, "eager_ms": e,
                     "saved_ms": None if g is None else e - g,
                     "speedup": None if g is None else e / g,
                     "iterations": {name: len(t) for name, t in times.items()}})
        print(f"{batch:>5} {'-' if g is None else f'{g:.3f}':>10} {e:>10.3f} "
              f"{'-' if g is None else f'{e - g:.3f}':>9} "
              f"{'-' if g is None else f'{e / g:.2f}':>12}", flush=True)
        if args.json:  # after every batch size, so a run cut short keeps its numbers
            with open(args.json, "w") as f:
                json.dump({"setup": label, "prompt_len": args.prompt_len,
                           "block_length": args.block_length, "rows": rows}, f, indent=2)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "graphs", help="decode iteration time with and without CUDA graphs (GPU)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", choices=("llada", "dream"), default="llada",
                   help="model shape on a GPU (random weights)")
    p.add_argument("--batch-sizes", type=parse_int_list, default=[1, 16, 64],
                   help="comma-separated requests per batch")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--block-length", type=int, default=32,
                   help="the graphs' span: the model's default block length")
    p.add_argument("--blocks", type=int, default=2, help="blocks per request and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.set_defaults(func=run)
