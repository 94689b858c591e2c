"""``sangam-bench capacity``: the highest offered load (QPS) whose latency meets an SLO.

The search doubles the load from ``--qps-start`` until the SLO fails, then bisects between the
last load that met it and the first that did not, until the bracket is within ``--rel-tol``.
Latency is assumed to grow with load; each probe is one full run of ``serve`` (real engine or
server) or ``sim`` (simulator) at that QPS, with the same trace lengths and arrival seed.

    sangam-bench capacity --slo-mean 5 sim --model llada --num-workers 8
    sangam-bench capacity --slo-p99 20 serve --model /path/to/ckpt --length-scale 0.05
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass
class CapacityResult:
    qps: float  # highest load found to meet the SLO; 0 when even the lowest probe failed
    probes: list[tuple[float, float, bool]] = field(default_factory=list)  # (qps, metric, ok)


def find_capacity(measure: Callable[[float], float | None], slo: float, qps_start: float = 1.0,
                  rel_tol: float = 0.05, max_qps: float = 1e4, min_qps: float = 1e-3
                  ) -> CapacityResult:
    """Highest QPS with ``measure(qps) <= slo``, by doubling then bisection.

    If ``qps_start`` already fails, the search halves it (down to ``min_qps``) to find a
    load that passes before bisecting.
    """
    if slo <= 0 or qps_start <= 0 or not 0 < rel_tol < 1:
        raise ValueError("slo, qps_start must be > 0 and rel_tol in (0, 1)")
    res = CapacityResult(0.0)

    def ok(q: float) -> bool:
        m = measure(q)
        good = m is not None and math.isfinite(m) and m <= slo
        res.probes.append((q, m, good))
        return good

    lo, hi = 0.0, math.inf
    q = qps_start
    if ok(q):
        lo = q
        while hi == math.inf and q < max_qps:
            q = min(2 * q, max_qps)
            if ok(q):
                lo = q
            else:
                hi = q
        if hi == math.inf:  # met the SLO up to max_qps
            res.qps = lo
            return res
    else:
        hi = q
        while lo == 0.0 and q / 2 >= min_qps:
            q /= 2
            if ok(q):
                lo = q
            else:
                hi = q
        if lo == 0.0:
            return res
    while (hi - lo) > rel_tol * hi:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    res.qps = lo
    return res


def _metric_of(args: argparse.Namespace) -> tuple[str, float]:
    if (args.slo_mean is None) == (args.slo_p99 is None):
        raise SystemExit("capacity: give exactly one of --slo-mean or --slo-p99")
    return ("latency_mean", args.slo_mean) if args.slo_mean is not None \
        else ("latency_p99", args.slo_p99)


@dataclass(frozen=True)
class CapacityTarget:
    """A benchmark the search probes (``sangam-bench capacity TARGET``): its flags, the
    configurations they name, and one run of a configuration at a load."""

    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    config_labels: Callable[[argparse.Namespace], list[str]]
    # args -> (qps, config label) -> that run's summary (``latency_mean``, ``latency_p99``, ...)
    probe: Callable[[argparse.Namespace], Callable[[float, str], dict]]


def run(args: argparse.Namespace) -> int:
    key, slo = _metric_of(args)
    target: CapacityTarget = args.capacity_target
    measure_all = target.probe(args)
    results = {}
    for label in target.config_labels(args):
        def measure(q: float, label: str = label) -> float:
            value = measure_all(q, label).get(key)
            shown = "-" if value is None else f"{value:.3f} s"
            print(f"  [{label}] qps {q:.4g}: {key} {shown}", flush=True)
            return value

        print(f"{label}: searching for the highest QPS with {key} <= {slo} s", flush=True)
        res = find_capacity(measure, slo, args.qps_start, args.rel_tol, args.max_qps)
        results[label] = res
        print(f"{label}: capacity {res.qps:.4g} QPS ({len(res.probes)} runs)", flush=True)
    print(f"\ncapacity at {key} <= {slo} s")
    for label, res in results.items():
        print(f"  {label:<28} {res.qps:8.4g} QPS")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"metric": key, "slo_s": slo, "results": {
                k: {"qps": r.qps, "probes": [{"qps": q, "value": m, "ok": g}
                                              for q, m, g in r.probes]}
                for k, r in results.items()}}, f, indent=2)
    return 0


def register(subparsers: argparse._SubParsersAction, targets: Mapping[str, CapacityTarget]
             ) -> None:
    """The ``capacity`` subcommand, with one sub-subcommand per target (its own flags)."""
    p = subparsers.add_parser(
        "capacity", help="highest QPS meeting a latency SLO (real runs or simulated)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slo-mean", type=float, default=None, help="mean end-to-end latency SLO, s")
    p.add_argument("--slo-p99", type=float, default=None, help="p99 end-to-end latency SLO, s")
    p.add_argument("--qps-start", type=float, default=1.0)
    p.add_argument("--max-qps", type=float, default=1e4)
    p.add_argument("--rel-tol", type=float, default=0.05,
                   help="stop when the bracket is this fraction of its upper end")
    p.add_argument("--json", default=None, help="write the searches to this JSON file")
    sub = p.add_subparsers(dest="target", required=True)
    for name, target in targets.items():
        tp = sub.add_parser(name, help=target.help)
        target.add_args(tp)
        tp.set_defaults(capacity_target=target)
    p.set_defaults(func=run)
