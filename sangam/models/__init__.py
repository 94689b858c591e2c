"""The model families Sangam serves (LLaDA, Dream, SDAR, LLaDA2.x, LLaDA-MoE) in PyTorch, loaded
from local Hugging Face checkpoints.

The names below are imported when first used, so that ``sangam.models.config``,
``checkpoint``, ``registry`` and ``sharding`` (shapes and rules, which the simulator reads)
import without PyTorch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sangam.models.attention import (
        AttentionBackend,
        AttentionMetadata,
        PagedKV,
        TorchAttentionBackend,
    )
    from sangam.models.checkpoint import parse_config, read_config
    from sangam.models.config import CheckpointError, ModelConfig
    from sangam.models.loader import ARCHITECTURES, load_model, resolve_dtype, save_checkpoint
    from sangam.models.sharding import ShardLayout
    from sangam.models.tokenizer import load_tokenizer, stop_token_ids
    from sangam.models.transformer import DiffusionLM

_HOME = {  # name -> the module that defines it
    "AttentionBackend": "attention", "AttentionMetadata": "attention", "PagedKV": "attention",
    "TorchAttentionBackend": "attention", "parse_config": "checkpoint",
    "read_config": "checkpoint", "CheckpointError": "config", "ModelConfig": "config",
    "ARCHITECTURES": "loader", "load_model": "loader", "resolve_dtype": "loader",
    "save_checkpoint": "loader", "ShardLayout": "sharding", "load_tokenizer": "tokenizer",
    "stop_token_ids": "tokenizer", "DiffusionLM": "transformer",
}
__all__ = [
    "ARCHITECTURES", "AttentionBackend", "AttentionMetadata", "CheckpointError", "DiffusionLM",
    "ModelConfig", "PagedKV", "ShardLayout", "TorchAttentionBackend", "load_model",
    "load_tokenizer", "parse_config", "read_config", "resolve_dtype", "save_checkpoint",
    "stop_token_ids",
]


def __getattr__(name: str) -> object:
    if name not in _HOME:
        raise AttributeError(f"module 'sangam.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sangam.models.{_HOME[name]}"), name)
