"""The hybrid KV pool (``--kv-pool hybrid``, sched/window_rings.py): DiffusionGemma's
sliding-window layers keep a ring of pages per request, the full layers every position.

Tokens are those of the reference decoder (and of the single pool) in float64 on prompts many
windows long; a ring is bounded by the window and the longest forward, never by the prompt;
every page comes back; the memory plan holds both kinds of page."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from sangam import LLM, SamplingParams  # noqa: E402
from sangam.config import EngineConfig  # noqa: E402
from sangam.engine import model_runner  # noqa: E402
from sangam.models import load_model  # noqa: E402
from sangam.sched.window_rings import PREFILL_CHUNK, RingShape  # noqa: E402
from tests.gemma_checkpoint import (  # noqa: E402
    CANVAS,
    VOCAB,
    reference_tokens,
    write_checkpoint,
)
from tests.test_sdar import run_in_mode  # noqa: E402

WINDOW, PAGE = 6, 4  # the test checkpoint's sliding window; the page size used here


def _workload(n: int = 10, seed: int = 3) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests with prompts of many windows (up to 160 positions against a window of 6),
    several canvases each, adaptive stopping on and off, stop ids."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        length = [160, 97, 45, 9, 130][i % 5] + i
        prompt = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        reqs.append((f"r{i}", prompt, SamplingParams(
            max_tokens=[8, 17, 24][i % 3], seed=300 + i, max_denoising_steps=[3, 5][i % 2],
            entropy_bound=[0.2, 2.0][i % 2], confidence_threshold=[0.0, 5.0][i % 2],
            stability_threshold=1, stop_token_ids=[9 + i % 4], stop_at_eos=False)))
    return reqs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dgemma"))


@pytest.fixture(scope="module")
def ours(checkpoint):
    """Sangam's model in float64: the reference decoder's (equal to transformers' generate,
    tests/test_diffusion_gemma.py)."""
    return load_model(checkpoint, dtype="float64")


@pytest.fixture(scope="module")
def workload(ours):
    """The requests, and what the reference decoder gives each (Sangam's token_ids: without
    the stop id)."""
    reqs = _workload()
    return reqs, reference_tokens(ours, reqs)


def _serve(path: str, reqs, kv_pool: str, backend: str = "torch", abort: tuple = (),
           monitor=None) -> dict:
    """The outputs of ``reqs`` on one in-process engine (staggered: a step per arrival),
    ``abort``'s ids aborted after their first steps; ``monitor(engine)`` after every step."""
    llm = LLM(model=path, dtype="float64", page_size=PAGE, token_budget=24, max_batch_size=4,
              kv_pool=kv_pool, enable_prefix_caching=False, attention_backend=backend)
    engine, outs = llm.engine, {}

    def step():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        if monitor is not None:
            monitor(engine)

    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
        step()
    for rid in abort:
        outs[rid] = engine.abort_request(rid)
    while engine.has_unfinished_requests():
        step()
    return {"outs": outs, "engine": engine}


def _record_spans(monkeypatch) -> list[int]:
    """Every request's span in the hybrid pool's forwards from now on (as the runner lays its
    rings out)."""
    spans: list[int] = []
    real = model_runner.window_arrays

    def recording(batch, rings, page_size, window):
        spans.extend(np.diff(batch.cu_seqlens_q).tolist())
        return real(batch, rings, page_size, window)

    monkeypatch.setattr(model_runner, "window_arrays", recording)
    return spans


def test_ring_shape_holds_one_forward_and_its_window():
    """A ring holds the most positions one forward writes and reads (its span and the window
    before it), and not a page more; the span is whole blocks within the token budget (at
    least two blocks: a later canvas's first step), ``PREFILL_CHUNK`` under an infinite one."""
    for window, page, block, budget in [(6, 4, 8, 24), (512, 16, 256, 1024), (512, 16, 256, 100),
                                        (4096, 64, 32, math.inf), (7, 1, 3, 10)]:
        shape = RingShape.of(window, page, block, budget)
        chunk = PREFILL_CHUNK if math.isinf(budget) else budget
        assert shape.max_span == max(int(chunk) // block, 2) * block
        need = shape.max_span + window - 1
        assert shape.pages * page >= need > (shape.pages - 1) * page


def test_tokens_equal_the_single_pool_and_the_reference(checkpoint, workload, monkeypatch):
    """10 requests, prompts up to 27 windows long, batched with staggered arrivals: with the
    hybrid pool each request's tokens are the reference decoder's and the single pool's, in
    float64; a sliding layer holds the ring alone (the sliding buffers have a ring a seat, 8
    pages, where the longest request spans 48); no forward of a request spans more than
    the ring allows; every page of both kinds comes back."""
    reqs, want = workload
    spans = _record_spans(monkeypatch)

    held = set()

    def monitor(engine):
        for req in engine.builder._requests.values():
            if req.pages:
                held.add(len(req.window_pages))

    hybrid = _serve(str(checkpoint), reqs, "hybrid", monitor=monitor)
    monkeypatch.undo()
    single = _serve(str(checkpoint), reqs, "single")
    got = {r: o.outputs[0].token_ids for r, o in hybrid["outs"].items()}
    assert got == want
    assert got == {r: o.outputs[0].token_ids for r, o in single["outs"].items()}

    engine = hybrid["engine"]
    rings, pool = engine.pool.rings, engine.pool
    assert rings.shape == RingShape.of(WINDOW, PAGE, CANVAS, 24) == RingShape(8, 24)
    longest = max(len(p) + params.max_tokens for _, p, params in reqs)
    assert -(-longest // PAGE) == 48 > rings.shape.pages
    assert held == {rings.shape.pages}  # every request holding pages holds one ring
    cfg = engine.loaded.config
    for i in range(cfg.num_layers):
        sliding = i in cfg.window_layers
        assert pool.kv.k[i].shape[0] == (rings.shape.pages * 4 if sliding else pool.num_pages)
    assert spans and max(spans) <= rings.shape.max_span
    assert pool.allocator.num_used == 0 and rings.allocator.num_used == 0


@pytest.mark.parametrize("policy,budget", [("prefill_first", math.inf), ("fastdllm", 24),
                                           ("adaptive", 24), ("deficit", 40)])
def test_every_policy_keeps_forwards_within_the_ring(checkpoint, workload, policy, budget,
                                                     monkeypatch):
    """Each scheduling policy admits a long prompt in chunks its ring holds (prefill-first:
    ``PREFILL_CHUNK``; fastdllm's one request at a time; adaptive's raised budget; chunked
    prefill within the budget), with the reference's tokens."""
    reqs, want = workload
    llm = LLM(model=str(checkpoint), dtype="float64", page_size=PAGE, token_budget=budget,
              max_batch_size=4, kv_pool="hybrid", policy=policy,
              enable_chunked_prefill=policy == "deficit")
    shape = llm.engine.pool.rings.shape
    assert shape == RingShape.of(WINDOW, PAGE, CANVAS, budget)
    spans = _record_spans(monkeypatch)

    outs = llm.generate(prompt_token_ids=[p for _, p, _ in reqs[:5]],
                        sampling_params=[s for _, _, s in reqs[:5]])
    assert [o.token_ids for o in outs] == [want[r] for r, _, _ in reqs[:5]]
    assert max(spans) <= shape.max_span


def test_the_triton_kernels_read_rings(checkpoint, workload):
    """The Triton attention and KV store over ring tables (a tile may start below a row's
    window, on a slot another position shares): three requests, prompts of 2 to 27 windows,
    the reference decoder's tokens."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    reqs, want = workload
    few = [reqs[0], reqs[3], reqs[4]]
    outs = _serve(str(checkpoint), few, "hybrid", "triton")["outs"]
    assert {r: o.outputs[0].token_ids for r, o in outs.items()} == {
        r: want[r] for r, _, _ in few}


def test_a_ring_too_short_for_its_span_fails_the_request_not_its_tokens(
        checkpoint, workload, monkeypatch):
    """The equality above depends on the ring's size: with one page fewer a forward would
    overwrite keys its own rows still read. Were the scheduler ever to build such a forward,
    the runner refuses it: its request ends with an error, the others with the reference's
    tokens (the batch is retried request by request)."""
    reqs, want = workload
    shape = RingShape.of(WINDOW, PAGE, CANVAS, 24)
    monkeypatch.setattr(RingShape, "of", classmethod(
        lambda cls, *a: cls(shape.pages - 1, shape.max_span)))
    outs = _serve(str(checkpoint), reqs, "hybrid")["outs"]
    failed = {r for r, o in outs.items() if o.error is not None}
    assert failed and "overflows a ring" in outs[min(failed)].error
    assert {r: o.outputs[0].token_ids for r, o in outs.items() if r not in failed} == {
        r: t for r, t in want.items() if r not in failed}


def test_aborted_requests_give_their_rings_back(checkpoint, workload):
    """Requests aborted mid-canvas free their pages of both kinds; the others finish with the
    reference's tokens."""
    reqs, want = workload
    aborted = ("r5", "r8", "r9")
    run = _serve(str(checkpoint), reqs, "hybrid", abort=aborted)
    outs = run["outs"]
    for rid in aborted:
        assert outs[rid].outputs[0].finish_reason == "abort"
    assert {r: o.outputs[0].token_ids for r, o in outs.items() if r not in aborted
            } == {r: t for r, t in want.items() if r not in aborted}
    pool = run["engine"].pool
    assert pool.allocator.num_used == 0 and pool.rings.allocator.num_used == 0


@pytest.mark.parametrize("layout,kill", [(dict(num_workers=2), 1),
                                         (dict(tensor_parallel_size=2), None)])
def test_worker_processes_with_rings(checkpoint, layout, kill, ours):
    """Colocated worker processes (one SIGKILLed mid-run: its requests restart their canvas on
    the other, with a ring of their own there) and a tensor-parallel pair (the rings' tables
    reach the other rank with the batch) give the reference's tokens under a hybrid pool."""
    g = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(8):
        prompt = torch.randint(2, VOCAB, ([150, 80, 20, 110][i % 4] + i,), generator=g).tolist()
        reqs.append((f"r{i}", prompt, SamplingParams(
            max_tokens=[8, 17][i % 2], seed=400 + i, max_denoising_steps=3,
            confidence_threshold=0.0, stop_at_eos=False)))
    run = run_in_mode(str(checkpoint), reqs, dict(layout, kv_pool="hybrid",
                                                  enable_prefix_caching=False), kill)
    assert {r: o.token_ids for r, o in run["outs"].items()} == reference_tokens(ours, reqs)
    assert run["dead"] == ([] if kill is None else [kill])


def test_auto_takes_the_hybrid_pool_where_it_can(checkpoint):
    """``--kv-pool auto`` (the default): a single pool while prefix caching is on (its default
    for DiffusionGemma), the hybrid pool with it off; ``hybrid`` turns the default prefix
    caching off."""
    def rings(**kw):
        return LLM(model=str(checkpoint), dtype="float64", page_size=PAGE,
                   **kw).engine.pool.rings

    assert rings() is None
    assert rings(enable_prefix_caching=False) is not None
    assert rings(kv_pool="hybrid") is not None
    assert rings(kv_pool="single", enable_prefix_caching=False) is None


@pytest.mark.parametrize("kw,match", [
    (dict(kv_pool="hybrid", enable_prefix_caching=True), "exclude each other"),
    (dict(kv_pool="hybrid", mode="disaggregated", prefill_workers=1, decode_workers=1),
     "colocated workers only"),
    (dict(kv_pool="ring"), "kv_pool must be one of"),
])
def test_what_the_hybrid_pool_cannot_serve_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_a_model_without_sliding_layers_refuses_the_hybrid_pool():
    with pytest.raises(ValueError, match="has no sliding-window layers"):
        LLM(model="sangam-demo", device="cpu", kv_pool="hybrid")


def test_the_memory_plan_holds_both_kinds_of_page(tmp_path):
    """DiffusionGemma-26B-A4B's geometry on one H100 with 4 seats: a single pool fits no
    131,072-token request; the hybrid pool fits four, its rings (one a seat) apart from the
    full layers' pages, and its largest forward bounded by the ring's span; docs/memory.md's
    DiffusionGemma rows are these plans."""
    import subprocess
    import sys

    from sangam.bench.memory import config_plan, memory_table, read_config_json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(root, "scripts", "diffusion_gemma_26b_config.py"),
                    str(tmp_path)], check=True, capture_output=True)
    raw = read_config_json(str(tmp_path))
    flags = dict(max_batch_size=4, max_model_len=131072)
    with pytest.raises(ValueError, match="no room for the KV pages of one 131072-token"):
        config_plan(raw, "h100", EngineConfig(**flags))
    plan = config_plan(raw, "h100", EngineConfig(kv_pool="hybrid", **flags))
    shape = RingShape.of(512, 16, 256, EngineConfig().token_budget)
    assert (plan.ring, plan.window_pages) == (shape.pages, 4 * shape.pages)
    assert plan.max_canvases == 4
    # A sliding page holds the 25 sliding layers' K/V, a full page the 5 full layers'.
    assert plan.window_page_bytes > 9 * plan.page_bytes
    table = memory_table("h100", (), EngineConfig(kv_pool="hybrid", **flags), (str(tmp_path),))
    assert "Sliding-window rings" in table and f"{4 * shape.pages:,} pages" in table
    # docs/memory.md's DiffusionGemma rows, single pool and hybrid, are these plans.
    doc = open(os.path.join(root, "docs", "memory.md")).read().split(
        "## DiffusionGemma (26B-A4B geometry)")[1]
    single, hybrid = doc.split("### The hybrid pool")
    checked = 0
    for section, kv_pool in ((single, "single"), (hybrid, "hybrid")):
        for line in section.splitlines():
            if not line.startswith("| H"):
                continue
            cells = [c.strip() for c in line.split("|")[1:-1]]
            gpu, seats, length, reserved, pages = cells[:5]
            engine = EngineConfig(kv_pool=kv_pool, max_batch_size=int(seats),
                                  max_model_len=int(length.replace(",", "")))
            checked += 1
            if cells[-1] == "no":
                with pytest.raises(ValueError, match="no room") as refused:
                    config_plan(raw, gpu.lower(), engine)
                said = re.search(r"reserved activations ([\d.]+) GiB.*KV pool (\d+) pages x 16 "
                                 r"= (\d+) tokens", str(refused.value))
                assert reserved == f"{float(said[1]):.1f} GiB", line
                assert pages == f"{int(said[2]):,} ({int(said[3]):,})", line
                continue
            p = config_plan(raw, gpu.lower(), engine)
            gib = 2 ** 30
            assert reserved == f"{p.reserved.total / gib:.1f} GiB", line
            assert pages == f"{p.num_pages:,} ({p.pool_tokens:,})", line
            assert cells[-1] == f"{p.max_canvases} × {length}", line
            if kv_pool == "hybrid":
                ring_gib = p.window_pages * p.window_page_bytes / gib
                assert cells[5] == f"{p.window_pages:,} pages ({ring_gib:.1f} GiB)", line
    assert checked == 14


def test_the_cpu_budget_pays_for_the_rings(checkpoint):
    """On the CPU the pool, rings and full pages together, fills --cpu-kv-cache-gb to within
    one full page."""
    budget = 0.002
    llm = LLM(model=str(checkpoint), dtype="float64", page_size=PAGE, max_batch_size=4,
              kv_pool="hybrid", cpu_kv_cache_gb=budget)
    pool = llm.engine.pool
    held = sum(t.numel() * t.element_size() for t in pool.kv.buffers)
    full = [b for b in pool.kv.buffers if b.shape[2] == pool.num_pages]
    full_page = sum(t[:, :, 0].numel() * t.element_size() for t in full)
    assert pool.rings is not None and len(full) < len(pool.kv.buffers)
    assert budget * 2**30 - full_page < held <= budget * 2**30


def test_released_rings_come_back_zeroed(checkpoint, workload):
    """The KV cache released and resumed (RL rollouts) comes back zeroed, as the hybrid pool
    starts (a ring's slot outside every query's bounds is read under a zero weight), and the
    next requests get the reference's tokens."""
    reqs, want = workload
    llm = LLM(model=str(checkpoint), dtype="float64", page_size=PAGE, token_budget=24,
              max_batch_size=4, kv_pool="hybrid")
    params = [p for _, _, p in reqs[:3]]
    prompts = [p for _, p, _ in reqs[:3]]
    first = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    pool = llm.engine.pool
    window = [pool.kv.k[i] for i in llm.engine.loaded.config.window_layers]
    assert any(k.abs().sum() > 0 for k in window)
    llm.release_memory_occupation(["kv_cache"])
    llm.resume_memory_occupation(["kv_cache"])
    assert all(k.abs().sum() == 0 for k in window)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first] == [
        want[rid] for rid, _, _ in reqs[:3]]


def test_an_fp8_kv_cache_in_rings(checkpoint, workload):
    """An FP8 KV cache (each page with its scales) in a hybrid pool: the rings' pages carry
    their scales as the single pool's do, so the tokens are the single FP8 pool's."""
    reqs, _ = workload
    few = reqs[:4]
    outs = {}
    for pool in ("single", "hybrid"):
        llm = LLM(model=str(checkpoint), dtype="float64", page_size=PAGE, token_budget=24,
                  max_batch_size=4, kv_pool=pool, enable_prefix_caching=False,
                  kv_cache_dtype="fp8")
        assert (llm.engine.pool.rings is not None) == (pool == "hybrid")
        outs[pool] = [o.token_ids for o in llm.generate(
            prompt_token_ids=[p for _, p, _ in few], sampling_params=[s for _, _, s in few])]
    assert outs["hybrid"] == outs["single"]
