"""``sangam-bench memory``: where one GPU's memory goes for a released model's shape, as the
engine would size its KV pool there (``sangam/engine/memory_profile.py``), without a GPU: the
model is built on the meta device and the GPU is an assumed one (``memory_profile.GPUS``).
Engine flags (``--max-batch-size``, ``--gpu-memory-fraction``, ...) apply as they would to
``sangam.serve``; the defaults give the table of docs/memory.md::

    sangam-bench memory --gpu h200

Under ``--tensor-parallel-size N`` (and ``--enable-expert-parallel``) the plan is one rank's:
its shard of the weights, its KV heads' pages, its activations::

    sangam-bench memory --model-shape llada2-flash --tp 8 --enable-expert-parallel

``--model-config CHECKPOINT`` plans a checkpoint's shape from its config.json alone (any
architecture Sangam serves, DiffusionGemma's among them: no registry shape of it is shipped)::

    sangam-bench memory --model-config path/to/checkpoint --gpu h100

A model with sliding-window layers under ``--kv-pool hybrid`` (or ``auto`` with prefix
caching off) plans both kinds of page: the full layers' and the sliding layers' rings::

    sangam-bench memory --model-config path/to/checkpoint --gpu h100 --kv-pool hybrid

``--quantization fp8`` plans FP8 weights (one byte a weight of every projection, the LM head
and embedding as they are); an FP8 checkpoint's config.json plans them by itself::

    sangam-bench memory --model-shape llada2-flash --tp 4 --quantization fp8 --gpu h100
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
from sangam.engine.pool_layout import window_ring
from sangam.engine.worker import captures_graphs, graph_plan
from sangam.models.checkpoint import parse_config
from sangam.models.loader import dummy_model, resolve_dtype, with_quantization
from sangam.models.registry import MODEL_SHAPES
from sangam.testing import real_shape_config

TABLE_SHAPES = ("llada", "dream", "sdar", "llada2-mini")  # docs/memory.md's rows


def shape_plan(key: str, gpu: str = "h200", engine: EngineConfig | None = None) -> MemoryPlan:
    """The memory plan of registry shape ``key`` (``MODEL_SHAPES``) served with ``engine``'s
    flags (default: the defaults) on one ``gpu``, nothing else on it: under tensor
    parallelism, rank 0's (the widest vocabulary shard)."""
    return config_plan(real_shape_config(key), gpu, engine)


def config_plan(raw: dict, gpu: str = "h200", engine: EngineConfig | None = None) -> MemoryPlan:
    """``shape_plan`` of the shape a config.json (``raw``) states."""
    device = torch.device("cuda")
    cfg = with_quantization(parse_config(raw), (engine or EngineConfig()).quantization)
    with tempfile.TemporaryDirectory() as path:  # what --load-format dummy reads: config.json
        (Path(path) / "config.json").write_text(json.dumps(raw))
        engine = dataclasses.replace(engine or EngineConfig(), model=path, device="cuda",
                                     load_format="dummy")
        dtype = resolve_dtype(None if engine.dtype == "auto" else engine.dtype, device)
        # Shapes only, nothing allocated (rank 0's shard under tensor parallelism).
        model = dummy_model(cfg, "meta", dtype, shard=shard_layout(engine))
        model.attention_backend = make_attention_backend(engine.attention_backend, device)
        loaded = LoadedModel.around(engine, path, model, cfg, device, dtype)
        # The spans the worker captures (build_worker_parts): a block-causal model's 2B too.
        spans = tuple(s for _, s in graph_plan(engine, loaded)) \
            if captures_graphs(engine, loaded) else ()
        total = GPUS[gpu]
        return plan_for(loaded, engine, total=total, free=total - model_bytes(model),
                        graph_spans=spans, ring=window_ring(engine, loaded))


def memory_table(gpu: str = "h200", keys: tuple[str, ...] = TABLE_SHAPES,
                 engine: EngineConfig | None = None,
                 configs: tuple[str, ...] = ()) -> str:
    """A Markdown table of :func:`shape_plan` for each registry shape, then of
    :func:`config_plan` for each checkpoint directory of ``configs``."""
    plans = [(MODEL_SHAPES[key].name, shape_plan(key, gpu, engine)) for key in keys]
    plans += [(Path(path).name, config_plan(read_config_json(path), gpu, engine))
              for path in configs]
    rings = any(p.ring for _, p in plans)  # a column of its own where a hybrid pool plans some
    lines = ["| Model | Weights | Reserved activations | KV pool pages (tokens) | "
             + ("Sliding-window rings | " if rings else "") + "Max concurrent canvases |",
             "|---|---:|---:|---:|" + ("---:|" if rings else "") + "---:|"]
    for name, p in plans:
        lines.append(f"| {name} | {p.weights / GIB:.1f} GiB | "
                     f"{p.reserved.total / GIB:.1f} GiB | {p.num_pages:,} ({p.pool_tokens:,}) "
                     + (f"| {rings_cell(p)} " if rings else "")
                     + f"| {p.max_canvases} x {p.context:,} tokens |")
    return "\n".join(lines)


def rings_cell(plan: MemoryPlan) -> str:
    """A hybrid pool's sliding-window pages: how many, per request, and their bytes."""
    if not plan.ring:
        return "—"
    return (f"{plan.window_pages:,} pages, {plan.ring} a request "
            f"({plan.window_pages * plan.window_page_bytes / GIB:.1f} GiB)")


def read_config_json(path: str) -> dict:
    """A checkpoint directory's config.json (or the file itself)."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    return json.loads(file.read_text())


def run(args: argparse.Namespace) -> int:
    engine = EngineConfig.from_cli_args(args)
    configs = tuple(args.model_config or ())
    keys = tuple(args.model_shape or (() if configs else TABLE_SHAPES))
    print(memory_table(args.gpu, keys, engine, configs))
    if args.verbose:
        for key in keys:
            print(f"{key}: {shape_plan(key, args.gpu, engine).describe()}")
        for path in configs:
            print(f"{path}: {config_plan(read_config_json(path), args.gpu, engine).describe()}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "memory", help="weights, reserved activations and KV pool of a model shape on a GPU",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", action="append", choices=sorted(MODEL_SHAPES),
                   help=f"a registry shape (repeatable; default: {', '.join(TABLE_SHAPES)})")
    p.add_argument("--model-config", action="append", metavar="CHECKPOINT",
                   help="a checkpoint directory (or its config.json) whose shape to plan, "
                        "weights not read (repeatable; instead of the registry shapes)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                   help="the GPU assumed (its memory as torch.cuda.mem_get_info reports it)")
    p.add_argument("--verbose", action="store_true",
                   help="also print each plan's breakdown (the engine's startup log line)")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=run)
