"""``sangam-bench quality``: what each decoding mode costs in quality, against vanilla decoding.

Decodes held-out instances of the demo tasks (:mod:`sangam.demo.tasks`) through the public API
(``sangam.LLM``): first with vanilla LLaDA decoding (top-1 per step, no cache), then with each
mode of a sweep - PrefixCache and DualCache under the threshold rule (``--thresholds``) and the
factor rule (``--factors``), then DualCache at threshold 0.9 under other refresh cadences
(``--cadences``: ``RxM`` refreshes every R-th block, every M-th of those fully, the others
response-only; R = 1000 never refreshes after the first block; ``--cadence-thresholds`` runs
them at other thresholds too), and adaptive refresh
(``--refresh-confidences``: no refresh after the first block unless the block before committed a
token below that confidence). Per mode it reports

- exact match, overall and per family;
- block agreement with vanilla: the share of blocks whose committed tokens equal vanilla's for
  the same request (blocks up to where either response ends), which moves before exact match
  does when an approximation starts to change tokens;
- tokens per forward: every canvas token decoded (answer, end-of-turn and the EOS padding of the
  blocks decoded) over the forwards spent, so vanilla scores exactly 1; and forwards per request;
- refreshed: the share of decoded blocks that started with a refresh (full or response-only);
- confidence: the mean probability of the response's tokens (up to its end) at the step that
  committed each.

``--profiles FILE`` writes each mode's commit profile (one entry per mode name), what
``sangam-bench sim --experiment refresh-cadence --profiles FILE`` serves each configuration
with: the forwards each block took (its refresh forward included), per block index of the
response, and which blocks started with a refresh (:func:`commit_profile`). The bench observes
them by driving ``llm.engine`` itself (``add_request`` / ``step``, as ``LLM.generate`` does) and
differencing each per-block output's ``num_forwards`` and ``metrics["num_refreshes"]``, as
``sangam-bench serve`` does. A simulated forward costs what its span costs, not what it commits,
so forwards per block and which blocks refresh are all the simulator needs of a mode.

The task set defaults to the families the model was trained on (its ``training.json``, as the
demo models' training script writes), else the short demo's; ``max_tokens`` and
``block_length`` default to the model's own (``generation_config.json``). ``--json`` writes
everything, ``--plot`` a PNG of exact match against tokens per forward, one line per cache and
rule, vanilla as a point.

``--structured`` runs another comparison instead of the sweep: each instance without and with
its family's answer format as structured output (:mod:`sangam.bench.structured`).

A uniform-state model (DiffusionGemma, ``sangam-demo-gemma``) has no masks, blocks or caches
to sweep: its sweep is ``--entropy-bounds`` x ``--denoising-steps`` (``entropy_bound`` x
``max_denoising_steps``, the model's other denoising options as its generation_config.json
says), reporting exact match, forwards per canvas and tokens per forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sangam.bench import structured
from sangam.bench.report import parse_float_list
from sangam.bench.structured import tokens_decoded
from sangam.config import KV_CACHE_DTYPES, QUANTIZATIONS
from sangam.demo.tasks import ANSWER_FORMATS, DEMO_FAMILIES, EVAL_SEED, FAMILIES, Task, eval_set
from sangam.sampling_params import SamplingParams

DEFAULT_THRESHOLDS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0)  # 0.3: deliberately too low
DEFAULT_FACTORS = (0.5, 1.0, 2.0)
NEVER = 1000  # an interval beyond any canvas here: no refresh after block 0
# (refresh_interval, prompt_refresh_interval) under DualCache, threshold CADENCE_THRESHOLD
# (Fast-dLLM's setting); the simulator's refresh-cadence experiment serves the same ones.
REFRESH_CADENCES = ((2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (4, 4))
DEFAULT_CADENCES = (*REFRESH_CADENCES, (NEVER, 1))  # NEVER: a deliberately bad approximation
# Adaptive refresh, with no cadence refresh after block 0 (refresh_interval NEVER). High: a
# trained model's least confident commit of a block is rarely below 0.9 (sangam-demo-long's).
DEFAULT_REFRESH_CONFIDENCES = (0.99, 0.999)
# Uniform-state models: entropy_bound x max_denoising_steps.
DEFAULT_ENTROPY_BOUNDS = (0.1, 0.5, 2.0, 8.0)
DEFAULT_DENOISING_STEPS = (1, 2, 4, 16)
CADENCE_THRESHOLD = 0.9


def _csv(values) -> str:
    return ",".join(f"{v:g}" for v in values)


# Each family's own flags (dest: default when not given; None: the code's own fallback); a flag
# of the other family is refused, never ignored.
MASKED_FLAGS = {"thresholds": None, "factors": _csv(DEFAULT_FACTORS),
                "cadences": ",".join(f"{r}x{m}" for r, m in DEFAULT_CADENCES),
                "cadence_thresholds": f"{CADENCE_THRESHOLD:g}",
                "refresh_confidences": _csv(DEFAULT_REFRESH_CONFIDENCES), "modes": None,
                "block_length": None, "plot": None, "profiles": None, "cache": "dual"}
UNIFORM_FLAGS = {"entropy_bounds": _csv(DEFAULT_ENTROPY_BOUNDS),
                 "denoising_steps": _csv(DEFAULT_DENOISING_STEPS),
                 "confidence_threshold": None}
VANILLA = "vanilla"
_REQUEST_IDS = itertools.count()


def dual_mode_name(threshold: float, refresh_interval: int = 1, prompt_refresh_interval: int = 1,
                   refresh_confidence: float = 0.0) -> str:
    """The sweep's name of a DualCache threshold-rule mode (the key of its profile)."""
    name = f"dual/threshold={threshold:g}"
    if refresh_confidence:
        return f"{name}/cadence={refresh_interval}x1/refresh_confidence={refresh_confidence:g}"
    if (refresh_interval, prompt_refresh_interval) != (1, 1):
        return f"{name}/cadence={refresh_interval}x{prompt_refresh_interval}"
    return name


@dataclass(frozen=True)
class Mode:
    name: str
    options: dict  # SamplingParams fields


def sweep(thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS,
          factors: tuple[float, ...] = DEFAULT_FACTORS,
          cadences: tuple[tuple[int, int], ...] = DEFAULT_CADENCES,
          refresh_confidences: tuple[float, ...] = DEFAULT_REFRESH_CONFIDENCES,
          cadence_thresholds: tuple[float, ...] = (CADENCE_THRESHOLD,),
          ) -> list[Mode]:
    """Vanilla first (the reference of block agreement), then cache x rule x value, then the
    refresh cadences and adaptive refresh under DualCache at each of ``cadence_thresholds``."""
    modes = [Mode(VANILLA, {"unmasking": "topk", "tokens_per_step": 1, "cache": "none"})]
    for cache in ("prefix", "dual"):
        modes += [Mode(f"{cache}/threshold={v:g}",
                       {"unmasking": "threshold", "threshold": v, "cache": cache})
                  for v in thresholds]
        modes += [Mode(f"{cache}/factor={v:g}", {"unmasking": "factor", "factor": v,
                                                  "cache": cache}) for v in factors]
    for t in cadence_thresholds:
        cadence = {"unmasking": "threshold", "threshold": t, "cache": "dual"}
        modes += [Mode(dual_mode_name(t, r, m),
                       {**cadence, "refresh_interval": r, "prompt_refresh_interval": m})
                  for r, m in cadences]
        modes += [Mode(dual_mode_name(t, NEVER, 1, c),
                       {**cadence, "refresh_interval": NEVER, "refresh_confidence": c})
                  for c in refresh_confidences]
    return modes


def parse_cadences(text: str) -> tuple[tuple[int, int], ...]:
    """``"2x1,1x4"`` -> ``((2, 1), (1, 4))``: (refresh_interval, prompt_refresh_interval)."""
    try:
        out = tuple(tuple(int(v) for v in c.split("x")) for c in text.split(",") if c.strip())
    except ValueError as e:
        raise ValueError(f"expected comma-separated RxM cadences, got {text!r}") from e
    if not out or any(len(c) != 2 or min(c) < 1 for c in out):
        raise ValueError(f"expected comma-separated RxM cadences of positive integers, got "
                         f"{text!r}")
    return out


def block_agreement(tokens: list[int], reference: list[int], block_length: int) -> tuple[int, int]:
    """(blocks equal, blocks compared) of one response against the reference's: the blocks up to
    the one where the longer of the two ends; a block agrees when both hold the same tokens in
    it (so where a response ends counts too)."""
    blocks = max(len(tokens), len(reference)) // block_length + 1
    same = sum(tokens[b * block_length:(b + 1) * block_length]
               == reference[b * block_length:(b + 1) * block_length] for b in range(blocks))
    return same, blocks


def decode_observed(llm, prompt_ids: list[list[int]], params: SamplingParams
                    ) -> tuple[list, list[list[tuple[int, bool]]]]:
    """Decode every prompt as ``LLM.generate`` does (all submitted at once, the engine stepped
    until each finishes), watching each block end: the final outputs, in input order, and per
    request its blocks' (forwards, started with a refresh). The engine emits an output whenever
    a request completes a block; its ``num_forwards`` and ``metrics["num_refreshes"]`` count
    everything so far, so their differences are the block's (the refresh that started it is
    counted by then, the next block's is not)."""
    engine = llm.engine
    rids = [f"quality-{next(_REQUEST_IDS)}" for _ in prompt_ids]
    index = {rid: i for i, rid in enumerate(rids)}
    last = [(0, 0)] * len(rids)
    blocks: list[list[tuple[int, bool]]] = [[] for _ in rids]
    done: dict[int, object] = {}
    try:
        for rid, prompt in zip(rids, prompt_ids):
            engine.add_request(rid, prompt, params)
        while len(done) < len(rids):
            for out in engine.step():
                i = index.get(out.request_id)
                if i is None:
                    continue
                forwards, refreshes = out.num_forwards, out.metrics["num_refreshes"]
                if forwards > last[i][0]:  # a block ended (a finished output may repeat one)
                    blocks[i].append((forwards - last[i][0], refreshes > last[i][1]))
                    last[i] = (forwards, refreshes)
                if out.finished:
                    done[i] = out
    finally:  # interrupted: what is left must not linger in the engine
        for i, rid in enumerate(rids):
            if i not in done:
                engine.abort_request(rid)
    return [done[i] for i in range(len(rids))], blocks


def commit_profile(blocks: list[list[tuple[int, bool]]], params: SamplingParams) -> dict:
    """A mode's commit profile, as ``--profiles`` writes it and
    :func:`sangam.bench.sim.steps.load_mode_profiles` reads it:

    - ``block_length``, the mode's ``threshold``, ``min_threshold``, cadence and
      ``refresh_confidence``;
    - ``forwards_per_block``: per block index of the response (0 = the block after the
      prompt), a histogram {forwards: blocks}, the block's refresh forward included. Each block
      decodes ``block_length`` positions, so its tokens per forward is ``block_length /
      forwards``: the simulator applies that distribution at its own block length B (a block
      then takes about B / tokens-per-forward forwards);
    - ``refreshed_per_block``: per block index, [blocks that started with a refresh, blocks];
    - ``boundary_refresh_rate``: of the block boundaries (every block but a response's first),
      the share that refreshed; for adaptive refresh (no cadence refresh after block 0) the
      trigger rate the simulator's ``adaptive_refresh_rate`` stands for;
    - ``tokens_per_forward``: the mean, positions decoded over forwards."""
    width = max((len(b) for b in blocks), default=0)
    hist: list[dict[str, int]] = [{} for _ in range(width)]
    refreshed = [[0, 0] for _ in range(width)]
    for request in blocks:
        for b, (forwards, refresh) in enumerate(request):
            hist[b][str(forwards)] = hist[b].get(str(forwards), 0) + 1
            refreshed[b][0] += refresh
            refreshed[b][1] += 1
    hist = [dict(sorted(h.items(), key=lambda kv: int(kv[0]))) for h in hist]
    n_blocks = sum(len(r) for r in blocks)
    forwards = sum(f for r in blocks for f, _ in r)
    boundaries = sum(n for _, n in refreshed[1:])
    return {"block_length": params.block_length, "threshold": params.threshold,
            "min_threshold": params.min_threshold, "unmasking": params.unmasking,
            "cache": params.cache, "refresh_interval": params.refresh_interval,
            "prompt_refresh_interval": params.prompt_refresh_interval,
            "refresh_confidence": params.refresh_confidence,
            "blocks": n_blocks, "forwards": forwards,
            "tokens_per_forward": n_blocks * params.block_length / forwards if forwards else None,
            "boundary_refresh_rate": (sum(r for r, _ in refreshed[1:]) / boundaries
                                      if boundaries else None),
            "forwards_per_block": hist, "refreshed_per_block": refreshed}


def exact_matches(tasks: list[Task], outs: list) -> dict[str, list[int]]:
    """Per family, 1 or 0 for each of its tasks: the response's text is its answer."""
    correct: dict[str, list[int]] = {f: [] for f in dict.fromkeys(t.family for t in tasks)}
    for task, out in zip(tasks, outs):
        correct[task.family].append(int((out.text or "") == task.answer))
    return correct


def evaluate_mode(llm, tasks: list[Task], prompt_ids: list[list[int]], params: SamplingParams,
                  reference: list[list[int]] | None = None) -> tuple[dict, list[list[int]]]:
    """Decode every task with ``params``: the mode's metrics (its commit profile under
    ``"profile"``), and each response's tokens."""
    start = time.perf_counter()
    outs, observed = decode_observed(llm, prompt_ids, params)
    seconds = time.perf_counter() - start
    correct = exact_matches(tasks, outs)
    tokens = [list(o.token_ids) for o in outs]
    forwards = sum(o.num_forwards for o in outs)
    refreshes = sum(o.metrics["num_refreshes"] for o in outs)
    decoded = sum(tokens_decoded(o, params) for o in outs)
    blocks = decoded // params.block_length
    probs = [lp for o in outs for lp in (o.logprobs or [])]
    same = compared = 0
    for t, ref in zip(tokens, reference or tokens):
        s, n = block_agreement(t, ref, params.block_length)
        same, compared = same + s, compared + n
    result = {
        "options": dataclasses.asdict(params),
        "accuracy": sum(map(sum, correct.values())) / len(tasks),
        "accuracy_by_family": {f: sum(c) / len(c) for f, c in correct.items()},
        "block_agreement": same / compared,
        "tokens_per_forward": decoded / forwards,
        "forwards_per_request": forwards / len(tasks),
        # Blocks that started with a refresh (full or response-only): 1 for Fast-dLLM's cache;
        # and of the block boundaries (every block but a request's first), the share that did:
        # adaptive refresh's trigger rate, the simulator's --adaptive-refresh-rate.
        "refreshed_blocks": refreshes / blocks,
        "boundary_refreshes": ((refreshes - len(outs)) / (blocks - len(outs))
                               if blocks > len(outs) else None),
        "confidence": sum(map(math.exp, probs)) / len(probs) if probs else None,
        "seconds": seconds,
        "profile": commit_profile(observed, params),
    }
    return result, tokens


def format_table(results: dict[str, dict]) -> str:
    families = list(next(iter(results.values()))["accuracy_by_family"])
    head = ["mode", "exact", "blocks=vanilla", "tok/fwd", "fwd/req", "refreshed", "conf",
            *families]
    rows = [[name, f"{r['accuracy']:.3f}", f"{r['block_agreement']:.3f}",
             f"{r['tokens_per_forward']:.2f}", f"{r['forwards_per_request']:.1f}",
             f"{r['refreshed_blocks']:.2f}",
             "-" if r["confidence"] is None else f"{r['confidence']:.3f}",
             *(f"{r['accuracy_by_family'][f]:.3f}" for f in families)]
            for name, r in results.items()]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in [head, *rows])


def plot(path: str, results: dict[str, dict], title: str) -> list[str]:
    """Exact match against tokens per forward: a line per cache x rule, vanilla a point."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    lines: dict[str, list[tuple[float, float, str]]] = {}
    for name, r in results.items():
        if name == VANILLA:
            ax.plot([r["tokens_per_forward"]], [r["accuracy"]], "k*", markersize=12,
                    label="vanilla (top-1, no cache)")
            continue
        line, value = name.rsplit("=", 1)  # a cadence's line: its interval over 0.9's
        lines.setdefault(line, []).append((r["tokens_per_forward"], r["accuracy"], value))
    for i, (line, pts) in enumerate(sorted(lines.items())):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if "dual" in line else "s--",
                color=f"C{i}", label=line)
        for x, y, value in pts:
            ax.annotate(value, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("tokens committed per forward")
    ax.set_ylabel("exact match")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def trained_families(model_dir: str) -> tuple[str, ...]:
    """The families a demo-style checkpoint was trained on (its training.json), else the short
    demo's."""
    info = Path(model_dir) / "training.json"
    if info.is_file():
        families = json.loads(info.read_text()).get("train_config", {}).get("families")
        if families:
            return tuple(dict.fromkeys(families.split(",")))
    return DEMO_FAMILIES


def _write_reports(args: argparse.Namespace, results: dict[str, dict], model: str,
                   families: tuple[str, ...], num_instances: int, max_tokens: int,
                   block_length: int) -> None:
    """``--json`` (everything) and ``--profiles`` (each mode's commit profile, with its exact
    match and block agreement)."""
    head = {"model": model, "families": families, "num_instances": num_instances,
            "seed": args.seed, "max_tokens": max_tokens, "block_length": block_length}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**head, "modes": results}, f, indent=2)
    if args.profiles:
        with open(args.profiles, "w") as f:
            json.dump({**head, "modes": {
                name: {"accuracy": r["accuracy"], "block_agreement": r["block_agreement"],
                       **r["profile"]} for name, r in results.items()}}, f, indent=2)


def run(args: argparse.Namespace) -> int:
    from sangam import LLM

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if llm.tokenizer is None:
        raise SystemExit(f"{args.model}: the checkpoint has no tokenizer; quality needs one")
    families = (tuple(args.families.split(",")) if args.families
                else trained_families(llm.loaded.path))
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown task families {unknown}; choose from {FAMILIES}")
    per_family = max(1, args.num_instances // len(families))
    tasks = eval_set(per_family, args.seed, families)
    defaults = llm.loaded.default_params()
    max_tokens = args.max_tokens or defaults.max_tokens
    block_length = args.block_length or defaults.block_length
    # As the model was trained: one user turn plus the assistant header.
    prompt_ids = [llm.loaded.text.encode_chat([{"role": "user", "content": t.prompt}])
                  for t in tasks]
    model = args.model or "sangam-demo"
    header = (f"{model}: {len(tasks)} held-out instances ({per_family} per family of "
              f"{','.join(families)}, seed {args.seed}), max_tokens {max_tokens}, block_length "
              f"{block_length}")
    uniform = llm.loaded.config.gemma is not None
    own, other = (UNIFORM_FLAGS, MASKED_FLAGS) if uniform else (MASKED_FLAGS, UNIFORM_FLAGS)
    given = [n for n in other if getattr(args, n) is not None and getattr(args, n) is not False]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise SystemExit(f"{flags}: not for a {'uniform-state' if uniform else 'masked'} "
                         f"model ({llm.loaded.config.architecture})")
    for n, default in own.items():
        if getattr(args, n) is None:
            setattr(args, n, default)
    if args.structured:
        if args.modes or args.plot:
            raise SystemExit("--modes and --plot belong to the sweep, not --structured")
        if uniform:
            settings = structured.uniform_settings(
                parse_float_list(args.entropy_bounds),
                [int(v) for v in parse_float_list(args.denoising_steps)],
                args.confidence_threshold)
        else:
            settings = structured.masked_settings(
                tuple(parse_float_list(args.thresholds)) if args.thresholds
                else structured.DEFAULT_THRESHOLDS, block_length, args.cache)
        results = structured.compare(llm, tasks, prompt_ids, settings, max_tokens, args.repeats,
                                     log=(lambda m: print(m, file=sys.stderr, flush=True))
                                     if args.verbose else None)
        how = ("uniform-state decoding (seed 0)" if uniform
               else f"cache {args.cache}, greedy")
        print(f"{header}, {how}; each cell without / with the family's regex")
        print(structured.format_table(results, markdown=args.markdown))
        if args.json:
            report = {"model": model, "families": families, "num_instances": len(tasks),
                      "seed": args.seed, "max_tokens": max_tokens, "repeats": args.repeats,
                      "answer_formats": {f: ANSWER_FORMATS[f] for f in families},
                      "options": settings, "settings": results}
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return 0
    if uniform:
        return run_uniform(llm, args, tasks, prompt_ids, model, families, max_tokens)
    modes = sweep(tuple(parse_float_list(args.thresholds or
                                         _csv(DEFAULT_THRESHOLDS))),
                  tuple(parse_float_list(args.factors)),
                  parse_cadences(args.cadences),
                  tuple(parse_float_list(args.refresh_confidences)),
                  tuple(parse_float_list(args.cadence_thresholds)))
    if args.modes:
        keep = set(args.modes.split(","))
        modes = [m for m in modes if m.name in keep or m.name == VANILLA]
    results: dict[str, dict] = {}
    reference = None
    for mode in modes:
        params = SamplingParams(max_tokens=max_tokens, block_length=block_length, logprobs=0,
                                **mode.options)
        results[mode.name], tokens = evaluate_mode(llm, tasks, prompt_ids, params, reference)
        reference = reference or tokens  # vanilla's, the first mode's
        if args.verbose:
            r = results[mode.name]
            print(f"{mode.name}: exact {r['accuracy']:.3f}, blocks {r['block_agreement']:.3f}, "
                  f"{r['tokens_per_forward']:.2f} tokens/forward, {r['seconds']:.1f}s",
                  file=sys.stderr, flush=True)
        # After every mode, so that a sweep cut short keeps what it measured.
        _write_reports(args, results, model, families, len(tasks), max_tokens, block_length)
    print(header)
    print(format_table(results))
    if args.plot:
        title = (f"{os.path.basename(str(model).rstrip('/'))}: {len(tasks)} held-out tasks, "
                 f"{max_tokens}-token canvas, blocks of {block_length}")
        plot(args.plot, results, title)
    return 0


def evaluate_uniform(llm, tasks: list[Task], prompt_ids: list[list[int]],
                     params: SamplingParams) -> dict:
    """One uniform-state setting over every task: exact match (overall, per family), the
    decoder forwards each canvas took, tokens per forward (canvas positions over forwards)."""
    start = time.perf_counter()
    outs, observed = decode_observed(llm, prompt_ids, params)
    correct = exact_matches(tasks, outs)
    forwards = sum(o.num_forwards for o in outs)
    canvases = sum(o.metrics["num_blocks"] for o in outs)
    length = llm.loaded.config.gemma.canvas_length
    hist: dict[str, int] = {}  # forwards per canvas (what sangam-bench sim --step-profile reads)
    for blocks in observed:
        for f, _ in blocks:
            hist[str(f)] = hist.get(str(f), 0) + 1
    return {"options": llm.loaded.uniform_defaults() | params.uniform_given(),
            "block_length": length, "steps_per_block": dict(sorted(hist.items(),
                                                                   key=lambda kv: int(kv[0]))),
            "accuracy": sum(map(sum, correct.values())) / len(tasks),
            "accuracy_by_family": {f: sum(c) / len(c) for f, c in correct.items()},
            "forwards_per_canvas": forwards / canvases,
            "tokens_per_forward": canvases * length / forwards,
            "seconds": time.perf_counter() - start}


def run_uniform(llm, args: argparse.Namespace, tasks: list[Task], prompt_ids: list[list[int]],
                model: str, families: tuple[str, ...], max_tokens: int) -> int:
    """The uniform-state sweep (module docstring): a table, and ``--json``."""
    bounds = parse_float_list(args.entropy_bounds)
    steps = [int(v) for v in parse_float_list(args.denoising_steps)]
    results = {}
    for bound, n in itertools.product(bounds, steps):
        name = f"entropy_bound={bound:g}/steps={n}"
        params = SamplingParams(max_tokens=max_tokens, seed=0, entropy_bound=bound,
                                max_denoising_steps=n,
                                confidence_threshold=args.confidence_threshold)
        results[name] = evaluate_uniform(llm, tasks, prompt_ids, params)
        if args.verbose:
            r = results[name]
            print(f"{name}: exact {r['accuracy']:.3f}, {r['forwards_per_canvas']:.1f} "
                  f"forwards/canvas, {r['seconds']:.1f}s", file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": model, "families": families, "num_instances": len(tasks),
                           "seed": args.seed, "max_tokens": max_tokens, "modes": results}, f,
                          indent=2)
    stopping = ("model default" if args.confidence_threshold is None
                else f"{args.confidence_threshold:g}")
    print(f"{model}: {len(tasks)} held-out instances of {','.join(families)} (seed {args.seed}),"
          f" max_tokens {max_tokens}, uniform-state decoding (seed 0), confidence_threshold "
          f"{stopping}")
    head = ["entropy_bound", *(f"steps={n}" for n in steps)]
    rows = [[f"{b:g}", *(f"{results[f'entropy_bound={b:g}/steps={n}']['accuracy']:.3f} "
                         f"({results[f'entropy_bound={b:g}/steps={n}']['forwards_per_canvas']:.1f})"
                         for n in steps)] for b in bounds]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    print("exact match (forwards per canvas)")
    print("\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in [head, *rows]))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "quality", help="exact match, block agreement with vanilla and tokens/forward of each "
                        "decoding mode on held-out tasks",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint directory or demo name (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: the checkpoint's projections quantized to FP8 at load")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8: an FP8 KV cache")
    p.add_argument("--num-instances", type=int, default=240,
                   help="held-out instances in total, split evenly over the families")
    p.add_argument("--families", default=None,
                   help=f"comma-separated subset of {','.join(FAMILIES)} (default: those the "
                        "model was trained on, from its training.json, else "
                        f"{','.join(DEMO_FAMILIES)})")
    p.add_argument("--thresholds", default=None,
                   help="threshold rule values of the sweep (default "
                        f"{','.join(f'{v:g}' for v in DEFAULT_THRESHOLDS)}: 0.3 is there to be "
                        "too low) or of --structured")
    p.add_argument("--factors", default=None,
                   help=f"factor rule values of the sweep (default {MASKED_FLAGS['factors']})")
    p.add_argument("--cadences", default=None,
                   help="refresh cadences RxM under DualCache: refresh_interval R, "
                        f"prompt_refresh_interval M (default {MASKED_FLAGS['cadences']})")
    p.add_argument("--cadence-thresholds", default=None,
                   help="thresholds the cadences and adaptive refresh run at, comma-separated "
                        f"(default {MASKED_FLAGS['cadence_thresholds']})")
    p.add_argument("--refresh-confidences", default=None,
                   help="refresh_confidence values (adaptive refresh) under DualCache and no "
                        "cadence refresh after the first block (default "
                        f"{MASKED_FLAGS['refresh_confidences']})")
    p.add_argument("--entropy-bounds", default=None,
                   help="uniform-state models: entropy_bound values of the sweep (default "
                        f"{UNIFORM_FLAGS['entropy_bounds']})")
    p.add_argument("--denoising-steps", default=None,
                   help="uniform-state models: max_denoising_steps values of the sweep "
                        f"(default {UNIFORM_FLAGS['denoising_steps']})")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="uniform-state models: adaptive stopping's threshold (0: off; default: "
                        "the model's)")
    p.add_argument("--modes", default=None,
                   help="only these modes of the sweep (and vanilla), e.g. dual/threshold=0.9")
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="seed of the held-out instances")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="canvas (default: the model's generation_config.json)")
    p.add_argument("--block-length", type=int, default=None,
                   help="block length (default: the model's generation_config.json)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="write the accuracy/speed PNG here")
    p.add_argument("--profiles", default=None,
                   help="write each mode's commit profile (forwards per block by block index, "
                        "refreshes) to this JSON file: sangam-bench sim --experiment "
                        "refresh-cadence --profiles reads it")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's)")
    p.add_argument("--verbose", action="store_true", help="print each mode as it finishes")
    structured.add_args(p)
    p.set_defaults(func=run)
