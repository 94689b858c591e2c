"""Shared reporting of serving runs, real (``serve``) or simulated (``sim``): per-request records,
summaries, tables, JSON / CSV files and latency-vs-QPS plots.

A *record* is one finished request as a flat dict (times in seconds on the run's clock):
``arrival``, ``finish``, ``latency`` (end to end), ``ttfb`` (time to first block), ``queueing``
(waiting before its prefills, summed over blocks), ``decode`` (refresh end to block end, summed),
``transfer`` (exposed K/V transfer, simulator only), ``forwards``, ``prompt_len``, ``gen_len``,
``canvas_tokens`` (canvas tokens decoded: whole blocks). Fields a driver cannot observe are None.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence

import numpy as np

from sangam.sched.config import SchedulerConfig

RECORD_FIELDS = ("id", "arrival", "finish", "latency", "ttfb", "queueing", "decode", "transfer",
                 "forwards", "prompt_len", "gen_len", "canvas_tokens")


def _stats(values: Sequence[float | None], prefix: str, pcts: bool = True) -> dict:
    vals = np.array([v for v in values if v is not None], dtype=float)
    if not len(vals):
        return {f"{prefix}_mean": None} | (
            {f"{prefix}_{p}": None for p in ("p50", "p90", "p99")} if pcts else {})
    out = {f"{prefix}_mean": float(vals.mean())}
    if pcts:
        for p in (50, 90, 99):
            out[f"{prefix}_p{p}"] = float(np.percentile(vals, p))
    return out


def summarize(records: Sequence[dict], offered_qps: float) -> dict:
    """Latency percentiles, mean phase times and throughput over a run's finished requests.

    Throughput is over the run's span, from the first arrival to the last finish.
    """
    n = len(records)
    out: dict = {"qps": offered_qps, "num_requests": n}
    if not n:
        return out
    start = min(r["arrival"] for r in records)
    span = max(r["finish"] for r in records) - start
    out["duration_s"] = span
    out["throughput_rps"] = n / span if span > 0 else math.inf
    out["output_tok_s"] = sum(r["gen_len"] for r in records) / span if span > 0 else math.inf
    out |= _stats([r["latency"] for r in records], "latency")
    out |= _stats([r.get("ttfb") for r in records], "ttfb", pcts=False)
    out |= _stats([r.get("queueing") for r in records], "queueing")
    out |= _stats([r.get("decode") for r in records], "decode", pcts=False)
    out |= _stats([r.get("transfer") for r in records], "transfer", pcts=False)
    forwards = sum(r["forwards"] or 0 for r in records)
    canvas = sum(r["canvas_tokens"] or 0 for r in records)
    out["tokens_per_forward"] = canvas / forwards if forwards else None
    return out


SUMMARY_COLUMNS = (
    ("qps", "QPS", "{:.3g}"), ("throughput_rps", "req/s", "{:.3f}"),
    ("output_tok_s", "tok/s", "{:.1f}"), ("latency_mean", "mean", "{:.2f}"),
    ("latency_p50", "p50", "{:.2f}"), ("latency_p90", "p90", "{:.2f}"),
    ("latency_p99", "p99", "{:.2f}"), ("queueing_mean", "queue", "{:.2f}"),
    ("decode_mean", "decode", "{:.2f}"), ("transfer_mean", "xfer", "{:.3f}"),
    ("tokens_per_forward", "tok/fwd", "{:.2f}"),
    ("prefill_tokens", "prefill tok", "{:.0f}"),  # refresh work (prefix caching saves some)
)


def format_table(rows: Sequence[dict], columns=SUMMARY_COLUMNS, lead: str = "config") -> str:
    """Fixed-width table, one row per (configuration, QPS) summary; ``rows`` carry ``config``."""
    head = [lead, *(title for _, title, _ in columns)]
    body = []
    for r in rows:
        cells = [str(r.get("config", ""))]
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else fmt.format(v))
        body.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in
                               enumerate(zip(row, widths))) for row in [head, *body])


def _jsonable(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def write_outputs(out_dir: str | os.PathLike, report: dict, summaries: Sequence[dict],
                  records: Sequence[dict]) -> list[str]:
    """``results.json`` (everything), ``summary.csv`` (one row per configuration and QPS) and
    ``requests.csv`` (one row per request, tagged with its configuration and QPS)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("results.json", "summary.csv", "requests.csv")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=2, default=_jsonable)
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    with open(paths[1], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(summaries)
    with open(paths[2], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["config", "qps", *RECORD_FIELDS], extrasaction="ignore")
        w.writeheader()
        w.writerows(records)
    return paths


def plot_latency(path: str | os.PathLike, panels: dict[str, dict[str, list[dict]]],
                 title: str = "") -> list[str]:
    """Mean (solid) and p99 (dashed) latency against offered QPS, one line per configuration,
    one subplot per panel (``{panel: {config: [summary, ...]}}``). Returns the paths written:
    none where matplotlib is not installed (the GPU machine), which costs only the plot."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn", file=sys.stderr)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    n = len(panels)
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, (panel, configs) in zip(axes.flat, panels.items()):
        values = []
        for i, (name, sums) in enumerate(configs.items()):
            pts = sorted((s["qps"], s.get("latency_mean"), s.get("latency_p99")) for s in sums
                         if s.get("latency_mean") is not None)
            if not pts:
                continue
            q, mean, p99 = zip(*pts)
            values += [*mean, *p99]
            color = f"C{i}"
            ax.plot(q, mean, "o-", color=color, label=f"{name} mean")
            ax.plot(q, p99, "x--", color=color, alpha=0.6, label=f"{name} p99")
        ax.set_xlabel("offered load (QPS)")
        ax.set_ylabel("end-to-end latency (s)")
        if values and min(values) > 0 and max(values) / min(values) > 20:
            # Overloaded points grow without bound: a log axis keeps the rest readable.
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_ylim(bottom=0)
        if n > 1 or not title:
            ax.set_title(panel, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def policy_label(policy: str, token_budget: float | str) -> str:
    """What a configuration schedules: ``fastdllm``, ``prefill-first``, ``deficit tau=T`` or
    ``adaptive tau>=T`` (the serve benchmark's labels; the simulator's runs are paired with them
    by these words)."""
    tau = float(token_budget)
    if policy == "fastdllm":
        return "fastdllm"
    if math.isinf(SchedulerConfig(policy=policy, token_budget=tau).budget):
        return "prefill-first"
    if policy == "adaptive":
        return f"adaptive tau>={tau:g}"
    return f"deficit tau={tau:g}"


def parse_float_list(text: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]``; "inf" allowed."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from e
    if not vals or any(not v > 0 for v in vals):
        raise ValueError(f"expected positive numbers, got {text!r}")
    return vals


def parse_int_list(text: str) -> list[int]:
    """``"1,16,64"`` -> ``[1, 16, 64]``: positive integers."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from e
    if not vals or min(vals) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return vals


def parse_overrides(spec: str, cls) -> dict:
    """``"policy=fastdllm,token_budget=512"`` -> typed field overrides of dataclass ``cls``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"bad override {item!r} in {spec!r}: use field=value with a field "
                             f"of {sorted(fields)}")
        kind = str(fields[key].type)  # annotation text, e.g. "int | None"
        raw = raw.strip()
        if raw.lower() == "none" and "None" in kind:
            out[key] = None
        elif kind.startswith("bool"):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key} takes true or false, got {raw!r}")
            out[key] = raw.lower() in ("true", "1")
        elif kind.startswith("float"):
            out[key] = float(raw)
        elif kind.startswith("int"):
            out[key] = int(raw)
        else:
            out[key] = raw
    return out
