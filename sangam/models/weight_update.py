"""Weights replaced in place (docs/design.md §3.1, RL rollouts): what an update may hold, its
check, and one rank's copy of it.

An update names tensors by the checkpoint's names (the model's state-dict keys) with their
full, unsharded shapes; each rank copies its own cut of each into the parameter that holds it,
so every address stays (CUDA graphs, the experts' stacked views) and nothing is allocated but
the incoming tensors. The whole update is checked before anything is copied: a name, shape or
dtype that does not fit, or a value that is not finite, refuses it and the model is unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from sangam.models.checkpoint import read_config
from sangam.models.config import ModelConfig
from sangam.models.loader import dummy_model, tensor_files
from sangam.models.transformer import DiffusionLM

# What an incoming tensor may be: floating values, cast to each parameter's dtype as they are
# copied (a trainer's bf16 or fp32 into a model of either).
UPDATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
UPDATE_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in UPDATE_DTYPES}

Shape = tuple[int, ...]


def updatable(config: ModelConfig) -> None:
    """Refuse weight updates on a model they cannot be applied to exactly."""
    if config.quantization is not None:
        raise ValueError(f"weight updates into an FP8 model ({config.quantization.method}) are "
                         "not supported: its projections hold quantized values and their "
                         "scales, which a full-precision update would have to be quantized "
                         "into; serve the full-precision checkpoint to train against it")


def full_shapes(config: ModelConfig) -> dict[str, Shape]:
    """Every tensor an update may name, with its full (unsharded) shape: the architecture's
    state dict, built on the meta device (nothing allocated)."""
    model = dummy_model(config, "meta", torch.float32)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype an update may carry, by its torch name ("bfloat16") or itself."""
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        dtype = UPDATE_DTYPE_NAMES.get(str(name).removeprefix("torch."))
    if dtype not in UPDATE_DTYPES:
        raise ValueError(f"weight update dtype {name!r} is not one of "
                         f"{sorted(UPDATE_DTYPE_NAMES)}")
    return dtype


def check_update(expected: dict[str, Shape], specs: Sequence[tuple[str, Shape, torch.dtype]]
                 ) -> None:
    """Refuse an update of tensors ``specs`` (name, full shape, dtype) that does not fit a
    model whose tensors are ``expected`` (``full_shapes``); says which tensor and why."""
    if not specs:
        raise ValueError("a weight update needs at least one tensor")
    seen = set()
    for name, shape, dtype in specs:
        if not isinstance(name, str) or name not in expected:
            raise ValueError(f"weight update: the model has no tensor {name!r}")
        if name in seen:
            raise ValueError(f"weight update: tensor {name!r} is given twice")
        seen.add(name)
        if tuple(shape) != expected[name]:
            raise ValueError(f"weight update: tensor {name!r} has shape {list(shape)}, the "
                             f"model's is {list(expected[name])}")
        parse_dtype(dtype)


def check_values(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse tensors holding a NaN or an infinity: served, they would answer garbage."""
    for name, t in named:
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"weight update: tensor {name!r} holds non-finite values")


@torch.no_grad()
def apply_update(model: DiffusionLM, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy this rank's cut of each full tensor in ``named`` (checked: ``check_update``) into
    the parameter holding it, in place; values are checked first, so a refused update changes
    nothing."""
    check_values(named)
    params = model.state_dict()
    cuts = model.weight_cuts
    for name, t in named:
        cut = cuts.get(name)
        params[name].copy_(t if cut is None else cut.take(t))


# safetensors' dtype names of the dtypes an update may carry.
_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                       "F64": torch.float64}


def check_same_model(config: ModelConfig, path: str | os.PathLike) -> None:
    """Refuse the checkpoint at ``path`` unless its config.json describes the served model
    (the same architecture, geometry, norms, RoPE and tokens): weights of another model with
    tensors of the same shapes would be served under this one's config, silently wrong. Only
    the request defaults it suggests may differ."""
    other = read_config(Path(path))
    differ = [f.name for f in dataclasses.fields(ModelConfig)
              if f.name != "request_defaults"
              and getattr(other, f.name) != getattr(config, f.name)]
    if differ:
        raise ValueError(f"weight update from {path}: its config.json differs from the served "
                         f"model's in {', '.join(differ)}")


def checkpoint_specs(path: str | os.PathLike, expected: dict[str, Shape]
                     ) -> list[tuple[str, Shape, torch.dtype]]:
    """(name, shape, dtype) of each of the model's tensors in the checkpoint at ``path``, read
    off the files' headers; refused unless it holds every one (a whole model: its other
    tensors are ignored, as at load) in a dtype an update may carry."""
    files = tensor_files(Path(path))
    missing = sorted(set(expected) - set(files))
    if missing:
        raise ValueError(f"weight update from {path}: the checkpoint lacks {missing[:3]}"
                         f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}")
    specs = []
    for h, names in _by_file(files, expected):
        for name in names:
            s = h.get_slice(name)
            dtype = _SAFETENSORS_DTYPES.get(s.get_dtype())
            if dtype is None:
                raise ValueError(f"weight update from {path}: tensor {name!r} is stored as "
                                 f"{s.get_dtype()}, not one of {sorted(_SAFETENSORS_DTYPES)}")
            specs.append((name, tuple(s.get_shape()), dtype))
    return specs


def read_checkpoint(path: str | os.PathLike, names: Iterable[str]
                    ) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``names`` of the checkpoint at ``path``, whole, on the CPU."""
    return [(name, h.get_tensor(name))
            for h, group in _by_file(tensor_files(Path(path)), names) for name in group]


def _by_file(files: dict[str, Path], names: Iterable[str]
             ) -> Iterator[tuple[object, list[str]]]:
    """Each safetensors file holding some of ``names``, open, with those names."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for f, group in by_file.items():
        with safe_open(f, framework="pt") as h:
            yield h, group
