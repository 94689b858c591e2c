"""The paper's serving experiments, simulated (``sangam-bench sim --experiment NAME``).

- ``fastdllm-vs-deficit``: one GPU, LLaDA-8B on ShareGPT: the Fast-dLLM baseline policy (batch
  size 1, each request to completion) against colocated tau=1024, and the QPS each sustains at
  the same mean latency (paper: 1.0 vs 0.3 QPS, 3x).
- ``tau-sweep``: 8 GPUs colocated, LLaDA-8B on ShareGPT, tau in {512, 1024, 2048, 16384}
  (paper at 6.5 QPS, mean/p99 s: 512 7.3/22.2, 1024 4.7/17.3, 16384 4.5/18.9).
- ``modes``: 8 GPUs as colocated (8C), disaggregated 5P3D and hybrid 5P3C, for LLaDA-8B and
  Dream-7B on ShareGPT and arXiv (paper: colocated best on LLaDA/ShareGPT by 9-20% mean
  latency, hybrid best on Dream/arXiv by 8-20%, 5P3D saturates first).
- ``adaptive-tau``: 8 GPUs colocated, LLaDA-8B on ShareGPT and arXiv: the adaptive budget
  (``policy="adaptive"``: tau raised with the prefill queue) against the static taus of the
  sweep, mean and p99 latency at loads from light to saturation (the paper's limitation: the
  best static tau flips between the two traces).
- ``block-causal``: SDAR-8B (block-causal: one prefill per request, no refreshes) on one GPU,
  ShareGPT and arXiv, block sizes 4 and 32: batch 1, prefill-first, and the deficit budget with
  whole-prompt and chunked prefill admission (the paper's unmeasured claim: with rare
  re-prefills the problem slides back toward autoregressive scheduling); then on 8 GPUs at
  B = 4, colocated 8C against disaggregated 5P3D and hybrid 5P3C (one prefill per request, its
  K/V sent once), as ``modes`` does for the bidirectional models.
- ``refresh-cadence``: ``fastdllm-vs-deficit``'s setting, colocated tau=1024 under refresh
  cadences (``quality.REFRESH_CADENCES``: blocks between refreshes, refreshes between full ones):
  the QPS
  each sustains at the baseline's matched mean latency, against batch-1 Fast-dLLM with full
  refreshes (with ``--adaptive-refresh-rate R``, adaptive refresh at that trigger rate too).
  With ``--profiles FILE`` (``sangam-bench quality --profiles``) every DualCache mode of the
  file is a configuration, served with its own commit profile (forwards per block by block
  index, at the simulator's block length; adaptive refresh at its measured boundary refresh
  rate), the baseline with Fast-dLLM's (threshold 0.9, full refreshes), plus the load-adaptive
  threshold (``--min-threshold``, default 0.7, from 0.9) served with the profiles of the
  thresholds measured between them; the table gives each one's exact match and block agreement
  next to its capacity. ``--profile-anchor TPF`` scales every profile's tokens per forward by
  one factor, the one that gives the baseline's TPF (LLaDA-8B's 3.25 at threshold 0.9): each
  knob keeps its measured effect relative to Fast-dLLM's, on a model as sure as LLaDA-8B.
- ``tensor-parallel``: 8 GPUs colocated, LLaDA-8B on ShareGPT and arXiv, as 8 workers of one
  GPU, 4 tensor-parallel workers of two and one of eight: saturation throughput and mean / p90
  latency against QPS. Then LLaDA2.0-flash (100B: four GPUs at least) at TP4 and TP8 under
  expert parallelism: one MoE layer's communication and a forward's time with the engine's
  all-reduce against all-to-all dispatch and combine, at a decode and a prefill batch.

Each prints its table(s), writes results.json / summary.csv / requests.csv and a
latency-vs-QPS figure into ``--out`` (default ``bench-results/sim-NAME``). Request counts are
modest (a few hundred per point) so that each runs in minutes on a laptop CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

from sangam.bench.capacity import find_capacity
from sangam.bench.cost_model import (
    ENGINE_EP_SCHEME,
    EP_SCHEMES,
    GPUS,
    MODELS,
    CostModel,
    Span,
    TensorParallel,
)
from sangam.bench.quality import CADENCE_THRESHOLD, NEVER, REFRESH_CADENCES, dual_mode_name
from sangam.bench.report import (
    SUMMARY_COLUMNS,
    format_table,
    parse_float_list,
    plot_latency,
    write_outputs,
)
from sangam.bench.sim.config import SimConfig
from sangam.bench.sim.runs import coefficients_from_args, run_point, step_model_from_args
from sangam.bench.sim.steps import (
    ModeProfile,
    ProfileSteps,
    StepModel,
    ThresholdSteps,
    load_mode_profiles,
)
from sangam.bench.traces import load_lengths
from sangam.sched.config import DRAIN_ITERATIONS

DEFAULT_REQUESTS = {"fastdllm-vs-deficit": 300, "tau-sweep": 600, "modes": 500,
                    "refresh-cadence": 300, "adaptive-tau": 1500,
                    "block-causal": 300, "tensor-parallel": 500}


class _Runner:
    """Runs points of one experiment, collecting summaries and per-request records."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name = name
        self.args = args
        self.n = args.num_requests or DEFAULT_REQUESTS[name]
        self.out = args.out or os.path.join("bench-results", f"sim-{name}")
        self.summaries: list[dict] = []
        self.records: list[dict] = []
        self.panels: dict[str, dict[str, list[dict]]] = {}
        self._lengths: dict[str, list] = {}
        self.start = time.perf_counter()

    def lengths(self, trace: str):
        if trace not in self._lengths:
            self._lengths[trace] = load_lengths(trace, self.n, self.args.trace_seed)
        return self._lengths[trace]

    def point(self, panel: str, label: str, cfg: SimConfig, trace: str, qps: float,
              keep: bool = True, steps: StepModel | None = None) -> dict:
        summary, res = run_point(cfg, self.lengths(trace), qps, self.args, label, steps)
        summary["panel"] = panel
        print(f"  [{time.perf_counter() - self.start:5.0f}s] {panel} | {label} @ {qps:.3g} QPS:"
              f" mean {summary['latency_mean']:.2f} s, p99 {summary['latency_p99']:.2f} s",
              file=sys.stderr, flush=True)
        if keep:
            self.summaries.append(summary)
            self.panels.setdefault(panel, {}).setdefault(label, []).append(summary)
            self.records += [{"config": f"{panel} | {label}", "qps": qps, **r}
                             for r in res.records]
        return summary

    def finish(self, extra: dict, title: str) -> None:
        report = {"experiment": self.name, "num_requests": self.n, "gpu": self.args.gpu,
                  "calibration": self.args.calibration,
                  "coefficients": coefficients_from_args(self.args, SimConfig(gpu=self.args.gpu)),
                  "steps": step_model_from_args(self.args).describe(),
                  "summaries": self.summaries, **extra}
        paths = write_outputs(self.out, report, self.summaries, self.records)
        paths += plot_latency(os.path.join(self.out, "latency_vs_qps.png"), self.panels, title)
        print("wrote " + ", ".join(paths))


def _grid(args: argparse.Namespace, default: list[float]) -> list[float]:
    return parse_float_list(args.qps) if args.qps else default


def _base(args: argparse.Namespace, **kw) -> SimConfig:
    return SimConfig(gpu=args.gpu, seed=args.seed, link=args.link,
                     layerwise_kv_streaming=args.layerwise_kv_streaming, **kw)


BASELINE = "fastdllm (batch 1)"


def _against_batch1(r: _Runner, panel: str, configs: dict[str, SimConfig],
                    grid: list[float], trace: str = "sharegpt",
                    steps: dict[str, StepModel] | None = None
                    ) -> tuple[float, float, dict[str, float]]:
    """Latency against QPS for each configuration (the first is the batch-1 baseline), then the
    QPS each sustains at matched latency: twice the baseline's mean latency at light load,
    where it is pure service time. Returns (light, target, capacity by label). ``steps``: a
    configuration's own step model (else the flags')."""
    steps = steps or {}
    for label, cfg in configs.items():
        for q in grid:
            r.point(panel, label, cfg, trace, q, steps=steps.get(label))
    print(format_table(r.summaries, SUMMARY_COLUMNS))
    light = r.point(panel, BASELINE, configs[BASELINE], trace, 0.02, keep=False,
                    steps=steps.get(BASELINE))["latency_mean"]
    target = 2 * light
    caps = {}
    for label, cfg in configs.items():
        res = find_capacity(
            lambda q, cfg=cfg, label=label: r.point(panel, label, cfg, trace, q, keep=False,
                                                    steps=steps.get(label))["latency_mean"],
            target, qps_start=0.2, rel_tol=0.03)
        caps[label] = res.qps
    print(f"\n{panel}: matched mean latency {target:.2f} s (2x the baseline's {light:.2f} s "
          "at light load):")
    for label, q in caps.items():
        print(f"  {label:<34} sustains {q:.3f} QPS, {q / caps[BASELINE]:.2f}x the baseline")
    return light, target, caps


def fastdllm_vs_deficit(args: argparse.Namespace) -> int:
    r = _Runner("fastdllm-vs-deficit", args)
    panel = f"LLaDA-8B, ShareGPT, 1x {GPUS[args.gpu].name}"
    base = _base(args, model="llada")
    configs = {BASELINE: replace(base, policy="fastdllm"),
               "colocated tau=1024": replace(base, token_budget=1024)}
    _, target, caps = _against_batch1(
        r, panel, configs, _grid(args, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2, 1.4]))
    print("  (paper: 1.0 vs 0.3 QPS, ~3x)")
    r.finish({"matched_latency_s": target, "capacity_qps": caps}, panel)
    return 0




LOAD_ADAPTIVE_MIN_THRESHOLD = 0.7  # the load-adaptive row's floor (--min-threshold)


def profile_configs(profiles: dict[str, ModeProfile], base: SimConfig, anchor: float | None,
                    min_threshold: float = LOAD_ADAPTIVE_MIN_THRESHOLD
                    ) -> tuple[dict[str, SimConfig], dict[str, StepModel], dict[str, dict]]:
    """The refresh-cadence experiment's configurations from a quality sweep's profiles, each
    with its own step model: (label -> config, label -> step model, label -> what quality
    measured of it). The baseline (batch-1 Fast-dLLM) and "Fast-dLLM's cache" serve with
    threshold 0.9's profile; every other DualCache threshold-rule mode at or above 0.9 with its
    own (adaptive refresh at its boundary refresh rate); the load-adaptive threshold (0.9 down
    to ``min_threshold``) with the profiles of the thresholds measured in that range
    (:class:`ThresholdSteps`). ``anchor``: scale every profile's tokens per forward by the one
    factor that gives the baseline's this many."""
    fast_name = dual_mode_name(CADENCE_THRESHOLD)
    if fast_name not in profiles:
        raise ValueError(f"the profiles have no {fast_name!r} (Fast-dLLM's, the baseline's)")
    scale = anchor / profiles[fast_name].tokens_per_forward if anchor else 1.0

    def steps(p: ModeProfile) -> ProfileSteps:
        return replace(p.steps, scale=scale)

    def measured(p: ModeProfile | None, **kw) -> dict:
        if p is None:
            return kw
        return {"mode": p.name, "accuracy": p.accuracy, "block_agreement": p.block_agreement,
                "tokens_per_forward": p.tokens_per_forward,
                "boundary_refresh_rate": p.boundary_refresh_rate, **kw}

    tau = replace(base, token_budget=1024)
    configs = {BASELINE: replace(base, policy="fastdllm")}
    models = {BASELINE: steps(profiles[fast_name])}
    info = {BASELINE: measured(profiles[fast_name])}
    for name, p in profiles.items():
        if not name.startswith("dual/threshold=") or p.threshold < CADENCE_THRESHOLD:
            continue
        if p.refresh_confidence:
            rate = p.boundary_refresh_rate or 0.0
            label = (f"tau=1024 {p.threshold:g}, adaptive refresh "
                     f"{p.refresh_confidence:g} ({rate:.2f} of boundaries)")
            cfg = replace(tau, threshold=p.threshold, refresh_interval=p.refresh_interval,
                          adaptive_refresh_rate=rate)
        else:
            cadence = (p.refresh_interval, p.prompt_refresh_interval)
            what = ("Fast-dLLM's cache" if cadence == (1, 1) else
                    f"refresh every {cadence[0]}, full every {cadence[1]}")
            label = f"tau=1024 {p.threshold:g}, {what}"
            cfg = replace(tau, threshold=p.threshold, refresh_interval=cadence[0],
                          prompt_refresh_interval=cadence[1])
        configs[label], models[label], info[label] = cfg, steps(p), measured(p)
    by_threshold = {p.threshold: steps(p) for name, p in profiles.items()
                    if name == dual_mode_name(p.threshold)
                    and min_threshold <= p.threshold <= CADENCE_THRESHOLD}
    if len(by_threshold) > 1:
        label = f"tau=1024 load-adaptive threshold {CADENCE_THRESHOLD:g}->{min_threshold:g}"
        configs[label] = replace(tau, threshold=CADENCE_THRESHOLD, min_threshold=min_threshold)
        models[label] = ThresholdSteps(by_threshold)
        info[label] = {"mode": "load-adaptive", "thresholds": sorted(by_threshold),
                       "accuracy_by_threshold": {
                           f"{t:g}": profiles[dual_mode_name(t)].accuracy for t in by_threshold},
                       "block_agreement_by_threshold": {
                           f"{t:g}": profiles[dual_mode_name(t)].block_agreement
                           for t in by_threshold}}
    return configs, models, info


def _interpolate(points: dict[str, float | None], t: float) -> float | None:
    """A score at threshold ``t``, linear between the measured thresholds."""
    pts = sorted((float(k), v) for k, v in points.items() if v is not None)
    if not pts:
        return None
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return pts[-1][1]


def refresh_cadence(args: argparse.Namespace) -> int:
    r = _Runner("refresh-cadence", args)
    panel = f"LLaDA-8B, ShareGPT, 1x {GPUS[args.gpu].name}"
    base = _base(args, model="llada")
    if args.profiles:
        return _refresh_cadence_profiles(r, args, panel, base)
    configs = {BASELINE: replace(base, policy="fastdllm")}
    for ri, pi in ((1, 1), *REFRESH_CADENCES):  # the quality sweep's, and Fast-dLLM's
        configs[f"tau=1024 refresh every {ri}, full every {pi}"] = replace(
            base, token_budget=1024, refresh_interval=ri, prompt_refresh_interval=pi)
    rate = args.adaptive_refresh_rate
    if rate:  # adaptive refresh at a measured trigger rate (sangam-bench quality's)
        configs[f"tau=1024 adaptive refresh, {rate:g} of boundaries"] = replace(
            base, token_budget=1024, refresh_interval=NEVER, adaptive_refresh_rate=rate)
    _, target, caps = _against_batch1(r, panel, configs, _grid(args, [0.2, 0.5, 1.0, 1.5]))
    r.finish({"matched_latency_s": target, "capacity_qps": caps,
              "cadences": REFRESH_CADENCES}, panel)
    return 0


def _refresh_cadence_profiles(r: _Runner, args: argparse.Namespace, panel: str,
                              base: SimConfig) -> int:
    try:
        configs, models, info = profile_configs(
            load_mode_profiles(args.profiles), base, args.profile_anchor,
            args.min_threshold if args.min_threshold is not None
            else LOAD_ADAPTIVE_MIN_THRESHOLD)
    except (OSError, ValueError) as e:
        raise SystemExit(f"sangam-bench sim --experiment refresh-cadence: {e}") from e
    for label, m in models.items():
        print(f"  {label}: {m.describe()}", file=sys.stderr)
    _, target, caps = _against_batch1(r, panel, configs, _grid(args, [0.2, 0.5, 1.0, 1.5]),
                                      steps=models)
    rows = {}
    for label, cfg in configs.items():  # each at its capacity: tokens per forward, threshold
        at = r.point(panel, label, cfg, "sharegpt", caps[label], keep=False,
                     steps=models[label]) if caps[label] else {}
        row = {**info[label], "capacity_qps": caps[label],
               "vs_baseline": caps[label] / caps[BASELINE] if caps[BASELINE] else None,
               "sim_tokens_per_forward": at.get("tokens_per_forward"),
               "threshold_mean": at.get("threshold_mean")}
        if "accuracy_by_threshold" in info[label] and row["threshold_mean"] is not None:
            row["accuracy"] = _interpolate(info[label]["accuracy_by_threshold"],
                                           row["threshold_mean"])
            row["block_agreement"] = _interpolate(info[label]["block_agreement_by_threshold"],
                                                  row["threshold_mean"])
        rows[label] = row
    print(f"\neach configuration with its own profile ({args.profiles}"
          + (f", tokens per forward scaled so the baseline's is {args.profile_anchor:g}"
             if args.profile_anchor else ", as measured") + "):")
    print(f"  {'configuration':<58}{'exact':>7}{'blocks':>8}{'tok/fwd':>9}{'sim tok/fwd':>12}"
          f"{'QPS':>8}{'x base':>8}")
    for label, row in rows.items():
        def pct(v):
            return "-" if v is None else f"{100 * v:.1f}%"
        tpf = row.get("tokens_per_forward")
        print(f"  {label:<58}{pct(row.get('accuracy')):>7}{pct(row.get('block_agreement')):>8}"
              f"{'-' if tpf is None else f'{tpf:.2f}':>9}"
              f"{row['sim_tokens_per_forward'] or 0:>12.2f}{row['capacity_qps']:>8.3f}"
              f"{row['vs_baseline'] or 0:>8.2f}"
              + (f"  (mean threshold {row['threshold_mean']:.3f})"
                 if row.get("threshold_mean") is not None else ""))
    r.finish({"matched_latency_s": target, "capacity_qps": caps, "profiles": args.profiles,
              "profile_anchor": args.profile_anchor, "rows": rows}, panel)
    return 0


BLOCK_CAUSAL_SIZES = (4, 32)


def block_causal(args: argparse.Namespace) -> int:
    """SDAR-8B on one GPU, both traces, block sizes 4 and 32: batch 1, prefill-first and the
    deficit budget with whole-prompt and chunked admission. Latency against QPS, and the QPS
    each sustains at the matched latency (twice batch 1's light-load mean)."""
    r = _Runner("block-causal", args)
    out = {}
    for trace in ("sharegpt", "arxiv"):
        for b in BLOCK_CAUSAL_SIZES:
            panel = f"SDAR-8B B={b}, {trace}, 1x {GPUS[args.gpu].name}"
            base = _base(args, model="sdar", block_length=b)
            configs = {BASELINE: replace(base, policy="fastdllm"),
                       "prefill-first": replace(base, policy="prefill_first"),
                       "tau=1024 whole prompt": replace(base, token_budget=1024),
                       "tau=1024 chunked": replace(base, token_budget=1024,
                                                   enable_chunked_prefill=True)}
            cap = r.point(panel, "prefill-first", configs["prefill-first"], trace,
                          float("inf"), keep=False)["throughput_rps"]
            grid = _grid(args, [round(f * cap, 2) for f in LOAD_FRACTIONS])
            light, target, caps = _against_batch1(r, panel, configs, grid, trace)
            out[panel] = {"matched_latency_s": target, "light_latency_s": light,
                          "capacity_qps": caps, "saturation_qps": cap}
    modes_out = {}
    for trace in ("sharegpt", "arxiv"):
        panel = f"SDAR-8B B={BLOCK_CAUSAL_SIZES[0]}, {trace}, 8x {GPUS[args.gpu].name}"
        cfgs = {label: _base(args, model="sdar", block_length=BLOCK_CAUSAL_SIZES[0],
                             token_budget=1024, **kw) for label, kw in MODE_CONFIGS.items()}
        sat = {label: r.point(panel, label, cfg, trace, float("inf"),
                              keep=False)["throughput_rps"] for label, cfg in cfgs.items()}
        grid = _grid(args, [round(f * sat["colocated 8C"], 2) for f in LOAD_FRACTIONS])
        for label, cfg in cfgs.items():
            for q in grid:
                r.point(panel, label, cfg, trace, q)
        modes_out[panel] = {"saturation_qps": sat, "mean_latency_s": {
            label: {s["qps"]: s["latency_mean"] for s in r.panels[panel][label]}
            for label in cfgs}}
    print("\nserving modes, 8 GPUs: saturation QPS, and mean latency (s) by offered QPS")
    for panel, m in modes_out.items():
        print(f"  {panel}")
        for label, sat in m["saturation_qps"].items():
            lat = "  ".join(f"{q:g}: {v:.2f}" for q, v in m["mean_latency_s"][label].items())
            print(f"    {label:<19} saturation {sat:6.2f}   {lat}")
    r.finish({"panels": out, "modes": modes_out}, f"SDAR-8B, {GPUS[args.gpu].name}")
    return 0


def tau_sweep(args: argparse.Namespace) -> int:
    r = _Runner("tau-sweep", args)
    panel = f"LLaDA-8B, ShareGPT, 8x {GPUS[args.gpu].name} colocated"
    grid = _grid(args, [6.5, 9.0, 11.0, 12.0, 13.0])
    for tau in (512, 1024, 2048, 16384):
        cfg = _base(args, model="llada", num_workers=8, token_budget=tau)
        for q in grid:
            r.point(panel, f"tau={tau}", cfg, "sharegpt", q)
    print(format_table(r.summaries, SUMMARY_COLUMNS))
    print("\nmean / p99 latency (s) by tau and QPS")
    head = "tau     " + "".join(f"{q:>14g}" for q in grid)
    print(head)
    for tau in (512, 1024, 2048, 16384):
        sums = {s["qps"]: s for s in r.panels[panel][f"tau={tau}"]}
        print(f"{tau:<8}" + "".join(
            f"{sums[q]['latency_mean']:>7.2f}/{sums[q]['latency_p99']:<6.1f}" for q in grid))
    print("paper, 6.5 QPS: tau=512 7.3/22.2, tau=1024 4.7/17.3, tau=16384 4.5/18.9")
    r.finish({}, panel)
    return 0


MODE_CONFIGS = {
    "colocated 8C": {"mode": "colocated", "num_workers": 8},
    "disaggregated 5P3D": {"mode": "disaggregated", "prefill_workers": 5, "decode_workers": 3},
    "hybrid 5P3C": {"mode": "hybrid", "prefill_workers": 5, "decode_workers": 3},
}
LOAD_FRACTIONS = (0.4, 0.6, 0.75, 0.9, 1.0)


def modes(args: argparse.Namespace) -> int:
    """Each (model, trace) panel gets its own QPS grid: fractions of the colocated deployment's
    saturation throughput (all requests offered at once), so every panel spans light load to
    saturation whatever its cost per request."""
    r = _Runner("modes", args)
    saturation: dict[str, dict[str, float]] = {}
    for model in ("llada", "dream"):
        for trace in ("sharegpt", "arxiv"):
            panel = f"{MODELS[model].name}, {trace}"
            cfgs = {label: _base(args, model=model, token_budget=1024, **kw)
                    for label, kw in MODE_CONFIGS.items()}
            saturation[panel] = {
                label: r.point(panel, label, cfg, trace, float("inf"),
                               keep=False)["throughput_rps"] for label, cfg in cfgs.items()}
            cap = saturation[panel]["colocated 8C"]
            grid = parse_float_list(args.qps) if args.qps else [
                round(f * cap, 2) for f in LOAD_FRACTIONS]
            for label, cfg in cfgs.items():
                for q in grid:
                    r.point(panel, label, cfg, trace, q)
    print(format_table(r.summaries, SUMMARY_COLUMNS))
    print("\nsaturation throughput (req/s, all requests offered at once)")
    for panel, sat in saturation.items():
        print(f"  {panel:<22}" + "".join(f"  {k} {v:6.2f}" for k, v in sat.items()))
    print("\nmean latency relative to colocated (negative: better than colocated)")
    for panel, configs in r.panels.items():
        colo = {s["qps"]: s["latency_mean"] for s in configs["colocated 8C"]}
        for label in ("disaggregated 5P3D", "hybrid 5P3C"):
            diffs = "  ".join(
                f"{s['qps']:g}: {100 * (s['latency_mean'] / colo[s['qps']] - 1):+.0f}%"
                for s in configs[label])
            print(f"  {panel:<22} {label:<19} {diffs}")
    lw = ", layer-wise KV streaming" if args.layerwise_kv_streaming else ""
    r.finish({"saturation_rps": saturation, "link": args.link},
             f"serving modes, 8x {GPUS[args.gpu].name}, K/V over {args.link}{lw}")
    return 0


STATIC_TAUS = (512, 1024, 2048, 4096, 16384)
ADAPTIVE = {"floor": 4096, "drain_iterations": DRAIN_ITERATIONS}  # the one compared
METRICS = ("latency_mean", "latency_p99")


def adaptive_tau(args: argparse.Namespace) -> int:
    """Per trace: a QPS grid of fractions of the tau=16384 deployment's saturation throughput;
    at each point every policy's mean and p99 over the best static tau's there. Each policy is
    scored by its worst ratio over the loads, per trace and over both traces (one setting,
    untuned, for both workloads: what the adaptive budget is for)."""
    r = _Runner("adaptive-tau", args)
    adaptive = f"adaptive tau>={ADAPTIVE['floor']}, drain {ADAPTIVE['drain_iterations']}"
    worst: dict[str, dict[str, float]] = {}
    for trace in ("sharegpt", "arxiv"):
        panel = f"LLaDA-8B, {trace}, 8x {GPUS[args.gpu].name} colocated"
        base = _base(args, model="llada", num_workers=8)
        cfgs = {f"tau={t}": replace(base, token_budget=t) for t in STATIC_TAUS}
        cfgs[adaptive] = replace(base, policy="adaptive", token_budget=ADAPTIVE["floor"],
                                 drain_iterations=ADAPTIVE["drain_iterations"])
        cap = r.point(panel, "tau=16384", cfgs["tau=16384"], trace, float("inf"),
                      keep=False)["throughput_rps"]
        grid = _grid(args, [round(f * cap, 2) for f in LOAD_FRACTIONS])
        for label, cfg in cfgs.items():
            for q in grid:
                r.point(panel, label, cfg, trace, q)
        runs = r.panels[panel]
        for m in METRICS:
            best = [min(runs[k][i][m] for k in cfgs if k != adaptive) for i in range(len(grid))]
            for label in cfgs:
                worst.setdefault(label, {})[f"{trace}_{m}"] = max(
                    runs[label][i][m] / best[i] for i in range(len(grid)))
    for scores in worst.values():
        for m in METRICS:
            scores[f"both_{m}"] = max(scores[f"{t}_{m}"] for t in ("sharegpt", "arxiv"))
    print(format_table(r.summaries, SUMMARY_COLUMNS))
    cols = [f"{t}_{m}" for t in ("sharegpt", "arxiv", "both") for m in METRICS]
    print("\nworst latency ratio over the loads to the best static tau at each load")
    print(f"  {'policy':<28}" + "".join(f"{c.replace('latency_', ''):>16}" for c in cols))
    for label, scores in worst.items():
        print(f"  {label:<28}" + "".join(f"{scores[c]:>16.3f}" for c in cols))
    r.finish({"worst_ratio": worst, "adaptive": ADAPTIVE, "static_taus": STATIC_TAUS},
             f"adaptive tau, 8x {GPUS[args.gpu].name}")
    return 0


# The 8 GPUs as (GPUs per worker, workers), by label.
TP_LAYOUTS = {"TP1x8": (1, 8), "TP2x4": (2, 4), "TP8x1": (8, 1)}
# Loads as fractions of the best layout's saturation: light enough for TP8x1's one worker to
# keep up, heavy enough to saturate the others.
TP_LOAD_FRACTIONS = (0.1, 0.25, 0.4, 0.6, 0.8, 0.95)
EP_MODEL = "llada2-flash"
EP_SIZES = (4, 8)  # 100B parameters in bf16 do not fit one or two GPUs
# Forwards the expert-parallel schemes are compared at (LLaDA2's blocks of 32, block-causal).
EP_BATCHES = {"decode 32 x 32 tokens": [Span(32, 1024, 32, causal_block=32)] * 32,
              "prefill 4096 tokens": [Span(4096, 4096, 32, causal_block=32)]}


def expert_parallel_comparison(args: argparse.Namespace) -> list[dict]:
    """LLaDA2.0-flash under expert parallelism at each of ``EP_SIZES``: per batch, one MoE
    layer's communication by scheme, and the forward's time with each (the engine's scheme is
    the one the cost model prices; the other swaps in its MoE layers' cost)."""
    geom = MODELS[EP_MODEL]
    coeffs = coefficients_from_args(args, SimConfig(gpu=args.gpu))
    rows = []
    for size in EP_SIZES:
        cm = CostModel(geom, coeffs, tp=TensorParallel.on(GPUS[args.gpu], size,
                                                         expert_parallel=True))
        for batch, spans in EP_BATCHES.items():
            comm = cm.moe_communication(sum(s.q_len for s in spans))
            forward = cm.iteration_time(spans)
            rows.append({"gpus": size, "batch": batch, "moe_layer_s": comm, "forward_s": {
                k: forward + geom.moe_layers * (v - comm[ENGINE_EP_SCHEME])
                for k, v in comm.items()}})
    return rows


def tensor_parallel(args: argparse.Namespace) -> int:
    """Per trace, a QPS grid of fractions of the best layout's saturation throughput and each
    layout's latency on it; then the expert-parallel schemes
    (:func:`expert_parallel_comparison`)."""
    r = _Runner("tensor-parallel", args)
    saturation: dict[str, dict[str, float]] = {}
    for trace in ("sharegpt", "arxiv"):
        cfgs = {label: _base(args, model="llada", num_workers=workers, tensor_parallel_size=n)
                for label, (n, workers) in TP_LAYOUTS.items()}
        gpus = next(iter(cfgs.values())).num_gpus  # every layout's
        panel = f"LLaDA-8B, {trace}, {gpus}x {GPUS[args.gpu].name} colocated"
        saturation[panel] = {label: r.point(panel, label, cfg, trace, float("inf"),
                                            keep=False)["throughput_rps"]
                             for label, cfg in cfgs.items()}
        best = max(saturation[panel].values())
        grid = _grid(args, [round(f * best, 2) for f in TP_LOAD_FRACTIONS])
        for label, cfg in cfgs.items():
            for q in grid:
                r.point(panel, label, cfg, trace, q)
    for panel in saturation:
        print(f"{panel}\n" + format_table([s for s in r.summaries if s["panel"] == panel],
                                          SUMMARY_COLUMNS))
    print("\nsaturation throughput (req/s, all requests offered at once), and mean / p90 "
          "latency (s) by offered QPS")
    for panel, sat in saturation.items():
        print(f"  {panel}")
        for label, cap in sat.items():
            lat = "  ".join(f"{s['qps']:g}: {s['latency_mean']:.2f}/{s['latency_p90']:.2f}"
                            for s in r.panels[panel][label])
            print(f"    {label:<6} saturation {cap:6.2f}   {lat}")
    ep = expert_parallel_comparison(args)
    geom = MODELS[EP_MODEL]
    print(f"\n{geom.name} under expert parallelism ({geom.experts} experts, top "
          f"{geom.experts_per_token}, hidden {geom.hidden}, {geom.moe_layers} MoE layers): one "
          "MoE layer's communication (us) and the forward (ms), by scheme")
    print(f"  {'GPUs':<6}{'batch':<24}" + "".join(f"{k + ' us':>15}" for k in EP_SCHEMES)
          + "".join(f"{'fwd ' + k + ' ms':>19}" for k in EP_SCHEMES))
    for row in ep:
        print(f"  {'TP' + str(row['gpus']):<6}{row['batch']:<24}"
              + "".join(f"{1e6 * row['moe_layer_s'][k]:>15.1f}" for k in EP_SCHEMES)
              + "".join(f"{1e3 * row['forward_s'][k]:>19.2f}" for k in EP_SCHEMES))
    cheaper = all(row["moe_layer_s"][ENGINE_EP_SCHEME] == min(row["moe_layer_s"].values())
                  for row in ep)
    print(f"  chosen: {ENGINE_EP_SCHEME} (the engine's: no collective beyond the layer's "
          "all-reduce)" + (", the cheaper at every size here" if cheaper else
                           ", though not the cheaper everywhere here"))
    r.finish({"saturation_rps": saturation, "layouts": TP_LAYOUTS, "expert_parallel": ep,
              "expert_parallel_scheme": ENGINE_EP_SCHEME},
             f"tensor parallelism, LLaDA-8B, 8x {GPUS[args.gpu].name}")
    return 0


EXPERIMENTS = {"fastdllm-vs-deficit": fastdllm_vs_deficit, "tau-sweep": tau_sweep,
               "modes": modes, "refresh-cadence": refresh_cadence, "adaptive-tau": adaptive_tau,
               "block-causal": block_causal, "tensor-parallel": tensor_parallel}


def run_experiment(name: str, args: argparse.Namespace) -> int:
    return EXPERIMENTS[name](args)
