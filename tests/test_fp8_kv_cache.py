"""``--kv-cache-dtype fp8`` in the engine (docs/design.md §4.9): the engine's tokens equal the
single-request reference decoder's over an FP8 cache of its own (float64, so nothing but the
cache's FP8 values differs from the full-precision run), colocated, disaggregated (the pages
travel with their scales, at about half the bytes) and at TP2; the memory plan holds about
twice the pages."""

from __future__ import annotations

import random

import pytest
from test_multi_worker import (
    PAGE_SIZE,
    WORKLOADS,
    _options,
    _run,
    _settle,
    _tokens,
    _top_ids,
)

from sangam.bench.memory import shape_plan
from sangam.config import EngineConfig
from sangam.engine.front import tokens_per_forward
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.multi import make_engine
from sangam.engine.reference_decoder import ReferenceDecoder
from sangam.engine.validation import new_state
from sangam.models.config import fp8_scale_rows

REQUESTS = {"llada": WORKLOADS["llada"][:8], "dream": WORKLOADS["dream"][:8]}
_WANT: dict[str, dict] = {}


def _reference(path: str, arch: str) -> dict:
    """Each request's outcome from the reference decoder over FP8 pages."""
    if arch not in _WANT:
        lm = LoadedModel.load(EngineConfig(model=path, device="cpu", dtype="float64"))
        out = {}
        for rid, prompt, params, _, suffix in REQUESTS[arch]:
            st = new_state(lm, prompt, params, random.Random(0), suffix)
            ReferenceDecoder(lm.model, fp8_kv=True).run(st)
            tokens = st.output_token_ids()
            top = st.output_top_logprobs(len(tokens)) if params.logprobs else None
            out[rid] = (tokens, st.num_forwards, _top_ids(top), tokens_per_forward(st))
        _WANT[arch] = out
    return _WANT[arch]


@pytest.fixture(scope="module")
def paths(llada_path, dream_path):
    return {"llada": llada_path, "dream": dream_path}


LAYOUTS = {
    "colocated": dict(num_workers=1),
    "1P1D": dict(mode="disaggregated", prefill_workers=1, decode_workers=1),
    "tp2": dict(num_workers=1, tensor_parallel_size=2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_engine_equals_the_reference_over_fp8_pages(paths, arch, layout):
    want = _reference(paths[arch], arch)
    engine = make_engine(EngineConfig(**_options(paths[arch], **LAYOUTS[layout]),
                                      kv_cache_dtype="fp8"))
    try:
        assert _tokens(_run(engine, REQUESTS[arch])) == want
        cfg = engine.loaded.config
        heads = cfg.num_kv_heads // LAYOUTS[layout].get("tensor_parallel_size", 1)
        # A layer's K (or V) page: its token rows and scale rows, a byte a value.
        layer_page = (PAGE_SIZE + fp8_scale_rows(PAGE_SIZE, cfg.head_dim)) * max(
            heads, 1) * cfg.head_dim
        if layout == "colocated":  # in this process
            assert engine.pool.kv.page_bytes() == 2 * cfg.num_layers * layer_page
            assert engine.pool.allocator.num_used == 0
            return
        assert {s.layer_page_bytes for s in engine.worker_states()} == {layer_page}
        if layout == "1P1D":
            assert engine.transfers and all(t.ok for t in engine.transfers)
        _settle(engine)
    finally:
        engine.shutdown()


def test_fp8_differs_from_the_full_precision_cache_only_a_little(paths):
    """Not a bound on quality (docs/results.md measures that), but a check that the FP8 pages
    are read as what was written: most requests keep the full-precision tokens."""
    from test_multi_worker import _reference as full_reference

    want = full_reference(paths["llada"], "llada")
    got = _reference(paths["llada"], "llada")
    same = sum(got[rid][0] == want[rid][0] for rid in got)
    assert same >= len(got) // 2, (same, len(got))


def test_the_memory_plan_holds_about_twice_the_pages():
    full = shape_plan("llada", "h100")
    fp8 = shape_plan("llada", "h100", EngineConfig(kv_cache_dtype="fp8"))
    # LLaDA-8B: 128-wide heads, 2 bytes a value -> 1 byte, and a 17th row for the scales.
    assert fp8.page_bytes * 2 * 16 == full.page_bytes * 17
    assert fp8.num_pages > 1.8 * full.num_pages


def test_diffusion_gemma_on_fp8_pages_triton_equals_torch():
    """DiffusionGemma's two page shapes (sliding and full layers) in the FP8 layout: the
    Triton backend (interpreted) decodes the canvases the reference backend does."""
    import os

    from sangam import LLM, SamplingParams

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton half needs TRITON_INTERPRET=1")
    prompts = ["Reverse: sangam"]
    params = SamplingParams(max_tokens=16, seed=3)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model="sangam-demo-gemma", device="cpu", kv_cache_dtype="fp8",
                  attention_backend=backend)
        assert llm.engine.pool.kv.fp8 and len(llm.engine.pool.kv.buffers) == 2
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["torch"] == outs["triton"] and all(outs["torch"])
