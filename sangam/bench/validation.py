"""The simulator against a measured run: ``sangam-bench sim --against SERVE_DIR``.

``sangam-bench serve --out SERVE_DIR`` records a real engine's latency at each (configuration,
QPS); the simulator, given the same trace flags (``--trace``, ``--num-requests``,
``--trace-seed``, ``--length-scale``, ``--qps``), the serve run's ``profile.json`` as
``--step-profile`` and a ``--calibration`` from the same machine, predicts the same points.
This pairs them by scheduling policy and QPS and reports simulated / measured mean and p99
latency, and whether the two ran the same requests (prompt and output lengths).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence

from sangam.bench.report import format_table, policy_label


def load_measured(serve_dir: str | os.PathLike) -> tuple[dict, dict]:
    """A serve run's summaries and request lengths, each keyed by (policy key, QPS)."""
    with open(os.path.join(serve_dir, "results.json")) as f:
        report = json.load(f)
    if report.get("kind") != "serve" or not report.get("configs"):
        raise ValueError(f"{serve_dir}: not the output of an in-process sangam-bench serve run")
    keys = {label: policy_label(c["policy"], c["token_budget"])
            for label, c in report["configs"].items()}
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
    keys = {label: policy_label(c.policy, c.token_budget) for label, c in sim_configs.items()}
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
