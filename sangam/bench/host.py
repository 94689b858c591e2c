"""``sangam-bench host``: the engine's host time per iteration: everything ``Engine.step``
does besides the model forward (placing requests, scheduling, batch assembly and staging for
the device, committing, the block reports, the outputs), at several batch sizes.

The in-process engine runs on the demo model with its forward stubbed out: the stub stages the
batch as the GPU path does (the scoring kernel's inputs, the rows scored again) and returns
drawn scores, so what is timed is the host work of a real iteration. Requests are DualCache
decodes (prompt 512, block 32, one token committed per step, so blocks take 32 steps); only
steady-state iterations are timed (those without a refresh). ``--penalized F`` gives a share F
of them a frequency penalty, so their rows' inputs for scoring again are built too; with
``--stop`` each request has a stop string (one that never occurs), so each completed block's
text is searched; ``--read-text`` reads each output's text in the loop, as a streaming reader
would. Both host implementations (pure Python, and the C++ extension when built) are measured
in the same run, alternating per batch size and round, so a busy machine skews them alike; each
cell is the best round's mean.

``--against DIR`` measures the ``sangam`` package of another checkout (DIR, with its C++
extension built in place) side by side with this one: every cell then runs this file in a
fresh process over one package or the other, alternating, so two commits are compared in one
run. This file only uses what both sides have (``Engine``, its ``add_request`` and ``step``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

IMPLS = ("python", "cext")
PROMPT_LEN, BLOCK, PAGE_SIZE = 512, 32, 16


def measure(batch: int, iters: int, impl: str = "python", gen_len: int = 256,
            block: int = BLOCK, page_size: int = PAGE_SIZE, penalized: float = 0.0,
            read_text: bool = False, stop: bool = False) -> dict[str, float]:
    """Mean microseconds per steady-state iteration over ``iters`` iterations of ``batch``
    requests, with the ``impl`` host batcher: the whole step (``total``) and its parts
    (``schedule``: placing and scheduling; ``assemble``: packing and staging; ``apply``:
    committing; ``outputs``: the rest, reports and outputs)."""
    from sangam.config import EngineConfig
    from sangam.engine.engine import Engine
    from sangam.engine.host_batch import make_host_batcher
    from sangam.engine.model_runner import stage_batch
    from sangam.sampling_params import SamplingParams

    pages = batch * -(-(PROMPT_LEN + gen_len) // page_size) + 1
    engine = Engine(EngineConfig(device="cpu", page_size=page_size, num_pages=pages,
                                 max_batch_size=batch, token_budget=10**9))
    runner, builder = engine.runner, engine.builder
    runner.host = make_host_batcher(page_size, impl)
    rng = np.random.default_rng(0)
    mask, vocab = engine.loaded.config.mask_token_id, engine.loaded.config.vocab_size
    clock = {"schedule": 0.0, "assemble": 0.0, "apply": 0.0, "scores": 0.0}

    def timed(phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[phase] += time.perf_counter() - t0
        return wrapper

    def forward_stub(states, page_lists, allow_graphs=True, rings=None):
        """The host half of a forward: staging as on a GPU, then drawn scores."""
        t0 = time.perf_counter()
        packed, dev, rescore = stage_batch(runner.host, runner.uploader, states, page_lists,
                                           True)
        packed.metadata(dev)
        t1 = time.perf_counter()
        m = packed.num_rows
        tokens = rng.integers(2, mask, m) % vocab
        conf = rng.random(m)
        clock["assemble"] += t1 - t0
        clock["scores"] += time.perf_counter() - t1  # not host work of the engine
        return packed, tokens, conf, None, None, {}  # no request with structured output

    runner._score = forward_stub
    builder.schedule = timed("schedule", builder.schedule)
    runner.host.apply = timed("apply", runner.host.apply)
    common = dict(max_tokens=gen_len, block_length=block, unmasking="topk", stop_at_eos=False,
                  stop="\u00e9" if stop else ())  # not in the demo's vocabulary
    plain = SamplingParams(**common)
    penalty = SamplingParams(**common, frequency_penalty=0.5)
    prompts = np.random.default_rng(1).integers(2, mask, (batch, PROMPT_LEN))
    for i in range(batch):
        engine.add_request(f"r{i}", prompts[i].tolist(),
                           penalty if i < round(penalized * batch) else plain, arrival_time=0.0)
    totals = {"total": 0.0, **{k: 0.0 for k in clock}}
    n = 0
    while n < iters:
        if not engine.has_unfinished_requests():
            raise SystemExit(f"the responses ended after {n} of {iters} iterations: lower "
                             "--iters or raise --gen-len")
        before = dict(clock)
        t0 = time.perf_counter()
        outputs = engine.step()
        total = time.perf_counter() - t0
        if read_text:
            for out in outputs:
                _ = out.text
            total = time.perf_counter() - t0
        last = engine.stats.iterations[-1] if engine.stats.iterations else None
        if last is not None and last.num_prefills == 0:  # steady-state decodes only
            totals["total"] += total
            for k in clock:
                totals[k] += clock[k] - before[k]
            n += 1
    us = {k: 1e6 * v / iters for k, v in totals.items()}
    us["total"] -= us.pop("scores")
    us["outputs"] = us["total"] - us["schedule"] - us["assemble"] - us["apply"]
    return us


def _cell(args: argparse.Namespace, batch: int, impl: str, package: str | None) -> dict:
    """One cell, here or (``package``: the directory holding a ``sangam`` package) in a fresh
    process running this file over that package."""
    options = dict(gen_len=args.gen_len, penalized=args.penalized, read_text=args.read_text,
                   stop=args.stop)
    if package is None:
        return measure(batch, args.iters, impl, **options)
    env = {**os.environ, "PYTHONPATH": package}
    cell = json.dumps({"batch": batch, "iters": args.iters, "impl": impl, **options})
    run = subprocess.run([sys.executable, __file__, cell], env=env, capture_output=True,
                         text=True)
    if run.returncode:
        raise SystemExit(f"sangam-bench host: the cell in {package} failed:\n{run.stderr}")
    return json.loads(run.stdout.splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    from sangam.engine.host_batch import cext_available

    if not 0.0 <= args.penalized <= 1.0:
        raise SystemExit(f"--penalized must be in [0, 1], got {args.penalized}")
    impls = [i for i in IMPLS if i == "python" or cext_available()]
    if args.impl != "both":
        impls = [args.impl]
    here = str(Path(__file__).resolve().parents[2])
    trees = {"this": None}
    if args.against:
        trees = {"this": here, "against": str(Path(args.against).resolve())}
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {
        t: {i: {} for i in impls} for t in trees}
    print(f"{'batch':>6} {'tree':>8} {'impl':>7} {'schedule':>10} {'assemble':>10} "
          f"{'apply':>10} {'outputs':>10} {'total us':>10}")
    for b in args.batch_sizes:
        for _ in range(args.rounds):
            for tree, package in trees.items():
                for impl in impls:
                    r = _cell(args, b, impl, package)
                    best = results[tree][impl].get(b)
                    if best is None or r["total"] < best["total"]:
                        results[tree][impl][b] = r
        for tree in trees:
            for impl in impls:
                r = results[tree][impl][b]
                print(f"{b:>6} {tree:>8} {impl:>7} {r['schedule']:>10.1f} "
                      f"{r['assemble']:>10.1f} {r['apply']:>10.1f} {r['outputs']:>10.1f} "
                      f"{r['total']:>10.1f}")
    if "cext" not in impls and args.impl == "both":
        print("(the C++ extension sangam._host is not built: Python only)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"against": args.against, "results": results}, f, indent=2)
    return 0


def register(sub) -> None:
    from sangam.bench.report import parse_int_list

    p = sub.add_parser("host", help="host-side microseconds per iteration (no model forward)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=parse_int_list, default=[1, 16, 64, 256],
                   help="comma-separated requests per batch")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3,
                   help="measure each cell this many times, alternating impls; keep the best")
    p.add_argument("--impl", choices=("both", *IMPLS), default="both",
                   help="host implementation(s) to measure (both: cext only when built)")
    p.add_argument("--penalized", type=float, default=0.0,
                   help="share of requests with a frequency penalty (scored again), 0..1")
    p.add_argument("--read-text", action="store_true",
                   help="read each output's text in the loop (detokenize at once)")
    p.add_argument("--stop", action="store_true",
                   help="give each request a stop string: search each completed block's text")
    p.add_argument("--gen-len", type=int, default=256,
                   help="response tokens per request (a multiple of 32)")
    p.add_argument("--against", default=None, metavar="DIR",
                   help="a checkout of another commit (its sangam._host built in place): "
                        "measure its package too, alternating with this one")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.set_defaults(func=run)


if __name__ == "__main__":  # one cell, for --against: its options as JSON, its result printed
    opts = json.loads(sys.argv[1])
    print(json.dumps(measure(opts.pop("batch"), opts.pop("iters"), opts.pop("impl"), **opts)))
