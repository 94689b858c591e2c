"""Iteration time of one packed forward from its batch composition, for the simulator.

The forward of an iteration is a sequence of kernels, each bounded by compute or by memory
traffic (a roofline per part), plus host overheads:

    time = overhead + per_sequence * requests
         + max(linear FLOPs / matmul rate,    layer weight bytes / bandwidth)   # read once
         + max(attention FLOPs / attn rate,   K/V bytes / bandwidth)            # per span
         + max(LM-head FLOPs / matmul rate,   LM-head bytes / bandwidth)

- linear FLOPs: 2 x tokens x parameters of the transformer layers (every span token goes
  through every projection);
- attention FLOPs: 4 x span x KV length x heads x head_dim per layer (QK^T and PV, no causal
  mask: every query sees every cached position of its request; a DiffusionGemma
  sliding-window layer's query at most its window and its span);
- K/V bytes: each span reads its request's whole cache (KV length x KV bytes per token) and
  writes its own fresh K/V;
- LM head: only the rows that predict masked positions of the current block (docs/design.md §2).

The rates default to a GPU's peak times efficiency factors (:data:`DEFAULT_EFFICIENCY`);
``sangam-bench calibrate`` measures forwards and fits all five coefficients instead
(:func:`fit_coefficients`), and ``--calibration FILE`` loads them.

A worker may be a tensor-parallel group of N GPUs (:class:`TensorParallel`, Megatron sharding):
each rank computes 1/N of the linear, attention and LM-head FLOPs and reads 1/N of the weights
and of the K/V (K/V heads are replicated when there are fewer than N: a rank holds at least
one), and the forward adds its collectives, which nothing overlaps:

    + 2 x layers x all_reduce(tokens x hidden x dtype)   # after o_proj and after down_proj
    + all_gather(LM-head rows x 5 fp64 statistics)        # vocabulary-parallel scoring
    all_reduce(b) = latency + 2 (N-1)/N x b / link bandwidth  (ring)

With expert parallelism the experts are split across the ranks (E/N each, full width) instead
of each expert's width; under uniform routing a rank's expert FLOPs and weight reads are 1/N
in expectation either way, so the split changes only the MoE layer's communication
(:meth:`CostModel.moe_communication`: the engine's all-reduce against all-to-all dispatch and
combine).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from sangam.models.config import ModelConfig
from sangam.models.registry import MODEL_SHAPES, ModelShape
from sangam.models.sharding import ShardLayout

GIB = 1 << 30
BF16_BYTES = 2


@dataclass(frozen=True)
class ModelGeometry:
    """Shapes that set a model's cost (docs/design.md §6): the simulator's view of a model (its
    fields are what calibration files record)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    block_causal: bool = False  # SDAR, LLaDA2: a query sees its block and the blocks before
    head_size: int = 0  # 0: hidden // heads (Qwen3 and SDAR name theirs: 128)
    tied_head: bool = False  # the LM head is the embedding table (SDAR-1.7B and 4B)
    # Mixture of experts (0 experts: dense): layers [0, dense_layers) have the dense MLP of
    # width intermediate, the others a router, experts_per_token routed experts of width
    # expert_intermediate chosen among experts, and always-on shared experts.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    # DiffusionGemma (docs/design.md §2.12): ``full_layers`` of the layers are full attention
    # with heads of ``full_head_size`` and ``full_kv_heads`` K/V heads (no V projection: V is
    # K), the others sliding-window layers (``sliding_window`` keys); a dense MLP of width
    # ``intermediate`` beside the experts in every layer (``parallel_mlp``); canvases of
    # ``canvas`` positions re-sampled every step (uniform-state: every canvas row takes the
    # LM head). All 0 / False for the other models.
    full_layers: int = 0
    full_head_size: int = 0
    full_kv_heads: int = 0
    sliding_window: int = 0
    parallel_mlp: bool = False
    canvas: int = 0

    @classmethod
    def of(cls, name: str, config: ModelConfig | ModelShape) -> ModelGeometry:
        """The cost view of a parsed config.json or of a registry shape (the same names)."""
        moe = config.moe
        experts = {} if moe is None else dict(
            experts=moe.num_experts, experts_per_token=moe.top_k,
            expert_intermediate=moe.intermediate_size,
            shared_intermediate=moe.shared_intermediate_size,
            dense_layers=moe.first_dense_layers)
        g = getattr(config, "gemma", None)
        gemma = {} if g is None else dict(
            full_layers=g.sliding.count(False), full_head_size=g.full_head_dim,
            full_kv_heads=g.full_kv_heads, sliding_window=g.sliding_window, parallel_mlp=True,
            canvas=g.canvas_length)
        return cls(name, config.hidden_size, config.num_layers, config.num_heads,
                   config.num_kv_heads, config.intermediate_size, config.vocab_size,
                   config.block_causal, config.head_dim, config.tie_word_embeddings,
                   **experts, **gemma)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def attention_params(self) -> float:
        """q and o (hidden x heads x head_dim each), k and v (GQA), per layer (the mean over
        DiffusionGemma's two kinds of layer: a full one has no v)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        if not self.full_layers:
            return 2 * h * q + 2 * h * kv
        full = 2 * h * self.heads * self.full_head_size + h * self.full_kv_heads \
            * self.full_head_size
        sliding = self.layers - self.full_layers
        return (sliding * (2 * h * q + 2 * h * kv) + self.full_layers * full) / self.layers

    @property
    def layer_params(self) -> float:
        """Weights of one dense block: attention and the SwiGLU gate/up/down."""
        return self.attention_params + 3 * self.hidden * self.intermediate

    def _moe_params(self, routed: float) -> float:
        """One MoE block's weights with ``routed`` routed experts: attention, router, shared
        and routed experts (and DiffusionGemma's dense MLP beside them)."""
        h = self.hidden
        dense = 3 * h * self.intermediate if self.parallel_mlp else 0
        return (self.attention_params + h * self.experts + dense
                + 3 * h * (self.shared_intermediate + routed * self.expert_intermediate))

    def attention_flops(self, spans: Sequence[Span]) -> float:
        """QK^T and PV FLOPs of a forward over every layer: a sliding-window layer's query
        sees at most its window and its span (DiffusionGemma's canvas rows: the window before
        the canvas and the canvas)."""
        pairs = sum(s.attention_pairs for s in spans)
        if not self.full_layers:
            return 4.0 * pairs * self.heads * self.head_dim * self.layers
        window = sum(s.q_len * min(s.kv_len, self.sliding_window + s.q_len) for s in spans)
        return 4.0 * self.heads * ((self.layers - self.full_layers) * self.head_dim * window
                                   + self.full_layers * self.full_head_size * pairs)

    @property
    def active_params(self) -> float:
        """The linear weights one token multiplies by, over all layers (MoE: its experts')."""
        dense = self.layers - self.moe_layers
        return dense * self.layer_params + self.moe_layers * self._moe_params(
            self.experts_per_token)

    def weights_read(self, tokens: int) -> float:
        """The linear weights a forward over ``tokens`` tokens reads: all the dense ones, and
        of each MoE layer the experts its tokens pick (the expected number under uniform
        routing: E (1 - (1 - k/E)^tokens))."""
        dense = self.layers - self.moe_layers
        if not self.moe_layers:
            return float(dense * self.layer_params)
        picked = self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens)
        return dense * self.layer_params + self.moe_layers * self._moe_params(picked)

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    def weight_bytes(self, dtype_bytes: int = BF16_BYTES, tp: int = 1) -> int:
        """Resident weights of one rank of a TP group of ``tp``: its share of the layers (every
        expert) and of the vocabulary-parallel LM head, and the embedding table, replicated
        (once if tied: the head's shard is a slice of it)."""
        dense = self.layers - self.moe_layers
        layers = dense * self.layer_params + self.moe_layers * self._moe_params(self.experts)
        head = 0 if self.tied_head else self.head_params / tp
        return int(layers / tp + head + self.head_params) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = BF16_BYTES, tp: int = 1,
                           window: bool | None = None) -> int:
        """K/V bytes of one position, on one rank of a TP group of ``tp`` (each layer's own
        shape: the engine's pool); ``window``: the sliding-window layers' alone (True) or the
        others' (False), a hybrid pool's two kinds of page."""
        rank = ShardLayout(0, tp)  # the engine's rule for KV heads
        sliding = 0 if window is False else self.layers - self.full_layers
        full = 0 if window else self.full_layers
        return 2 * dtype_bytes * (
            sliding * rank.kv_heads(self.kv_heads) * self.head_dim
            + full * rank.kv_heads(self.full_kv_heads) * self.full_head_size)

    def check_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> None:
        """The engine's sharding rules (``ShardLayout.check_split``)."""
        ShardLayout(0, tp, expert_parallel).check_split(
            self.name, self.heads, self.kv_heads,
            self.intermediate if self.layers > self.moe_layers else 0, self.experts,
            self.expert_intermediate, self.shared_intermediate)


# The known models (sangam.models.registry), by the keys --model and --geometry take.
MODELS = {key: ModelGeometry.of(shape.name, shape) for key, shape in MODEL_SHAPES.items()}


CALIBRATED = "calibrated"  # the simulator's model: the geometry a calibration file records


def load_calibrated_geometry(path: str | os.PathLike) -> tuple[ModelGeometry, int]:
    """The model geometry and dtype size a ``sangam-bench calibrate`` file was measured on."""
    with open(path) as f:
        data = json.load(f)
    if "geometry" not in data:
        raise ValueError(f"{path}: calibration records no geometry (rerun sangam-bench "
                         "calibrate)")
    return ModelGeometry(**data["geometry"]), int(data.get("dtype_bytes", BF16_BYTES))


# NVLink 4 (H100 / H200 SXM): 18 links x 25 GB/s = 450 GB/s per direction (NVIDIA's H100
# datasheet: 900 GB/s bidirectional).
NVLINK_BYTES_PER_S = 450e9
# A small collective within one NVLink node: NCCL's all_reduce_perf reports ~10 us for messages
# of a few KiB on 8 GPUs (launch, ring setup and synchronisation; bandwidth does not matter).
COLLECTIVE_LATENCY_S = 10e-6


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    link_bytes_per_s: float = NVLINK_BYTES_PER_S  # to the node's other GPUs, per direction
    collective_latency_s: float = COLLECTIVE_LATENCY_S


GPUS = {
    "h100": GPUSpec("H100-SXM", 989e12, 3.35e12, 79.6 * GIB),
    "h200": GPUSpec("H200", 989e12, 4.8e12, 140.4 * GIB),
}

# Link bandwidths for K/V transfer between workers, bytes/s.
LINKS = {"nvlink": NVLINK_BYTES_PER_S, "pcie": 50e9, "network": 25e9}

# Fractions of peak reached by real kernels: ~0.8 for a large square bf16 matmul (docs/design.md §5
# measures 790 of 989 TFLOP/s), less for a model's thinner shapes; attention kernels reach about
# half of peak; streaming reads reach ~80% of HBM bandwidth; NCCL's collectives ~80% of NVLink's
# (all_reduce_perf's bus bandwidth on 8 H100s: ~360 of 450 GB/s).
DEFAULT_EFFICIENCY = {"matmul": 0.7, "attention": 0.5, "bandwidth": 0.8, "collective": 0.8}
# Per-iteration host cost without CUDA graphs: ~10 kernel launches per layer plus scheduling,
# and per-request batch assembly (the engine's host target is < 0.5 ms at batch 64).
DEFAULT_OVERHEAD_S = 3e-3
DEFAULT_PER_SEQUENCE_S = 8e-6


# Numbers per logits row and rank that vocabulary-parallel scoring combines, in fp64 (exact for
# token ids): decoding.confidence.SHARD_FIELDS, counted here so that the simulator imports
# without PyTorch (tests/test_sim.py checks the two agree).
LM_STATISTICS = 5
STATISTIC_BYTES = 8
# How one MoE layer's experts communicate under expert parallelism
# (CostModel.moe_communication), and the engine's choice: the layer's one all-reduce.
EP_SCHEMES = ("all-reduce", "all-to-all")
ENGINE_EP_SCHEME = "all-reduce"


@dataclass(frozen=True)
class TensorParallel:
    """A worker as a group of ``size`` GPUs under Megatron sharding, and its collectives: ring
    algorithms, each rank's share over its own link, each collective paying ``latency_s``."""

    size: int = 1
    expert_parallel: bool = False  # split the experts across the ranks, not each one's width
    link_bytes_per_s: float = NVLINK_BYTES_PER_S * DEFAULT_EFFICIENCY["collective"]
    latency_s: float = COLLECTIVE_LATENCY_S

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.size}")
        if self.link_bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError("a TP group needs a positive link bandwidth and a latency >= 0")

    @classmethod
    def on(cls, gpu: GPUSpec, size: int = 1, expert_parallel: bool = False) -> TensorParallel:
        """``size`` of ``gpu``: its link at NCCL's efficiency, its collective latency."""
        return cls(size, expert_parallel, gpu.link_bytes_per_s * DEFAULT_EFFICIENCY["collective"],
                   gpu.collective_latency_s)

    def all_reduce(self, nbytes: float) -> float:
        """Every rank gets the sum of every rank's ``nbytes``: a ring's reduce-scatter and
        all-gather each carry (N-1)/N of them over each link."""
        n = self.size
        return 0.0 if n == 1 else self.latency_s + 2 * (n - 1) / n * nbytes / self.link_bytes_per_s

    def all_gather(self, nbytes: float) -> float:
        """Every rank gets every rank's ``nbytes``: each link carries the other N-1 ranks'."""
        n = self.size
        return 0.0 if n == 1 else self.latency_s + (n - 1) * nbytes / self.link_bytes_per_s

    def all_to_all(self, nbytes: float) -> float:
        """Every rank sends its ``nbytes`` spread evenly over the ranks: (N-1)/N leave it."""
        n = self.size
        return 0.0 if n == 1 else self.latency_s + (n - 1) / n * nbytes / self.link_bytes_per_s


@dataclass(frozen=True)
class Coefficients:
    matmul_flops: float  # achieved FLOP/s of the projections and the LM head
    attention_flops: float  # achieved FLOP/s of attention
    hbm_bytes_per_s: float  # achieved bandwidth streaming weights and K/V
    iteration_overhead_s: float  # fixed cost of every forward
    per_sequence_s: float  # extra cost per request in the batch

    @classmethod
    def defaults(cls, gpu: GPUSpec) -> Coefficients:
        e = DEFAULT_EFFICIENCY
        return cls(gpu.peak_flops * e["matmul"], gpu.peak_flops * e["attention"],
                   gpu.hbm_bytes_per_s * e["bandwidth"], DEFAULT_OVERHEAD_S,
                   DEFAULT_PER_SEQUENCE_S)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Coefficients:
        """The ``coefficients`` object of a ``sangam-bench calibrate`` JSON file."""
        with open(path) as f:
            data = json.load(f)
        coeffs = data.get("coefficients", data)
        names = [f for f in cls.__dataclass_fields__]
        missing = [n for n in names if n not in coeffs]
        if missing:
            raise ValueError(f"{path}: calibration lacks {missing}")
        return cls(**{n: float(coeffs[n]) for n in names})

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Span:
    """One request's part of a forward."""

    q_len: int  # positions computed (T for a refresh, the block for a DualCache step)
    kv_len: int  # positions attended to (the request's whole sequence T; block-causal: to e)
    lm_rows: int  # LM-head rows: masked positions of the current block
    causal_block: int = 0  # block-causal: the block size (a query sees keys to its block's end)

    @property
    def attention_pairs(self) -> float:
        """(query, key) pairs the attention computes: all of them, or under the block-causal
        mask for a span ending at ``kv_len``, each query's keys up to its block's end."""
        if not self.causal_block:
            return float(self.q_len * self.kv_len)
        start = self.kv_len - self.q_len
        return self.q_len * (start + self.kv_len + self.causal_block) / 2


def batch_features(geom: ModelGeometry, spans: Sequence[Span], dtype_bytes: int = BF16_BYTES,
                   tp: int = 1) -> np.ndarray:
    """FLOPs and bytes of one forward, by part, on one rank of a TP group of ``tp``: the
    inputs of the roofline.

    Order: linear FLOPs, layer weight bytes, attention FLOPs, K/V bytes, LM-head FLOPs, LM-head
    bytes, number of requests.
    """
    tokens = sum(s.q_len for s in spans)
    rows = sum(s.lm_rows for s in spans)
    kv_tokens = sum(s.kv_len + s.q_len for s in spans)
    return np.array([
        2.0 * tokens * geom.active_params / tp,
        geom.weights_read(tokens) * dtype_bytes / tp,
        geom.attention_flops(spans) / tp,
        float(kv_tokens * geom.kv_bytes_per_token(dtype_bytes, tp)),
        2.0 * rows * geom.head_params / tp,
        float(geom.head_params * dtype_bytes) / tp if rows else 0.0,
        float(len(spans)),
    ])


def _predict(features: np.ndarray, mm: np.ndarray, attn: np.ndarray, bw: np.ndarray,
             c0: np.ndarray, c1: np.ndarray) -> np.ndarray:
    """Roofline time; ``features`` [..., 7] broadcast against the coefficient arrays."""
    f = features
    return (c0 + c1 * f[..., 6]
            + np.maximum(f[..., 0] / mm, f[..., 1] / bw)
            + np.maximum(f[..., 2] / attn, f[..., 3] / bw)
            + np.maximum(f[..., 4] / mm, f[..., 5] / bw))


class CostModel:
    """Seconds per iteration of ``geom`` with ``coeffs`` (each GPU's), on a worker of ``tp``."""

    def __init__(self, geom: ModelGeometry, coeffs: Coefficients,
                 dtype_bytes: int = BF16_BYTES, tp: TensorParallel = TensorParallel()):
        geom.check_tensor_parallel(tp.size, tp.expert_parallel)
        self.geom = geom
        self.coeffs = coeffs
        self.dtype_bytes = dtype_bytes
        self.tp = tp

    def iteration_time(self, spans: Sequence[Span]) -> float:
        if not spans:
            return 0.0
        c = self.coeffs
        return float(_predict(batch_features(self.geom, spans, self.dtype_bytes, self.tp.size),
                              c.matmul_flops, c.attention_flops, c.hbm_bytes_per_s,
                              c.iteration_overhead_s, c.per_sequence_s)
                     ) + self.communication_time(spans)

    def communication_time(self, spans: Sequence[Span]) -> float:
        """The forward's collectives, which nothing overlaps (none on one GPU): an all-reduce
        of the activations after each layer's attention and after its MLP (an MoE layer's
        experts as ``ENGINE_EP_SCHEME`` under expert parallelism), and the LM head's
        statistics gathered."""
        tp, g = self.tp, self.geom
        if tp.size == 1:
            return 0.0
        tokens = sum(s.q_len for s in spans)
        rows = sum(s.lm_rows for s in spans)
        layer = tp.all_reduce(tokens * g.hidden * self.dtype_bytes)
        moe = (self.moe_communication(tokens)[ENGINE_EP_SCHEME] if tp.expert_parallel
               else layer)
        head = tp.all_gather(rows * LM_STATISTICS * STATISTIC_BYTES) if rows else 0.0
        return (2 * g.layers - g.moe_layers) * layer + g.moe_layers * moe + head

    def moe_communication(self, tokens: int) -> dict[str, float]:
        """Seconds one MoE layer's MLP communicates in a forward of ``tokens`` tokens under
        expert parallelism, by scheme (:data:`EP_SCHEMES`):

        - ``all-reduce`` (the engine's): every rank holds every token (the attention's
          all-reduce leaves them so) and runs its own experts on the tokens routed to them; the
          partial outputs join the all-reduce the layer's MLP ends with anyway;
        - ``all-to-all``: the tokens split evenly over the ranks (the attention's all-reduce
          becomes a reduce-scatter, and an all-gather after the combine gives every rank all of
          them again: the same bytes, one more latency); dispatch sends each token to its
          top-k experts' ranks and combine brings the outputs back, each moving tokens x k x
          hidden x dtype x (N-1)/N bytes over the group, 1/N of them on each rank's link.

        Under uniform routing the experts' FLOPs and weight reads per rank are the same
        either way.
        """
        g, tp = self.geom, self.tp
        if not g.experts:
            raise ValueError(f"{g.name} has no experts")
        act = tokens * g.hidden * self.dtype_bytes
        dispatch = tp.all_to_all(act * g.experts_per_token / tp.size)
        return {"all-reduce": tp.all_reduce(act),
                "all-to-all": 2 * dispatch + (tp.latency_s if tp.size > 1 else 0.0)}

    def kv_bytes(self, tokens: int) -> int:
        """K/V bytes of ``tokens`` positions on one rank (the worker's on one GPU): what each
        rank sends, all at once over their own links, when the K/V moves to another worker."""
        return tokens * self.geom.kv_bytes_per_token(self.dtype_bytes, self.tp.size)


def kv_pool_pages(geom: ModelGeometry, gpu: GPUSpec, page_size: int,
                  memory_fraction: float = 0.9, dtype_bytes: int = BF16_BYTES, tp: int = 1,
                  ring_pages: int = 0) -> int:
    """KV pages of a worker of ``tp`` GPUs: what each rank has left after its weights in
    ``memory_fraction`` of its memory, in pages of its share of the K/V heads (activations,
    which are small next to the pool for these models, are not subtracted). A hybrid pool's
    ``ring_pages`` (every seat's ring) of the sliding layers come first; the pages counted are
    then the full layers'."""
    budget = gpu.memory_bytes * memory_fraction - geom.weight_bytes(dtype_bytes, tp)
    if ring_pages:
        budget -= ring_pages * page_size * geom.kv_bytes_per_token(dtype_bytes, tp, window=True)
    per_token = geom.kv_bytes_per_token(dtype_bytes, tp, window=False if ring_pages else None)
    pages = int(budget // (page_size * per_token))
    if pages < 1:
        where = gpu.name if tp == 1 else f"{tp}x {gpu.name} (tensor parallel)"
        raise ValueError(f"{geom.name} does not fit {where} with room for a KV pool")
    return pages


def _nonneg_affine(resid: np.ndarray, n: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Weighted least squares ``resid ~ c0 + c1 * n`` with c0, c1 >= 0 (2-variable NNLS)."""
    best = (0.0, 0.0)
    best_err = float(np.sum((w * resid) ** 2))
    a = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    b = resid * w
    candidates = []
    sol, *_ = np.linalg.lstsq(a, b, rcond=None)
    candidates.append((float(sol[0]), float(sol[1])))
    candidates.append((float(np.sum(w * w * resid) / np.sum(w * w)), 0.0))
    candidates.append((0.0, float(np.sum(w * w * resid * n) / max(np.sum(w * w * n * n), 1e-30))))
    for c0, c1 in candidates:
        if c0 < 0 or c1 < 0:
            continue
        err = float(np.sum((w * (resid - c0 - c1 * n)) ** 2))
        if err < best_err:
            best, best_err = (c0, c1), err
    return best


MIN_FIT_POINTS = 3  # measured forwards the fit needs


def fit_coefficients(geom: ModelGeometry, points: Sequence[tuple[Sequence[Span], float]],
                     initial: Coefficients, dtype_bytes: int = BF16_BYTES, rounds: int = 14
                     ) -> tuple[Coefficients, float]:
    """Fit the five coefficients to measured ``(spans, seconds)`` points; returns them and the
    root-mean-square relative error.

    The three rates enter through maxima (not smooth), so they are found by a shrinking grid
    search in log space around ``initial``; for each candidate the two overheads are a
    non-negative linear fit of what the roofline leaves unexplained. Relative error is
    minimized, so short forwards count as much as long ones.
    """
    if len(points) < MIN_FIT_POINTS:
        raise ValueError(f"need at least {MIN_FIT_POINTS} measured forwards to fit")
    feats = np.stack([batch_features(geom, spans, dtype_bytes) for spans, _ in points])
    y = np.array([t for _, t in points], dtype=float)
    w = 1.0 / y
    center = np.log([initial.matmul_flops, initial.attention_flops, initial.hbm_bytes_per_s])
    width = 7.0  # e^7 ~ 1000x either way in the first round
    best: tuple[float, tuple[float, ...]] = (np.inf, ())
    for _ in range(rounds):
        axes = [c + np.linspace(-width, width, 9) for c in center]
        for logs in itertools.product(*axes):
            mm, attn, bw = np.exp(logs)
            roof = _predict(feats, mm, attn, bw, 0.0, 0.0)
            c0, c1 = _nonneg_affine(y - roof, feats[:, 6], w)
            err = float(np.sum(((roof + c0 + c1 * feats[:, 6]) / y - 1.0) ** 2))
            if err < best[0]:
                best = (err, (mm, attn, bw, c0, c1))
        center = np.log(best[1][:3])
        width /= 2.0
    err, (mm, attn, bw, c0, c1) = best
    return Coefficients(mm, attn, bw, c0, c1), float(np.sqrt(err / len(y)))
