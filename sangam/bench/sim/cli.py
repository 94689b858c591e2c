"""``sangam-bench sim``: the simulator's flags, one run per configuration and load (or one of
the paper's experiments, ``--experiment``), the simulated-against-measured comparison
(``--against``), and the probe ``sangam-bench capacity`` searches with."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import replace

from sangam.bench import validation
from sangam.bench.cost_model import CALIBRATED, GPUS, LINKS, MODELS
from sangam.bench.experiments import EXPERIMENTS, run_experiment
from sangam.bench.report import (
    SUMMARY_COLUMNS,
    format_table,
    parse_float_list,
    parse_overrides,
    plot_latency,
    write_outputs,
)
from sangam.bench.sim import simulator
from sangam.bench.sim.config import ENGINE_FIELDS, SimConfig
from sangam.bench.sim.runs import (
    DEFAULT_NUM_REQUESTS,
    coefficients_from_args,
    geometry_from_args,
    run_point,
    step_model_from_args,
    trace_lengths,
)
from sangam.bench.sim.steps import GeometricSteps
from sangam.bench.traces import add_prompt_sharing_args
from sangam.sampling_params import CACHE_MODES
from sangam.sched.config import MODES, POLICIES
from sangam.sched.window_rings import KV_POOLS

_HELP = {
    "model": "model geometry (docs/design.md §6): llada = LLaDA-8B, dream = Dream-7B, sdar = "
             "SDAR-8B, sdar-4b, sdar-1.7b (block-causal: one prefill per request), "
             "calibrated = the model a --calibration file was measured on (e.g. a "
             "CPU-calibrated small one)",
    "gpu": "GPU of every worker: peak FLOP/s, HBM bandwidth and memory",
    "mode": "colocated, disaggregated (xPyD) or hybrid (xPyD + overflow onto decode workers)",
    "num_workers": "workers in colocated mode (each --tensor-parallel-size GPUs)",
    "prefill_workers": "prefill workers in disaggregated / hybrid mode",
    "decode_workers": "decode workers in disaggregated / hybrid mode",
    "tensor_parallel_size": "GPUs per worker (Megatron tensor parallelism: heads, projections "
                            "and the LM head split across them, two all-reduces per layer)",
    "enable_expert_parallel": "MoE models: split the experts across a worker's GPUs instead of "
                              "each expert's width",
    "policy": "scheduling policy of every worker",
    "token_budget": "deficit token budget tau per iteration ('inf' = prefill-first; adaptive: "
                    "its floor)",
    "drain_iterations": "adaptive policy: tau admits the queue's share of the waiting prefill "
                        "tokens over this many iterations",
    "enable_chunked_prefill": "block-causal models (sdar): admit a prompt's prefill in chunks "
                              "of whole blocks within tau",
    "enable_prefix_caching": "block-causal and uniform-state models: share cached prompt "
                             "blocks (default: on for "
                             "them; with --shared-prefix or --samples prompts share some)",
    "kv_pool": ENGINE_FIELDS["kv_pool"].metadata["help"],  # the engine's flag, as it is
    "max_batch_size": "most requests in one forward",
    "overflow_threshold": "hybrid: outstanding prefill tokens (theta) on every prefill worker "
                          "before a prefill overflows onto a decode worker",
    "block_length": "block length B",
    "cache": "dual (span = block), prefix (span = block + rest of canvas) or none (refresh "
             "every step)",
    "refresh_interval": "blocks start with a refresh only every this many (the others with a "
                        "cached step)",
    "prompt_refresh_interval": "every this-many-th refresh is full, the others response-only "
                               "(span [P, T), cost T - P)",
    "adaptive_refresh_rate": "adaptive refresh: the share of blocks the cadence starts from "
                             "cache that refresh fully anyway (sangam-bench quality measures "
                             "it for a refresh_confidence)",
    "threshold": "threshold of the threshold rule (what a --step-profile or --profiles profile "
                 "was measured at; the load-adaptive threshold starts from it)",
    "min_threshold": "load-adaptive threshold (SamplingParams.min_threshold): each block's "
                     "threshold is the engine's threshold_under(the worker's load), and its "
                     "steps come from that threshold's profile (refresh-cadence --profiles; "
                     "default there 0.7)",
    "max_tokens": "fixed max_tokens of every request (canvas size); default: its output length",
    "page_size": "KV page size in tokens",
    "num_pages": "KV pages per worker; default: GPU memory left after the weights",
    "memory_fraction": "fraction of GPU memory for weights + KV pool",
    "link": "K/V transfer link: nvlink 450 GB/s, pcie 50 GB/s, network 25 GB/s",
    "layerwise_kv_streaming": "send layer l's K/V while layer l+1 computes",
    "seed": "seed of router tie-breaks and of the tokens committed per step",
}
_CHOICES = {"model": [*sorted(MODELS), CALIBRATED], "gpu": sorted(GPUS), "mode": MODES,
            "link": sorted(LINKS), "policy": POLICIES, "cache": CACHE_MODES,
            "kv_pool": KV_POOLS}
EXPERIMENT_NAMES = tuple(EXPERIMENTS)  # the --experiment choices


def add_sim_args(p: argparse.ArgumentParser, for_capacity: bool = False) -> None:
    g = p.add_argument_group("deployment (one configuration; --compare adds more)")
    for f in dataclasses.fields(SimConfig):
        kind = str(f.type)
        kw: dict = {"help": _HELP[f.name], "default": f.default}
        if kind in ("bool", "bool | None"):
            kw["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("float"):
            kw["type"] = float
        elif kind.startswith("int"):
            kw["type"] = int
        if f.name in _CHOICES:
            kw["choices"] = _CHOICES[f.name]
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kw)
    g.add_argument("--compare", nargs="+", default=None, metavar="SPEC",
                   help="configurations to compare side by side, each a comma-separated list "
                        "of overrides of the flags above, e.g. 'policy=fastdllm' "
                        "'mode=hybrid,prefill_workers=5,decode_workers=3'")
    g.add_argument("--policies", default=None,
                   help="shorthand for --compare policy=A policy=B ...: comma-separated")
    g.add_argument("--token-budgets", default=None,
                   help="shorthand for --compare token_budget=A ...: comma-separated")
    g.add_argument("--calibration", default=None,
                   help="JSON of measured cost coefficients (sangam-bench calibrate)")
    g.add_argument("--model-config", default=None, metavar="CHECKPOINT",
                   help="with --model calibrated: the model's shape from this checkpoint's "
                        "config.json (e.g. a DiffusionGemma one) instead of --calibration's")
    t = p.add_argument_group("workload")
    t.add_argument("--trace", default="sharegpt",
                   help="sharegpt, arxiv or chat (seeded synthetic), or a ShareGPT .json / .csv "
                        "file")
    t.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per run (default {DEFAULT_NUM_REQUESTS}; experiments have "
                        "their own)")
    t.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    t.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    t.add_argument("--trace-seed", type=int, default=0, help="seed of lengths and arrivals")
    t.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every prompt and output length (as sangam-bench serve's)")
    add_prompt_sharing_args(t)
    t.add_argument("--tokens-per-step", type=float, default=GeometricSteps().mean,
                   help="mean tokens committed per forward (geometric)")
    t.add_argument("--step-profile", default=None,
                   help="forwards-per-block histogram recorded by sangam-bench serve "
                        "(profile.json), or FILE#MODE: a uniform-state mode's forwards per "
                        "canvas from sangam-bench quality --json; replaces --tokens-per-step")
    if not for_capacity:
        t.add_argument("--profiles", default=None,
                       help="refresh-cadence experiment: the commit profiles of sangam-bench "
                            "quality --profiles, one per configuration (forwards per block by "
                            "block index, refresh rates)")
        t.add_argument("--profile-anchor", type=float, default=None, metavar="TPF",
                       help="with --profiles: scale every profile's tokens per forward by one "
                            "factor, the one that makes Fast-dLLM's (threshold 0.9) this many "
                            "(LLaDA-8B's: 3.25); default: as measured")
        t.add_argument("--qps", default=None,
                       help="offered load(s), comma-separated ('inf': all at once); default 1, "
                            "experiments have their own grids")
        p.add_argument("--out", default=None,
                       help="directory for results.json, summary.csv, requests.csv and the plot")
        p.add_argument("--against", default=None, metavar="SERVE_DIR",
                       help="the --out directory of a sangam-bench serve run on the same trace "
                            "flags: print simulated / measured latency per policy and QPS")
        p.add_argument("--experiment", default=None, choices=sorted(EXPERIMENT_NAMES),
                       help="run one of the paper's experiments, or refresh-cadence / "
                            "adaptive-tau / block-causal / tensor-parallel (of the "
                            "deployment flags it takes "
                            "--gpu, --link, --layerwise-kv-streaming, --calibration and "
                            "--seed, and refresh-cadence --adaptive-refresh-rate, "
                            "--profiles, --profile-anchor and --min-threshold; "
                            "--num-requests and --qps "
                            "replace its defaults)")


def configs_from_args(args: argparse.Namespace) -> dict[str, SimConfig]:
    """Label -> configuration: the flags, with each --compare spec applied on top."""
    base = SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})
    specs = list(args.compare or [])
    policies = args.policies.split(",") if args.policies else [None]
    budgets = args.token_budgets.split(",") if args.token_budgets else [None]
    for pol, tau in itertools.product(policies, budgets):
        parts = ([f"policy={pol}"] if pol else []) + ([f"token_budget={tau}"] if tau else [])
        if parts:
            specs.append(",".join(parts))
    configs = [(s, replace(base, **parse_overrides(s, SimConfig))) for s in specs or [""]]
    labels = [c.label for _, c in configs]
    return {(c.label if labels.count(c.label) == 1 else f"{c.label} [{s}]"): c
            for s, c in configs}


def config_labels(args: argparse.Namespace) -> list[str]:
    return list(configs_from_args(args))


def capacity_probe(args: argparse.Namespace) -> Callable[[float, str], dict]:
    """For ``sangam-bench capacity``: (qps, label) -> summary of one simulated run."""
    configs = configs_from_args(args)
    lengths = trace_lengths(args)

    def probe(qps: float, label: str) -> dict:
        return run_point(configs[label], lengths, qps, args, label)[0]

    return probe


def run(args: argparse.Namespace) -> int:
    if args.experiment:
        return run_experiment(args.experiment, args)
    try:  # the user's inputs, checked before any run: a clear message instead of a traceback
        configs = configs_from_args(args)
        qps_list = parse_float_list(args.qps or "1")
        lengths = trace_lengths(args)
        steps = step_model_from_args(args)
        first = next(iter(configs.values()))
        coefficients_from_args(args, first)
        geometry = geometry_from_args(args, first)
        model_name = geometry[0].name if geometry else MODELS[first.model].name
        if args.against:
            validation.load_measured(args.against)
    except (ValueError, OSError) as e:
        raise SystemExit(f"sangam-bench sim: {e}") from e
    summaries, records = [], []
    print(f"trace {args.trace}: {len(lengths)} requests, {args.arrival} arrivals; "
          f"{steps.describe()}", file=sys.stderr)
    # Against a serve run that recorded each configuration's profile: each its own.
    own = validation.step_profiles(args.against) if args.against and args.step_profile else {}
    for label, cfg in configs.items():
        mine = own.get(validation.sim_key(cfg))
        if mine is not None:
            print(f"  {label}: its own profile, {mine.describe()}", file=sys.stderr)
        for qps in qps_list:
            summary, res = run_point(cfg, lengths, qps, args, label, mine)
            print(f"  {label} @ {qps:g} QPS: mean {summary['latency_mean']:.2f} s", file=sys.stderr)
            summaries.append(summary)
            records += [{"config": label, "qps": qps, **r} for r in res.records]
    print(format_table(summaries, SUMMARY_COLUMNS + (("utilization", "util", "{:.2f}"),)))
    against = None
    if args.against:
        against = validation.compare(summaries, records, configs, args.against)
        print(f"\nsimulated against measured ({args.against}):")
        print(validation.format_rows(against))
    if args.out:
        report = {"kind": "sim", "trace": args.trace, "num_requests": len(lengths),
                  "length_scale": args.length_scale, "configs": configs,
                  "summaries": summaries, "against": against}
        paths = write_outputs(args.out, report, summaries, records)
        by_config: dict[str, list[dict]] = {}
        for s in summaries:
            by_config.setdefault(s["config"], []).append(s)
        paths += plot_latency(
            os.path.join(args.out, "latency_vs_qps.png"),
            {f"{model_name}, {args.trace}": by_config})
        print("wrote " + ", ".join(paths))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sim", help="discrete-event simulation of a multi-GPU deployment",
        description=simulator.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_args(p)
    p.set_defaults(func=run)
