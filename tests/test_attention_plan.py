"""The attention launch plan: CUDA graphs plan as the eager path does, and batches do not compile.

On CPU: plans are made for an H200 (``platform.assume_gpu``), and launches are bound, not run,
by Triton's own argument binder for sm_90, which yields the specialization its kernel cache is
keyed by, so each distinct key is one compile on a fresh GPU.
"""

from __future__ import annotations

import importlib
import random
import types

import numpy as np
import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from sangam.engine.cuda_graphs import DecodeGraphRunner
from sangam.engine.host_batch import PackedBatch
from sangam.kernels.cross_compile import H200
from sangam.kernels.platform import assume_gpu
from sangam.models import load_model
from sangam.models.attention import PagedKV
from sangam.models.registry import MODEL_SHAPES
from sangam.models.triton_attention import TritonAttentionBackend

# The module, not the function of the same name that sangam.kernels exports.
pa = importlib.import_module("sangam.kernels.paged_attention")
ta = importlib.import_module("sangam.models.triton_attention")

PAGE = 16
SPAN = 32  # the default block length: a DualCache decode step's queries
CONTEXTS = {"llada": 4096, "dream": 131072}  # max_sequence_length, max_position_embeddings
META = torch.device("meta")  # shapes only: plans and bindings read no data


@pytest.fixture
def h200():
    with assume_gpu(H200.sms, H200.max_shared_bytes):
        yield


def _batch(arch: str, kv_lens: list[int], span: int, width: int) -> tuple[torch.Tensor, ...]:
    """q, k_cache, cu_seqlens_q, block_tables (``width`` pages), kv_lens on the meta device."""
    shape = MODEL_SHAPES[arch]
    n = len(kv_lens)
    q = torch.empty(n * span, shape.num_heads, shape.head_dim, dtype=torch.bfloat16, device=META)
    kc = torch.empty(1 << 20, PAGE, shape.num_kv_heads, shape.head_dim, dtype=torch.bfloat16,
                     device=META)
    cu = torch.arange(0, n * span + 1, span, dtype=torch.int32, device=META)
    bt = torch.empty(n, width, dtype=torch.int32, device=META)
    return q, kc, cu, bt, torch.empty(n, dtype=torch.int32, device=META)


def _runner(arch: str, max_batch_size: int) -> DecodeGraphRunner:
    """A graph runner (graphs off) over a model and pool of ``arch``'s shape: planning only."""
    s = MODEL_SHAPES[arch]
    model = types.SimpleNamespace(config=types.SimpleNamespace(
        num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, gemma=None))
    kv = PagedKV(torch.empty(1, 2, 8, PAGE, s.num_kv_heads, s.head_dim, dtype=torch.bfloat16,
                             device=META))
    return DecodeGraphRunner(model, kv, SPAN, max_batch_size, CONTEXTS[arch] // PAGE, META,
                             use_graphs=False)


def _kv_lens(rng: random.Random, n: int, context: int) -> list[int]:
    longest = rng.choice([SPAN, 300, 600, 2048, context])
    return [rng.randint(SPAN, max(SPAN, min(context, longest))) for _ in range(n)]


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_split_count_follows_kv_lengths_not_table_width(h200, arch):
    """A batch's own-width table and a graph's context-wide one get the same plan, and the graph
    runner replays the graph of that split count."""
    rng = random.Random(1)
    runner = _runner(arch, 64)
    max_pages = CONTEXTS[arch] // PAGE
    seen = set()
    for _ in range(150):
        kv = _kv_lens(rng, rng.choice([1, 1, 2, 3, 5, 8, 13, 24, 40, 64]), CONTEXTS[arch])
        own = -(-max(kv) // PAGE)
        plans = []
        for width in (own, max_pages):
            q, kc, cu, bt, _ = _batch(arch, kv, SPAN, width)
            plans.append(pa.plan_attention(q, kc, cu, bt, max_kv_len=max(kv),
                                           max_query_len=SPAN))
        eager, wide = plans
        assert (eager.block_m, eager.block_n, eager.num_splits) == \
               (wide.block_m, wide.block_n, wide.num_splits), kv
        batch = types.SimpleNamespace(kv_lens=np.array(kv, dtype=np.int32),
                                      input_ids=np.zeros(len(kv) * SPAN))
        bucket, splits = runner.graph_key(batch)
        assert splits == eager.num_splits and splits in runner.split_counts[bucket]
        seen.add(splits)
    assert {1, 2}.issubset(seen) and max(seen) >= 8  # the sweep reaches split plans
    # A one-request decode over a short context is not split, however wide its table.
    q, kc, cu, bt, _ = _batch(arch, [300], SPAN, max_pages)
    assert pa.plan_attention(q, kc, cu, bt, max_kv_len=300, max_query_len=SPAN).num_splits == 1


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_graph_runner_captures_every_reachable_split_count(h200, arch):
    """Every (batch size, longest KV length) a graph can serve has its split count captured,
    and no count is captured that no batch gets."""
    runner = _runner(arch, 64)
    context = CONTEXTS[arch]
    reached: dict[int, set[int]] = {b: set() for b in runner.sizes}
    for n in range(1, 65):
        bucket = next(b for b in runner.sizes if b >= n)
        for kv in [*range(0, context, 128), context]:
            reached[bucket].add(runner.kv_splits(n * SPAN, kv))
    assert {b: sorted(s) for b, s in reached.items()} == runner.split_counts
    assert all(s == [1] for b, s in runner.split_counts.items() if b >= 64)


def test_canvas_runner_captures_the_split_pairs_canvas_batches_reach(h200):
    """DiffusionGemma-26B-A4B's canvas steps (256 queries a request; sliding layers 8 KV heads
    of 256, full layers 2 of 512) plan their KV splits per layer shape; the canvas runner's key
    is the pair, equal to the eager plans of both shapes, and every pair a batch of up to 16
    canvases over up to 131,072 keys reaches is captured."""
    gemma = types.SimpleNamespace(full_kv_heads=2, full_head_dim=512)
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(num_heads=16, num_kv_heads=8, head_dim=256,
                                     hidden_size=2816, gemma=gemma),
        output_head=lambda: types.SimpleNamespace(weight=torch.empty(0, dtype=torch.bfloat16)))
    kv = PagedKV.grouped([
        (torch.empty(1, 2, 8, PAGE, 8, 256, dtype=torch.bfloat16, device=META), [0]),
        (torch.empty(1, 2, 8, PAGE, 2, 512, dtype=torch.bfloat16, device=META), [1])])
    span, context = 256, 131072
    runner = DecodeGraphRunner(model, kv, span, 16, context // PAGE, META, use_graphs=False,
                               canvas=True)
    seen = set()
    for n in range(1, 17):
        bucket = next(b for b in runner.sizes if b >= n)
        for longest in [*range(span, context, 1024), context]:
            pair = runner.kv_splits(n * span, longest)
            eager = []
            for heads, d in ((2, 512), (8, 256)):  # full layers, then sliding ones
                q = torch.empty(n * span, 16, d, dtype=torch.bfloat16, device=META)
                kc = torch.empty(1 << 20, PAGE, heads, d, dtype=torch.bfloat16, device=META)
                cu = torch.arange(0, n * span + 1, span, dtype=torch.int32, device=META)
                bt = torch.empty(n, -(-longest // PAGE), dtype=torch.int32, device=META)
                eager.append(pa.plan_attention(q, kc, cu, bt, max_kv_len=longest,
                                               max_query_len=span).num_splits)
            assert pair == tuple(eager), (n, longest)
            assert pair in runner.split_counts[bucket], (n, longest, runner.split_counts)
            seen.add(pair)
    assert len(seen) > 1  # the sweep reaches split plans


class _Binder:
    """Stands in for a kernel: each launch is bound as the sm_90 JIT binds it, not run. Records
    its cache keys, and its choices: the constexpr part of a key, with the model it ran for
    (model constants such as head counts are specialised too, once per model)."""

    def __init__(self, kernel):
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn,
                                                                        **kernel.kwargs)
        backend = make_backend(GPUTarget("cuda", H200.arch, 32))
        self.bind = create_function_from_signature(jit.signature, jit.params, backend)
        self.model = ""
        self.keys: set[str] = set()
        self.choices: set[str] = set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.bind(*args, **kwargs)
            self.keys.add(str(specialization) + str(options))  # JITFunction's cache key
            self.choices.add(self.model + str([s for s in specialization if s[0] == "constexpr"])
                             + str(options))
        return launch


def test_batches_do_not_add_kernel_variants(h200, monkeypatch):
    """300 random LLaDA/Dream batches (decode steps and refreshes, tables as wide as the batch
    or the context) compile one attention (and merge) variant per model and constexpr choice:
    none per request count, split count or table width."""
    attn, merge = _Binder(pa._attn_kernel), _Binder(pa._merge_splits_kernel)
    monkeypatch.setattr(pa, "_attn_kernel", attn)
    monkeypatch.setattr(pa, "_merge_splits_kernel", merge)
    rng = random.Random(0)
    for _ in range(300):
        arch = attn.model = merge.model = rng.choice(["llada", "dream"])
        context = CONTEXTS[arch]
        span = SPAN if rng.random() < 0.8 else rng.randint(1, 512)
        kv = [max(k, span) for k in _kv_lens(rng, rng.randint(1, 64), context)]
        width = rng.choice([-(-max(kv) // PAGE), context // PAGE])
        q, kc, cu, bt, kvl = _batch(arch, kv, span, width)
        plan = pa.plan_attention(q, kc, cu, bt, max_kv_len=max(kv), max_query_len=span)
        pa.paged_attention(q, kc, kc, cu, bt, kvl, 0.1, plan=plan)
    assert len(merge.choices) > 2  # the sweep splits in several ways
    for binder in (attn, merge):
        assert len(binder.keys) == len(binder.choices), (len(binder.keys), len(binder.choices))


def _stub_attention(monkeypatch) -> list[pa.AttentionPlan]:
    """Record the Triton backend's plans; store and attend to nothing (zeros)."""
    plans = []

    def attend(q, *args, plan, **kwargs):
        plans.append(plan)
        return torch.zeros_like(q)

    monkeypatch.setattr(ta, "store_kv", lambda *args: None)
    monkeypatch.setattr(ta, "paged_attention", attend)
    return plans


def _packed(kv_lens: list[int], span: int, width: int, num_pages: int) -> PackedBatch:
    """A decode batch of uniform spans with the given KV lengths (tokens and pages arbitrary)."""
    n, rng = len(kv_lens), np.random.default_rng(len(kv_lens))
    tokens = n * span
    i64 = np.int64
    return PackedBatch(
        input_ids=rng.integers(0, 50, tokens), positions=np.arange(tokens, dtype=i64) % span,
        slot_mapping=rng.integers(0, num_pages * PAGE, tokens),
        block_tables=rng.integers(0, num_pages, (n, width)).astype(np.int32),
        cu_seqlens_q=np.arange(0, tokens + 1, span, dtype=np.int32),
        kv_lens=np.array(kv_lens, dtype=np.int32), logits_indices=np.zeros(0, i64),
        cu_rows=np.zeros(n + 1, i64), row_keys=np.zeros(0, i64),
        temperatures=np.zeros(0), cand_positions=np.zeros(0, i64), num_forced=np.zeros(n, i64),
        num_editable=np.zeros(n, i64))


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_graph_runner_plans_as_the_eager_forward(request, h200, monkeypatch, arch):
    """The graph runner's padded, context-wide batch (graphs off, as on CPU) is planned exactly
    as the eager forward plans the batch itself: tiles, warps, stages and split count."""
    model = load_model(request.getfixturevalue(f"{arch}_path"), "cpu", "float32")
    model.attention_backend = TritonAttentionBackend()
    cfg = model.config
    num_pages, span, max_pages = 64, 8, 2048 // PAGE
    kv = PagedKV.allocate(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim,
                          torch.float32, "cpu")
    runner = DecodeGraphRunner(model, kv, span, 6, max_pages, torch.device("cpu"),
                               use_graphs=False)
    plans = _stub_attention(monkeypatch)
    fields = ("block_m", "block_n", "num_warps", "num_stages", "num_splits")
    splits = set()
    for kv_lens in ([40], [700], [2000], [600, 30], [1500, 200, 900], [100] * 5, [1800] * 6):
        batch = _packed(kv_lens, span, -(-max(kv_lens) // PAGE), num_pages)
        dev = {k: torch.from_numpy(v) for k, v in batch.device_arrays().items()}
        assert runner.can_run(batch)
        model.hidden_states(dev["input_ids"], dev["positions"], batch.metadata(dev), kv)
        eager = plans[-1]
        runner.run(batch, dev)
        graph = plans[-1]
        assert graph is not eager
        assert [getattr(graph, f) for f in fields] == [getattr(eager, f) for f in fields]
        assert runner.graph_key(batch)[1] == eager.num_splits
        splits.add(eager.num_splits)
    assert len(splits) > 1  # split plans are among them


def test_block_causal_graph_runners_plan_as_the_eager_forward(tmp_path, h200, monkeypatch):
    """A block-causal model's runners: span B takes later steps only, span 2B every mix of B
    and 2B spans, a B-span request padded with dummy rows; each plans as the eager forward of
    the real batch (same tiles, the real token count's split count)."""
    from sangam.testing import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(tmp_path, seed=5, arch="sdar"), "cpu", "float32")
    model.attention_backend = TritonAttentionBackend()
    cfg = model.config
    num_pages, block, max_pages = 64, 8, 2048 // PAGE
    kv = PagedKV.allocate(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim,
                          torch.float32, "cpu")
    later, first = (DecodeGraphRunner(model, kv, span, 6, max_pages, torch.device("cpu"),
                                      use_graphs=False, causal_block=block)
                    for span in (block, 2 * block))
    plans = _stub_attention(monkeypatch)
    fields = ("block_m", "block_n", "num_warps", "num_stages", "num_splits")
    for kv_lens, spans in (([40], [16]), ([700, 30], [8, 16]), ([2000] * 3, [16, 8, 8]),
                           ([600, 90, 1200], [8, 8, 8]), ([100] * 5, [16] * 5)):
        batch = _packed(kv_lens, 1, -(-max(kv_lens) // PAGE), num_pages)
        batch.cu_seqlens_q = np.concatenate([[0], np.cumsum(spans)]).astype(np.int32)
        tokens = int(batch.cu_seqlens_q[-1])
        batch.input_ids, batch.positions = np.zeros(tokens, np.int64), np.arange(tokens)
        batch.slot_mapping = np.zeros(tokens, np.int64)
        runner = later if max(spans) == block else first
        assert runner.can_run(batch, block)
        assert not (first if runner is later else later).can_run(batch, block)
        assert not runner.can_run(batch, block // 2)  # another block length: eager
        dev = {k: torch.from_numpy(v) for k, v in batch.device_arrays().items()}
        dev["causal_blocks"] = torch.full((len(spans),), block, dtype=torch.int32)
        model.hidden_states(dev["input_ids"], dev["positions"], batch.metadata(dev), kv)
        eager = plans[-1]
        hidden = runner.run(batch, dev)
        graph = plans[-1]
        assert hidden.shape[0] == tokens  # the real rows, in packed order
        assert [getattr(graph, f) for f in fields] == [getattr(eager, f) for f in fields]


def test_step_kernels_do_not_add_variants(h200, monkeypatch):
    """The other kernels of every step (KV store, scoring, MoE experts) over 200 random batch
    sizes: one variant per constexpr choice, none per token, row or pair count."""
    modules = {m: importlib.import_module(f"sangam.kernels.{m}")
               for m in ("kv_store", "unmask", "fused_moe")}
    binders = []
    for module, name in (("kv_store", "_store_kv_kernel"), ("unmask", "_score_kernel"),
                         ("unmask", "_merge_kernel"), ("fused_moe", "_gate_up_kernel"),
                         ("fused_moe", "_down_kernel"), ("fused_moe", "_combine_kernel")):
        binders.append(_Binder(getattr(modules[module], name)))
        monkeypatch.setattr(modules[module], name, binders[-1])
    moe = MODEL_SHAPES["llada-moe"]
    hidden, experts = moe.hidden_size, moe.moe.num_experts
    inter, top_k = moe.moe.intermediate_size, moe.moe.top_k
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=META)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device=META)
    rng = random.Random(2)
    for _ in range(200):
        n = rng.randint(1, 64) * (SPAN if rng.random() < 0.8 else rng.randint(1, 20))
        for arch in ("llada", "dream"):
            for binder in binders:
                binder.model = arch
            s = MODEL_SHAPES[arch]
            k = torch.empty(n, s.num_kv_heads, s.head_dim, dtype=torch.bfloat16, device=META)
            cache = torch.empty(64, PAGE, s.num_kv_heads, s.head_dim, dtype=torch.bfloat16,
                                device=META)
            modules["kv_store"].store_kv(k, k, cache, cache,
                                         torch.empty(n, dtype=torch.int64, device=META))
        rows = rng.randint(1, 2000)
        modules["unmask"].fused_score(
            torch.empty(rows, MODEL_SHAPES["llada"].vocab_size, dtype=torch.bfloat16,
                        device=META), 0,
            torch.empty(rows, dtype=torch.float64, device=META),
            torch.empty(rows, dtype=torch.int64, device=META))
        tokens = rng.randint(1, 300)
        modules["fused_moe"].fused_moe(
            torch.empty(tokens, hidden, dtype=torch.bfloat16, device=META), w13, w2,
            torch.empty(tokens, top_k, dtype=torch.float32, device=META),
            torch.empty(tokens, top_k, dtype=torch.int32, device=META))
    for binder in binders:
        assert binder.keys and len(binder.keys) == len(binder.choices), binder.choices
