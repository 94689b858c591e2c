"""``sangam-bench quality --structured``: what structured output costs and buys on the demo tasks.

Decodes every held-out instance twice with the same params: without a constraint, and with
``structured_outputs=StructuredOutputsParams(regex=ANSWER_FORMATS[family])``, the family's answer
format (:data:`sangam.demo.tasks.ANSWER_FORMATS`). The settings compared: for a masked model,
greedy and the threshold rule at each of ``--thresholds`` (default 0.9 and 0.5) — a constrained
request commits left to right from its block's first masked position (the frontier rule,
docs/design.md §2.10), so it may spend more forwards per block —; for a uniform-state model
(DiffusionGemma), each ``--entropy-bounds`` x ``--denoising-steps`` setting — its canvas is
fixed left to right under the grammar and completed by the masked argmax, so the constraint
costs host work, not forwards. Per family and overall, without / with:

- exact: the output equals the answer;
- valid: the output fully matches the family's regex (``re.fullmatch``);
- tokens per forward: canvas tokens decoded (masked: answer, end-of-turn, the EOS padding of
  the blocks decoded; uniform: every position of every canvas) over forwards, as
  ``sangam-bench quality`` counts them; and forwards per request;
- latency per request: the wall time of the batch of all instances divided by their count
  (``batch ms/req``), and the mean wall time of each instance decoded alone (``alone ms``);
  each the best of ``--repeats`` rounds.

Both are timed after an untimed warm-up pass of every configuration (the first batch of a shape
pays one-off costs, and the first use of a regex compiles it), the configurations interleaved
within each round.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time

from sangam.demo.tasks import ANSWER_FORMATS, Task
from sangam.sampling_params import RequestOutput, SamplingParams, StructuredOutputsParams
from sangam.sched.block_cursor import BlockCursor

DEFAULT_THRESHOLDS = (0.9, 0.5)
ALL = "all"
SIDES = ("without", "with")
WARM_ALONE = 4  # instances of each configuration decoded alone in the warm-up pass



def tokens_decoded(out: RequestOutput, params: SamplingParams) -> int:
    """Canvas tokens committed for ``out``: every block up to the one holding the first stop."""
    canvas = BlockCursor.canvas_len(1, params.max_tokens, params.block_length)  # bidirectional
    if out.finish_reason == "stop":
        blocks = len(out.token_ids) // params.block_length + 1
        return min(blocks * params.block_length, canvas)
    return canvas

def masked_settings(thresholds: tuple[float, ...], block_length: int, cache: str
                    ) -> dict[str, dict]:
    """A masked model's settings, by label: greedy, the threshold rule at each threshold."""
    return {f"threshold={t:g}": dict(block_length=block_length, unmasking="threshold",
                                     threshold=t, cache=cache, temperature=0.0)
            for t in thresholds}


def uniform_settings(entropy_bounds: list[float], steps: list[int],
                     confidence_threshold: float | None) -> dict[str, dict]:
    """A uniform-state model's settings, by label: each entropy bound x denoising steps."""
    return {f"entropy_bound={b:g}/steps={n}": dict(
        seed=0, entropy_bound=b, max_denoising_steps=n, confidence_threshold=confidence_threshold)
        for b in entropy_bounds for n in steps}


def params_for(task: Task, constrained: bool, options: dict, max_tokens: int
               ) -> SamplingParams:
    """The params of one instance under a setting's ``options``; with the family's regex when
    ``constrained``."""
    so = StructuredOutputsParams(regex=ANSWER_FORMATS[task.family]) if constrained else None
    return SamplingParams(max_tokens=max_tokens, structured_outputs=so, **options)


def _decoded(llm, out: RequestOutput, params: SamplingParams) -> int:
    gemma = llm.loaded.config.gemma
    if gemma is not None:  # every position of every canvas
        return out.metrics["num_blocks"] * gemma.canvas_length
    return tokens_decoded(out, params)


def _metrics(llm, tasks: list[Task], outs: list, params: list[SamplingParams]) -> dict:
    n = len(tasks)
    texts = [o.text or "" for o in outs]
    forwards = sum(o.num_forwards for o in outs)
    decoded = sum(_decoded(llm, o, p) for o, p in zip(outs, params))
    return {
        "n": n,
        "exact": sum(t == task.answer for t, task in zip(texts, tasks)) / n,
        "valid": sum(re.fullmatch(ANSWER_FORMATS[task.family], t) is not None
                     for t, task in zip(texts, tasks)) / n,
        "tokens_per_forward": decoded / forwards,
        "forwards_per_request": forwards / n,
        "finished_by_length": sum(o.finish_reason == "length" for o in outs) / n,
    }


def _timed(llm, prompt_ids: list[list[int]], params) -> tuple[list, float]:
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    return outs, time.perf_counter() - start


def compare(llm, tasks: list[Task], prompt_ids: list[list[int]], settings: dict[str, dict],
            max_tokens: int, repeats: int = 3, log=None) -> dict:
    """{label: {"setting", "without": metrics, "with": metrics, "outputs"}} for each of
    ``settings`` (``masked_settings`` or ``uniform_settings``), the metrics per family and
    overall (the overall ones with the timings).

    Every configuration is warmed up untimed first. Then ``repeats`` rounds, each decoding every
    configuration in turn (so a load that comes and goes falls on all of them alike): the batch
    of all instances, then each instance alone. Latency is the best of the rounds (the batch's
    wall time over the count; per instance alone, then the mean over instances), the least
    disturbed by other work on the machine. Outputs are the first batch's; ``identical_outputs``
    is the share of every round's outputs (batched and alone) whose tokens equal them
    (batch invariance: 1)."""
    configs = [(label, c) for label in settings for c in (False, True)]
    params = {(label, c): [params_for(task, c, settings[label], max_tokens) for task in tasks]
              for label, c in configs}
    warm = min(WARM_ALONE, len(tasks))
    for key in configs:  # warm-up, untimed
        llm.generate(prompt_token_ids=prompt_ids, sampling_params=params[key])
        for i in range(warm):
            llm.generate(prompt_token_ids=[prompt_ids[i]], sampling_params=params[key][i])
    outs: dict = {}
    batch_s = {key: math.inf for key in configs}
    alone_s = {key: [math.inf] * len(tasks) for key in configs}
    agree = {key: 0 for key in configs}
    for _ in range(max(1, repeats)):
        for key in configs:
            got, seconds = _timed(llm, prompt_ids, params[key])
            batch_s[key] = min(batch_s[key], seconds)
            first = outs.setdefault(key, got)
            tokens = [list(o.token_ids) for o in first]
            agree[key] += sum(list(o.token_ids) == t for o, t in zip(got, tokens))
            for i in range(len(tasks)):
                (one,), seconds = _timed(llm, [prompt_ids[i]], params[key][i])
                alone_s[key][i] = min(alone_s[key][i], seconds)
                agree[key] += list(one.token_ids) == tokens[i]
    families = list(dict.fromkeys(t.family for t in tasks))
    results: dict = {}
    for key in configs:
        t, c = key
        o, p = outs[key], params[key]
        metrics = {ALL: _metrics(llm, tasks, o, p)}
        for f in families:
            idx = [i for i, task in enumerate(tasks) if task.family == f]
            metrics[f] = _metrics(llm, [tasks[i] for i in idx], [o[i] for i in idx],
                                  [p[i] for i in idx])
        metrics[ALL] |= {
            "batch_ms_per_request": 1e3 * batch_s[key] / len(tasks),
            "alone_ms": 1e3 * sum(alone_s[key]) / len(tasks),
            "alone_ms_p50": 1e3 * statistics.median(alone_s[key]),
            "identical_outputs": agree[key] / (2 * max(1, repeats) * len(tasks)),
        }
        entry = results.setdefault(t, {"setting": t})
        entry[SIDES[c]] = metrics
        entry.setdefault("outputs", [{"family": task.family, "answer": task.answer}
                                     for task in tasks])
        for row, out in zip(entry["outputs"], o):
            row[SIDES[c]] = out.text or ""
        if log is not None:
            m = metrics[ALL]
            log(f"{t} {SIDES[c]} constraint: exact {m['exact']:.3f}, valid "
                f"{m['valid']:.3f}, {m['tokens_per_forward']:.2f} tokens/forward, "
                f"{m['batch_ms_per_request']:.2f} ms/req batched, {m['alone_ms']:.1f} ms alone")
    return results


def _pair(a, b, fmt: str) -> str:
    show = lambda v: "-" if v is None else format(v, fmt)
    return f"{show(a)} / {show(b)}"


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per setting, each family then all, each cell ``without / with``."""
    head = ["setting", "family", "n", "exact %", "valid %", "tok/fwd", "fwd/req",
            "batch ms/req", "alone ms"]
    rows = []
    for entry in results.values():
        without, with_ = entry["without"], entry["with"]
        for f in [*(k for k in without if k != ALL), ALL]:
            a, b = without[f], with_[f]
            rows.append([entry["setting"], f, str(a["n"]),
                         _pair(100 * a["exact"], 100 * b["exact"], ".1f"),
                         _pair(100 * a["valid"], 100 * b["valid"], ".1f"),
                         _pair(a["tokens_per_forward"], b["tokens_per_forward"], ".2f"),
                         _pair(a["forwards_per_request"], b["forwards_per_request"], ".2f"),
                         _pair(a.get("batch_ms_per_request"), b.get("batch_ms_per_request"),
                               ".2f"),
                         _pair(a.get("alone_ms"), b.get("alone_ms"), ".1f")])
    return head, rows


def format_table(results: dict, markdown: bool = False) -> str:
    head, rows = table_rows(results)
    if markdown:
        lines = [head, ["---"] * len(head), *rows]
        return "\n".join("| " + " | ".join(r) + " |" for r in lines)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
                     for r in [head, *rows])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--structured", action="store_true",
                   help="instead of the sweep: each instance without and with its family's "
                        "answer regex as structured output (exact match, validity, tokens per "
                        f"forward, latency), at --thresholds (default "
                        f"{','.join(f'{v:g}' for v in DEFAULT_THRESHOLDS)}; uniform-state "
                        "models: --entropy-bounds x --denoising-steps)")
    p.add_argument("--cache", default=None, choices=("none", "prefix", "dual"),
                   help="with --structured on a masked model: the cache of both runs (default "
                        "dual)")
    p.add_argument("--repeats", type=int, default=3,
                   help="with --structured: timed rounds; latency is the best round's")
    p.add_argument("--markdown", action="store_true",
                   help="with --structured: print the table as Markdown")
