"""One simulated run at an offered load, from the command line's flags: the trace's lengths
and arrivals, the step model, the cost coefficients and the model's geometry. ``sangam-bench
sim`` and its experiments run their points through it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sangam.bench.cost_model import (
    BF16_BYTES,
    CALIBRATED,
    GPUS,
    Coefficients,
    ModelGeometry,
    load_calibrated_geometry,
)
from sangam.bench.report import summarize
from sangam.bench.sim.config import SimConfig
from sangam.bench.sim.simulator import SimResult, simulate
from sangam.bench.sim.steps import GeometricSteps, StepModel, load_step_profile
from sangam.bench.traces import (
    LengthSample,
    TraceRequest,
    arrivals,
    build_trace,
    load_lengths,
    scale_lengths,
    with_shared_prompts,
)

DEFAULT_NUM_REQUESTS = 300  # per run; the experiments have their own


def step_model_from_args(args: argparse.Namespace) -> StepModel:
    if args.step_profile:
        return load_step_profile(args.step_profile, args.block_length)
    return GeometricSteps(args.tokens_per_step)


def coefficients_from_args(args: argparse.Namespace, config: SimConfig) -> Coefficients:
    if args.calibration:
        return Coefficients.load(args.calibration)
    return Coefficients.defaults(GPUS[config.gpu])


def geometry_from_args(args: argparse.Namespace, config: SimConfig
                       ) -> tuple[ModelGeometry, int] | None:
    """The shape of ``--model calibrated``: a checkpoint's config.json (``--model-config``,
    bf16), else what ``--calibration`` was measured on."""
    if config.model != CALIBRATED:
        return None
    if getattr(args, "model_config", None):
        from sangam.models.checkpoint import read_config

        path = args.model_config
        return ModelGeometry.of(str(path).rstrip("/").rsplit("/", 1)[-1], read_config(path)), \
            BF16_BYTES
    if not args.calibration:
        raise ValueError("--model calibrated needs --calibration or --model-config")
    return load_calibrated_geometry(args.calibration)


# Prompt token ids the simulator makes up for shared prompts: only their equality matters.
SIM_VOCAB = 1 << 20


def make_trace(lengths: Sequence[LengthSample], qps: float, args: argparse.Namespace
               ) -> list[TraceRequest]:
    times = arrivals(len(lengths), qps, args.trace_seed + 1, args.arrival, args.cv)
    return with_shared_prompts(build_trace(lengths, times), args.shared_prefix, args.samples,
                               SIM_VOCAB, args.trace_seed + 3)


def run_point(config: SimConfig, lengths: Sequence[LengthSample], qps: float,
              args: argparse.Namespace, label: str, steps: StepModel | None = None
              ) -> tuple[dict, SimResult]:
    """One simulated run; its summary carries ``config`` (the label) and utilization (and, for
    a load-adaptive threshold, the mean threshold its blocks decoded at). ``steps``: the
    configuration's own step model (a quality profile's), else the flags'."""
    res = simulate(config, make_trace(lengths, qps, args), qps,
                   coefficients_from_args(args, config), steps or step_model_from_args(args),
                   geometry_from_args(args, config))
    summary = {"config": label, **summarize(res.records, qps)}
    summary["utilization"] = sum(w["utilization"] for w in res.workers) / len(res.workers)
    summary["prefill_tokens"] = sum(w["prefill_tokens"] for w in res.workers)
    thresholds = [r["threshold"] for r in res.records if r.get("threshold") is not None]
    if thresholds:
        summary["threshold_mean"] = sum(thresholds) / len(thresholds)
    return summary, res


def trace_lengths(args: argparse.Namespace) -> list[LengthSample]:
    return scale_lengths(load_lengths(args.trace, args.num_requests or DEFAULT_NUM_REQUESTS,
                                      args.trace_seed), args.length_scale)
