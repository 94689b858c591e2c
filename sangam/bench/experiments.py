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
  re-prefills the problem slides back toward autoregressive scheduling).
- ``refresh-cadence``: ``fastdllm-vs-deficit``'s setting, colocated tau=1024 under refresh
  cadences (``quality.REFRESH_CADENCES``: blocks between refreshes, refreshes between full ones):
  the QPS
  each sustains at the baseline's matched mean latency, against batch-1 Fast-dLLM with full
  refreshes (with ``--adaptive-refresh-rate R``, adaptive refresh at that trigger rate too).
  What each costs in quality is ``sangam-bench quality``'s to measure.

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
from sangam.bench.cost_model import GPUS, MODELS
from sangam.bench.quality import NEVER, REFRESH_CADENCES
from sangam.bench.report import (
    SUMMARY_COLUMNS,
    format_table,
    parse_float_list,
    plot_latency,
    write_outputs,
)
from sangam.bench.sim.config import SimConfig
from sangam.bench.sim.runs import coefficients_from_args, run_point, step_model_from_args
from sangam.bench.traces import load_lengths
from sangam.sched.config import DRAIN_ITERATIONS

DEFAULT_REQUESTS = {"fastdllm-vs-deficit": 300, "tau-sweep": 600, "modes": 500,
                    "refresh-cadence": 300, "adaptive-tau": 1500,
                    "block-causal": 300}


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
              keep: bool = True) -> dict:
        summary, res = run_point(cfg, self.lengths(trace), qps, self.args, label)
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
                    grid: list[float], trace: str = "sharegpt"
                    ) -> tuple[float, float, dict[str, float]]:
    """Latency against QPS for each configuration (the first is the batch-1 baseline), then the
    QPS each sustains at matched latency: twice the baseline's mean latency at light load,
    where it is pure service time. Returns (light, target, capacity by label)."""
    for label, cfg in configs.items():
        for q in grid:
            r.point(panel, label, cfg, trace, q)
    print(format_table(r.summaries, SUMMARY_COLUMNS))
    light = r.point(panel, BASELINE, configs[BASELINE], trace, 0.02,
                    keep=False)["latency_mean"]
    target = 2 * light
    caps = {}
    for label, cfg in configs.items():
        res = find_capacity(
            lambda q, cfg=cfg, label=label: r.point(panel, label, cfg, trace, q,
                                                    keep=False)["latency_mean"],
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




def refresh_cadence(args: argparse.Namespace) -> int:
    r = _Runner("refresh-cadence", args)
    panel = f"LLaDA-8B, ShareGPT, 1x {GPUS[args.gpu].name}"
    base = _base(args, model="llada")
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
    r.finish({"panels": out}, f"SDAR-8B, 1x {GPUS[args.gpu].name}")
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


EXPERIMENTS = {"fastdllm-vs-deficit": fastdllm_vs_deficit, "tau-sweep": tau_sweep,
               "modes": modes, "refresh-cadence": refresh_cadence, "adaptive-tau": adaptive_tau,
               "block-causal": block_causal}


def run_experiment(name: str, args: argparse.Namespace) -> int:
    return EXPERIMENTS[name](args)
