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
LAYOUTS = ("llada", "dream", "sdar", "llada2", "llada_moe")


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts model's expert shape (LLaDA2's config.json key names)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int  # leading layers with a dense MLP (intermediate_size wide)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def config_keys(self, layout: str = "llada2", num_layers: int = 0) -> dict:
        """The config.json keys of ``layout``: LLaDA2's names (the fields), or LLaDA-MoE's
        (``llada_moe``: expert and shared-expert widths, a dense/MoE flag per layer)."""
        if layout == "llada_moe":
            if (self.n_group, self.topk_group) != (1, 1):
                raise ValueError("LLaDA-MoE's router has no expert groups")
            dense = self.first_k_dense_replace
            return {"num_experts": self.num_experts,
                    "num_experts_per_tok": self.num_experts_per_tok,
                    "expert_intermediate_size": self.moe_intermediate_size,
                    "shared_expert_intermediate_size":
                        self.num_shared_experts * self.moe_intermediate_size or None,
                    "moe_layer_freq": [0] * dense + [1] * (num_layers - dense)}
        return dict(self.__dict__)

    # MoeConfig's names (the cost model reads a shape and a parsed config alike).
    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok

    @property
    def intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def first_dense_layers(self) -> int:
        return self.first_k_dense_replace


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
    moe: MoeShape | None = None  # None: dense

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.name}: layout must be one of {LAYOUTS}, got "
                             f"{self.layout!r}")

    @property
    def block_causal(self) -> bool:
        """SDAR's and LLaDA2's attention: bidirectional within a block, causal across
        blocks."""
        return self.layout in ("sdar", "llada2")


MODEL_SHAPES = {
    "llada": ModelShape("LLaDA-8B", "llada", 4096, 32, 32, 32, 12288, 126464, 128),
    "dream": ModelShape("Dream-7B", "dream", 3584, 28, 28, 4, 18944, 152064, 128),
    "sdar": ModelShape("SDAR-8B", "sdar", 4096, 36, 32, 8, 12288, 151936, 128),
    "sdar-4b": ModelShape("SDAR-4B", "sdar", 2560, 36, 32, 8, 9728, 151936, 128,
                          tie_word_embeddings=True),
    "sdar-1.7b": ModelShape("SDAR-1.7B", "sdar", 2048, 28, 16, 8, 6144, 151936, 128,
                            tie_word_embeddings=True),
    "llada2-mini": ModelShape("LLaDA2.0-mini", "llada2", 2048, 20, 16, 4, 5120, 157184, 128,
                              moe=MoeShape(256, 8, 512, 1, 1, n_group=8, topk_group=4,
                                           routed_scaling_factor=2.5)),
    "llada2-flash": ModelShape("LLaDA2.0-flash", "llada2", 4096, 32, 32, 4, 9216, 157184, 128,
                               moe=MoeShape(256, 8, 1024, 1, 1, n_group=8, topk_group=4,
                                            routed_scaling_factor=2.5)),
    # Every layer MoE, no shared expert; intermediate_size: dense_intermediate_size (8192 =
    # 8 experts x 1024, the active MLP width).
    "llada-moe": ModelShape("LLaDA-MoE-7B-A1B", "llada_moe", 2048, 16, 16, 16, 8192, 157184,
                            128, moe=MoeShape(64, 8, 1024, 0, 0)),
}
