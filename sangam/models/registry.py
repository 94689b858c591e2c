"""The released models Sangam knows by name, each model's shape written once, as its
config.json states it.

The simulator's cost geometries (``sangam.bench.cost_model.MODELS``) and the config.json files
of real shapes for ``--load-format dummy`` (``python -m sangam.testing DIR --shape KEY``) are
built from this table; ``tests/test_model_registry.py`` checks that such a config.json parses
back to the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

# The config.json layouts (key names and architecture) that sangam.testing writes.
LAYOUTS = ("llada", "dream", "sdar")


@dataclass(frozen=True)
class ModelShape:
    """A released model's shape, under ``ModelConfig``'s field names."""

    name: str  # the release, as the paper and the reports name it
    layout: str  # its config.json's layout: one of LAYOUTS
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding / LM head
    head_dim: int
    tie_word_embeddings: bool = False  # the LM head is the embedding table

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.name}: layout must be one of {LAYOUTS}, got "
                             f"{self.layout!r}")

    @property
    def block_causal(self) -> bool:
        """SDAR's attention: bidirectional within a block, causal across blocks."""
        return self.layout == "sdar"


MODEL_SHAPES = {
    "llada": ModelShape("LLaDA-8B", "llada", 4096, 32, 32, 32, 12288, 126464, 128),
    "dream": ModelShape("Dream-7B", "dream", 3584, 28, 28, 4, 18944, 152064, 128),
    "sdar": ModelShape("SDAR-8B", "sdar", 4096, 36, 32, 8, 12288, 151936, 128),
    "sdar-4b": ModelShape("SDAR-4B", "sdar", 2560, 36, 32, 8, 9728, 151936, 128,
                          tie_word_embeddings=True),
    "sdar-1.7b": ModelShape("SDAR-1.7B", "sdar", 2048, 28, 16, 8, 6144, 151936, 128,
                            tie_word_embeddings=True),
}
