"""`sangam-bench graphs`: the decode-iteration benchmark runs (graphs themselves need a GPU)."""

import argparse
import json

import pytest
import torch

from sangam.bench import graphs
from sangam.bench.cli import main
from sangam.models.registry import MODEL_SHAPES, ModelShape


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path captures graphs")
def test_cpu_run_times_the_eager_engine(tmp_path, capsys):
    out = tmp_path / "graphs.json"
    assert main(["graphs", "--batch-sizes", "1,4,64", "--blocks", "1", "--rounds", "1",
                 "--json", str(out)]) == 0
    assert "CUDA graphs need one" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]  # 64 is beyond the demo's scale
    for r in rows:  # a block of 8 on the demo: a refresh, then 7 decode-only iterations
        assert r["graphs_ms"] is None and r["eager_ms"] > 0
        assert r["iterations"] == {"eager": 7}


def test_random_weight_engine_times_decode_iterations(monkeypatch):
    """The GPU run's model and engines, at a tiny geometry on the CPU."""
    tiny = ModelShape("tiny", "llada", 64, 2, 4, 2, 128, 160, 16)
    monkeypatch.setitem(MODEL_SHAPES, "llada", tiny)
    loaded = graphs._random_loaded("llada", torch.device("cpu"), block_length=8)
    assert loaded.default_params().block_length == 8  # the span graphs are captured for
    args = argparse.Namespace(batch_sizes=[3], prompt_len=20, blocks=2, block_length=8,
                              page_size=16)
    engine = graphs._engine(loaded, args, eager=False)
    seconds = graphs.decode_iteration_seconds(engine, 3, 20, 2, 8)
    assert len(seconds) == 2 * 7 and min(seconds) > 0
    assert not engine.has_unfinished_requests()
    assert engine.pool.allocator.num_free == engine.pool.num_pages
