"""The activation reservation of ``memory_profile.py`` against the measured peak of the forward
it reserves for (tiny shapes, CPU), the KV pool it leaves, chunked rescoring, and the memory
table of docs/memory.md."""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sangam.config import EngineConfig
from sangam.decoding.confidence import score_logits
from sangam.decoding.logit_edits import LogitEdits, apply_edits
from sangam.engine import memory_profile as mp
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.model_runner import slice_edits
from sangam.models import AttentionMetadata, PagedKV, read_config
from sangam.sched.block_cursor import BlockCursor
from sangam.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent


class PeakBytes(TorchDispatchMode):
    """The live bytes of the tensors made inside (by every op's outputs, counted once per
    storage, until the storage dies) and their peak. Tensors made before do not count: the
    weights and the KV pool are not activations."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, weakref.ref] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: no new bytes (and the
        # weights and the pool predate the mode).
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ref = self._seen.get(id(st))
            if (ref is not None and ref() is st) or (
                    t.device.type != "meta" and st.data_ptr() in inputs):
                continue
            self._seen[id(st)] = weakref.ref(st)
            weakref.finalize(st, self._free, id(st), st.nbytes())
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        return out


def test_peak_bytes_follows_frees():
    with PeakBytes() as m:
        a = torch.ones(1000)
        b = a * 2
        del a
        c = b[:10] + 1
        del b
        assert m.live == 40 and m.peak == 8000
        del c
    assert m.live == 0


# A dense model and a MoE one (block-causal, grouped queries, partial RoPE, a shared expert).
MODELS = {"llada": dict(arch="llada", num_layers=2, max_position=128),
          "llada2": dict(arch="llada2", num_layers=3, num_heads=4, num_kv_heads=2,
                         block_size=8, max_position=128)}
ENGINE = dict(device="cpu", dtype="float32", max_batch_size=4, token_budget=40, max_model_len=96)


@pytest.fixture(scope="module", params=sorted(MODELS))
def loaded(request, tmp_path_factory) -> LoadedModel:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **MODELS[request.param])
    return LoadedModel.load(EngineConfig(model=path, **ENGINE))


def _worst_batch(loaded: LoadedModel, worst: mp.WorstForward, span: int, block: int
                 ) -> list[tuple[int, int]]:
    """(queries, keys) of each request of the forward ``worst`` describes: every decode's span
    over the whole context, then prefills of the whole context (the last one what is left)."""
    ctx = loaded.context_length
    reqs = [(span, ctx)] * (worst.decode_tokens // span)
    left = worst.prefill_tokens
    while left > 0:
        reqs.append((min(left, ctx), min(left, ctx)))
        left -= reqs[-1][0]
    return reqs


def _run_forward(loaded: LoadedModel, reqs: list[tuple[int, int]], block: int) -> int:
    """The measured peak bytes of one forward over ``reqs`` with its scoring: the first pass,
    then the full rescoring of every row (top_p, top_k, min_p, a penalty, logprobs)."""
    cfg, model = loaded.config, loaded.model
    page = 16
    pages_per = -(-loaded.context_length // page)
    kv = PagedKV.allocate(cfg.num_layers, pages_per * len(reqs), page, cfg.num_kv_heads,
                          cfg.head_dim, loaded.dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    ids, pos, slots, rows, tables = [], [], [], [], []
    for r, (n, keys) in enumerate(reqs):
        first = r * pages_per
        tables.append(list(range(first, first + pages_per)))
        p = torch.arange(keys - n, keys)
        pos.append(p)
        slots.append(first * page + p)
        ids.append(torch.randint(0, cfg.vocab_size, (n,), generator=gen))
        start = sum(q for q, _ in reqs[:r])
        rows.extend(range(start + n - min(n, block), start + n))  # its block's rows
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(np.cumsum([0] + [q for q, _ in reqs]), dtype=torch.int32),
        kv_lens=torch.tensor([k for _, k in reqs], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.cat(slots), query_lens=[q for q, _ in reqs],
        kv_lens_host=[k for _, k in reqs])
    if cfg.block_causal:
        meta.causal_blocks = torch.full((len(reqs),), block, dtype=torch.int32)
        meta.positions = torch.cat(pos)
    m = len(rows)
    hot = torch.arange(0, m, 2)
    temperature = torch.zeros(m).index_fill_(0, hot, 1.0)
    keys = torch.arange(m)
    edits = LogitEdits(*(torch.tensor(a) for a in (
        [0], [m], [0, 0], [3, 4], [1.0, -2.0], [0, 0], [5, 6], [1.3, 1.3])), width=m)
    chunk = mp.rescore_chunk_rows(cfg.vocab_size, loaded.dtype)
    with PeakBytes() as peak:
        hidden = model.hidden_states(torch.cat(ids), torch.cat(pos), meta, kv)
        logits = model.logits(hidden, torch.tensor(rows))
        del hidden
        tokens, conf, _ = score_logits(logits, cfg.mask_token_id, temperature, keys, hot=hot)
        for a in range(0, m, chunk):
            b = min(a + chunk, m)
            part = slice_edits(LogitEdits(*(t.numpy() if isinstance(t, torch.Tensor) else t
                                            for t in edits)), a, b)
            score_logits(logits[a:b], cfg.mask_token_id, temperature[a:b], keys[a:b],
                         torch.full((b - a,), 0.9, dtype=torch.float64),
                         torch.full((b - a,), 5), torch.full((b - a,), 0.05, dtype=torch.float64),
                         part.map(torch.from_numpy), 3, hot=hot[(hot >= a) & (hot < b)] - a)
    return peak.peak


def test_reservation_covers_the_worst_forward(loaded):
    engine = EngineConfig(model=loaded.path, **ENGINE)
    params = loaded.default_params()
    cfg, ctx = loaded.config, loaded.context_length
    worst = mp.worst_forward(cfg, engine, ctx, params.block_length, params.cache)
    span = BlockCursor.longest_cached_span(params.block_length, params.cache, ctx,
                                           int(cfg.shift_logits), cfg.block_causal)
    reqs = _worst_batch(loaded, worst, span, params.block_length)
    assert sum(q for q, _ in reqs) == worst.decode_tokens + worst.prefill_tokens
    measured = _run_forward(loaded, reqs, params.block_length)
    r = mp.reserve(cfg, loaded.dtype, worst, worst.decode_tokens + worst.prefill_tokens,
                   "torch", ())
    reserved = r.forward + r.scoring
    assert measured <= reserved <= 2 * measured + (1 << 20), (measured, r)


def _plan(loaded: LoadedModel, total: int, **flags) -> mp.MemoryPlan:
    engine = EngineConfig(model=loaded.path, **{**ENGINE, **flags})
    return mp.plan_for(loaded, engine, total=total, free=total - mp.model_bytes(loaded.model))


def test_pool_gets_what_the_reservation_leaves(loaded):
    total = 1 << 30
    plan = _plan(loaded, total)
    used = plan.weights + plan.reserved.total + plan.num_pages * plan.page_bytes
    assert used <= 0.9 * total < used + plan.page_bytes
    assert "reserved activations" in plan.describe() and "KV pool" in plan.describe()
    # Prefill-first: the prefills are bounded by the pool, whose tokens the reservation covers.
    unbounded = _plan(loaded, total, policy="prefill_first")
    assert unbounded.num_pages < plan.num_pages
    tokens = unbounded.reserved.forward - mp.reference_attention_bytes(
        loaded.config, loaded.dtype, loaded.context_length)
    per_token = mp.forward_bytes(loaded.config, loaded.dtype, 1)
    assert tokens >= per_token * min(unbounded.pool_tokens, 4 * loaded.context_length)
    with pytest.raises(ValueError, match="--gpu-memory-fraction.*--max-model-len"):
        _plan(loaded, mp.model_bytes(loaded.model) + plan.reserved.total)
    # Where K/V moves, the transfer buffer budget is reserved too.
    moving = _plan(loaded, total, mode="disaggregated", transfer_buffer_bytes=64 << 20)
    assert moving.reserved.transfers == 64 << 20 and plan.reserved.transfers == 0
    assert moving.reserved.total == plan.reserved.total + (64 << 20)
    assert moving.num_pages < plan.num_pages


# LLaDA's, Dream's and LLaDA2's vocabularies, and the rows of a chunk (docs/memory.md).
@pytest.mark.parametrize("vocab,chunk", [(126464, 265), (152064, 220), (157184, 213)])
def test_rescore_chunks_fit_the_reservation(vocab, chunk):
    """At real vocabularies (on the meta device: nothing is allocated) a chunk's rows hold no
    more than the reservation, and a chunk is the reservation's worth of rows."""
    rows = mp.rescore_chunk_rows(vocab, torch.bfloat16)
    per_row = mp.rescore_row_bytes(vocab, torch.bfloat16)
    assert rows == chunk and f"{chunk} " in (ROOT / "docs" / "memory.md").read_text()
    assert rows * per_row <= mp.RESCORE_CHUNK_BYTES < (rows + 1) * per_row
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device="meta")
    with PeakBytes() as m:
        index = torch.arange(rows, device="meta")
        score_logits(logits[index], vocab - 1, torch.ones(rows, device="meta"),
                     torch.zeros(rows, dtype=torch.int64, device="meta"),
                     torch.full((rows,), 0.9, device="meta"),
                     torch.full((rows,), 5, device="meta"),
                     torch.zeros(rows, device="meta"), None, 5, hot=index)
    assert m.peak <= rows * per_row


def test_chunked_rescoring_is_bit_identical(tmp_path, monkeypatch):
    """Rescoring in chunks of 3 rows gives the same tokens, confidences and alternatives as
    in one (float64, sampled rows, nucleus and top-k, a penalty, logprobs)."""
    from sangam.engine.engine import Engine
    from sangam.engine.model_runner import Rescore
    from sangam.sampling_params import SamplingParams

    chunks = []
    score = Rescore.score
    monkeypatch.setattr(Rescore, "score", lambda self, *a: chunks.append(len(self.chunks))
                        or score(self, *a))
    path = make_tiny_checkpoint(tmp_path / "m", arch="llada", seed=5)
    results = []
    for chunk in (None, 3):
        engine = Engine(EngineConfig(model=path, device="cpu", dtype="float64", num_pages=64))
        if chunk is not None:
            engine.runner.rescore_rows = chunk
        for i in range(4):
            engine.add_request(f"r{i}", [5 + i, 9, 13], SamplingParams(
                max_tokens=16, block_length=8, temperature=1.5, top_p=0.8, top_k=20 + i,
                seed=i, logprobs=2, repetition_penalty=1.3, unmasking="topk",
                tokens_per_step=1))
        outputs = {}
        while engine.num_requests:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        results.append({k: (v[-1].outputs[0].token_ids, v[-1].outputs[0].logprobs)
                        for k, v in outputs.items()})
    assert results[0] == results[1]
    assert max(chunks) > 1  # the second run rescored in several chunks


def test_docs_memory_table_is_current():
    """docs/memory.md's table is what ``sangam-bench memory --gpu h200`` prints."""
    from sangam.bench.memory import memory_table

    assert memory_table("h200") in (ROOT / "docs" / "memory.md").read_text()


def test_docs_diffusion_gemma_rows_are_current(tmp_path):
    """docs/memory.md's DiffusionGemma rows are what ``sangam-bench memory --model-config``
    prints for the script's config (written by transformers' DiffusionGemmaConfig)."""
    import subprocess
    import sys

    from sangam.bench.memory import config_plan, read_config_json

    subprocess.run([sys.executable, str(ROOT / "scripts" / "diffusion_gemma_26b_config.py"),
                    str(tmp_path)], check=True, capture_output=True)
    raw = read_config_json(str(tmp_path))
    doc = (ROOT / "docs" / "memory.md").read_text()
    for gpu, seats, context in (("h100", 4, 40960), ("h200", 16, 32768)):
        p = config_plan(raw, gpu, EngineConfig(max_batch_size=seats, max_model_len=context))
        row = (f"| {gpu.upper()} | {seats} | {context:,} | {p.reserved.total / mp.GIB:.1f} GiB | "
               f"{p.num_pages:,} ({p.pool_tokens:,}) |")
        assert row in doc, row
    with pytest.raises(ValueError, match="no room"):  # the refused row
        config_plan(raw, "h100", EngineConfig(max_batch_size=16, max_model_len=32768))


def test_slice_edits_edits_the_rows_alike():
    rng = np.random.default_rng(0)
    edits = LogitEdits(np.array([0, 2, 5]), np.array([4, 1, 3]), np.array([0, 1, 2, 2]),
                       np.array([1, 2, 3, 4]), np.array([0.5, -1.0, 2.0, -np.inf]),
                       np.array([0, 2]), np.array([5, 6]), np.array([1.5, 2.0]), width=4)
    x = torch.from_numpy(rng.normal(size=(8, 10)))
    whole = x.clone()
    apply_edits(whole, edits.map(torch.from_numpy))
    for a, b in ((0, 3), (3, 6), (6, 8), (1, 2)):
        part = x[a:b].clone()
        sliced = slice_edits(edits, a, b)
        if sliced is not None:
            apply_edits(part, sliced.map(torch.from_numpy))
        assert torch.equal(part, whole[a:b])



def test_tensor_parallel_ranks_plan_their_share():
    """``sangam-bench memory`` under tensor parallelism plans one rank: LLaDA2.0-flash does
    not fit one H200, and at TP8 with expert parallelism a rank holds an eighth of it plus the
    whole embedding (docs/memory.md's table)."""
    from sangam.bench.memory import shape_plan

    with pytest.raises(ValueError, match="no room for the KV pages"):
        shape_plan("llada2-flash")
    ep8 = shape_plan("llada2-flash",
                     engine=EngineConfig(tensor_parallel_size=8, enable_expert_parallel=True))
    assert (round(ep8.weights / mp.GIB, 1), ep8.num_pages) == (25.1, 337_700)
    tp2 = shape_plan("llada", engine=EngineConfig(tensor_parallel_size=2))
    assert (round(tp2.weights / mp.GIB, 1), tp2.num_pages) == (7.9, 28_440)


def test_a_uniform_state_models_worst_forward_is_its_canvases(tmp_path):
    """DiffusionGemma: every seat's step is a canvas (a later canvas's first one spans two),
    every canvas row an LM-head row scored whole; its widest heads (the full layers') size the
    layers' activations."""
    from tests.test_diffusion_gemma import CANVAS, write_checkpoint

    cfg = read_config(write_checkpoint(tmp_path / "dg"))
    engine = EngineConfig(max_batch_size=4)
    worst = mp.worst_forward(cfg, engine, 200, 32, "dual")  # the masked defaults are ignored
    assert (worst.decode_tokens, worst.rows) == (4 * 2 * CANVAS, 4 * CANVAS)
    narrow = dataclasses.replace(cfg, gemma=dataclasses.replace(cfg.gemma, full_head_dim=8))
    assert mp.layer_token_bytes(cfg, torch.float32) > mp.layer_token_bytes(narrow,
                                                                           torch.float32)
    scoring = mp.reserve(cfg, torch.float32, worst, 64, "triton", ()).scoring
    assert scoring == mp.uniform_scoring_bytes(cfg, torch.float32, 4 * CANVAS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_canvas_step_fits_the_uniform_scoring_reservation(tmp_path, dtype):
    """The measured peak of a uniform-state batch's scoring — the LM head over two canvases'
    rows, then each canvas's step and self-conditioning in turn, as the model runner commits
    them — is within ``uniform_scoring_bytes``, and not far below it (a vocabulary large
    beside the canvas, as DiffusionGemma's 262,144 is beside its 256)."""
    from sangam.decoding.uniform import Canvas, denoise_step
    from sangam.models.loader import load_model
    from sangam.sampling_params import UniformStateParams
    from tests.test_diffusion_gemma import CANVAS, write_checkpoint

    path = write_checkpoint(tmp_path / "dg", vocab_size=4096)
    model = load_model(path, dtype="float64" if dtype == torch.float64 else "float32")
    cfg = read_config(path)
    rows = 2 * CANVAS
    hidden = torch.randn(rows, cfg.hidden_size, dtype=dtype)
    params = UniformStateParams(max_denoising_steps=4, entropy_bound=1.0, t_min=0.4, t_max=0.8,
                                stability_threshold=1, confidence_threshold=0.005)
    canvases = [Canvas.start(7, i, CANVAS, cfg.vocab_size, torch.device("cpu"))
                for i in range(2)]
    with PeakBytes() as peak:
        logits = model.logits(hidden, torch.arange(rows))
        for i, canvas in enumerate(canvases):
            processed = denoise_step(canvas, logits[i * CANVAS:(i + 1) * CANVAS], params, 7)
            canvas.soft = model.soft_embeddings(processed)
            del processed
    reserved = mp.uniform_scoring_bytes(cfg, dtype, rows)
    assert peak.peak <= reserved
    assert peak.peak >= reserved * 0.7, (peak.peak, reserved)
