"""Simulator, cost model, traces and capacity search on cases computable by hand."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from sangam.bench.capacity import find_capacity
from sangam.bench.cli import main
from sangam.bench.cost_model import (
    GPUS,
    MODELS,
    Coefficients,
    CostModel,
    Span,
    fit_coefficients,
)
from sangam.bench.sim import (
    FixedSteps,
    GeometricSteps,
    ProfileSteps,
    SimConfig,
    simulate,
)
from sangam.bench.traces import (
    TraceRequest,
    arrivals,
    gamma_arrivals,
    load_csv,
    load_lengths,
    load_sharegpt,
    poisson_arrivals,
    synthetic_lengths,
)

TICK = 0.1
# Rates so high that the roofline terms vanish: every iteration lasts exactly the overhead.
CONSTANT = Coefficients(1e40, 1e40, 1e40, TICK, 0.0)


def run(cfg: SimConfig, trace: list[TraceRequest], tokens_per_step: int = 2):
    return simulate(cfg, trace, coefficients=CONSTANT, steps=FixedSteps(tokens_per_step))


def by_id(res) -> dict[int, dict]:
    return {r["id"]: r for r in res.records}


def test_one_request_alone_iterations_and_latency():
    # P=10, G=16, B=8, 2 tokens per step: each block is a refresh + 3 cached steps, 2 blocks.
    cfg = SimConfig(block_length=8, token_budget=1024)
    r = by_id(run(cfg, [TraceRequest(1.0, 10, 16)]))[0]
    assert r["forwards"] == 8
    assert r["latency"] == pytest.approx(8 * TICK)
    assert r["finish"] == pytest.approx(1.0 + 8 * TICK)
    assert r["queueing"] == pytest.approx(0.0)  # both refreshes start as soon as queued
    assert r["decode"] == pytest.approx(6 * TICK)  # 3 cached steps per block
    assert r["ttfb"] == pytest.approx(4 * TICK)
    assert r["canvas_tokens"] == 16


def test_refresh_cadence_changes_work_and_decode_time():
    """Four blocks of 8, 2 tokens per step: refreshing every 2nd block and fully every 2nd of
    those, blocks 1 and 3 start with a cached step and block 2 with a response-only refresh
    (span T - P): same forwards, fewer prefill tokens, more decode time."""
    trace = [TraceRequest(1.0, 10, 32)]
    full = run(SimConfig(block_length=8), trace)
    res = run(SimConfig(block_length=8, refresh_interval=2, prompt_refresh_interval=2), trace)
    (a,), (b,) = full.records, res.records
    assert a["forwards"] == b["forwards"] == 16
    assert res.workers[0]["prefill_tokens"] == 42 + 32  # one full refresh, one response-only
    assert full.workers[0]["prefill_tokens"] == 4 * 42
    assert b["decode"] == pytest.approx(a["decode"] + 2 * TICK)  # two blocks without a refresh
    with pytest.raises(ValueError, match="need a cache"):
        SimConfig(cache="none", refresh_interval=2)

    # Adaptive refresh: rate 1 refreshes every block fully (as the default cadence), rate 0.5
    # some, in every mode; the same draws on a rerun.
    trace = [TraceRequest(0.1 * i, 10, 64) for i in range(12)]
    work = {}
    for mode, workers in (("colocated", {}), ("disaggregated", {"prefill_workers": 1,
                                                                 "decode_workers": 1})):
        for rate in (0.0, 0.5, 1.0):
            cfg = SimConfig(block_length=8, refresh_interval=1000, adaptive_refresh_rate=rate,
                            mode=mode, **workers)
            work[mode, rate] = sum(w["prefill_tokens"] for w in run(cfg, trace).workers)
        assert work[mode, 0.0] == 12 * 74 < work[mode, 0.5] < work[mode, 1.0] == 12 * 8 * 74
    cfg = SimConfig(block_length=8, refresh_interval=1000, adaptive_refresh_rate=0.5)
    assert run(cfg, trace).records == run(cfg, trace).records


def test_refresh_cadence_experiment_reports_capacity_against_batch1(tmp_path, capsys):
    from sangam.bench.experiments import EXPERIMENTS
    from sangam.bench.sim.cli import EXPERIMENT_NAMES

    assert EXPERIMENT_NAMES == tuple(EXPERIMENTS)
    assert main(["sim", "--experiment", "refresh-cadence", "--num-requests", "16", "--qps",
                 "0.5", "--adaptive-refresh-rate", "0.3", "--out", str(tmp_path)]) == 0
    caps = json.loads((tmp_path / "results.json").read_text())["capacity_qps"]
    every = {k: v for k, v in caps.items() if k.startswith("tau=1024")}
    assert len(every) == 8 and caps["fastdllm (batch 1)"] < every[
        "tau=1024 refresh every 1, full every 1"] < every["tau=1024 refresh every 2, full every 1"]
    assert every["tau=1024 adaptive refresh, 0.3 of boundaries"] > every[
        "tau=1024 refresh every 2, full every 1"]  # fewer refreshes than every other block
    assert "sustains" in capsys.readouterr().out


def test_adaptive_tau_experiment_compares_against_the_static_sweep(tmp_path, capsys):
    assert main(["sim", "--experiment", "adaptive-tau", "--num-requests", "12", "--qps", "2",
                 "--out", str(tmp_path)]) == 0
    worst = json.loads((tmp_path / "results.json").read_text())["worst_ratio"]
    assert len(worst) == 6 and "tau=16384" in worst
    for label, scores in worst.items():
        assert len(scores) == 6 and scores["both_latency_p99"] == max(
            scores["sharegpt_latency_p99"], scores["arxiv_latency_p99"])
        if label.startswith("tau="):  # the best static at a load is one of them: ratio >= 1
            assert min(scores.values()) >= 1.0
    assert min(worst[f"tau={t}"]["arxiv_latency_mean"] for t in (512, 1024, 2048, 4096, 16384)
               ) == 1.0  # one load only (--qps 2): its best static tau scores exactly 1
    assert "worst latency ratio" in capsys.readouterr().out


def test_output_shorter_than_canvas_stops_after_its_block():
    cfg = SimConfig(block_length=8, max_tokens=64)  # canvas 64, output 12: blocks 0 and 1
    r = by_id(run(cfg, [TraceRequest(0.0, 10, 12)], tokens_per_step=8))[0]
    assert r["forwards"] == 2 and r["latency"] == pytest.approx(2 * TICK)


def test_deficit_budget_delays_a_large_prefill_by_known_iterations():
    # A (T=40) is seated from t=0 with a 32-token decode span, so each iteration adds
    # tau - 32 = 68 tokens to the budget; B (T=200) arrives at 0.05.
    # it0 (t=0):   A admitted, deficit = 100 - 40 = 60
    # it1 (t=0.1): remaining 68 + 60 = 128 < 200 -> wait
    # it2 (t=0.2): 68 + 128 = 196 < 200 -> wait
    # it3 (t=0.3): 68 + 196 = 264 >= 200 -> B admitted
    trace = [TraceRequest(0.0, 8, 32), TraceRequest(0.05, 168, 32)]
    cfg = SimConfig(block_length=32, token_budget=100)
    recs = by_id(run(cfg, trace, tokens_per_step=1))
    assert recs[1]["queueing"] == pytest.approx(0.3 - 0.05)
    assert recs[0]["latency"] == pytest.approx(32 * TICK)  # never displaced: 32 forwards
    assert recs[1]["finish"] == pytest.approx(0.3 + 32 * TICK)
    # Prefill-first admits B at the first iteration after it arrives.
    first = by_id(run(SimConfig(block_length=32, policy="prefill_first"), trace, 1))
    assert first[1]["queueing"] == pytest.approx(0.1 - 0.05)


def test_fastdllm_runs_one_request_at_a_time():
    trace = [TraceRequest(0.0, 10, 16), TraceRequest(0.0, 10, 16)]
    recs = by_id(run(SimConfig(block_length=8, policy="fastdllm"), trace))
    assert sorted(r["finish"] for r in recs.values()) == pytest.approx([8 * TICK, 16 * TICK])


@pytest.mark.parametrize("layerwise", [False, True])
def test_disaggregated_transfer_time(layerwise):
    # 1P1D: per block, a refresh on the prefill worker, the K/V transfer, 3 cached steps.
    cfg = SimConfig(mode="disaggregated", prefill_workers=1, decode_workers=1, block_length=8,
                    link="network", layerwise_kv_streaming=layerwise)
    r = by_id(run(cfg, [TraceRequest(0.0, 10, 16)]))[0]
    xfer = 32 * MODELS["llada"].kv_bytes_per_token() / 25e9  # 26 positions: 2 pages of 16
    # Streamed: the last layer's share is all that outlasts the (longer) refresh forward.
    exposed = xfer / MODELS["llada"].layers if layerwise else xfer
    assert r["transfer"] == pytest.approx(2 * exposed)
    assert r["latency"] == pytest.approx(8 * TICK + 2 * exposed)
    assert r["forwards"] == 8


def test_hybrid_overflows_onto_the_decode_worker():
    # theta = 1: once the prefill worker holds any outstanding prefill, the next one overflows
    # onto the idle decode worker and refreshes there (no transfer).
    cfg = SimConfig(mode="hybrid", prefill_workers=1, decode_workers=1, block_length=8,
                    overflow_threshold=1)
    trace = [TraceRequest(0.0, 10, 8), TraceRequest(0.0, 10, 8)]
    res = run(cfg, trace, tokens_per_step=8)  # one refresh finishes each request
    recs = by_id(res)
    assert recs[0]["latency"] == pytest.approx(TICK) and recs[1]["latency"] == pytest.approx(TICK)
    assert [w["iterations"] for w in res.workers] == [1, 1]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "hybrid"])
def test_small_kv_pool_finishes_everything(mode):
    """Memory-blocked admissions (colocated) and requests waiting for a decode worker's pages
    (disaggregated) still all finish, in any mode."""
    lengths = synthetic_lengths("sharegpt", 40, seed=3, max_total=1024)
    times = arrivals(40, 50.0, seed=4)
    trace = [TraceRequest(t, s.prompt_len, s.gen_len) for s, t in zip(lengths, times)]
    cfg = SimConfig(mode=mode, num_workers=2, prefill_workers=1, decode_workers=1,
                    num_pages=200, overflow_threshold=512)  # 200 pages: ~3 canvases
    res = simulate(cfg, trace, steps=GeometricSteps(3.25))
    assert len(res.records) == 40
    assert all(r["latency"] > 0 for r in res.records)


def test_request_that_can_never_fit_is_refused():
    with pytest.raises(ValueError, match="never fit"):
        run(SimConfig(num_pages=2), [TraceRequest(0.0, 100, 32)])


def test_simulation_is_seeded():
    lengths = synthetic_lengths("arxiv", 30, seed=1)
    trace = [TraceRequest(t, s.prompt_len, s.gen_len)
             for s, t in zip(lengths, arrivals(30, 2.0, seed=2))]
    cfg = SimConfig(mode="hybrid", overflow_threshold=2048)
    a = simulate(cfg, trace).records
    assert a == simulate(cfg, trace).records
    assert a != simulate(SimConfig(mode="hybrid", overflow_threshold=2048, seed=9), trace).records


# Step models.
def test_step_models_cover_the_block():
    rng = random.Random(0)
    geo = GeometricSteps(3.25)
    blocks = [geo.block_commits(rng, 32) for _ in range(4000)]
    assert all(sum(b) == 32 and min(b) >= 1 for b in blocks)
    steps = np.mean([len(b) for b in blocks])
    assert 9.5 < steps < 11  # ~32 / 3.25 plus the truncated last step
    assert FixedSteps(5).block_commits(rng, 12) == [5, 5, 2]
    prof = ProfileSteps({4: 1})
    assert prof.block_commits(rng, 10) == [3, 3, 2, 2]


# Cost model.
def test_cost_model_roofline_regimes():
    geom, gpu = MODELS["llada"], GPUS["h100"]
    cm = CostModel(geom, Coefficients.defaults(gpu))
    c = cm.coeffs
    one = cm.iteration_time([Span(32, 1024, 32)])
    # A single cached step is memory-bound: reading the weights dominates.
    weights = geom.layers * geom.layer_params * 2 / c.hbm_bytes_per_s
    assert weights < one < weights * 1.8 + c.iteration_overhead_s
    # A long refresh is compute-bound: time ~ linearly in tokens.
    t2k = cm.iteration_time([Span(2048, 2048, 32)])
    t4k = cm.iteration_time([Span(4096, 4096, 32)])
    assert 2.0 < t4k / t2k < 2.6  # linear part doubles, attention quadruples
    # Batching decodes is nearly free while memory-bound.
    assert cm.iteration_time([Span(32, 1024, 32)] * 8) < 1.5 * one
    assert geom.kv_bytes_per_token() == 512 * 1024
    assert MODELS["dream"].kv_bytes_per_token() == 56 * 1024


def test_fit_recovers_known_coefficients():
    geom = MODELS["dream"]
    truth = Coefficients(6e14, 3e14, 2.5e12, 4e-3, 2e-5)
    cm = CostModel(geom, truth)
    comps = [[Span(t, t, 32)] for t in (256, 1024, 4096)]
    comps += [[Span(32, kv, 32)] * n for kv in (512, 2048) for n in (1, 16, 64)]
    comps += [[Span(1024, 1024, 32)] + [Span(32, 1024, 32)] * 16]
    points = [(c, cm.iteration_time(c)) for c in comps]
    fitted, err = fit_coefficients(geom, points, Coefficients.defaults(GPUS["h200"]))
    assert err < 0.02
    fit_cm = CostModel(geom, fitted)
    for c, t in points:
        assert fit_cm.iteration_time(c) == pytest.approx(t, rel=0.05)


def test_calibration_file_round_trip(tmp_path):
    path = tmp_path / "calib.json"
    coeffs = Coefficients(1e14, 5e13, 1e12, 1e-3, 1e-5)
    path.write_text(json.dumps({"coefficients": coeffs.to_dict()}))
    assert Coefficients.load(path) == coeffs


# Traces.
@pytest.mark.parametrize("shape, prompt, gen", [("sharegpt", 795, 266), ("arxiv", 2827, 162)])
def test_synthetic_traces_have_the_paper_medians(shape, prompt, gen):
    s = synthetic_lengths(shape, 20000, seed=0)
    assert np.median([x.prompt_len for x in s]) == pytest.approx(prompt, rel=0.05)
    assert np.median([x.gen_len for x in s]) == pytest.approx(gen, rel=0.05)
    assert max(x.prompt_len + x.gen_len for x in s) <= 4096
    assert min(min(x.prompt_len, x.gen_len) for x in s) >= 4
    assert synthetic_lengths(shape, 50, seed=0) == s[:50]  # seeded: a prefix of the same draw
    assert synthetic_lengths(shape, 50, seed=1) != s[:50]


def test_arrival_processes_are_seeded_with_the_right_rate():
    t = poisson_arrivals(20000, 4.0, seed=0)
    gaps = np.diff([0.0, *t])
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)
    assert t == poisson_arrivals(20000, 4.0, seed=0)
    g = np.diff([0.0, *gamma_arrivals(20000, 4.0, cv=3.0, seed=0)])
    assert np.mean(g) == pytest.approx(0.25, rel=0.1)
    assert np.std(g) / np.mean(g) == pytest.approx(3.0, rel=0.1)
    assert arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_sharegpt_and_csv_loaders(tmp_path):
    convs = [
        {"conversations": [{"from": "human", "value": "x" * 40},
                           {"from": "gpt", "value": "y" * 81}]},
        {"conversations": [{"from": "human", "value": "too short reply"},
                           {"from": "gpt", "value": "no"}]},  # dropped: reply < 4 tokens
        {"conversations": [{"from": "gpt", "value": "starts with the model"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    got = load_sharegpt(path)
    assert [(s.prompt_len, s.gen_len) for s in got] == [(10, 21)]  # ceil(chars / 4)
    words = load_sharegpt(path, count_tokens=lambda text: len(text) // 10 + 3)
    assert [(s.prompt_len, s.gen_len, s.prompt) for s in words] == [(7, 11, "x" * 40)]
    csv_path = tmp_path / "trace.csv"
    csv_path.write_text('prompt_len,gen_len,messages\n5,7,"[{""role"": ""user"", '
                        '""content"": ""hi""}]"\n9,3,\n')
    rows = load_csv(csv_path)
    assert [(s.prompt_len, s.gen_len, s.prompt) for s in rows] == [(5, 7, "hi"), (9, 3, None)]
    many = load_lengths(str(csv_path), 5, seed=0)  # reused in a seeded order
    assert len(many) == 5 and {s.prompt_len for s in many} == {5, 9}


# Capacity search.
def test_capacity_finds_a_known_threshold():
    cap = 7.3  # latency 1 / (cap - q): the SLO of 2 s holds up to q = cap - 0.5
    latency = lambda q: 1.0 / (cap - q) if q < cap else math.inf  # noqa: E731
    res = find_capacity(latency, 2.0, qps_start=1.0, rel_tol=0.01)
    assert 6.8 * 0.99 <= res.qps <= 6.8
    assert [round(q) for q, _, _ in res.probes[:4]] == [1, 2, 4, 8]  # doubling first
    low = find_capacity(latency, 2.0, qps_start=50.0, rel_tol=0.01)  # halving down first
    assert 6.8 * 0.99 <= low.qps <= 6.8
    assert find_capacity(lambda q: 0.0, 1.0, max_qps=64).qps == 64
    assert find_capacity(lambda q: 10.0, 1.0).qps == 0.0


# Command line.
def test_sim_cli_writes_outputs(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["sim", "--num-requests", "20", "--qps", "1,4", "--policies", "deficit,fastdllm",
                 "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "1C tau=1024" in table and "1C fastdllm" in table
    report = json.loads((out / "results.json").read_text())
    assert len(report["summaries"]) == 4
    assert (out / "latency_vs_qps.png").stat().st_size > 1000
    assert len((out / "requests.csv").read_text().splitlines()) == 1 + 4 * 20


def test_capacity_cli_on_the_simulator(tmp_path, capsys):
    path = tmp_path / "cap.json"
    assert main(["capacity", "--slo-mean", "5", "--qps-start", "0.5", "--rel-tol", "0.2",
                 "--json", str(path), "sim", "--num-requests", "30"]) == 0
    result = json.loads(path.read_text())["results"]["1C tau=1024"]
    assert result["qps"] > 0
    assert all(p["value"] <= 5 for p in result["probes"] if p["qps"] <= result["qps"])


def _fake_serve_run(path, sim_report, records, lengthen: int = 0):
    """A serve output directory holding the simulated points as if measured (latency x 2)."""
    from sangam.bench.report import write_outputs

    configs = {"fastdllm": {"policy": "fastdllm", "token_budget": 1024.0},
               "deficit tau=64": {"policy": "deficit", "token_budget": 64.0}}
    labels = {"1C fastdllm": "fastdllm", "1C tau=64": "deficit tau=64"}
    summaries = [{**s, "config": labels[s["config"]], "latency_mean": 2 * s["latency_mean"],
                  "latency_p99": 2 * s["latency_p99"]} for s in sim_report["summaries"]]
    rows = [{**r, "config": labels[r["config"]]} for r in records]
    rows[0]["gen_len"] += lengthen
    write_outputs(path, {"kind": "serve", "configs": configs, "summaries": summaries},
                  summaries, rows)


def test_sim_against_a_measured_run_pairs_policies_and_checks_the_requests(tmp_path, capsys):
    import csv

    calib = tmp_path / "calib.json"
    geom = {"name": "small", "hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2,
            "intermediate": 512, "vocab": 1000}
    calib.write_text(json.dumps({"coefficients": Coefficients(1e11, 5e10, 1e10, 1e-3, 0)
                                 .to_dict(), "geometry": geom, "dtype_bytes": 4}))
    common = ["sim", "--model", "calibrated", "--calibration", str(calib), "--num-pages", "512",
              "--num-requests", "5", "--length-scale", "0.05", "--qps", "2", "--block-length",
              "8", "--policies", "deficit,fastdllm", "--token-budget", "64"]
    assert main([*common, "--out", str(tmp_path / "sim")]) == 0
    sim = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert sim["against"] is None and sim["length_scale"] == 0.05
    with open(tmp_path / "sim" / "requests.csv") as f:
        records = [{**r, "prompt_len": int(r["prompt_len"]), "gen_len": int(r["gen_len"])}
                   for r in csv.DictReader(f)]
    assert max(r["prompt_len"] for r in records) < 400  # scaled: ShareGPT's are ~800
    for lengthen, same in ((0, True), (1, False)):
        serve = tmp_path / f"serve{lengthen}"
        _fake_serve_run(serve, sim, records, lengthen)
        capsys.readouterr()
        assert main([*common, "--against", str(serve), "--out", str(tmp_path / "again")]) == 0
        assert "simulated against measured" in capsys.readouterr().out
        rows = json.loads((tmp_path / "again" / "results.json").read_text())["against"]
        assert sorted(r["config"] for r in rows) == ["deficit tau=64", "fastdllm"]
        for r in rows:
            assert r["mean_ratio"] == pytest.approx(0.5) and r["p99_ratio"] == pytest.approx(0.5)
        assert sorted(r["same_requests"] for r in rows) == sorted([True, same])
    with pytest.raises(SystemExit, match="needs --calibration"):
        main(["sim", "--model", "calibrated", "--num-requests", "2"])
    with pytest.raises(SystemExit, match="not the output of an in-process"):
        main([*common, "--against", str(tmp_path / "sim")])


def test_calibrate_cut_short_keeps_a_usable_calibration(tmp_path, monkeypatch):
    """A calibration cut by a time limit (the prepared GPU run's) keeps the points it measured,
    fitted, so the simulator step after it still runs (issue #36)."""
    from sangam.bench import calibrate

    measured = []
    real = calibrate._Timer.seconds

    def seconds(self, spans, reps):
        if len(measured) == 4:
            raise KeyboardInterrupt  # the time limit strikes
        measured.append(spans)
        return real(self, spans, reps)

    monkeypatch.setattr(calibrate._Timer, "seconds", seconds)
    out = tmp_path / "calibration.json"
    with pytest.raises(KeyboardInterrupt):
        main(["calibrate", "--device", "cpu", "--max-len", "128", "--block-length", "8",
              "--reps", "1", "--torch-threads", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] is False and len(data["points"]) == 4
    assert Coefficients.load(out).iteration_overhead_s >= 0


# Block-causal models (SDAR).
def test_block_causal_request_prefills_once_and_steps_its_blocks():
    # P=10, 12 tokens, B=4: the grid puts block 0 at [8, 12) (2 masks), blocks to position 24:
    # 4 blocks. 2 tokens per step: block 0 takes 1 forward (the prefill [0, 12)), blocks 1-3
    # two each (their first spans 8: the finished block and the new one).
    cfg = SimConfig(model="sdar", block_length=4)
    res = run(cfg, [TraceRequest(0.0, 10, 12)])
    r = by_id(res)[0]
    assert r["forwards"] == 7 and r["latency"] == pytest.approx(7 * TICK)
    assert res.workers[0]["prefill_tokens"] == 12  # one prefill, no refresh ever after
    with pytest.raises(ValueError, match="block-causal"):
        SimConfig(model="sdar", mode="hybrid")
    with pytest.raises(ValueError, match="block-causal"):
        SimConfig(model="sdar", refresh_interval=2)


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    # A (P=2, prefill 4) is admitted at t=0 with B (P=200, prefill 204) not yet there, leaving
    # a deficit of 60. tau = 64; whole-prompt waits until the deficit covers 204 tokens.
    # Chunked: t=0.1, 60 carried + 64 - 4 (A's step) = 120 -> chunk [0, 120); t=0.2, 64 - 8
    # (A's first step of a block) = 56 -> chunk [120, 176); t=0.3, the rest (28, with block 0)
    # fits whole: two chunks.
    trace = [TraceRequest(0.0, 2, 40), TraceRequest(0.05, 200, 8)]
    whole = run(SimConfig(model="sdar", block_length=4, token_budget=64), trace, 1)
    chunked = run(SimConfig(model="sdar", block_length=4, token_budget=64,
                            enable_chunked_prefill=True), trace, 1)
    w, c = by_id(whole), by_id(chunked)
    assert w[1]["forwards"] == 8 and c[1]["forwards"] == 8 + 2  # its chunks are forwards too
    assert whole.workers[0]["prefill_tokens"] == chunked.workers[0]["prefill_tokens"] == 204 + 4
    # A steps every iteration whatever B does: 2 masks in block 0, 4 in each of 10 more.
    assert w[0]["forwards"] == c[0]["forwards"] == 42


def test_block_causal_attention_counts_the_keys_each_query_sees():
    # A prefill of 3 blocks of 4 from position 0: queries of block j see 4(j + 1) keys.
    assert Span(12, 12, 0, causal_block=4).attention_pairs == 4 * (4 + 8 + 12)
    assert Span(8, 24, 4, causal_block=4).attention_pairs == 4 * 20 + 4 * 24  # a block step
    assert Span(8, 24, 4).attention_pairs == 8 * 24


def test_block_causal_experiment(tmp_path, capsys):
    assert main(["sim", "--experiment", "block-causal", "--num-requests", "12", "--qps", "2",
                 "--out", str(tmp_path)]) == 0
    panels = json.loads((tmp_path / "results.json").read_text())["panels"]
    assert len(panels) == 4 and all(len(p["capacity_qps"]) == 4 for p in panels.values())
    assert "sustains" in capsys.readouterr().out
