"""Weight sharding for tensor parallelism (docs/design.md §4.10): which slice of a model one
rank of a group holds (``ShardLayout``), and cutting a model into that slice (``shard_model``).

Megatron's layout, read off each layer's ``LayerParts`` so that every architecture shares it:
the query/key/value projections are column-parallel (each rank computes its heads; KV heads
replicated when there are fewer than ranks), the output projection row-parallel; an MLP's
gate and up projections column-parallel, its down projection row-parallel; a mixture of
experts' experts split by width, or by expert under expert parallelism; the LM head split by
vocabulary rows. Norms, the router and the embedding stay whole. The model then sums each
row-parallel output across the group (``DiffusionLM.all_reduce``): two all-reduces a layer.

``shard_model`` turns a model built on the meta device into its rank's shapes and returns,
per tensor name, which slices of the checkpoint's tensor this rank reads (``Cut``): the
loader reads only those bytes.

``ShardLayout`` is plain Python: the simulator's cost model applies the same rules without
PyTorch, so this module imports PyTorch and the model classes only where a model is cut.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sangam.models.config import ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from sangam.models.transformer import DiffusionLM


@dataclass(frozen=True)
class ShardLayout:
    """Which slice of a model one rank of a tensor-parallel group holds (Megatron sharding:
    docs/design.md §4.10): attention heads split across the ``size`` ranks (KV heads split, or
    one per rank, replicated, when there are fewer KV heads than ranks), MLP widths split, the
    LM head's vocabulary split, the embedding and norms whole. With ``expert_parallel`` a
    mixture of experts' experts are split instead of each expert's width."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not (self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size}")

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError, naming the flag, when ``cfg`` cannot be split ``size`` ways."""
        moe = cfg.moe
        dense_layers = cfg.num_layers if moe is None else moe.first_dense_layers
        if cfg.gemma is not None:  # a dense MLP beside the experts in every layer
            dense_layers = cfg.num_layers
            self.check_split(cfg.architecture, cfg.num_heads, cfg.gemma.full_kv_heads, 0,
                             moe.num_experts, moe.intermediate_size)
        self.check_split(cfg.architecture, cfg.num_heads, cfg.num_kv_heads,
                         cfg.intermediate_size if dense_layers else 0,
                         *((moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size)
                           if moe is not None else ()))

    def check_split(self, name: str, heads: int, kv_heads: int, dense_width: int,
                    experts: int = 0, expert_width: int = 0, shared_width: int = 0) -> None:
        """:meth:`check` over a model's counts (the simulator's geometries have no config):
        ``dense_width`` 0 without dense MLPs, ``experts`` 0 without experts."""
        if self.expert_parallel and not experts:
            raise ValueError(f"--enable-expert-parallel: {name} is not a mixture-of-experts "
                             "model")
        n = self.size
        if n == 1:
            return
        problems = []
        if heads % n:
            problems.append(f"its {heads} attention heads")
        if kv_heads % n and n % kv_heads:
            problems.append(f"its {kv_heads} KV heads (neither divides the other)")
        if dense_width % n:
            problems.append(f"its MLP width {dense_width}")
        if experts:
            if self.expert_parallel and experts % n:
                problems.append(f"its {experts} experts (--enable-expert-parallel)")
            if not self.expert_parallel and expert_width % n:
                problems.append(f"its expert width {expert_width}")
            if shared_width % n:
                problems.append(f"its shared experts' width {shared_width}")
        if problems:
            raise ValueError(f"--tensor-parallel-size {n} cannot split {name}: "
                             f"{'; '.join(problems)} do not split over {n} ranks")

    def kv_heads(self, num_kv_heads: int) -> int:
        """How many KV heads a rank holds: its share, or one (replicated) when there are
        fewer KV heads than ranks."""
        return max(1, num_kv_heads // self.size)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of ``n`` things split evenly (``check`` made sure)."""
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def heads(self, cfg: ModelConfig, num_kv_heads: int | None = None
              ) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's query heads and KV heads (of ``num_kv_heads``: default the model's;
        a Gemma full layer has its own), as [start, end). With fewer KV heads than ranks each
        rank holds the one KV head its query heads read (vLLM's rule)."""
        q = self.split(cfg.num_heads)
        kv = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
        per_rank = self.kv_heads(kv)
        # Below one KV head per rank, ranks r*Hkv//N share a head; else each its own share.
        first = self.rank * kv // self.size if kv < self.size else self.rank * per_rank
        return q, (first, first + per_rank)

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head counts: what sizes its KV pages and activations."""
        if self.size == 1:
            return cfg
        (q0, q1), (k0, k1) = self.heads(cfg)
        g = cfg.gemma
        if g is not None:
            g = dataclasses.replace(g, full_kv_heads=self.kv_heads(g.full_kv_heads))
        return dataclasses.replace(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, gemma=g)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of the LM head: chunks of ceil(V / size), the last one shorter."""
        k = -(-vocab_size // self.size)
        return min(vocab_size, self.rank * k), min(vocab_size, (self.rank + 1) * k)


@dataclass(frozen=True)
class Cut:
    """This rank's part of a tensor: the ranges ``ranges`` along ``dim``, concatenated
    (a fused QKV weight takes three); ``zero``: a row-parallel bias, held whole by rank 0 and
    as zeros by the others (the all-reduce adds it once)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    zero: bool = False

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full)
        out[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(out)

    def take(self, full: object) -> torch.Tensor:
        """This rank's part of ``full`` (a tensor, or a safetensors slice read lazily)."""
        import torch

        parts = []
        for a, b in self.ranges:
            index = (slice(None),) * self.dim + (slice(a, b),)
            parts.append(full[index])
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        return torch.zeros_like(t) if self.zero else t


def shard_model(model: DiffusionLM, layout: ShardLayout) -> dict[str, Cut]:
    """Give ``model`` (on the meta device, not yet loaded) the shapes of ``layout``'s shard;
    returns the cut of every tensor that is not whole, by state-dict name."""
    import torch
    from torch import nn

    layout.check(model.config)
    model.shard = layout
    if layout.size == 1:
        return {}
    cuts = _cuts(model, layout)
    cuts.update(_fp8_scale_cuts(model, cuts))
    params = dict(model.named_parameters())
    for name, cut in cuts.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        p = params[name]
        local = torch.empty(cut.shape(tuple(p.shape)), dtype=p.dtype, device=p.device)
        setattr(module, attr, nn.Parameter(local, requires_grad=False))
    for module in model.modules():  # keep Linear's repr and features true to the shard
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    return cuts


def _fp8_scale_cuts(model: DiffusionLM, cuts: dict[str, Cut]) -> dict[str, Cut]:
    """The scales of each cut FP8 projection, cut with it: per-channel scales with its output
    rows; 128 x 128 block scales with its rows or columns, which must then fall on block
    edges (a block split between ranks would need two scales)."""
    from sangam.kernels.reference import FP8_GROUP
    from sangam.models.quantization import Fp8Linear

    out = {}
    for name, m in model.named_modules():
        cut = cuts.get(f"{name}.weight")
        if not isinstance(m, Fp8Linear) or cut is None or m.fmt.weights == "tensor":
            continue
        scale = f"{name}.{m.fmt.scale_name}"
        if m.fmt.weights == "channel":
            if cut.dim == 0:
                out[scale] = Cut(0, cut.ranges)
            continue
        full = m.weight.shape[cut.dim]
        if any(a % FP8_GROUP or (b % FP8_GROUP and b != full) for a, b in cut.ranges):
            raise ValueError(
                f"--tensor-parallel-size {model.shard.size} cannot split the FP8 projection "
                f"{name}: its slices {list(cut.ranges)} of {full} do not fall on the edges of "
                f"its {FP8_GROUP} x {FP8_GROUP} scale blocks")
        out[scale] = Cut(cut.dim, tuple((a // FP8_GROUP, -(-b // FP8_GROUP))
                                        for a, b in cut.ranges))
    return out


def _cuts(model: DiffusionLM, layout: ShardLayout) -> dict[str, Cut]:
    from torch import nn

    from sangam.models.llada2 import FusedQKV
    from sangam.models.llada_moe import RoutedPlusShared
    from sangam.models.moe import Expert, SparseMoe
    from sangam.models.transformer import SplitQKV, SwiGLU

    cfg = model.config
    hd = cfg.head_dim
    (q0, q1), (k0, k1) = layout.heads(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    cuts: dict[str, Cut] = {}
    if cfg.gemma is not None:
        return _gemma_cuts(model, layout, names)

    def put(module: nn.Module, weight: Cut, bias: Cut | None = None) -> None:
        cuts[f"{names[id(module)]}.weight"] = weight
        if module.bias is not None:
            cuts[f"{names[id(module)]}.bias"] = bias or weight

    def column(module: nn.Module, ranges: tuple[tuple[int, int], ...]) -> None:
        put(module, Cut(0, ranges))

    def row(module: nn.Module, a: int, b: int) -> None:
        n = module.weight.shape[0]
        put(module, Cut(1, ((a, b),)), Cut(0, ((0, n),), zero=layout.rank != 0))

    def swiglu(gate: nn.Module, up: nn.Module, down: nn.Module) -> None:
        a, b = layout.split(gate.weight.shape[0])
        column(gate, ((a, b),))
        column(up, ((a, b),))
        row(down, a, b)

    def mlp(m: object) -> None:
        if isinstance(m, SwiGLU):
            swiglu(m.gate, m.up, m.down)
        elif isinstance(m, Expert):
            swiglu(m.gate_proj, m.up_proj, m.down_proj)
        elif isinstance(m, RoutedPlusShared):
            mlp(m.routed)
            mlp(m.shared)
        elif isinstance(m, SparseMoe):
            if layout.expert_parallel:
                lo, hi = layout.split(len(m.experts))
                m.local_experts = (lo, hi)
                for j, e in enumerate(m.experts):  # the others' experts: zero width
                    if not lo <= j < hi:
                        column(e.gate_proj, ((0, 0),))
                        column(e.up_proj, ((0, 0),))
                        put(e.down_proj, Cut(1, ((0, 0),)))
            else:
                for e in m.experts:
                    mlp(e)
            if hasattr(m, "shared_experts"):
                mlp(m.shared_experts)
        else:
            raise TypeError(f"no tensor-parallel rule for the MLP {type(m).__name__}")

    for part in model.parts():
        qkv = part.qkv
        if isinstance(qkv, SplitQKV):
            column(qkv.q, ((q0 * hd, q1 * hd),))
            column(qkv.k, ((k0 * hd, k1 * hd),))
            column(qkv.v, ((k0 * hd, k1 * hd),))
        elif isinstance(qkv, FusedQKV):
            q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
            column(qkv.proj, ((q0 * hd, q1 * hd), (q + k0 * hd, q + k1 * hd),
                              (q + kv + k0 * hd, q + kv + k1 * hd)))
        else:
            raise TypeError(f"no tensor-parallel rule for the projection {type(qkv).__name__}")
        row(part.o, q0 * hd, q1 * hd)
        mlp(part.mlp)
    head = model.output_head()
    if isinstance(head, nn.Linear):  # a tied head is the embedding: whole, sliced in logits
        lo, hi = layout.vocab(cfg.vocab_size)
        column(head, ((lo, hi),))
    return cuts


def _gemma_cuts(model: DiffusionLM, layout: ShardLayout, names: dict[int, str]
                ) -> dict[str, Cut]:
    """DiffusionGemma's shard: per layer, its heads (each layer type its own head_dim and KV
    heads; a full layer's V is its K, so it has no v_proj), the dense MLP split by width,
    the experts by width or, under expert parallelism, by expert; router, norms, scalars,
    self-conditioning and the embedding whole (the tied head is sliced in ``logits``)."""
    cfg = model.config
    cuts: dict[str, Cut] = {}

    def name(module: object, attr: str = "weight") -> str:
        return f"{names[id(module)]}.{attr}"

    for i, layer in enumerate(model.model.decoder.layers):
        a = layer.self_attn
        kv_heads, hd = cfg.layer_kv_shape(i)
        (q0, q1), (k0, k1) = layout.heads(cfg, kv_heads)
        cuts[name(a.q_proj)] = Cut(0, ((q0 * hd, q1 * hd),))
        cuts[name(a.k_proj)] = Cut(0, ((k0 * hd, k1 * hd),))
        if a.sliding:
            cuts[name(a.v_proj)] = Cut(0, ((k0 * hd, k1 * hd),))
        cuts[name(a.o_proj)] = Cut(1, ((q0 * hd, q1 * hd),))
        lo, hi = layout.split(cfg.intermediate_size)
        cuts[name(layer.mlp.gate_proj)] = Cut(0, ((lo, hi),))
        cuts[name(layer.mlp.up_proj)] = Cut(0, ((lo, hi),))
        cuts[name(layer.mlp.down_proj)] = Cut(1, ((lo, hi),))
        e, width = layer.experts, cfg.moe.intermediate_size
        if layout.expert_parallel:
            lo, hi = layout.split(cfg.moe.num_experts)
            e.local_experts = (lo, hi)
            cuts[name(e, "gate_up_proj")] = Cut(0, ((lo, hi),))
            cuts[name(e, "down_proj")] = Cut(0, ((lo, hi),))
        else:
            lo, hi = layout.split(width)
            cuts[name(e, "gate_up_proj")] = Cut(1, ((lo, hi), (width + lo, width + hi)))
            cuts[name(e, "down_proj")] = Cut(2, ((lo, hi),))
    return cuts
