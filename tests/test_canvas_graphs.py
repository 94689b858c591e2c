"""CUDA graphs for DiffusionGemma's canvas steps (engine/cuda_graphs.py, ``canvas``): a
canvas's later steps replay one graph per batch-size bucket, self-conditioning, key bounds and
(under a hybrid pool) the rings' tables among its static inputs.

On CPU the runners run their padded batches eagerly (``use_graphs=False``): the static buffers,
padding and row order are what the graphs replay, checked against the reference decoder in
float64. On a GPU the graphs are captured and replayed against the eager engine."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from sangam import LLM, SamplingParams  # noqa: E402
from sangam.config import EngineConfig  # noqa: E402
from sangam.decoding.uniform import UniformStateParams  # noqa: E402
from sangam.engine.cuda_graphs import DecodeGraphRunner  # noqa: E402
from sangam.engine.reference_canvas import generate_canvases  # noqa: E402
from sangam.engine.worker import captures_graphs, graph_plan  # noqa: E402
from sangam.models import load_model  # noqa: E402
from tests.gemma_checkpoint import (  # noqa: E402
    CANVAS,
    VOCAB,
    reference_tokens,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dgemma"))


def _workload(n: int = 11, seed: int = 7) -> list[tuple[str, list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"c{i}", torch.randint(2, VOCAB, (int(torch.randint(3, 70, (1,), generator=g)),),
                                    generator=g).tolist(),
             SamplingParams(max_tokens=[8, 17, 24][i % 3], seed=500 + i,
                            max_denoising_steps=[4, 6][i % 2], entropy_bound=[0.2, 2.0][i % 2],
                            confidence_threshold=[0.0, 5.0][i % 2], stability_threshold=i % 2,
                            stop_token_ids=[9 + i % 4], stop_at_eos=False))
            for i in range(n)]


@pytest.mark.parametrize("kv_pool", ["single", "hybrid"])
def test_padded_canvas_batches_give_the_reference_tokens(checkpoint, kv_pool):
    """Later canvas steps batched in buckets 1, 2, 4 and 5 through the runner's static
    buffers (padding requests see no key and store nothing): each request's tokens and
    forwards are the reference decoder's, with a single pool and with a hybrid one."""
    ours = load_model(checkpoint, dtype="float64")
    llm = LLM(model=str(checkpoint), dtype="float64", page_size=4, token_budget=24,
              max_batch_size=5, kv_pool=kv_pool, enable_prefix_caching=False)
    engine = llm.engine
    runner = DecodeGraphRunner(engine.loaded.model, engine.pool.kv, CANVAS, 5,
                               -(-engine.loaded.context_length // 4), engine.loaded.device,
                               use_graphs=False, canvas=True,
                               rings=engine.pool.rings is not None)
    assert runner.sizes == [1, 2, 4, 5]
    assert runner.split_counts == {b: [(1, 1)] for b in runner.sizes}  # off GPU: one split
    engine.runner.graphs = [runner]
    reqs, outs = _workload(), {}
    for rid, prompt, params in reqs:  # staggered: canvases at different steps
        engine.add_request(rid, prompt, params)
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    for rid, prompt, params in reqs:
        want = generate_canvases(ours, prompt, UniformStateParams(**params.uniform_given()),
                                 params.seed, params.max_tokens, params.stop_token_ids)
        out = outs[rid]
        assert out.outputs[0].token_ids == reference_tokens(ours, [(rid, prompt, params)])[rid]
        assert out.num_forwards - (out.metrics["num_refreshes"] - 1) == sum(want.forwards), rid
    assert runner.runs > 10, runner.runs


def test_canvas_steps_are_captured_on_a_gpu(checkpoint, monkeypatch):
    """The plan a GPU worker follows: canvas steps get graphs (span C, one runner), as other
    families' decode steps do; --enforce-eager and the reference backend do not."""
    llm = LLM(model=str(checkpoint), dtype="float64", page_size=4)
    loaded = llm.engine.loaded
    assert graph_plan(EngineConfig(), loaded) == [(CANVAS, CANVAS)]
    monkeypatch.setattr(loaded, "device", torch.device("cuda"))
    assert not captures_graphs(EngineConfig(), loaded)  # the torch backend reads the host
    monkeypatch.setattr(loaded.model.attention_backend, "name", "triton")
    assert captures_graphs(EngineConfig(), loaded)
    assert not captures_graphs(EngineConfig(enforce_eager=True), loaded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kv_pool", ["single", "hybrid"])
def test_canvas_graphs_match_eager(checkpoint, kv_pool):
    """On a GPU: the same requests through an eager engine and one replaying the canvas
    graphs give the same tokens and forwards, and the graphs run."""
    reqs = _workload()
    outs = {}
    for eager in (True, False):
        llm = LLM(model=str(checkpoint), device="cuda", dtype="float64", enforce_eager=eager,
                  num_pages=512, page_size=4, token_budget=24, max_batch_size=5,
                  kv_pool=kv_pool, enable_prefix_caching=False)
        graphs = llm.engine.runner.graphs
        assert [g.span for g in graphs] == ([] if eager else [CANVAS])
        done = llm.generate(prompt_token_ids=[p for _, p, _ in reqs],
                            sampling_params=[s for _, _, s in reqs])
        outs[eager] = [(o.token_ids, o.num_forwards) for o in done]
        if not eager:
            assert graphs[0].runs > 0
        llm.shutdown()
    assert outs[True] == outs[False]
