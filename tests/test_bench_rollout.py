"""``sangam-bench rollout`` (docs/rollouts.md): its upstream baseline decodes what the engine
decodes (Fast-dLLM's loop and the engine share the threshold rule, DualCache and the noise, so
each response's tokens up to its stop are the engine's, greedy and sampled), and the command
prints its table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sangam import LLM
from sangam.bench.cli import main
from sangam.bench.rollout import UpstreamBatchedGenerate, rollout_requests


@pytest.mark.parametrize("temperature", [0.0, 3.0])
def test_upstream_loop_decodes_the_engines_tokens(temperature):
    llm = LLM(model="sangam-demo", device="cpu", dtype="float64")
    params = dataclasses.replace(llm.get_default_sampling_params(), temperature=temperature,
                                 cache="dual", seed=5)
    requests = rollout_requests(llm, ("reverse", "count"), 4, 3, params)
    outs = llm.generate(prompt_token_ids=[ids for _, ids, _ in requests],
                        sampling_params=[p for _, _, p in requests])
    upstream = UpstreamBatchedGenerate(llm.engine.loaded.model).generate(
        [ids for _, ids, _ in requests], [p.seed for _, _, p in requests], params.max_tokens,
        params.block_length, params.threshold, params.temperature)
    stop = llm.engine.loaded.stop_ids
    for out, tokens in zip(outs, upstream):
        tokens = tokens.tolist()
        cut = next((i for i, t in enumerate(tokens) if t in stop), len(tokens))
        assert tokens[:cut] == out.token_ids
    if temperature > 0:  # some prompt's samples differ (the demo is sure of most answers)
        assert any(len({tuple(o.token_ids) for o in outs[k:k + 3]}) > 1
                   for k in range(0, len(outs), 3))


def test_upstream_loop_refuses_other_models(tmp_path):
    from sangam.testing import make_tiny_checkpoint

    llm = LLM(model=make_tiny_checkpoint(tmp_path, arch="dream"), device="cpu")
    with pytest.raises(ValueError, match="LLaDA"):
        UpstreamBatchedGenerate(llm.engine.loaded.model)


def test_command_prints_its_table(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    assert main(["rollout", "--prompts", "2", "--samples", "2", "--concurrency", "2,4",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 rollouts (2 prompts x 2 samples)" in text and "upstream tok/s" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [2, 4]
    assert all(r["sangam"]["tokens_per_s"] > 0 and r["ratio"] > 0 for r in rows)
