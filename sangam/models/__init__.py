"""LLaDA and Dream in PyTorch, loaded from local Hugging Face checkpoints."""

from sangam.models.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedKV,
    TorchAttentionBackend,
)
from sangam.models.config import CheckpointError, ModelConfig, ShardLayout, parse_config
from sangam.models.loader import (
    ARCHITECTURES,
    load_model,
    read_config,
    resolve_dtype,
    save_checkpoint,
)
from sangam.models.tokenizer import load_tokenizer, stop_token_ids
from sangam.models.transformer import DiffusionLM

__all__ = [
    "ARCHITECTURES", "AttentionBackend", "AttentionMetadata", "CheckpointError", "DiffusionLM",
    "ModelConfig", "PagedKV", "ShardLayout", "TorchAttentionBackend", "load_model",
    "load_tokenizer", "parse_config", "read_config", "resolve_dtype", "save_checkpoint",
    "stop_token_ids",
]
