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
    with_shared_prompts,
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
        SimConfig(model="sdar", refresh_interval=2)


@pytest.mark.parametrize("layout", [
    dict(mode="disaggregated", prefill_workers=1, decode_workers=2),
    dict(mode="hybrid", prefill_workers=1, decode_workers=2, overflow_threshold=8)])
def test_block_causal_requests_prefill_once_in_every_mode(layout):
    """Disaggregated and hybrid: each request's one prefill, then its blocks where its K/V went;
    the same forwards as colocated, and no prefill again."""
    trace = [TraceRequest(0.05 * i, 10 + 3 * i, 12) for i in range(8)]
    colocated = run(SimConfig(model="sdar", block_length=4), trace)
    moved = run(SimConfig(model="sdar", block_length=4, **layout), trace)
    assert [r["forwards"] for r in by_id(moved).values()] == \
        [r["forwards"] for r in by_id(colocated).values()]
    assert sum(w["prefill_tokens"] for w in moved.workers) == \
        colocated.workers[0]["prefill_tokens"]
    if layout["mode"] == "disaggregated":
        assert all(r["transfer"] > 0 for r in by_id(moved).values())


def test_the_simulators_prefix_cache_computes_shared_prompt_blocks_once():
    """A shared system prompt (``--shared-prefix``) and n samples (``--samples``): cached
    blocks are not computed again, as in the engine; off, every prefill is whole."""
    spaced = [TraceRequest(1.0 * i, 40, 8) for i in range(4)]  # each after the last finished
    shared = with_shared_prompts(spaced, 32, 1, 1000, 0)
    samples = with_shared_prompts(spaced[:1], 0, 4, 1000, 0)
    assert len(samples) == 4 and samples[0].prompt == samples[3].prompt
    assert all(t.prompt[:32] == shared[0].prompt[:32] for t in shared)
    assert len({tuple(t.prompt[32:]) for t in shared}) == 4
    for trace, cached in ((shared, 32), (samples, 40)):
        on = run(SimConfig(model="sdar", block_length=4, page_size=4), trace)
        off = run(SimConfig(model="sdar", block_length=4, page_size=4,
                            enable_prefix_caching=False), trace)
        assert off.workers[0]["prefill_tokens"] == 4 * 44  # [0, 44): the prompt and block 0
        assert on.workers[0]["prefill_tokens"] == 44 + 3 * (44 - cached)
        assert [r["forwards"] for r in by_id(on).values()] == \
            [r["forwards"] for r in by_id(off).values()]
    with pytest.raises(ValueError, match="block-causal"):
        SimConfig(model="llada", enable_prefix_caching=True)


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
    results = json.loads((tmp_path / "results.json").read_text())
    panels = results["panels"]
    assert len(panels) == 4 and all(len(p["capacity_qps"]) == 4 for p in panels.values())
    modes = results["modes"]  # 8 GPUs: colocated, disaggregated and hybrid rows
    assert len(modes) == 2 and all(set(m["saturation_qps"]) == {
        "colocated 8C", "disaggregated 5P3D", "hybrid 5P3C"} for m in modes.values())
    out = capsys.readouterr().out
    assert "sustains" in out and "serving modes, 8 GPUs" in out


# Commit profiles (sangam-bench quality --profiles) and the load-adaptive threshold.
def _profile_entry(forwards: int, threshold: float = 0.9, cadence: tuple[int, int] = (1, 1),
                   confidence: float = 0.0, rate: float | None = None, blocks: int = 40,
                   accuracy: float = 0.9) -> dict:
    """A quality profile whose blocks of 16 all took ``forwards`` forwards, 4 block indices."""
    return {"accuracy": accuracy, "block_agreement": accuracy + 0.05, "block_length": 16,
            "threshold": threshold, "min_threshold": None, "unmasking": "threshold",
            "cache": "dual", "refresh_interval": cadence[0],
            "prompt_refresh_interval": cadence[1], "refresh_confidence": confidence,
            "blocks": 4 * blocks, "forwards": 4 * blocks * forwards,
            "tokens_per_forward": 16 / forwards, "boundary_refresh_rate": rate,
            "forwards_per_block": [{str(forwards): blocks}] * 4,
            "refreshed_per_block": [[blocks, blocks]] * 4}


def _write_profiles(path, modes: dict[str, dict]) -> str:
    path.write_text(json.dumps({"model": "m", "block_length": 16, "modes": modes}))
    return str(path)


def test_profile_steps_keep_tokens_per_forward_at_another_block_length():
    from sangam.bench.sim.steps import ProfileSteps

    rng = random.Random(0)
    # Recorded at 16: 2 forwards a block (8 tokens per forward); served at 32: 4 forwards.
    prof = ProfileSteps.from_blocks([{2: 30}, {2: 30}], 16)
    assert prof.block_commits(rng, 32, block=1) == [8, 8, 8, 8]
    assert prof.block_commits(rng, 16, block=0) == [8, 8]
    assert prof.mean_tokens_per_forward() == 8
    # Per block index: block 0 from its own histogram; an index measured on too few blocks, or
    # never reached, from the pooled blocks after the first.
    prof = ProfileSteps.from_blocks([{1: 30}, {4: 30}, {2: 1}], 16)
    assert len(prof.block_commits(rng, 16, block=0)) == 1
    assert len(prof.block_commits(rng, 16, block=1)) == 4
    assert len(prof.block_commits(rng, 16, block=7)) in (2, 4)
    # A fractional number of forwards is rounded at random, its mean kept: 3 forwards at 16
    # make 1.5 at 8.
    prof = ProfileSteps({3: 1}, 16)
    assert np.mean([len(prof.block_commits(rng, 8)) for _ in range(2000)]) == pytest.approx(
        1.5, abs=0.05)
    assert len(ProfileSteps({2: 1}, 16, scale=0.5).block_commits(rng, 16)) == 4  # anchored


def test_a_profile_committing_half_the_tokens_per_step_takes_twice_the_forwards():
    from sangam.bench.sim.steps import ProfileSteps

    trace = [TraceRequest(0.5 * i, 40, 96) for i in range(6)]
    cfg = SimConfig(block_length=32, token_budget=1024)
    fast = simulate(cfg, trace, coefficients=CONSTANT,
                    steps=ProfileSteps.from_blocks([{2: 20}, {3: 20}], 16))
    slow = simulate(cfg, trace, coefficients=CONSTANT,
                    steps=ProfileSteps.from_blocks([{4: 20}, {6: 20}], 16))
    f, s = (sum(r["forwards"] for r in res.records) for res in (fast, slow))
    assert s == 2 * f
    assert sum(r["latency"] for r in slow.records) > 1.5 * sum(r["latency"] for r in fast.records)


def test_profiles_file_round_trips(tmp_path):
    from sangam.bench.quality import commit_profile
    from sangam.bench.sim.steps import load_mode_profiles
    from sangam.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=48, block_length=16, refresh_interval=1000,
                            refresh_confidence=0.99)
    # Three requests: (forwards, started with a refresh) per block.
    observed = [[(2, True), (3, False), (2, True)], [(2, True), (4, True)], [(1, True)]]
    entry = commit_profile(observed, params)
    assert entry["forwards_per_block"] == [{"1": 1, "2": 2}, {"3": 1, "4": 1}, {"2": 1}]
    assert entry["refreshed_per_block"] == [[3, 3], [1, 2], [1, 1]]
    assert entry["boundary_refresh_rate"] == pytest.approx(2 / 3)
    assert entry["tokens_per_forward"] == pytest.approx(6 * 16 / 14)
    path = _write_profiles(tmp_path / "p.json", {"dual/x": {"accuracy": 0.5, **entry}})
    (name, prof), = load_mode_profiles(path).items()
    assert name == "dual/x" and prof.accuracy == 0.5 and prof.refresh_confidence == 0.99
    assert (prof.refresh_interval, prof.threshold) == (1000, 0.9)
    assert prof.boundary_refresh_rate == pytest.approx(2 / 3)
    assert prof.steps.by_block == ({1: 1, 2: 2}, {3: 1, 4: 1}, {2: 1})
    assert prof.steps.steps_per_block == {1: 1, 2: 3, 3: 1, 4: 1}
    assert prof.steps.mean_tokens_per_forward() == pytest.approx(entry["tokens_per_forward"])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="quality --profiles"):
        load_mode_profiles(str(tmp_path / "bad.json"))


def test_refresh_cadence_experiment_serves_each_configuration_with_its_own_profile(tmp_path):
    from sangam.bench.experiments import BASELINE, profile_configs
    from sangam.bench.sim.steps import ThresholdSteps, load_mode_profiles

    modes = {"vanilla": {**_profile_entry(16), "unmasking": "topk"},
             "dual/threshold=0.7": _profile_entry(1, 0.7, accuracy=0.7),
             "dual/threshold=0.8": _profile_entry(1, 0.8, accuracy=0.8),
             "dual/threshold=0.9": _profile_entry(2),
             "dual/threshold=0.95": _profile_entry(4, 0.95, accuracy=0.95),
             "dual/threshold=0.9/cadence=2x1": _profile_entry(3, cadence=(2, 1)),
             "dual/threshold=0.9/cadence=1000x1/refresh_confidence=0.999":
                 _profile_entry(2, cadence=(1000, 1), confidence=0.999, rate=0.25)}
    path = _write_profiles(tmp_path / "p.json", modes)
    configs, steps, info = profile_configs(load_mode_profiles(path), SimConfig(), None)
    fast = "tau=1024 0.9, Fast-dLLM's cache"
    assert set(configs) == {BASELINE, fast, "tau=1024 0.95, Fast-dLLM's cache",
                            "tau=1024 0.9, refresh every 2, full every 1",
                            "tau=1024 0.9, adaptive refresh 0.999 (0.25 of boundaries)",
                            "tau=1024 load-adaptive threshold 0.9->0.7"}
    assert configs[BASELINE].policy == "fastdllm" and steps[BASELINE] == steps[fast]
    for label in configs:  # forwards per block: each one's own
        own = {fast: 2, BASELINE: 2, "tau=1024 0.95, Fast-dLLM's cache": 4,
               "tau=1024 0.9, refresh every 2, full every 1": 3}.get(label)
        if own:
            assert steps[label].steps_per_block == {own: 160}
    cadence = configs["tau=1024 0.9, refresh every 2, full every 1"]
    assert (cadence.refresh_interval, cadence.prompt_refresh_interval) == (2, 1)
    adaptive = configs["tau=1024 0.9, adaptive refresh 0.999 (0.25 of boundaries)"]
    assert adaptive.adaptive_refresh_rate == 0.25 and adaptive.refresh_interval == 1000
    load = configs["tau=1024 load-adaptive threshold 0.9->0.7"]
    assert (load.threshold, load.min_threshold) == (0.9, 0.7)
    assert isinstance(steps["tau=1024 load-adaptive threshold 0.9->0.7"], ThresholdSteps)
    assert sorted(steps["tau=1024 load-adaptive threshold 0.9->0.7"].by_threshold) == [
        0.7, 0.8, 0.9]
    # Anchored: every profile scaled by the factor that gives the baseline's 3.2 (of 8).
    _, anchored, _ = profile_configs(load_mode_profiles(path), SimConfig(), 3.2)
    assert anchored[BASELINE].mean_tokens_per_forward() == pytest.approx(3.2)
    assert anchored["tau=1024 0.95, Fast-dLLM's cache"].mean_tokens_per_forward() == (
        pytest.approx(1.6))
    # The experiment end to end: a slower profile sustains less; the table has the scores.
    out = tmp_path / "out"
    assert main(["sim", "--experiment", "refresh-cadence", "--num-requests", "12", "--qps",
                 "0.5", "--profiles", path, "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows[fast]["accuracy"] == 0.9 and rows[fast]["tokens_per_forward"] == 8
    assert rows[fast]["sim_tokens_per_forward"] == pytest.approx(8)  # blocks of 32: 4 forwards
    assert rows["tau=1024 0.95, Fast-dLLM's cache"]["sim_tokens_per_forward"] == (
        pytest.approx(4))
    assert rows["tau=1024 0.95, Fast-dLLM's cache"]["capacity_qps"] < rows[fast]["capacity_qps"]
    assert rows[BASELINE]["vs_baseline"] == 1.0


def test_load_adaptive_threshold_is_the_engines_function_of_the_workers_load(monkeypatch):
    from sangam.bench.sim.steps import ThresholdSteps
    from sangam.sampling_params import SamplingParams

    # One token per forward at 0.9, a whole block at 0.5.
    steps = ThresholdSteps({0.5: FixedSteps(8), 0.9: FixedSteps(1)})
    cfg = SimConfig(block_length=8, token_budget=1024, max_batch_size=1, min_threshold=0.5)
    alone = simulate(cfg, [TraceRequest(0.0, 10, 16)], coefficients=CONSTANT, steps=steps)
    (r,) = alone.records  # alone on its worker: load 0, the request's threshold
    assert r["threshold"] == 0.9 and r["forwards"] == 16
    crowd = simulate(cfg, [TraceRequest(0.0, 10, 16) for _ in range(4)],
                     coefficients=CONSTANT, steps=steps)
    # Four held with max_batch_size 1: load 1, every block at min_threshold but those started
    # once the others had left.
    assert min(r["threshold"] for r in crowd.records) == 0.5
    assert min(r["forwards"] for r in crowd.records) == 2
    for r in crowd.records:
        assert 0.5 <= r["threshold"] <= 0.9
    # The threshold is SamplingParams.threshold_under's, whatever that function says.
    monkeypatch.setattr(SamplingParams, "threshold_under", lambda self, load: 0.5)
    (r,) = simulate(cfg, [TraceRequest(0.0, 10, 16)], coefficients=CONSTANT, steps=steps).records
    assert r["threshold"] == 0.5 and r["forwards"] == 2
    # Without min_threshold: no thresholds recorded, every block at the configuration's.
    plain = simulate(SimConfig(block_length=8, threshold=0.5), [TraceRequest(0.0, 10, 16)],
                     coefficients=CONSTANT, steps=steps).records[0]
    assert plain["threshold"] is None and plain["forwards"] == 2
    with pytest.raises(ValueError, match="min_threshold"):
        SimConfig(min_threshold=0.95)


def test_against_pairs_configurations_by_cadence_each_with_its_own_profile(tmp_path):
    from sangam.bench.validation import sim_key, step_profiles

    configs = {"deficit tau=1024 []": {"policy": "deficit", "token_budget": 1024,
                                       "refresh_interval": None, "threshold": None},
               "deficit tau=1024 [refresh_interval=2]": {"policy": "deficit",
                                                         "token_budget": 1024,
                                                         "refresh_interval": 2}}
    (tmp_path / "results.json").write_text(json.dumps({"kind": "serve", "configs": configs}))
    (tmp_path / "profile.json").write_text(json.dumps({
        "block_length": 16, "steps_per_block": {"2": 2, "3": 1},
        "configs": {"deficit tau=1024 []": {"steps_per_block": {"2": 2}},
                    "deficit tau=1024 [refresh_interval=2]": {"steps_per_block": {"3": 1}}}}))
    own = step_profiles(tmp_path)
    assert own[sim_key(SimConfig())].steps_per_block == {2: 2}
    assert own[sim_key(SimConfig(refresh_interval=2))].steps_per_block == {3: 1}
    assert sim_key(SimConfig(policy="fastdllm")) == "fastdllm"
    assert sim_key(SimConfig(threshold=0.95)) == "deficit tau=1024 threshold=0.95"


# Tensor and expert parallelism.
def test_tensor_parallel_splits_the_forward_and_adds_its_all_reduces():
    from dataclasses import replace

    from sangam.bench.cost_model import TensorParallel, batch_features

    geom, gpu = MODELS["llada"], GPUS["h100"]
    c = Coefficients.defaults(gpu)
    spans = [Span(32, 1024, 32)] * 4 + [Span(512, 512, 32)]
    tokens, rows, pairs, kv_tokens = 640, 160, 4 * 32 * 1024 + 512 * 512, 4 * 1056 + 1024
    # One GPU: the roofline as it always was, to the bit.
    old = (c.iteration_overhead_s + c.per_sequence_s * 5
           + max(2.0 * tokens * geom.active_params / c.matmul_flops,
                 geom.weights_read(tokens) * 2 / c.hbm_bytes_per_s)
           + max(4.0 * pairs * 32 * 128 * 32 / c.attention_flops,
                 kv_tokens * 512 * 1024 / c.hbm_bytes_per_s)
           + max(2.0 * rows * geom.head_params / c.matmul_flops,
                 geom.head_params * 2 / c.hbm_bytes_per_s))
    assert CostModel(geom, c).iteration_time(spans) == old
    assert CostModel(geom, c, tp=TensorParallel.on(gpu, 1)).iteration_time(spans) == old
    # TP2: every per-rank term halves (32 K/V heads split too); requests do not.
    one, two = batch_features(geom, spans), batch_features(geom, spans, tp=2)
    assert np.allclose(two, one * [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1])
    # Dream's 4 K/V heads over 8 ranks: a head each, replicated, so its K/V reads fall to 1/4.
    with pytest.raises(ValueError, match="do not split"):
        CostModel(MODELS["dream"], c, tp=TensorParallel.on(gpu, 8))  # 28 heads
    dream = replace(MODELS["dream"], heads=32, hidden=4096)
    assert batch_features(dream, spans, tp=8)[3] == batch_features(dream, spans)[3] / 4
    # Plus 2 x 32 all-reduces of 640 x 4096 bf16 over a ring of 2 (latency 10 us, NVLink's
    # 450 GB/s at 0.8), and the LM head's 160 rows x 5 fp64 statistics gathered.
    tp2 = TensorParallel.on(gpu, 2)
    assert (tp2.link_bytes_per_s, tp2.latency_s) == (360e9, 10e-6)
    cm = CostModel(geom, c, tp=tp2)
    comm = 64 * (10e-6 + 2 * (1 / 2) * 640 * 4096 * 2 / 360e9) + 10e-6 + 160 * 5 * 8 / 360e9
    assert cm.communication_time(spans) == pytest.approx(comm)
    roof = (c.iteration_overhead_s + c.per_sequence_s * 5
            + max(two[0] / c.matmul_flops, two[1] / c.hbm_bytes_per_s)
            + max(two[2] / c.attention_flops, two[3] / c.hbm_bytes_per_s)
            + max(two[4] / c.matmul_flops, two[5] / c.hbm_bytes_per_s))
    assert cm.iteration_time(spans) == pytest.approx(roof + comm)
    assert cm.iteration_time(spans) < old  # the halved reads outweigh 1.6 ms of all-reduces
    assert cm.kv_bytes(16) == 16 * 256 * 1024  # a rank's half of the K/V: what it sends


def test_tensor_parallel_kv_pool_grows_with_the_group():
    from sangam.bench.cost_model import kv_pool_pages

    llada, flash, gpu = MODELS["llada"], MODELS["llada2-flash"], GPUS["h100"]
    # A rank keeps 1/N of the layers and the LM head, and the whole embedding table.
    assert llada.weight_bytes(tp=2) == (32 * llada.layer_params / 2 + llada.head_params / 2
                                        + llada.head_params) * 2
    pages = {n: kv_pool_pages(llada, gpu, 16, tp=n) for n in (1, 2, 8)}
    assert pages[2] > 2 * pages[1] and pages[8] > 8 * pages[1]
    assert pages[2] == int((0.9 * gpu.memory_bytes - llada.weight_bytes(tp=2))
                           // (16 * 256 * 1024))
    with pytest.raises(ValueError, match=r"2x H100-SXM"):  # 100B parameters: 200 GB
        kv_pool_pages(flash, gpu, 16, tp=2)
    assert kv_pool_pages(flash, gpu, 16, tp=8) > kv_pool_pages(flash, gpu, 16, tp=4)
    # A worker of two GPUs: a fuller pool, faster forwards, half the K/V per link.
    cfg = SimConfig(num_workers=1, tensor_parallel_size=2)
    assert cfg.label == "1C TP2 tau=1024" and cfg.num_gpus == 2
    trace = [TraceRequest(0.0, 500, 64)]
    one, two = (simulate(c, trace).records[0]["latency"] for c in (SimConfig(), cfg))
    assert two < one
    disagg = dict(mode="disaggregated", prefill_workers=1, decode_workers=1, block_length=8,
                  link="network")
    moved = [simulate(SimConfig(**disagg, tensor_parallel_size=n), [TraceRequest(0.0, 10, 16)],
                      coefficients=CONSTANT, steps=FixedSteps(2)).records[0] for n in (1, 2)]
    assert moved[1]["transfer"] == pytest.approx(moved[0]["transfer"] / 2)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        SimConfig(enable_expert_parallel=True)


def test_expert_parallel_all_reduce_against_all_to_all():
    from dataclasses import replace

    from sangam.bench.cost_model import TensorParallel

    flash, gpu = MODELS["llada2-flash"], GPUS["h100"]
    c = Coefficients.defaults(gpu)
    ep8 = CostModel(flash, c, tp=TensorParallel.on(gpu, 8, expert_parallel=True))
    comm = ep8.moe_communication(1024)
    act = 1024 * 4096 * 2
    # The all-reduce: 2 (N-1)/N of the activations over each link. Dispatch and combine: the
    # tokens' 8 copies, split over 8 ranks, (N-1)/N of them leaving each; and one more latency.
    assert comm["all-reduce"] == pytest.approx(10e-6 + 2 * 7 / 8 * act / 360e9)
    assert comm["all-to-all"] == pytest.approx(2 * (10e-6 + 7 / 8 * 8 * act / 8 / 360e9) + 10e-6)
    # top-k = N: the same bytes, so all-to-all costs two latencies more; at 4 ranks twice the
    # bytes; with fewer experts per token than ranks, all-to-all moves less.
    assert comm["all-to-all"] - comm["all-reduce"] == pytest.approx(20e-6)
    ep4 = CostModel(flash, c, tp=TensorParallel.on(gpu, 4, expert_parallel=True))
    four = ep4.moe_communication(4096)
    assert 0 < four["all-reduce"] < four["all-to-all"]
    assert four["all-to-all"] - 3 * 10e-6 == pytest.approx(2 * (four["all-reduce"] - 10e-6))
    top2 = CostModel(replace(flash, experts_per_token=2), c, tp=ep8.tp).moe_communication(4096)
    assert top2["all-to-all"] < top2["all-reduce"]
    # The engine's scheme rides on the layer's all-reduce: priced as TP's split of the experts.
    tp8 = CostModel(flash, c, tp=TensorParallel.on(gpu, 8))
    spans = [Span(32, 1024, 32, causal_block=32)] * 32
    assert ep8.iteration_time(spans) == tp8.iteration_time(spans)
    with pytest.raises(ValueError, match="do not split"):
        CostModel(flash, c, tp=TensorParallel.on(gpu, 3))


def test_tensor_parallel_experiment(tmp_path, capsys):
    assert main(["sim", "--experiment", "tensor-parallel", "--num-requests", "8", "--qps", "1",
                 "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["saturation_rps"]) == 2 and all(
        list(s) == ["TP1x8", "TP2x4", "TP8x1"] for s in results["saturation_rps"].values())
    assert [s["config"] for s in results["summaries"]] == 2 * ["TP1x8", "TP2x4", "TP8x1"]
    ep = results["expert_parallel"]
    assert [row["gpus"] for row in ep] == [4, 4, 8, 8]
    assert all(row["moe_layer_s"]["all-reduce"] < row["moe_layer_s"]["all-to-all"]
               for row in ep)
    out = capsys.readouterr().out
    assert all(label in out for label in ("TP1x8", "TP2x4", "TP8x1"))
    assert "chosen: all-reduce" in out


def test_the_cost_model_counts_the_scoring_statistics_the_engine_gathers():
    """The all-gather of vocabulary-parallel scoring carries SHARD_FIELDS per row; the cost
    model counts them without importing the scoring (and PyTorch)."""
    from sangam.bench.cost_model import LM_STATISTICS
    from sangam.decoding.confidence import SHARD_FIELDS

    assert LM_STATISTICS == len(SHARD_FIELDS)


def _timed_spans(monkeypatch) -> list:
    """Every span the cost model times from now on."""
    spans: list = []
    real = CostModel.iteration_time

    def spy(self, s):
        spans.extend(s)
        return real(self, s)

    monkeypatch.setattr(CostModel, "iteration_time", spy)
    return spans


def test_a_uniform_state_model_from_its_config(tmp_path, monkeypatch):
    """DiffusionGemma's shape read from a checkpoint's config.json (the shipped Gemma-layout
    demo): its K/V bytes are the engine's pool's (each layer its own shape); requests run as
    canvases after the prompt, each taking the profile's forwards with every canvas row through
    the LM head, the first canvas's first forward holding the prompt; prefix caching on by
    default, as in the engine; and the command line runs it from a quality sweep's profile."""
    from sangam.bench.cost_model import ModelGeometry
    from sangam.demo import demo_model_path
    from sangam.models import read_config

    cfg = read_config(demo_model_path("sangam-demo-gemma"))
    geom = ModelGeometry.of("demo-gemma", cfg)
    canvas = cfg.gemma.canvas_length
    assert geom.canvas == canvas and geom.full_layers == 1 and geom.parallel_mlp
    assert geom.kv_bytes_per_token(2) == cfg.kv_bytes_per_token(2)
    sim = SimConfig(model="calibrated", page_size=4, num_pages=4096)
    trace = [TraceRequest(0.0, 30, 40), TraceRequest(5.0, 30, 10)]
    res = simulate(sim, trace, coefficients=CONSTANT, steps=ProfileSteps({3: 1}),
                   geometry=(geom, 2))
    r = by_id(res)
    # 40 tokens: two canvases of 24, three forwards each; 10: one canvas.
    assert r[0]["forwards"] == 6 and r[0]["canvas_tokens"] == 2 * canvas
    assert r[1]["forwards"] == 3 and r[1]["canvas_tokens"] == canvas
    # The second request's prompt is another's (no shared tokens in the trace): all prefilled.
    assert res.workers[0]["prefill_tokens"] == 2 * (30 + canvas)
    spans = _timed_spans(monkeypatch)
    simulate(sim, trace[:1], coefficients=CONSTANT, steps=ProfileSteps({3: 1}),
             geometry=(geom, 2))
    monkeypatch.undo()
    assert [(s.q_len, s.lm_rows) for s in spans] == [
        (30 + canvas, canvas), (canvas, canvas), (canvas, canvas),  # the prompt and canvas 0
        (2 * canvas, canvas), (canvas, canvas), (canvas, canvas)]  # canvas 0 encoded, canvas 1
    quality = tmp_path / "q.json"
    quality.write_text(json.dumps({"modes": {"m": {"block_length": canvas,
                                                   "steps_per_block": {"2": 9, "3": 1}}}}))
    assert main(["sim", "--model", "calibrated", "--model-config",
                 demo_model_path("sangam-demo-gemma"), "--block-length", str(canvas),
                 "--step-profile", f"{quality}#m", "--num-requests", "8", "--qps", "4"]) == 0


def test_a_hybrid_pool_as_the_engine_has_it(tmp_path, monkeypatch):
    """``kv_pool``: each seat a ring of the sliding layers' pages and the rest of the memory for
    the full layers' (DiffusionGemma-26B-A4B on an H100: over nine times the positions of a
    single pool), prefix caching off, and no forward of a request spanning more than its ring
    allows (a long prompt stored in chunks within the token budget); refused where the engine
    refuses it."""
    import subprocess
    import sys

    from sangam.bench.cost_model import ModelGeometry
    from sangam.bench.sim.simulator import Simulator
    from sangam.demo import demo_model_path
    from sangam.models import read_config
    from sangam.sched.window_rings import RingShape

    subprocess.run([sys.executable, "scripts/diffusion_gemma_26b_config.py", str(tmp_path)],
                   check=True, capture_output=True)
    big = ModelGeometry.of("dgemma-26b", read_config(str(tmp_path)))
    pages = {pool: Simulator(SimConfig(model="calibrated", gpu="h100", max_batch_size=4,
                                       kv_pool=pool), geometry=(big, 2)).num_pages
             for pool in ("single", "hybrid")}
    assert pages["hybrid"] > 9 * pages["single"]

    cfg = read_config(demo_model_path("sangam-demo-gemma"))
    geom = ModelGeometry.of("demo-gemma", cfg)
    canvas, window = cfg.gemma.canvas_length, cfg.gemma.sliding_window
    sim = SimConfig(model="calibrated", page_size=4, num_pages=4096, token_budget=2 * canvas,
                    kv_pool="hybrid")
    simulator = Simulator(sim, CONSTANT, ProfileSteps({3: 1}), (geom, 2))
    assert not simulator.prefix_caching
    assert simulator.ring == RingShape.of(window, 4, canvas, 2 * canvas)
    spans = _timed_spans(monkeypatch)
    prompt = 7 * canvas + 5
    res = simulator.run([TraceRequest(0.0, prompt, 40), TraceRequest(1.0, 30, 10)])
    monkeypatch.undo()
    assert len(res.records) == 2
    assert max(s.q_len for s in spans) <= simulator.ring.max_span < prompt
    assert res.workers[0]["prefill_tokens"] == prompt + 30 + 2 * canvas  # chunks, nothing twice
    for bad in (dict(kv_pool="hybrid", enable_prefix_caching=True),
                dict(kv_pool="hybrid", mode="disaggregated")):
        with pytest.raises(ValueError, match="kv-pool hybrid"):
            SimConfig(model="calibrated", **bad)
