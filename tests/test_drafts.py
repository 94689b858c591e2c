"""Streamed drafts (``SamplingParams.include_drafts``, ``stream_options.include_drafts``): after
each step that does not end its block, an output whose ``draft_token_ids`` are the block in
progress — a uniform-state canvas's argmax (transformers' ``put_draft``), a masked block's
committed tokens with each masked position's predicted token. Drafts never change a response."""

from __future__ import annotations

import pytest

from sangam import LLM, SamplingParams
from sangam.testing import make_tiny_checkpoint


def _run(llm: LLM, prompt: list[int], params: SamplingParams) -> list:
    engine, outs = llm.engine, []
    engine.add_request("r", prompt, params)
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return LLM(make_tiny_checkpoint(tmp_path_factory.mktemp("llada")), dtype="float64")


def test_masked_drafts(llada):
    """A masked block's draft: its committed tokens kept, the rest as predicted; a draft per
    step that leaves the block open, none otherwise; the response as without drafts."""
    params = dict(max_tokens=12, block_length=4, unmasking="topk", tokens_per_step=1,
                  stop_at_eos=False, seed=1)
    plain = _run(llada, [5, 6, 7], SamplingParams(**params))
    outs = _run(llada, [5, 6, 7], SamplingParams(**params, include_drafts=True))
    final = outs[-1]
    assert final.finished and final.token_ids == plain[-1].token_ids
    drafts = [o for o in outs if o.draft_token_ids is not None]
    assert [o for o in plain if o.draft_token_ids is not None] == []
    # One token a step, blocks of 4: three drafts per block, of 4 tokens each.
    assert len(drafts) == 9 and all(len(d.draft_token_ids) == 4 for d in drafts)
    for k, d in enumerate(drafts):
        block = final.token_ids[4 * (k // 3):4 * (k // 3 + 1)]
        assert d.token_ids == final.token_ids[:4 * (k // 3)]  # committed so far
        # The k-th draft of a block has k + 1 committed positions, which are final.
        assert sum(a == b for a, b in zip(d.draft_token_ids, block)) >= k % 3 + 1
        assert not d.finished and d.draft_text is None  # no tokenizer: no text


def test_uniform_state_drafts(monkeypatch, tmp_path):
    """DiffusionGemma: each step's argmax canvas, as the reference decoder's steps have it."""
    import torch

    import sangam.engine.reference_canvas as rc
    from sangam.decoding import uniform
    from sangam.models import load_model
    from tests.test_diffusion_gemma import write_checkpoint

    path = write_checkpoint(tmp_path / "dg")
    llm = LLM(str(path), dtype="float64")
    params = SamplingParams(max_tokens=16, seed=2, max_denoising_steps=4, entropy_bound=0.5,
                            confidence_threshold=0.0, stop_at_eos=False, include_drafts=True)
    outs = _run(llm, [3, 4, 5, 6], params)
    seen = []  # the reference's argmax after each step
    step = uniform.denoise_step

    def recording(canvas, *args):
        result = step(canvas, *args)
        seen.append((canvas.done, canvas.argmax.tolist()))
        return result

    monkeypatch.setattr(rc, "denoise_step", recording)
    ref = rc.generate_canvases(load_model(path, dtype="float64"), [3, 4, 5, 6],
                               uniform.UniformStateParams(4, 0.5, confidence_threshold=0.0), 2,
                               16)
    assert outs[-1].token_ids == ref.tokens
    drafts = [o.draft_token_ids for o in outs if o.draft_token_ids is not None]
    assert drafts == [argmax for done, argmax in seen if not done]
    assert len(drafts) == 2 * 3 and torch.is_tensor(torch.tensor(drafts))


def _gemma_drafts(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list, list]:
    outs = _run(llm, prompt, params)
    return outs[-1].token_ids, [o.draft_token_ids for o in outs if o.draft_token_ids is not None]


def test_drafts_from_worker_processes_and_an_abort(tmp_path):
    """Drafts are reports like any other: from worker processes (disaggregated: the canvas's
    steps move to the decode worker) they are the in-process engine's; a request aborted
    between drafts gives no more outputs and frees its pages, and its late reports are
    dropped."""
    from tests.test_diffusion_gemma import write_checkpoint

    path = str(write_checkpoint(tmp_path / "dg"))
    params = SamplingParams(max_tokens=16, seed=3, max_denoising_steps=4, entropy_bound=0.5,
                            confidence_threshold=0.0, stop_at_eos=False, include_drafts=True)
    local = LLM(path, dtype="float64")
    want = _gemma_drafts(local, [3, 4, 5, 6], params)
    assert len(want[1]) == 2 * 3
    remote = LLM(path, dtype="float64", mode="disaggregated", prefill_workers=1,
                 decode_workers=1)
    try:
        assert _gemma_drafts(remote, [3, 4, 5, 6], params) == want
        engine = remote.engine
        engine.add_request("gone", [3, 4, 5, 6], params)
        while not any(o.draft_token_ids for o in engine.step()):
            pass
        engine.abort_request("gone")
        for _ in range(20):  # the workers' reports of it still arrive: dropped
            assert [o for o in engine.step() if o.request_id == "gone"] == []
        assert not engine.has_unfinished_requests()
    finally:
        remote.shutdown()
    engine = local.engine
    engine.add_request("gone", [3, 4, 5, 6], params)
    while not any(o.draft_token_ids for o in engine.step()):
        pass
    engine.abort_request("gone")
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert local.engine.worker.builder.allocator.num_used == 0
