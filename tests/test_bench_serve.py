"""``sangam-bench serve`` on a tiny checkpoint on CPU: it runs the engine on a Poisson trace for
two policies and writes the JSON, CSV, plot and step profile."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from sangam.bench.cli import main
from sangam.bench.sim import load_step_profile


def test_serve_writes_json_csv_png_and_profile(llada_path, tmp_path, capsys):
    out = tmp_path / "serve"
    threads = torch.get_num_threads()
    try:  # one thread: a tiny model's steps stay fast on a busy CPU (restored after)
        rc = main(["serve", "--model", llada_path, "--device", "cpu", "--dtype", "float32",
                   "--num-pages", "256", "--num-requests", "4", "--qps", "50",
                   "--length-scale", "0.02", "--block-length", "8", "--torch-threads", "1",
                   "--policies", "deficit,fastdllm", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    table = capsys.readouterr().out
    assert "deficit tau=1024" in table and "fastdllm" in table

    report = json.loads((out / "results.json").read_text())
    assert [s["config"] for s in report["summaries"]] == ["deficit tau=1024", "fastdllm"]
    for s in report["summaries"]:
        assert s["num_requests"] == 4 and s["qps"] == 50
        assert 0 < s["latency_p50"] <= s["latency_p99"]
        assert s["queueing_mean"] >= 0 and s["decode_mean"] > 0
        assert s["throughput_rps"] > 0 and s["tokens_per_forward"] >= 1
    fast = report["summaries"][1]
    assert fast["mean_batch"] == 1  # the baseline runs one request at a time

    with open(out / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and all(float(r["latency"]) > 0 for r in rows)
    # Every block of every request is decoded (ignore-eos), the same in both configurations:
    # batch invariance makes the forwards per request identical too.
    forwards = {}
    for r in rows:
        forwards.setdefault(r["id"], set()).add(r["forwards"])
    assert all(len(v) == 1 for v in forwards.values())

    assert (out / "latency_vs_qps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    profile = load_step_profile(str(out / "profile.json"))
    assert sum(profile.steps_per_block.values()) > 0


def _serve_tiny(model: str, out, *args: str) -> int:
    """``sangam-bench serve`` in-process on a tiny model, CPU, one torch thread (restored)."""
    threads = torch.get_num_threads()
    try:
        return main(["serve", "--model", model, "--device", "cpu", "--dtype", "float32",
                     "--num-pages", "256", "--length-scale", "0.05", "--block-length", "4",
                     "--torch-threads", "1", *args, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)


def test_compare_specs_set_their_requests_options(llada_path, tmp_path, capsys):
    """A --compare spec of a request default (here the refresh cadence) applies to that
    configuration's requests: fewer refreshes, so fewer prefill tokens; same forwards."""
    out = tmp_path / "serve"
    assert _serve_tiny(llada_path, out, "--num-requests", "4", "--qps", "50", "--unmasking",
                       "topk", "--compare", "", "refresh_interval=1000") == 0
    summaries = json.loads((out / "results.json").read_text())["summaries"]
    full, never = summaries
    assert never["config"].endswith("[refresh_interval=1000]")
    assert never["prefill_tokens"] < full["prefill_tokens"]
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    forwards = {}
    for r in rows:
        forwards.setdefault(r["id"], set()).add(r["forwards"])
    assert all(len(v) == 1 for v in forwards.values())  # topk 1: one forward per token


def test_compare_specs_take_request_overrides(llada_path, tmp_path, capsys):
    """A --compare spec may set SamplingParams fields that are no engine flag (min_threshold):
    that configuration's requests are load-adaptive and the run reports their mean threshold;
    a configuration without it reports none."""
    out = tmp_path / "serve"
    assert _serve_tiny(llada_path, out, "--num-requests", "6", "--qps", "100",
                       "--compare", "", "min_threshold=0.3") == 0
    plain, adaptive = json.loads((out / "results.json").read_text())["summaries"]
    assert adaptive["config"].endswith("[min_threshold=0.3]")
    assert plain["threshold_mean"] is None
    assert 0.3 <= adaptive["threshold_mean"] <= 0.9  # lowered from the default 0.9 with load
    assert "threshold" in capsys.readouterr().out
    with pytest.raises(ValueError, match="bad override"):
        main(["serve", "--model", llada_path, "--compare", "not_a_field=1"])


def test_serve_a_uniform_state_model(tmp_path, capsys):
    """DiffusionGemma (the Gemma demo): its requests take its own denoising defaults and whole
    canvases (24 positions each: every canvas decoded, ignore-eos); a masked decoding flag is
    refused by name."""
    out = tmp_path / "gemma"
    flags = ["serve", "--model", "sangam-demo-gemma", "--device", "cpu", "--dtype", "float32",
             "--num-pages", "256", "--torch-threads", "1", "--num-requests", "4", "--qps", "20",
             "--length-scale", "0.03"]
    threads = torch.get_num_threads()
    try:
        assert main([*flags, "--out", str(out)]) == 0
        with pytest.raises(SystemExit, match="--unmasking"):
            main([*flags, "--unmasking", "topk"])
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert all(int(r["canvas_tokens"]) % 24 == 0 and int(r["forwards"]) >= 1 for r in rows)
    assert json.loads((out / "profile.json").read_text())["block_length"] == 24
