"""The simulator against a measured run: ``sangam-bench sim --against SERVE_DIR``.

``sangam-bench serve --out SERVE_DIR`` records a real engine's latency at each (configuration,
QPS); the simulator, given the same trace flags (``--trace``, ``--num-requests``,
``--trace-seed``, ``--length-scale``, ``--qps``), the serve run's ``profile.json`` as
``--step-profile`` and a ``--calibration`` from the same machine, predicts the same points.
This pairs them by configuration (:func:`config_key`: the scheduling policy, plus the refresh
cadence and threshold where they are not the defaults) and QPS and reports simulated / measured
mean and p99 latency, and whether the two ran the same requests (prompt and output lengths).
When the serve run's ``profile.json`` has each configuration's own forwards-per-block histogram
(``configs``), :func:`step_profiles` gives each simulated configuration its own.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence

from sangam.bench.report import format_table, policy_label
from sangam.bench.sim.steps import ProfileSteps
from sangam.sampling_params import SamplingParams

_DEFAULTS = SamplingParams()


def config_key(policy: str, token_budget: float | str, refresh_interval: int | None = None,
               prompt_refresh_interval: int | None = None, threshold: float | None = None
               ) -> str:
    """What pairs a serve configuration with a simulated one: the policy's words
    (``policy_label``), then the refresh cadence and threshold when not the defaults (None: the
    default, as an EngineConfig leaves it)."""
    key = policy_label(policy, token_budget)
    ri = refresh_interval or _DEFAULTS.refresh_interval
    pi = prompt_refresh_interval or _DEFAULTS.prompt_refresh_interval
    if (ri, pi) != (_DEFAULTS.refresh_interval, _DEFAULTS.prompt_refresh_interval):
        key += f" refresh={ri}/{pi}"
    if threshold is not None and threshold != _DEFAULTS.threshold:
        key += f" threshold={threshold:g}"
    return key


def _serve_key(c: dict) -> str:
    return config_key(c["policy"], c["token_budget"], c.get("refresh_interval"),
                      c.get("prompt_refresh_interval"), c.get("threshold"))


def sim_key(c) -> str:
    """:func:`config_key` of a simulated configuration (a SimConfig)."""
    return config_key(c.policy, c.token_budget, c.refresh_interval, c.prompt_refresh_interval,
                      c.threshold)


def step_profiles(serve_dir: str | os.PathLike) -> dict[str, ProfileSteps]:
    """Each serve configuration's own forwards-per-block histogram (its ``profile.json``'s
    ``configs``), keyed by :func:`config_key`; empty when it has none."""
    path = os.path.join(serve_dir, "profile.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        profile = json.load(f)
    with open(os.path.join(serve_dir, "results.json")) as f:
        configs = json.load(f).get("configs") or {}
    return {_serve_key(configs[label]): ProfileSteps({int(k): int(v) for k, v in
                                                      h["steps_per_block"].items()})
            for label, h in (profile.get("configs") or {}).items() if label in configs}


def load_measured(serve_dir: str | os.PathLike) -> tuple[dict, dict]:
    """A serve run's summaries and request lengths, each keyed by (policy key, QPS)."""
    with open(os.path.join(serve_dir, "results.json")) as f:
        report = json.load(f)
    if report.get("kind") != "serve" or not report.get("configs"):
        raise ValueError(f"{serve_dir}: not the output of an in-process sangam-bench serve run")
    keys = {label: _serve_key(c) for label, c in report["configs"].items()}
    summaries = {(keys[s["config"]], float(s["qps"])): s for s in report["summaries"]}
    lengths: dict[tuple, list] = {}
    path = os.path.join(serve_dir, "requests.csv")
    if os.path.exists(path):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                point = (keys[r["config"]], float(r["qps"]))
                lengths.setdefault(point, []).append((int(r["prompt_len"]), int(r["gen_len"])))
    return summaries, lengths


def compare(sim_summaries: Sequence[dict], sim_records: Sequence[dict],
            sim_configs: Mapping[str, object], serve_dir: str | os.PathLike) -> list[dict]:
    """One row per simulated point that the serve run measured too (``config``: the policy)."""
    measured, measured_lengths = load_measured(serve_dir)
    keys = {label: sim_key(c) for label, c in sim_configs.items()}
    sim_lengths: dict[tuple, list] = {}
    for r in sim_records:
        sim_lengths.setdefault((keys[r["config"]], float(r["qps"])), []).append(
            (r["prompt_len"], r["gen_len"]))
    rows = []
    for s in sim_summaries:
        point = (keys[s["config"]], float(s["qps"]))
        m = measured.get(point)
        if m is None or "latency_mean" not in m or "latency_mean" not in s:
            continue
        same = (sorted(sim_lengths.get(point, [])) == sorted(measured_lengths[point])
                if point in measured_lengths else None)
        rows.append({"config": point[0], "qps": point[1],
                     "measured_mean": m["latency_mean"], "simulated_mean": s["latency_mean"],
                     "mean_ratio": s["latency_mean"] / m["latency_mean"],
                     "measured_p99": m["latency_p99"], "simulated_p99": s["latency_p99"],
                     "p99_ratio": s["latency_p99"] / m["latency_p99"],
                     "same_requests": same})
    return rows


COLUMNS = (("qps", "QPS", "{:.3g}"),
           ("measured_mean", "measured mean s", "{:.3f}"),
           ("simulated_mean", "simulated mean s", "{:.3f}"), ("mean_ratio", "sim/meas", "{:.2f}"),
           ("measured_p99", "measured p99 s", "{:.3f}"),
           ("simulated_p99", "simulated p99 s", "{:.3f}"), ("p99_ratio", "sim/meas", "{:.2f}"),
           ("same_requests", "same requests", "{}"))


def format_rows(rows: Sequence[dict]) -> str:
    return format_table(rows, COLUMNS, lead="policy")
