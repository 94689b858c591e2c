"""``sangam-bench calibrate``: measure forwards and fit the simulator's cost coefficients.

Times the real model forward (paged attention, LM head on the block's rows) at a few batch
compositions - refreshes of several lengths, batches of DualCache steps at several batch sizes
and KV lengths, and a mix - then fits the five coefficients of
:mod:`sangam.bench.cost_model` (achieved matmul and attention FLOP/s, bandwidth, per-iteration
and per-request overheads). The engine's host path (scheduling, batch assembly, committing,
outputs; what ``sangam-bench host`` times) runs between forwards, so it is measured too and
added to the two overheads (``--no-host``: the forward alone). The JSON, for ``sangam-bench sim
--calibration``, records the model's geometry as well (``sim --model calibrated``).

On a GPU it needs no weights: ``--geometry llada`` (or ``dream``) builds the real model shape
with random weights (timing does not depend on the values). ``--model DIR`` times a checkpoint
instead (``--load-format dummy``: random weights of its config.json). Without a GPU it says so
and exits 0, unless ``--device cpu`` is given: then it calibrates the CPU model (the demo model
by default) - a demonstration of the procedure, not numbers to simulate a GPU with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

from sangam.bench.cost_model import (
    GPUS,
    MIN_FIT_POINTS,
    MODELS,
    Coefficients,
    CostModel,
    ModelGeometry,
    Span,
    fit_coefficients,
)
from sangam.config import LOAD_FORMATS

# Rough CPU rates to start the fit from (it searches 1000x either way).
CPU_START = Coefficients(5e10, 2e10, 1e10, 1e-3, 1e-5)


def compositions(max_len: int, block: int) -> list[list[Span]]:
    """Batches to time: refreshes, DualCache step batches, and one mix, within ``max_len``."""
    out: list[list[Span]] = []
    lens = [n for n in (256, 512, 1024, 2048, 4096) if n <= max_len] or [max_len]
    for t in lens:
        out.append([Span(t, t, block)])
    for kv in sorted({min(512, max_len), min(2048, max_len)}):
        for n in (1, 4, 16, 64):
            out.append([Span(block, kv, block)] * n)
    mid = lens[len(lens) // 2]
    out.append([Span(mid, mid, block)] + [Span(block, mid, block)] * 16)
    return out


def random_model(geom_key: str, device, dtype):
    """The real geometry with random weights, built straight on the device in ``dtype``."""
    from sangam.models import parse_config
    from sangam.models.loader import dummy_model
    from sangam.testing import real_shape_config

    cfg = parse_config(real_shape_config(geom_key))
    return dummy_model(cfg, device, dtype), cfg


class _Timer:
    """Times forwards of one model over one KV pool sized for the largest composition."""

    def __init__(self, model, cfg, device, dtype, page_size: int, max_tokens: int):
        import torch

        from sangam.models import PagedKV

        self.torch = torch
        self.model, self.cfg, self.device = model, cfg, device
        self.page_size = page_size
        pages = -(-max_tokens // page_size) + 64  # each request rounds up to whole pages
        self.kv = PagedKV.allocate(cfg.num_layers, pages, page_size, cfg.num_kv_heads,
                                   cfg.head_dim, dtype, device)

    def inputs(self, spans: list[Span]):
        from sangam.models import AttentionMetadata

        torch, ps = self.torch, self.page_size
        rng = np.random.default_rng(0)
        tables, slots, positions, rows = [], [], [], []
        next_page, offset = 0, 0
        for s in spans:
            n = -(-s.kv_len // ps)
            pages = np.arange(next_page, next_page + n)
            next_page += n
            pos = np.arange(s.kv_len - s.q_len, s.kv_len)
            tables.append(pages)
            slots.append(pages[pos // ps] * ps + pos % ps)
            positions.append(pos)
            rows.append(offset + s.q_len - s.lm_rows + np.arange(s.lm_rows))
            offset += s.q_len
        width = max(len(t) for t in tables)
        bt = np.zeros((len(spans), width), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        q_lens = [s.q_len for s in spans]
        kv_lens = [s.kv_len for s in spans]
        cu = np.zeros(len(spans) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        meta = AttentionMetadata(
            cu_seqlens_q=dev(cu), kv_lens=dev(np.asarray(kv_lens, dtype=np.int32)),
            block_tables=dev(bt), slot_mapping=dev(np.concatenate(slots).astype(np.int64)),
            query_lens=q_lens, kv_lens_host=kv_lens)
        ids = rng.integers(0, self.cfg.vocab_size - 1, offset)
        return (dev(ids), dev(np.concatenate(positions)), meta,
                dev(np.concatenate(rows).astype(np.int64)))

    def seconds(self, spans: list[Span], reps: int) -> float:
        torch = self.torch
        args = self.inputs(spans)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.model(*args[:3], self.kv, args[3])  # warm-up: compilation, allocator
        sync()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            self.model(*args[:3], self.kv, args[3])
            sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import torch

    from sangam.engine.loaded_model import make_attention_backend
    from sangam.models import load_model, resolve_dtype

    if args.device is None:
        if not torch.cuda.is_available():
            print("calibrate needs a GPU to measure GPU coefficients, and none is visible. "
                  "`--device cpu` calibrates the CPU model instead (a demonstration).")
            return 0
        args.device = "cuda"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"calibrate: --device {args.device} but no GPU is visible; nothing measured.")
        return 0
    device = torch.device(args.device)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    dtype = resolve_dtype(args.dtype, device)
    if args.model is None and args.geometry and device.type == "cuda":
        model, cfg = random_model(args.geometry, device, dtype)
        name = f"{MODELS[args.geometry].name} (random weights)"
    else:
        path = args.model
        if path is None:
            from sangam.demo import demo_model_path

            path = demo_model_path()
        model = load_model(path, device, dtype, args.load_format)
        cfg = model.config
        name = str(path)
    model.attention_backend = make_attention_backend(args.attention_backend, device)
    geom = ModelGeometry.of(name, cfg)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    comps = compositions(min(args.max_len, cfg.max_position), args.block_length)
    if device.type == "cuda":  # keep the pool within free memory (LLaDA: 0.5 MiB per token)
        free, _ = torch.cuda.mem_get_info(device)
        cap = int(0.7 * free) // cfg.kv_bytes_per_token(dtype_bytes)
        comps = [c for c in comps if sum(s.kv_len for s in c) <= cap]
    timer = _Timer(model, cfg, device, dtype, args.page_size,
                   max(sum(s.kv_len for s in c) for c in comps))
    if device.type == "cuda":
        gpu = next((g for k, g in GPUS.items() if k in torch.cuda.get_device_name().lower()),
                   GPUS["h100"])
        start = Coefficients.defaults(gpu)
    else:
        start = CPU_START
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    about = {"device": device_name, "model": name, "geometry": dataclasses.asdict(geom),
             "dtype": str(dtype).removeprefix("torch."), "dtype_bytes": dtype_bytes}
    points = []
    for spans in comps:
        t = timer.seconds(spans, args.reps)
        points.append((spans, t))
        print(f"  {_describe(spans):<34} {t * 1e3:9.3f} ms", file=sys.stderr, flush=True)
        if len(points) >= MIN_FIT_POINTS and len(points) < len(comps):
            # A run cut short (the prepared GPU run's time limit) keeps a usable calibration
            # of the points it measured.
            _write(args.out, _report(about, geom, points, start, dtype_bytes, None, False)[0])
    host = host_overhead(args.block_length, args.page_size) if args.host else None
    report, cm = _report(about, geom, points, start, dtype_bytes, host, True)
    print(f"{'batch':<34} {'measured ms':>12} {'fitted ms':>10}")
    for spans, t in points:
        print(f"{_describe(spans):<34} {t * 1e3:12.3f} {cm.iteration_time(spans) * 1e3:10.3f}")
    print(f"rms relative error {report['rms_relative_error']:.3f}")
    if host is not None:
        print(f"host path ({host['impl']}): {host['iteration_s'] * 1e6:.0f} us per iteration "
              f"+ {host['per_sequence_s'] * 1e6:.1f} us per request")
    for k, v in report["coefficients"].items():
        print(f"  {k:<22} {v:.4g}")
    _write(args.out, report)
    print(f"wrote {args.out}")
    return 0


def _report(about: dict, geom: ModelGeometry, points: list, start: Coefficients,
            dtype_bytes: int, host: dict | None, complete: bool) -> tuple[dict, CostModel]:
    """The calibration JSON of ``points`` (``complete``: every composition was measured), and
    the fitted cost model."""
    forward, err = fit_coefficients(geom, points, start, dtype_bytes)
    coeffs = forward if host is None else dataclasses.replace(
        forward, iteration_overhead_s=forward.iteration_overhead_s + host["iteration_s"],
        per_sequence_s=forward.per_sequence_s + host["per_sequence_s"])
    cm = CostModel(geom, forward, dtype_bytes)
    return {**about, "complete": complete, "coefficients": coeffs.to_dict(),
            "forward_coefficients": forward.to_dict(), "host": host,
            "rms_relative_error": err,
            "points": [{"spans": [[s.q_len, s.kv_len, s.lm_rows] for s in spans],
                        "seconds": t, "fitted": cm.iteration_time(spans)}
                       for spans, t in points]}, cm


def _write(path: str, report: dict) -> None:
    """Whole or not at all: a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, path)


HOST_BATCHES = (1, 16)


def host_overhead(block_length: int, page_size: int, iters: int = 20) -> dict:
    """What the engine's host path adds to every forward (scheduling, batch assembly and
    staging, committing, outputs: ``sangam-bench host``), as a fixed cost per iteration plus
    one per request, from decode iterations at two batch sizes. The engine runs it between
    forwards, so the simulator adds it to each forward's time."""
    from sangam.bench.host import measure
    from sangam.engine.host_batch import cext_available

    impl = "cext" if cext_available() else "python"
    small, large = (min(measure(b, iters, impl, block=block_length, page_size=page_size)["total"]
                        for _ in range(3)) * 1e-6 for b in HOST_BATCHES)
    per_sequence = max(0.0, (large - small) / (HOST_BATCHES[1] - HOST_BATCHES[0]))
    return {"impl": impl, "iteration_s": max(0.0, small - per_sequence * HOST_BATCHES[0]),
            "per_sequence_s": per_sequence}


def _describe(spans: list[Span]) -> str:
    refresh = [s for s in spans if s.q_len == s.kv_len]
    steps = [s for s in spans if s.q_len != s.kv_len]
    parts = [f"refresh {s.q_len}" for s in refresh]
    if steps:
        parts.append(f"{len(steps)} x step(kv {steps[0].kv_len})")
    return " + ".join(parts)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="time forwards and fit the simulator's cost coefficients (GPU)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", choices=sorted(k for k in MODELS if not MODELS[k].block_causal),
                   default="llada",
                   help="on a GPU without --model: this model's shape with random weights")
    p.add_argument("--model", default=None, help="checkpoint directory to time instead")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights of --model's config.json")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default=None, choices=("torch", "triton"))
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=4096, help="longest refresh / KV length timed")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per batch (median)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads on CPU (default: torch's)")
    p.add_argument("--host", action=argparse.BooleanOptionalAction, default=True,
                   help="add the engine's host path per iteration and per request (measured "
                        "as sangam-bench host does) to the fitted forward coefficients")
    p.add_argument("--out", default="calibration.json")
    p.set_defaults(func=run)
