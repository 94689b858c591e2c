"""``sangam-bench host``: host-side time per iteration (scheduling, batch assembly and staging
for the device, unmasking bookkeeping) at several batch sizes, with the model forward replaced
by a stub.

The forward is excluded so the number is what the CPU adds to every GPU iteration; the target
is < 0.5 ms at batch 64 (engine issue). Requests are seated decodes of a DualCache block, with
the demo model's tokenizer; "outputs" is making the RequestOutput of each completed block (what
the engine loop does; their text is made when, and where, a caller reads it: ``--read-text``
reads it in the loop, as the engine did before text was made on demand, for comparison).
``--penalized F`` gives a share F of them a frequency penalty, so their rows are scored again
and the host builds those inputs too (the assemble phase). With ``--stop`` each request has a
stop string (one that never occurs), so each completed block's text is searched, as the engine
loop does (in the outputs phase). ``--gen-len`` sets the responses' length.
Both host implementations (pure Python, and the C++ extension when built) are measured in the
same run, alternating per batch size and round, so a busy machine skews them alike; each cell
is the best round's mean.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from sangam.bench.report import parse_int_list
from sangam.config import EngineConfig
from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.demo.tokenizer import MASK_ID, VOCAB_SIZE
from sangam.engine.device_batch import BatchUploader
from sangam.engine.host_batch import IMPLS, cext_available, make_host_batcher
from sangam.engine.loaded_model import LoadedModel, checkpoint_path
from sangam.engine.model_runner import stage_batch
from sangam.engine.stop_strings import apply_stop_strings
from sangam.models import read_config
from sangam.sampling_params import SamplingParams
from sangam.sched.batch_builder import BatchBuilder
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.request import Request

VOCAB = VOCAB_SIZE
MASK = MASK_ID


def _seated(batch: int, prompt_len: int, gen_len: int, block: int, page_size: int,
            penalized: float, stop: bool):
    alloc = PageAllocator(batch * (-(-(prompt_len + gen_len) // page_size)) + 1)
    builder = BatchBuilder(alloc, page_size, "deficit", 10**9, max_batch_size=batch)
    common = dict(max_tokens=gen_len, block_length=block, unmasking="topk",
                  stop="\u00e9" if stop else ())  # not in the demo's vocabulary
    plain = SamplingParams(**common)
    penalty = SamplingParams(**common, frequency_penalty=0.5)
    rng = np.random.default_rng(1)
    states = {}
    for i in range(batch):
        params = penalty if i < round(penalized * batch) else plain
        req = Request(f"r{i}", 0.0, prompt_len, params.canvas_length, block, "dual")
        builder.add(req)
        prompt = rng.integers(2, MASK, prompt_len).tolist()
        states[req.request_id] = DecodeState(prompt, params, MASK, frozenset({1}), False)
    return builder, states


def measure(batch: int, iters: int, impl: str = "python", prompt_len: int = 512,
            gen_len: int = 256, block: int = 32, page_size: int = 16,
            penalized: float = 0.0, read_text: bool = False, stop: bool = False
            ) -> dict[str, float]:
    """Mean microseconds per iteration of each host phase, over ``iters`` decode iterations,
    with the ``impl`` host batcher; a share ``penalized`` of the requests is scored again;
    ``read_text`` reads each output's text at once; ``stop`` gives each a stop string."""
    builder, states = _seated(batch, prompt_len, gen_len, block, page_size, penalized, stop)
    host = make_host_batcher(page_size, impl)
    uploader = BatchUploader("cpu")  # the staging a GPU runner does; a memcpy stands in for DMA
    loaded = _demo_tokenizer_only()
    texts = {rid: IncrementalDetokenizer(True) for rid in states}  # as the engine's
    phases = {"schedule": 0.0, "assemble": 0.0, "apply": 0.0, "outputs": 0.0}
    rng = np.random.default_rng(0)
    n = 0
    now = 0.0
    while n < iters:
        now += 1.0
        t0 = time.perf_counter()
        sb = builder.schedule(now)
        reqs = sb.decodes + sb.prefills
        if not reqs:
            raise SystemExit(f"the responses ended after {n} of {iters} iterations: lower "
                             "--iters or raise --gen-len")
        sts = [states[r.request_id] for r in reqs]
        t1 = time.perf_counter()
        pb, dev, _ = stage_batch(host, uploader, sts, [r.pages for r in reqs], True)
        pb.metadata(dev)
        t2 = time.perf_counter()
        m = pb.num_rows
        tokens = rng.integers(2, MASK, m)
        conf = rng.random(m)  # topk 1: one commit per step, so blocks take B steps
        t3 = time.perf_counter()  # drawing the stub's scores is not host work: not timed
        done = host.apply(sts, pb, tokens, conf)
        for req, st, d in zip(reqs, sts, done):
            builder.step_done(req, now, d, st.finished, st.finish_reason)
        t4 = time.perf_counter()
        for req, st, d in zip(reqs, sts, done):
            if d:
                apply_stop_strings(st, loaded.decode)  # as the ModelRunner does
                out = loaded.output(req.request_id, [], st, st.finished, st.finish_reason, {},
                                    texts[req.request_id])
                if read_text:
                    _ = out.text
        t5 = time.perf_counter()
        if not sb.prefills:  # time steady-state decode iterations only
            phases["schedule"] += t1 - t0
            phases["assemble"] += t2 - t1
            phases["apply"] += t4 - t3
            phases["outputs"] += t5 - t4
            n += 1
    out = {k: 1e6 * v / iters for k, v in phases.items()}
    out["total"] = sum(out.values())
    return out


def _demo_tokenizer_only() -> LoadedModel:
    """The demo model's tokenizer and config, without its weights."""
    config = EngineConfig(device="cpu")
    path = checkpoint_path(config)
    return LoadedModel.around(config, path, None, read_config(path), torch.device("cpu"),
                              torch.float32)


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.penalized <= 1.0:
        raise SystemExit(f"--penalized must be in [0, 1], got {args.penalized}")
    sizes = args.batch_sizes
    impls = [i for i in IMPLS if i == "python" or cext_available()]
    if args.impl != "both":
        impls = [args.impl]
    results: dict[str, dict[int, dict[str, float]]] = {i: {} for i in impls}
    print(f"{'batch':>6} {'impl':>7} {'schedule':>10} {'assemble':>10} {'apply':>10} "
          f"{'outputs':>10} {'total us':>10}")
    for b in sizes:
        for _ in range(args.rounds):
            for impl in impls:
                r = measure(b, args.iters, impl, gen_len=args.gen_len,
                            penalized=args.penalized, read_text=args.read_text, stop=args.stop)
                best = results[impl].get(b)
                if best is None or r["total"] < best["total"]:
                    results[impl][b] = r
        for impl in impls:
            r = results[impl][b]
            print(f"{b:>6} {impl:>7} {r['schedule']:>10.1f} {r['assemble']:>10.1f} "
                  f"{r['apply']:>10.1f} {r['outputs']:>10.1f} {r['total']:>10.1f}")
    if "cext" not in impls and args.impl == "both":
        print("(the C++ extension sangam._host is not built: Python only)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def register(sub) -> None:
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
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.set_defaults(func=run)
