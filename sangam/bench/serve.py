"""``sangam-bench serve``: replay a trace against the engine in-process, or against a server.

Open-loop load: each request is submitted at its trace arrival time (Poisson or gamma at the
given QPS) whatever the state of earlier ones, and timed from that arrival; several QPS values
(``--qps 0.5,1,2``) make a latency-vs-load curve. Several engine configurations run side by
side in one invocation (``--policies deficit,fastdllm``, ``--token-budgets 512,1024`` or
``--compare SPEC ...``) on the same trace: the same lengths and arrival times for each.

In-process (the default) the engine is built from the usual engine flags (``--model``,
``--device``, ``--policy``, ``--token-budget``, ...) and driven through ``Engine.add_request`` /
``Engine.step`` on the wall clock. Prompts are random token ids of the trace's lengths (or the
trace's text when it has text, a tokenizer and ``--length-scale 1``); ``--length-scale`` shrinks
every length so that a tiny model runs on a CPU. Outputs are decoded to their full length
(``--ignore-eos``, the default, as in vLLM's benchmark), so the work is the trace's.

With ``--url`` the requests go to a running OpenAI-compatible server (``/v1/completions``,
streaming, token-id prompts); the client then sees latency and time to first block only.

Reported per configuration and QPS: end-to-end latency mean/p50/p90/p99, time to first block,
queueing before prefills and decode time (from the engine's per-request metrics), throughput
(requests/s, output tokens/s), tokens per forward and mean batch size. ``--out DIR`` writes
``results.json``, ``summary.csv``, ``requests.csv``, ``latency_vs_qps.png`` and ``profile.json``
(forwards per block, over all configurations and per configuration under ``configs``: the
input of ``sangam-bench sim --step-profile``; with ``--against`` each simulated configuration
takes its own).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

import numpy as np

from sangam.bench.report import (
    SUMMARY_COLUMNS,
    format_table,
    parse_float_list,
    parse_overrides,
    plot_latency,
    policy_label,
    summarize,
    write_outputs,
)
from sangam.bench.traces import (
    LengthSample,
    TraceRequest,
    add_prompt_sharing_args,
    arrivals,
    build_trace,
    load_lengths,
    scale_lengths,
    with_shared_prompts,
)
from sangam.config import EngineConfig
from sangam.sampling_params import MASKED_ONLY_FIELDS, SamplingParams

DEFAULT_NUM_REQUESTS = 50
HTTP_PROMPT_VOCAB = 100  # random prompt ids for a server stay below this: valid in any vocab


@dataclasses.dataclass
class Prepared:
    """One trace request made concrete for a model: prompt and sampling parameters."""

    index: int
    arrival_time: float
    prompt: list[int] | str
    prompt_len: int
    params: SamplingParams
    canvas: int | None = None  # a uniform-state model's canvas length (its blocks)


@dataclasses.dataclass
class RunResult:
    records: list[dict]
    steps_per_block: Counter
    extra: dict  # mean batch size, iterations, failures


# Preparing requests.
def sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    if getattr(args, "canvas_length", None):  # uniform-state: the checkpoint's own defaults
        return SamplingParams(max_tokens=max_tokens, stop_at_eos=not args.ignore_eos)
    return SamplingParams(max_tokens=max_tokens, block_length=args.block_length,
                          unmasking=args.unmasking, threshold=args.threshold, cache=args.cache,
                          tokens_per_step=args.tokens_per_step, temperature=args.temperature,
                          stop_at_eos=not args.ignore_eos)


def grid(args: argparse.Namespace) -> int:
    """The block grid requests' lengths keep to: the block length, or the model's canvas."""
    return getattr(args, "canvas_length", None) or args.block_length


def prepare(trace: Sequence[TraceRequest], args: argparse.Namespace, vocab: int,
            mask_id: int | None, context: int | None, encode=None) -> list[Prepared]:
    """Prompts and parameters for ``trace``: lengths clipped to the context (canvas first);
    with ``--shared-prefix`` / ``--samples``, shared prompts (``with_shared_prompts``)."""
    trace = with_shared_prompts(trace, args.shared_prefix, args.samples, vocab,
                                args.trace_seed + 3, mask_id)
    rng = np.random.default_rng(args.trace_seed + 2)
    b = grid(args)
    out = []
    for i, t in enumerate(trace):
        gen = t.gen_len
        plen = t.prompt_len
        if context is not None:
            gen = min(gen, (context - 1) // b * b)
            plen = min(plen, context - (-(-gen // b) * b))
        if isinstance(t.prompt, str) and encode is not None and args.length_scale == 1:
            prompt: list[int] | str = encode(t.prompt)[:plen]
        elif isinstance(t.prompt, list):
            prompt = list(t.prompt[:plen])
        else:
            ids = rng.integers(0, vocab, plen)
            if mask_id is not None:
                ids[ids == mask_id] = (mask_id + 1) % vocab
            prompt = ids.tolist()
        out.append(Prepared(i, t.arrival_time, prompt, len(prompt), sampling_params(args, gen),
                            getattr(args, "canvas_length", None)))
    return out


def _record(p: Prepared, arrival: float, finish: float, ttfb: float | None,
            queueing: float | None, decode: float | None, forwards: int | None,
            blocks: int | None, thresholds: list[float] | None = None) -> dict:
    return {"id": p.index, "arrival": arrival, "finish": finish, "latency": finish - arrival,
            "ttfb": ttfb, "queueing": queueing, "decode": decode, "transfer": None,
            "forwards": forwards, "prompt_len": p.prompt_len, "gen_len": p.params.max_tokens,
            "canvas_tokens": None if blocks is None else blocks * (
                p.params.block_length if p.canvas is None else p.canvas),
            "threshold": _mean(thresholds or ())}  # its blocks' mean: load-adaptive only


class _Progress:
    """A self-overwriting stderr line per run on a terminal; elsewhere (logs) one line when the
    run ends."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self._last = label, total, 0, 0.0
        self._tty = sys.stderr.isatty()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        last = self.done == self.total
        if last or (self._tty and now - self._last > 0.2):
            self._last = now
            lead = "\r" if self._tty else ""
            print(f"{lead}  {self.label}: {self.done}/{self.total} done",
                  end="\n" if last else "", file=sys.stderr, flush=True)


def _mean(values) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


# In-process engine.
def run_engine(engine, requests: Sequence[Prepared], label: str) -> RunResult:
    """Submit each request at its arrival time (wall clock) and step until all finish."""
    pending = deque(sorted(requests, key=lambda p: p.arrival_time))
    by_id = {f"bench-{p.index}": p for p in requests}
    last_forwards: dict[str, int] = {}
    steps: Counter = Counter()
    records = []
    progress = _Progress(label, len(requests))
    engine.stats.iterations.clear()
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and t0 + pending[0].arrival_time <= now:
            p = pending.popleft()
            rid = f"bench-{p.index}"
            engine.add_request(rid, p.prompt, p.params, arrival_time=t0 + p.arrival_time)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + pending[0].arrival_time - time.monotonic()))
            continue
        for out in engine.step():
            rid = out.request_id
            steps[out.num_forwards - last_forwards.get(rid, 0)] += 1
            last_forwards[rid] = out.num_forwards
            if out.finished:
                m = out.metrics
                records.append(_record(by_id[rid], m["arrival_time"] - t0, m["finish_time"] - t0,
                                       m["time_to_first_block"], m["queueing_time"],
                                       m["decode_time"], m["num_forwards"], m["num_blocks"],
                                       out.block_thresholds))
                progress.update()
    its = list(engine.stats.iterations)
    extra = {"iterations": len(its),
             "mean_batch": sum(i.batch_size for i in its) / len(its) if its else None,
             "prefill_tokens": sum(i.prefill_tokens for i in its),  # refresh work, in tokens
             "threshold_mean": _mean(r["threshold"] for r in records)}  # load-adaptive only
    return RunResult(records, steps, extra)


class EngineFactory:
    """Engines for each configuration, loading each distinct model once."""

    _MODEL_KEYS = ("model", "load_format", "device", "dtype", "attention_backend")

    def __init__(self):
        self._loaded: dict[tuple, object] = {}

    def loaded(self, cfg: EngineConfig):
        from sangam.engine.loaded_model import LoadedModel

        key = tuple(getattr(cfg, k) for k in self._MODEL_KEYS)
        if key not in self._loaded:
            self._loaded[key] = LoadedModel.load(cfg)
        return self._loaded[key]

    def engine(self, cfg: EngineConfig):
        from sangam.engine.engine import Engine

        return Engine(cfg, self.loaded(cfg))


def _release_device_memory() -> None:
    """Free a finished run's KV pool and CUDA graphs before the next engine allocates its own:
    an engine's reference cycles would otherwise hold them until a collection, and a GPU fits
    only one default-sized pool at a time."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _warm_up(engine, args: argparse.Namespace, vocab: int) -> None:
    """One short request first, so one-time costs (allocations, kernel compilation) are not
    charged to the first measured request."""
    engine.add_request("warmup", [min(2, vocab - 1)] * 4, sampling_params(args, grid(args)))
    while engine.has_unfinished_requests():
        engine.step()


# HTTP server.
async def _http_one(client, url: str, p: Prepared, t0: float, args: argparse.Namespace
                    ) -> dict | None:
    await asyncio.sleep(max(0.0, t0 + p.arrival_time - time.monotonic()))
    sp = p.params
    body = {"prompt": p.prompt, "max_tokens": sp.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "block_length": sp.block_length,
            "unmasking": sp.unmasking, "threshold": sp.threshold, "cache": sp.cache,
            "tokens_per_step": sp.tokens_per_step, "temperature": sp.temperature,
            "stop_at_eos": sp.stop_at_eos}
    if args.served_model_name:
        body["model"] = args.served_model_name
    ttfb = forwards = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and ttfb is None:
                    ttfb = time.monotonic() - (t0 + p.arrival_time)
                if chunk.get("usage"):
                    forwards = chunk["usage"].get("num_forwards")
    except Exception as e:  # a failed request is counted, not fatal: the load goes on
        print(f"\n  request {p.index} failed: {e}", file=sys.stderr)
        return None
    finish = time.monotonic() - t0
    blocks = -(-sp.max_tokens // sp.block_length) if not sp.stop_at_eos else None
    return _record(p, p.arrival_time, finish, ttfb, None, None, forwards, blocks)


async def _http_run(url: str, requests: Sequence[Prepared], args: argparse.Namespace,
                    label: str) -> RunResult:
    import httpx

    progress = _Progress(label, len(requests))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        t0 = time.monotonic()

        async def one(p: Prepared):
            rec = await _http_one(client, "/v1/completions", p, t0, args)
            progress.update()
            return rec

        results = await asyncio.gather(*(one(p) for p in requests))
    records = [r for r in results if r is not None]
    return RunResult(records, Counter(), {"failed": len(results) - len(records)})


# Driving runs.
def _split_spec(spec: str) -> tuple[str, dict]:
    """A --compare spec's engine-flag part, and its SamplingParams overrides (the fields that
    are no EngineConfig field, e.g. ``min_threshold``), typed."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine, request = [], []
    for item in spec.split(","):
        key = item.partition("=")[0].strip().replace("-", "_")
        (engine if key in engine_fields or not key else request).append(item)
    return ",".join(engine), parse_overrides(",".join(request), SamplingParams)


def compare_specs(args: argparse.Namespace) -> dict[str, tuple[EngineConfig, dict]]:
    """Label -> (engine configuration, request overrides): the flags, with each --compare spec
    applied on top."""
    base = EngineConfig.from_cli_args(args)
    specs = list(args.compare or [])
    policies = args.policies.split(",") if args.policies else [None]
    budgets = args.token_budgets.split(",") if args.token_budgets else [None]
    for pol, tau in itertools.product(policies, budgets):
        parts = ([f"policy={pol}"] if pol else []) + ([f"token_budget={tau}"] if tau else [])
        if parts:
            specs.append(",".join(parts))
    configs = []
    for s in specs or [""]:
        engine, request = _split_spec(s)
        configs.append((s, dataclasses.replace(base, **parse_overrides(engine, EngineConfig)),
                        request))
    labels = [policy_label(c.policy, c.token_budget) for _, c, _ in configs]
    return {(lab if labels.count(lab) == 1 else f"{lab} [{s}]"): (c, r)
            for lab, (s, c, r) in zip(labels, configs)}


def configs_from_args(args: argparse.Namespace) -> dict[str, EngineConfig]:
    """Label -> engine configuration (:func:`compare_specs` without the request overrides)."""
    return {label: cfg for label, (cfg, _) in compare_specs(args).items()}


def config_labels(args: argparse.Namespace) -> list[str]:
    return ["server"] if args.url else list(configs_from_args(args))


def _lengths(args: argparse.Namespace, count_tokens=None) -> list[LengthSample]:
    n = args.num_requests or DEFAULT_NUM_REQUESTS
    return scale_lengths(load_lengths(args.trace, n, args.trace_seed, count_tokens),
                         args.length_scale)


class Bench:
    """Everything needed to run one (configuration, QPS) point."""

    def __init__(self, args: argparse.Namespace):
        args.canvas_length = None if args.url else uniform_canvas(args)
        if args.canvas_length is None:
            defaults = SamplingParams()  # the engine's request-default flags, else its own
            for name in ("block_length", "unmasking", "threshold", "cache"):
                if getattr(args, name) is None:
                    setattr(args, name, getattr(defaults, name))
        self.args = args
        self.factory = None if args.url else EngineFactory()
        self.specs = {} if args.url else compare_specs(args)
        self.configs = {label: cfg for label, (cfg, _) in self.specs.items()}
        self.steps: Counter = Counter()
        self.steps_by_config: dict[str, Counter] = {}  # each configuration's own
        self._lengths: list[LengthSample] | None = None

    def lengths(self, cfg: EngineConfig | None) -> list[LengthSample]:
        if self._lengths is None:
            count = None
            if cfg is not None and self.args.length_scale == 1:
                loaded = self.factory.loaded(cfg)
                if loaded.text.tokenizer is not None:
                    def count(text: str) -> int:
                        return len(loaded.text.encode(text))
            self._lengths = _lengths(self.args, count)
        return self._lengths

    def run(self, label: str, qps: float) -> tuple[dict, RunResult]:
        args = self.args
        cfg = self.configs.get(label)
        lengths = self.lengths(cfg)
        trace = build_trace(lengths, arrivals(len(lengths), qps, args.trace_seed + 1,
                                              args.arrival, args.cv))
        name = f"{label} @ {qps:g} QPS"
        if args.url:
            reqs = prepare(trace, args, HTTP_PROMPT_VOCAB, None, None)
            res = asyncio.run(_http_run(args.url.rstrip("/"), reqs, args, name))
        else:
            loaded = self.factory.loaded(cfg)
            mc = loaded.config
            reqs = prepare(trace, args, mc.vocab_size, mc.mask_token_id, loaded.context_length,
                           loaded.text.encode if loaded.text.tokenizer is not None else None)
            # The configuration's request defaults (a --compare spec's cache, refresh cadence,
            # ...) and its request overrides (min_threshold, ...) apply to its requests; the
            # trace keeps their lengths.
            own = {k: v for k, v in cfg.request_defaults().items() if k != "max_tokens"}
            own |= self.specs[label][1]
            reqs = [dataclasses.replace(r, params=dataclasses.replace(r.params, **own))
                    for r in reqs]
            engine = self.factory.engine(cfg)
            _warm_up(engine, args, mc.vocab_size)
            res = run_engine(engine, reqs, name)
            del engine
            _release_device_memory()
        self.steps.update(res.steps_per_block)
        self.steps_by_config.setdefault(label, Counter()).update(res.steps_per_block)
        summary = {"config": label, **summarize(res.records, qps), **res.extra}
        return summary, res


def uniform_canvas(args: argparse.Namespace) -> int | None:
    """The canvas length of ``--model`` if it is a uniform-state model (DiffusionGemma), whose
    requests take its own denoising defaults; its masked decoding flags given are refused."""
    from sangam.engine.loaded_model import checkpoint_path
    from sangam.models import read_config

    gemma = read_config(checkpoint_path(EngineConfig.from_cli_args(args))).gemma
    if gemma is None:
        return None
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    defaults = vars(parser.parse_args([]))
    given = [n for n in MASKED_ONLY_FIELDS if n in defaults and getattr(args, n) != defaults[n]]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise SystemExit(f"{flags}: masked-diffusion options; {args.model} is a uniform-state "
                         "model (its requests take its generation_config's denoising options)")
    return gemma.canvas_length


def capacity_probe(args: argparse.Namespace) -> Callable[[float, str], dict]:
    """For ``sangam-bench capacity``: (qps, label) -> summary of one real run."""
    _set_threads(args)
    bench = Bench(args)
    return lambda qps, label: bench.run(label, qps)[0]


def _set_threads(args: argparse.Namespace) -> None:
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)


def run(args: argparse.Namespace) -> int:
    _set_threads(args)
    bench = Bench(args)
    qps_list = parse_float_list(args.qps)
    summaries, records = [], []
    # Configurations alternate at each load, so that a shared machine's drifting background
    # load biases all of them alike.
    labels = config_labels(args)
    for qps in qps_list:
        for label in labels:
            summary, res = bench.run(label, qps)
            summaries.append(summary)
            records += [{"config": label, "qps": qps, **r} for r in res.records]
            summaries.sort(key=lambda s: labels.index(s["config"]))  # stable: config, then QPS
            if args.out:  # after every run, so a run cut short keeps what it measured
                paths = write_serve_outputs(args, bench, summaries, records)
    columns = SUMMARY_COLUMNS + (("mean_batch", "batch", "{:.2f}"),
                                 ("threshold_mean", "threshold", "{:.3f}"))
    print(format_table(summaries, columns))
    if args.out:
        print("wrote " + ", ".join(paths))
    return 0


def write_serve_outputs(args: argparse.Namespace, bench: Bench, summaries: list[dict],
                        records: list[dict]) -> list[str]:
    """results.json, the CSVs, the plot and (in-process) profile.json under ``args.out``."""
    report = {"kind": "serve", "url": args.url, "trace": args.trace,
              "length_scale": args.length_scale, "configs": bench.configs,
              "sampling": dataclasses.asdict(sampling_params(args, grid(args))),
              "summaries": summaries}
    paths = write_outputs(args.out, report, summaries, records)
    by_config: dict[str, list[dict]] = {}
    for s in summaries:
        by_config.setdefault(s["config"], []).append(s)
    model = args.url or args.model or "demo model"
    paths += plot_latency(os.path.join(args.out, "latency_vs_qps.png"),
                          {f"{model}, {args.trace} x{args.length_scale:g}": by_config})
    if bench.steps:
        def hist(steps: Counter) -> dict:
            return {"mean_forwards_per_block": sum(k * c for k, c in steps.items())
                    / sum(steps.values()),
                    "steps_per_block": {str(k): c for k, c in sorted(steps.items())}}

        path = os.path.join(args.out, "profile.json")
        with open(path, "w") as f:  # all configurations together, and each one's own
            json.dump({"block_length": grid(args), **hist(bench.steps),
                       "configs": {label: hist(steps)
                                   for label, steps in bench.steps_by_config.items() if steps}},
                      f, indent=2)
        paths.append(path)
    return paths


def add_serve_args(p: argparse.ArgumentParser, for_capacity: bool = False) -> None:
    e = p.add_argument_group("engine (in-process; every EngineConfig field)")
    EngineConfig.add_cli_args(e)
    e.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); 1 keeps a tiny model's "
                        "steps fast on a shared CPU, where spinning threads oversubscribe it")
    e.add_argument("--compare", nargs="+", default=None, metavar="SPEC",
                   help="configurations to compare in one run, each a comma-separated list of "
                        "engine-flag or SamplingParams overrides, e.g. 'policy=fastdllm' "
                        "'token_budget=512' 'min_threshold=0.5'")
    e.add_argument("--policies", default=None,
                   help="shorthand for --compare policy=A policy=B ...: comma-separated")
    e.add_argument("--token-budgets", default=None,
                   help="shorthand for --compare token_budget=A ...: comma-separated")
    h = p.add_argument_group("server (instead of the in-process engine)")
    h.add_argument("--url", default=None, help="base URL of a running server, e.g. "
                                               "http://127.0.0.1:8000")
    h.add_argument("--served-model-name", default=None, help="the request's 'model' field")
    h.add_argument("--api-key", default=None)
    h.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    t = p.add_argument_group("workload")
    t.add_argument("--trace", default="sharegpt",
                   help="sharegpt, arxiv or chat (seeded synthetic), or a ShareGPT .json / .csv "
                        "file")
    t.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per run (default {DEFAULT_NUM_REQUESTS})")
    t.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    t.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    t.add_argument("--trace-seed", type=int, default=0, help="seed of lengths, arrivals, prompts")
    t.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every prompt and output length (e.g. 0.05 for a tiny CPU model)")
    add_prompt_sharing_args(t)
    s = p.add_argument_group("decoding (every request; --block-length, --unmasking, "
                             "--threshold and --cache are the engine flags above)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--tokens-per-step", type=int, default=SamplingParams().tokens_per_step,
                   help="topk rule: tokens committed per step (a fixed rate: what a benchmark "
                        "of random weights, which are never confident, needs)")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="decode every block of the canvas (stop_at_eos=False)")
    if not for_capacity:
        t.add_argument("--qps", default="1", help="offered load(s), comma-separated")
        p.add_argument("--out", default=None,
                       help="directory for results.json, summary.csv, requests.csv, the plot "
                            "and profile.json")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="replay a trace against the engine (or a server) at one or more QPS",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(p)
    p.set_defaults(func=run)
