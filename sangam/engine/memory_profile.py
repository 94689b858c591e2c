"""What a worker's GPU memory holds besides its KV pool, computed before the pool is sized.

The pool takes what is left of ``--gpu-memory-fraction`` of the GPU once the weights, what
others hold (the CUDA context, other processes) and the activations of the largest forward the
scheduler may build are set aside (vLLM profiles a worst-case forward for the same reason: a
pool sized on free memory alone leaves the forward to run out of memory).

The activations are computed, not measured: an upper bound of the live bytes of each phase of
a forward (``transformer.py``'s layer code, the attention backend, the MoE path), as a function
of its tokens and the scheduler's bounds (``worst_forward``). ``tests/test_memory_profile.py``
checks the bound against the measured peak of that forward at tiny shapes. No GPU is needed:
``sangam-bench memory`` (``sangam/bench/memory.py``) plans a registry shape on an assumed GPU
(docs/memory.md).

Parts of the reservation (:class:`Reservation`):
- forward: the layers' activations at the worst forward's tokens (linear in them), and with
  the reference attention the largest request's materialized attention;
- scoring: the LM head's logits of every row the batch scores, their first scoring (the fused
  kernel's few bytes a row, or the reference ``score_logits``), and one chunk of full
  rescoring (``rescore_chunk_rows``: the model runner rescores in chunks of that many rows);
  a uniform-state model's instead (``uniform_scoring_bytes``): every canvas row's whole
  logits, and one canvas's step at a time;
- graphs: each captured CUDA-graph runner's private pool (its largest batch's forward);
- workspace: cuBLAS / Triton workspaces and the caching allocator's slack.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from sangam.config import EngineConfig
from sangam.engine.loaded_model import LoadedModel
from sangam.models import ModelConfig
from sangam.sched.block_cursor import BlockCursor
from sangam.sched.window_rings import RingShape

GIB = 1 << 30
# An H200 (141 GB of HBM3e nominal) as torch.cuda.mem_get_info reports it: about 139.8 GiB;
# an H100 SXM (80 GB of HBM3): about 79.2 GiB.
H200_MEMORY_BYTES = int(139.8 * GIB)
GPUS = {"h200": H200_MEMORY_BYTES, "h100": int(79.2 * GIB)}
# cuBLAS and Triton workspaces, split-KV partials, and the caching allocator's rounding and
# fragmentation: what no formula here follows.
WORKSPACE_BYTES = 512 << 20
# One chunk of full rescoring (top_p / top_k / min_p, edits, logprobs): ``score_logits`` keeps
# at most this many bytes per logit of the chunk live, per byte of its compute dtype (measured:
# ~12 x 4 on fp32; the GPU's segmented sort adds its double buffers).
RESCORE_BYTES_PER_LOGIT = 16
# What one rescoring chunk may hold: rows are rescored this many bytes at a time.
RESCORE_CHUNK_BYTES = 2 * GIB


def compute_bytes(dtype: torch.dtype) -> int:
    """Bytes of the dtype norms, RoPE, softmax and scoring run in (``compute_dtype``)."""
    return 8 if dtype == torch.float64 else 4


def rescore_row_bytes(vocab_size: int, dtype: torch.dtype) -> int:
    """The most one row of full rescoring holds live (``score_logits`` on logits of ``dtype``,
    with every option on)."""
    return RESCORE_BYTES_PER_LOGIT * compute_bytes(dtype) * vocab_size


def rescore_chunk_rows(vocab_size: int, dtype: torch.dtype) -> int:
    """Rows the model runner rescores at once: as many as ``RESCORE_CHUNK_BYTES`` holds (at
    least one)."""
    return max(1, RESCORE_CHUNK_BYTES // rescore_row_bytes(vocab_size, dtype))


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype,
               kv_cache_dtype: str = "auto", layers: Iterable[int] | None = None) -> int:
    """One KV page of ``layers`` (default: every layer; ``kv_cache_dtype`` fp8: a byte a
    value, plus the rows of their scales)."""
    if kv_cache_dtype == "fp8":
        return cfg.fp8_page_bytes(page_size, layers)
    return page_size * cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size(),
                                              layers)


def pool_page_bytes(cfg: ModelConfig, engine: EngineConfig, dtype: torch.dtype,
                    hybrid: bool) -> tuple[int, int]:
    """Bytes of one page of the pool's two kinds: (full layers', sliding layers') under a
    ``hybrid`` pool, else (every layer's, 0)."""
    window = set(cfg.window_layers) if hybrid else set()
    full = [i for i in range(cfg.num_layers) if i not in window]
    return (page_bytes(cfg, engine.page_size, dtype, engine.kv_cache_dtype, full),
            page_bytes(cfg, engine.page_size, dtype, engine.kv_cache_dtype, window)
            if window else 0)


@dataclass(frozen=True)
class WorstForward:
    """The largest forward the scheduler may build, by its bounds (``batch_builder.py``)."""

    decode_tokens: int  # every seat's longest cached span
    prefill_tokens: int  # the most prefill tokens one iteration admits (pool aside)
    rows: int  # LM-head rows: each request scores at most its block
    longest: int  # the longest request's span, which it attends over whole: the context


def worst_forward(cfg: ModelConfig, engine: EngineConfig, context: int, block_length: int,
                  cache: str, max_span: int | None = None) -> WorstForward:
    """The scheduler's bounds on one forward. Decodes: every seat runs its cached step. A
    finite token budget tau admits at most tau + the carried deficit (below the largest
    prefill, the context) of prefills beyond the decodes, and the idle rule one whole prefill;
    prefill-first and adaptive budgets are bounded by the seats (and the pool: see
    :func:`plan_memory`). Under a hybrid pool no forward of a request spans more than
    ``max_span`` positions (``window_rings.RingShape``)."""
    sched = engine.scheduler
    seats = sched.batch_cap
    exact = cfg.block_causal
    if cfg.gemma is not None:  # its blocks are canvases, with the block-causal spans
        block_length, exact = cfg.gemma.canvas_length, True
    span = BlockCursor.longest_cached_span(block_length, cache, context, int(cfg.shift_logits),
                                           exact)
    decodes = seats * min(context, span)
    prefill = context if max_span is None else min(context, max_span)  # one request's
    prefills = seats * prefill
    if sched.policy != "adaptive" and not math.isinf(sched.budget):
        prefills = min(prefills, max(0, int(sched.budget) - decodes) + prefill)
    return WorstForward(decodes, prefills, seats * block_length, context)


def layer_token_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Live bytes per token of a forward's costliest phase (``DiffusionLM._layers``), beyond
    what every phase holds (the residual stream, ids, positions, RoPE rows). A layer's q, k, v
    live on until the next layer makes its own."""
    e, c = torch.empty((), dtype=dtype).element_size(), compute_bytes(dtype)
    # The widest layer's heads (a DiffusionGemma full layer's are its own).
    head_dim = max(d for _, d in map(cfg.layer_kv_shape, range(cfg.num_layers)))
    hidden, q = cfg.hidden_size, cfg.num_heads * head_dim
    kv = max(h * d for h, d in map(cfg.layer_kv_shape, range(cfg.num_layers)))
    norm = 3 * c * hidden + e * hidden  # fp32 copy, square, scaled, back to the dtype
    qk_norm = 3 * c * q + e * q
    qkv = e * (q + 2 * kv)
    rope = 5 * c * q  # fp32 copy, rotated half, two products, their sum
    attention = qkv + max(qkv, qk_norm + e * q, rope + e * q)  # the last q, k, v; or the old q
    output = qkv + e * q + 2 * e * hidden  # attention output, o projection, the new stream
    mlp = [dense_mlp_bytes(cfg.intermediate_size, hidden, e)]
    if cfg.moe is not None:
        mlp.append(moe_token_bytes(cfg, e, c))
    # DiffusionGemma runs both, the dense output live while the experts run.
    return max(qkv + norm, attention, output,
               qkv + (sum(mlp) if cfg.gemma is not None else max(mlp)))


def dense_mlp_bytes(width: int, hidden: int, e: int) -> int:
    """A SwiGLU MLP per token: its input, silu(gate), up, their product, down, the new
    stream."""
    return e * (3 * hidden + 3 * width)


def moe_token_bytes(cfg: ModelConfig, e: int, c: int) -> int:
    """A mixture-of-experts MLP per token (``moe.py``, either path): router logits and their
    scores, an fp32 copy of the input, a row per (token, expert) of the combined output and
    of the experts' activations, the shared experts' SwiGLU."""
    m, hidden = cfg.moe, cfg.hidden_size
    router = 6 * c * m.num_experts + 16 * m.top_k
    experts = c * (2 * hidden + m.top_k * hidden + 3 * m.top_k * m.intermediate_size)
    shared = dense_mlp_bytes(m.shared_intermediate_size, hidden, e) if \
        m.shared_intermediate_size else 3 * e * hidden
    return e * hidden + router + experts + shared


def resident_token_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What a forward holds per token through every layer: ids, positions, slots, the
    residual stream, the RoPE rows of its positions."""
    e, c = torch.empty((), dtype=dtype).element_size(), compute_bytes(dtype)
    rope = cfg.rotary_dim if cfg.gemma is None else cfg.head_dim + cfg.gemma.full_head_dim
    return 24 + e * cfg.hidden_size + 2 * c * rope


def reference_attention_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """The reference backend's temporaries for one request of ``tokens`` queries over as many
    keys (``paged_attention_ref``, one request at a time): its pages gathered and cast, the
    queries cast and attended, the scores (and a block-causal mask)."""
    e, c = torch.empty((), dtype=dtype).element_size(), compute_bytes(dtype)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return (tokens * ((e + c) * 2 * kv + 2 * c * q + e * q)
            + (c * cfg.num_heads + 1) * tokens ** 2)  # the scores, a block-causal mask


def forward_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """The layers' activations of a forward of ``tokens`` (no LM head): linear in them."""
    return tokens * (resident_token_bytes(cfg, dtype) + layer_token_bytes(cfg, dtype))


def scoring_bytes(cfg: ModelConfig, dtype: torch.dtype, rows: int, fused: bool) -> int:
    """The LM head and scoring of ``rows`` rows: their hidden rows and logits, then the larger
    of their first scoring (the fused kernel's per-row results, or ``score_logits``) and one
    chunk of full rescoring (which runs after it)."""
    e = torch.empty((), dtype=dtype).element_size()
    per_row = rescore_row_bytes(cfg.vocab_size, dtype)
    head = rows * (e * cfg.hidden_size + e * cfg.vocab_size + 64)
    first = 0 if fused else rows * per_row
    return head + max(first, min(rows, rescore_chunk_rows(cfg.vocab_size, dtype)) * per_row)


# A uniform-state model's LM head holds three fp32 copies of its rows' logits at its peak (the
# projection, the cast or the division by the cap, the tanh); a canvas's step
# (``decoding/uniform.py``'s ``denoise_step``, then its self-conditioning) at most this many
# fp32 [C, V] tensors beside the batch's logits: the processed logits, the probabilities, the
# entropy's normalised logits, its probabilities and their product; and its fp64 Gumbel draws,
# one chunk of rows at a time, this many [rows, V] copies (the noise, its hash words, the
# probabilities' logarithm, their sum). Measured: tests/test_memory_profile.py.
UNIFORM_HEAD_COPIES = 3
UNIFORM_STEP_CANVAS_COPIES = 5
UNIFORM_GUMBEL_COPIES = 5


def uniform_scoring_bytes(cfg: ModelConfig, dtype: torch.dtype, rows: int) -> int:
    """A uniform-state model's LM head over ``rows`` canvas rows and its steps: the larger of
    the head's peak and the steps' — every row's fp32 logits, kept while each request steps
    its canvas in turn, and the largest step, one canvas's."""
    from sangam.decoding.uniform import GUMBEL_ROWS

    e, v, canvas = torch.empty((), dtype=dtype).element_size(), cfg.vocab_size, \
        cfg.gemma.canvas_length
    head = rows * (e * cfg.hidden_size + UNIFORM_HEAD_COPIES * 4 * v + 64)
    step = (rows * 4 * v + UNIFORM_STEP_CANVAS_COPIES * canvas * v * 4
            + UNIFORM_GUMBEL_COPIES * min(GUMBEL_ROWS, canvas) * v * 8)
    return max(head, step)


@dataclass(frozen=True)
class Reservation:
    """Bytes set aside for activations, by what they are for."""

    forward: int
    scoring: int
    graphs: int
    workspace: int
    transfers: int = 0  # K/V transfer buffers (--transfer-buffer-bytes) where K/V moves

    @property
    def total(self) -> int:
        return self.forward + self.scoring + self.graphs + self.workspace + self.transfers


@dataclass(frozen=True)
class MemoryPlan:
    """A worker's GPU memory: the pool gets what the fraction leaves after the rest."""

    total: int  # the GPU's memory
    weights: int
    others: int  # in use besides the weights before the pool (CUDA context, other processes)
    reserved: Reservation
    num_pages: int  # the full layers' (a single pool: every layer's)
    page_size: int
    page_bytes: int
    context: int  # the longest request (prompt + canvas), tokens
    # A hybrid pool: the sliding-window layers' pages (``ring`` a seat) and their bytes each.
    window_pages: int = 0
    window_page_bytes: int = 0
    ring: int = 0

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def max_canvases(self) -> int:
        """Requests of the longest length the pool holds at once."""
        n = self.num_pages // -(-self.context // self.page_size)
        return min(n, self.window_pages // self.ring) if self.ring else n

    def describe(self) -> str:
        """The one log line of where the memory went."""
        r, g = self.reserved, GIB
        return (f"GPU memory {self.total / g:.1f} GiB: weights {self.weights / g:.2f} GiB, "
                f"others {self.others / g:.2f} GiB, reserved activations {r.total / g:.2f} GiB "
                f"(forward {r.forward / g:.2f}, scoring {r.scoring / g:.2f}, CUDA graphs "
                f"{r.graphs / g:.2f}, workspace {r.workspace / g:.2f}, K/V transfers "
                f"{r.transfers / g:.2f}), KV pool "
                f"{self.num_pages} pages x {self.page_size} = {self.pool_tokens} tokens "
                f"({self.num_pages * self.page_bytes / g:.2f} GiB"
                + (f"; sliding-window rings {self.window_pages} pages, {self.ring} a request, "
                   f"{self.window_pages * self.window_page_bytes / g:.2f} GiB"
                   if self.ring else "")
                + f", {self.max_canvases} requests of {self.context} tokens)")


def reserve(cfg: ModelConfig, dtype: torch.dtype, worst: WorstForward, tokens: int,
            backend: str, graph_tokens: tuple[int, ...], transfers: int = 0) -> Reservation:
    """The reservation for a forward of ``tokens`` (within ``worst``'s rows and longest
    request) on ``backend``, with CUDA graphs captured for batches of ``graph_tokens``, and
    ``transfers`` bytes of K/V transfer buffers."""
    forward = forward_bytes(cfg, dtype, tokens)
    if backend == "torch":
        forward += reference_attention_bytes(cfg, dtype, worst.longest)
    if cfg.gemma is not None:  # rows come back whole, in fp32, and each canvas steps on them
        scoring = uniform_scoring_bytes(cfg, dtype, min(worst.rows, tokens))
    else:
        scoring = scoring_bytes(cfg, dtype, min(worst.rows, tokens), fused=backend == "triton")
    graphs = sum(forward_bytes(cfg, dtype, n) for n in graph_tokens)
    return Reservation(forward, scoring, graphs, WORKSPACE_BYTES, transfers)


def plan_memory(cfg: ModelConfig, engine: EngineConfig, dtype: torch.dtype, *, total: int,
                free: int, weights: int, context: int, block_length: int, cache: str,
                backend: str, graph_spans: tuple[int, ...] = (),
                ring: RingShape | None = None) -> MemoryPlan:
    """The KV pool for ``engine`` on a GPU of ``total`` bytes of which ``free`` are free (the
    weights, ``weights`` bytes, loaded); a hybrid pool's rings (``ring``, one a seat) come
    off the top. Prefills beyond a finite budget's bound are also
    bounded by the pool (every admitted request holds its pages), so a pool of p pages
    reserves for decodes + min(prefill bound, p pages of tokens): the larger p of the two
    linear cases. Raises ValueError, naming the flags, when no request of ``context`` tokens
    fits."""
    worst = worst_forward(cfg, engine, context, block_length, cache,
                          None if ring is None else ring.max_span)
    # A graph runner captures batches of up to max_batch_size decodes.
    graph_tokens = tuple(engine.max_batch_size * span for span in graph_spans)
    # Disaggregated and hybrid workers hold K/V transfer buffers up to their budget.
    transfers = engine.transfer_buffer_bytes if engine.mode != "colocated" else 0
    per_page, window_page = pool_page_bytes(cfg, engine, dtype, ring is not None)
    ring_pages = 0 if ring is None else ring.pages
    window_pages = ring_pages * engine.scheduler.batch_cap
    budget = free - (1.0 - engine.gpu_memory_fraction) * total - window_pages * window_page

    def fixed(tokens: int) -> int:
        return reserve(cfg, dtype, worst, tokens, backend, graph_tokens, transfers).total

    # Prefills at their bound; or bounded by the pool: per page, its tokens' activations.
    at_bound = (budget - fixed(worst.decode_tokens + worst.prefill_tokens)) // per_page
    per_token = fixed(worst.decode_tokens + 1) - fixed(worst.decode_tokens)
    by_pool = (budget - fixed(worst.decode_tokens)) // (per_page + per_token * engine.page_size)
    num_pages = int(max(at_bound, by_pool, 0))
    tokens = worst.decode_tokens + min(worst.prefill_tokens, num_pages * engine.page_size)
    plan = MemoryPlan(total, weights, total - free - weights,
                      reserve(cfg, dtype, worst, tokens, backend, graph_tokens, transfers),
                      num_pages, engine.page_size, per_page, context, window_pages,
                      window_page, ring_pages)
    if plan.max_canvases < 1:
        raise ValueError(
            f"no room for the KV pages of one {context}-token request: {plan.describe()}. "
            "Raise --gpu-memory-fraction, or shrink the largest forward (--max-model-len, "
            "--max-batch-size, --token-budget) or the CUDA graphs (--enforce-eager), or set "
            "--num-pages")
    return plan


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's weights (parameters and buffers; on any device, meta too)."""
    return sum(t.numel() * t.element_size()
               for t in (*model.parameters(), *model.buffers()))


def plan_for(loaded: LoadedModel, engine: EngineConfig, *, total: int, free: int,
             graph_spans: tuple[int, ...] = (), ring: RingShape | None = None) -> MemoryPlan:
    """:func:`plan_memory` for a loaded model (its weights in ``total - free``), its requests'
    defaults and its context."""
    params = loaded.default_params()
    # A tensor-parallel rank's pages hold its KV heads, its activations its heads' share.
    config = loaded.model.rank_config
    return plan_memory(config, engine, loaded.dtype, total=total, free=free,
                       weights=model_bytes(loaded.model), context=loaded.context_length,
                       block_length=params.block_length, cache=params.cache,
                       backend=loaded.model.attention_backend.name, graph_spans=graph_spans,
                       ring=ring)
