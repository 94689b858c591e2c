"""``sangam-bench memory``: where one GPU's memory goes for a released model's shape, as the
engine would size its KV pool there (``sangam/engine/memory_profile.py``), without a GPU: the
model is built on the meta device and the GPU is an assumed one (``memory_profile.GPUS``).
Engine flags (``--max-batch-size``, ``--gpu-memory-fraction``, ...) apply as they would to
``sangam.serve``; the defaults give the table of docs/memory.md::

    sangam-bench memory --gpu h200

Under ``--tensor-parallel-size N`` (and ``--enable-expert-parallel``) the plan is one rank's:
its shard of the weights, its KV heads' pages, its activations::

    sangam-bench memory --model-shape llada2-flash --tp 8 --enable-expert-parallel
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from sangam.config import EngineConfig
from sangam.engine.loaded_model import LoadedModel, make_attention_backend
from sangam.engine.memory_profile import GIB, GPUS, MemoryPlan, model_bytes, plan_for
from sangam.engine.multi.data_plane import shard_layout
from sangam.engine.worker import captures_graphs, graph_block_lengths
from sangam.models.checkpoint import parse_config
from sangam.models.loader import dummy_model, resolve_dtype
from sangam.models.registry import MODEL_SHAPES
from sangam.testing import real_shape_config

TABLE_SHAPES = ("llada", "dream", "sdar", "llada2-mini")  # docs/memory.md's rows


def shape_plan(key: str, gpu: str = "h200", engine: EngineConfig | None = None) -> MemoryPlan:
    """The memory plan of registry shape ``key`` (``MODEL_SHAPES``) served with ``engine``'s
    flags (default: the defaults) on one ``gpu``, nothing else on it: under tensor
    parallelism, rank 0's (the widest vocabulary shard)."""
    device = torch.device("cuda")
    raw = real_shape_config(key)
    cfg = parse_config(raw)
    with tempfile.TemporaryDirectory() as path:  # what --load-format dummy reads: config.json
        (Path(path) / "config.json").write_text(json.dumps(raw))
        engine = dataclasses.replace(engine or EngineConfig(), model=path, device="cuda",
                                     load_format="dummy")
        dtype = resolve_dtype(None if engine.dtype == "auto" else engine.dtype, device)
        # Shapes only, nothing allocated (rank 0's shard under tensor parallelism).
        model = dummy_model(cfg, "meta", dtype, shard=shard_layout(engine))
        model.attention_backend = make_attention_backend(engine.attention_backend, device)
        loaded = LoadedModel.around(engine, path, model, cfg, device, dtype)
        spans = graph_block_lengths(engine, loaded) if captures_graphs(engine, loaded) else ()
        total = GPUS[gpu]
        return plan_for(loaded, engine, total=total, free=total - model_bytes(model),
                        graph_spans=spans)


def memory_table(gpu: str = "h200", keys: tuple[str, ...] = TABLE_SHAPES,
                 engine: EngineConfig | None = None) -> str:
    """A Markdown table of :func:`shape_plan` for each shape."""
    lines = ["| Model | Weights | Reserved activations | KV pool pages (tokens) | "
             "Max concurrent canvases |", "|---|---:|---:|---:|---:|"]
    for key in keys:
        p = shape_plan(key, gpu, engine)
        lines.append(f"| {MODEL_SHAPES[key].name} | {p.weights / GIB:.1f} GiB | "
                     f"{p.reserved.total / GIB:.1f} GiB | {p.num_pages:,} ({p.pool_tokens:,}) "
                     f"| {p.max_canvases} x {p.context:,} tokens |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    engine = EngineConfig.from_cli_args(args)
    print(memory_table(args.gpu, tuple(args.model_shape or TABLE_SHAPES), engine))
    if args.verbose:
        for key in args.model_shape or TABLE_SHAPES:
            print(f"{key}: {shape_plan(key, args.gpu, engine).describe()}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "memory", help="weights, reserved activations and KV pool of a model shape on a GPU",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", action="append", choices=sorted(MODEL_SHAPES),
                   help=f"a registry shape (repeatable; default: {', '.join(TABLE_SHAPES)})")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                   help="the GPU assumed (its memory as torch.cuda.mem_get_info reports it)")
    p.add_argument("--verbose", action="store_true",
                   help="also print each plan's breakdown (the engine's startup log line)")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=run)
