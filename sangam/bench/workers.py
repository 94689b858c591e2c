"""``sangam-bench workers``: multi-worker generation time against the in-process engine, on the
same requests, side by side in one run.

The multi-worker path (a front process, worker processes, ZeroMQ for control, gloo for K/V on
CPU) needs no GPU to be right; this measures what it costs on CPU beyond the one-process
engine: the same requests (a random-weight model, mixed prompt lengths, all submitted at once)
through ``LLM`` in one process, then through each layout. Reported per layout: seconds, the
ratio to one process, K/V transfers and megabytes, the control plane's messages and kilobytes
per block (both ways, heartbeats aside), and whether the tokens were the same.

    sangam-bench workers --layouts 1P2D,hybrid-2P1C --num-requests 6,24
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time

from sangam.sampling_params import SamplingParams

LAYOUTS = {
    "colocated-2": dict(num_workers=2),
    "1P2D": dict(mode="disaggregated", prefill_workers=1, decode_workers=2),
    "2P1D": dict(mode="disaggregated", prefill_workers=2, decode_workers=1),
    "hybrid-2P1C": dict(mode="hybrid", prefill_workers=2, decode_workers=1,
                        overflow_threshold=64),
}


def _requests(n: int, seed: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab - 2) for _ in range(rng.choice([8, 24, 48]))]
               for _ in range(n)]
    params = [SamplingParams(max_tokens=64, block_length=8, cache="dual", seed=i,
                             stop_at_eos=False) for i in range(n)]
    return prompts, params


def _timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, outs


def run(args: argparse.Namespace) -> int:
    from sangam import LLM
    from sangam.testing import make_tiny_checkpoint

    sizes = [int(n) for n in args.num_requests.split(",")]
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as ckpt:
        make_tiny_checkpoint(ckpt, arch="llada", seed=0)
        options = dict(model=ckpt, device="cpu", dtype="float32", page_size=16)
        engines = {"one process": LLM(**options)}
        for name in layouts:
            engines[name] = LLM(**options, **LAYOUTS[name])
        try:
            print("| requests | engine | seconds | vs one process | K/V transfers | K/V MB | "
                  "control messages / block | control KB / block | same tokens |")
            print("|---|---|---|---|---|---|---|---|---|")
            for n in sizes:
                prompts, params = _requests(n, args.seed, 160)
                for llm in engines.values():  # warm up: the first requests pay for imports
                    llm.generate(prompt_token_ids=prompts[:1], sampling_params=params[:1])
                base, want = _timed(engines["one process"], prompts, params)
                print(f"| {n} | one process | {base:.2f} | 1.00x | - | - | - | - | - |")
                for name in layouts:
                    c = engines[name].engine.counters
                    before = dataclasses.replace(c)
                    seconds, outs = _timed(engines[name], prompts, params)
                    blocks = c.blocks - before.blocks
                    mb = (c.kv_bytes - before.kv_bytes) / 2**20
                    messages = (c.control_messages - before.control_messages) / blocks
                    kb = (c.control_bytes - before.control_bytes) / 1024 / blocks
                    same = [o.token_ids for o in outs] == [o.token_ids for o in want]
                    print(f"| {n} | {name} | {seconds:.2f} | {seconds / base:.2f}x | "
                          f"{c.kv_transfers - before.kv_transfers} | {mb:.1f} | "
                          f"{messages:.1f} | {kb:.1f} | {same} |")
        finally:
            for llm in engines.values():
                llm.shutdown()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workers", help="multi-worker generation time vs the in-process engine "
                       "(CPU)", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="1P2D,hybrid-2P1C",
                   help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--num-requests", default="6,24")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
