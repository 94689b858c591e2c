"""Request traces for the serving benchmarks and the simulator (docs/design.md §7).

A trace is a list of :class:`TraceRequest`: arrival time (seconds from the start), prompt
length, output length, and optionally the prompt itself (text, or token ids). Lengths come from

- a real ShareGPT file (the JSON that vLLM's serving benchmark reads: a list of
  ``{"conversations": [{"from": "human" | "gpt", "value": ...}, ...]}``): the first human turn is
  the prompt and the reply to it the output. Lengths are counted with a tokenizer when one is
  given, else estimated as ``ceil(characters / 4)`` (the usual rule of thumb for English BPE
  vocabularies; pass a tokenizer for exact counts). Pairs beyond the length cap are dropped, as
  vLLM's benchmark does;
- a CSV file with columns ``prompt_len,gen_len`` and optionally ``prompt`` (text) or
  ``messages`` (a JSON list of ``{"role", "content"}``, joined into one prompt);
- seeded synthetic generators shaped like ShareGPT (chat, decode-heavy: median prompt 795,
  output 266 tokens) and arXiv summarization (prefill-heavy: median 2827 / 162): independent
  lognormals with those medians; and "chat": a 512-token system prompt, a 50-300-token user
  turn, a ShareGPT-shaped reply. Prompts are truncated so that prompt + output stays within
  ``max_total`` (4096, the paper's cap), as a long document would be; fewer than half the
  samples are truncated, so the medians survive.

Arrivals are a seeded Poisson process (exponential gaps) or a gamma process with a chosen
coefficient of variation (burstier than Poisson when ``cv > 1``).

Prompt sharing (``with_shared_prompts``; the prefix cache's workloads): every prompt begins with
the same ``--shared-prefix`` tokens (a system prompt) and goes on with its own, and each prompt
may be sent ``--samples`` times at its arrival (n samples of it, as an RL rollout draws).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

MAX_TOTAL = 4096  # prompt + output cap of the paper's traces
MIN_LEN = 4  # shorter prompts or outputs are dropped (as in vLLM's benchmark)


@dataclass(frozen=True)
class LengthSample:
    """One request's shape, before it is given an arrival time."""

    prompt_len: int
    gen_len: int
    prompt: str | list[int] | None = None


@dataclass(frozen=True)
class TraceRequest:
    arrival_time: float  # seconds after the start of the run
    prompt_len: int
    gen_len: int
    prompt: str | list[int] | None = None  # text or token ids; None: make one of prompt_len


@dataclass(frozen=True)
class LognormalShape:
    """Medians and log-space spreads of prompt and output lengths."""

    prompt_median: float
    prompt_sigma: float
    gen_median: float
    gen_sigma: float


# Sigmas: ShareGPT prompts and replies spread over two orders of magnitude (multi-turn context
# vs one-liners); arXiv articles and abstracts are far more uniform in length.
SHAPES = {
    "sharegpt": LognormalShape(795, 1.0, 266, 0.8),
    "arxiv": LognormalShape(2827, 0.45, 162, 0.5),
}


# A chat deployment's requests (the "chat" trace): a system prompt of CHAT_SYSTEM tokens, then
# the user's turn of CHAT_TURN tokens (uniform), and a ShareGPT-shaped reply. With
# --shared-prefix CHAT_SYSTEM every request shares the system prompt (prefix caching's case).
CHAT_SYSTEM = 512
CHAT_TURN = (50, 300)


def chat_lengths(n: int, seed: int) -> list[LengthSample]:
    """``n`` seeded (prompt, output) lengths of the "chat" trace."""
    rng = np.random.default_rng(seed)
    turn = rng.integers(CHAT_TURN[0], CHAT_TURN[1] + 1, n)
    s = SHAPES["sharegpt"]
    gen = np.exp(math.log(s.gen_median) + s.gen_sigma * rng.standard_normal(n))
    gen = np.clip(np.rint(gen), MIN_LEN, MAX_TOTAL // 2).astype(int)
    return [LengthSample(CHAT_SYSTEM + int(t), int(g)) for t, g in zip(turn, gen)]


def synthetic_lengths(shape: str, n: int, seed: int, max_total: int = MAX_TOTAL
                      ) -> list[LengthSample]:
    """``n`` seeded (prompt, output) lengths shaped like ``shape`` ("sharegpt" or "arxiv")."""
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic trace {shape!r}; use one of {sorted(SHAPES)}")
    if max_total < 2 * MIN_LEN:
        raise ValueError(f"max_total must be >= {2 * MIN_LEN}, got {max_total}")
    s = SHAPES[shape]
    # One (prompt, output) pair of normals per row: the first n requests of a longer trace are
    # the n of a shorter one, so runs of different sizes share their requests.
    z = np.random.default_rng(seed).standard_normal((n, 2))
    prompt = np.exp(math.log(s.prompt_median) + s.prompt_sigma * z[:, 0])
    gen = np.exp(math.log(s.gen_median) + s.gen_sigma * z[:, 1])
    gen = np.clip(np.rint(gen), MIN_LEN, max_total // 2).astype(int)
    prompt = np.clip(np.rint(prompt), MIN_LEN, max_total - gen).astype(int)
    return [LengthSample(int(p), int(g)) for p, g in zip(prompt, gen)]


def char_estimate(text: str) -> int:
    """Token count estimate without a tokenizer: about four characters per token."""
    return max(1, -(-len(text) // 4))


def load_sharegpt(path: str | os.PathLike, count_tokens: Callable[[str], int] | None = None,
                  max_total: int = MAX_TOTAL) -> list[LengthSample]:
    """(prompt, reply) pairs of a ShareGPT JSON file, in file order, within the length caps."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    count = count_tokens or char_estimate
    out = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not turns or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if first.get("from") != "human" or reply.get("from") != "gpt":
            continue
        prompt, answer = str(first.get("value", "")), str(reply.get("value", ""))
        p, g = count(prompt), count(answer)
        if p < MIN_LEN or g < MIN_LEN or p + g > max_total:
            continue
        out.append(LengthSample(p, g, prompt))
    if not out:
        raise ValueError(f"{path}: no usable (human, gpt) pair within {max_total} tokens")
    return out


def load_csv(path: str | os.PathLike) -> list[LengthSample]:
    """Rows of ``prompt_len,gen_len[,prompt | messages]``."""
    out = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"prompt_len", "gen_len"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}")
        for i, row in enumerate(reader):
            p, g = int(row["prompt_len"]), int(row["gen_len"])
            if p < 1 or g < 1:
                raise ValueError(f"{path}: row {i + 2}: lengths must be >= 1, got {p}, {g}")
            text = row.get("prompt") or None
            if not text and row.get("messages"):
                text = "\n".join(str(m.get("content", "")) for m in json.loads(row["messages"]))
            out.append(LengthSample(p, g, text))
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


def load_lengths(source: str, n: int, seed: int, count_tokens: Callable[[str], int] | None = None,
                 max_total: int = MAX_TOTAL) -> list[LengthSample]:
    """``n`` samples from ``source``: "sharegpt" / "arxiv" (synthetic) or a .json / .csv file.

    A file's samples are shuffled with ``seed`` and reused in that order when ``n`` exceeds
    them, so a run is reproducible and does not depend on the file's ordering.
    """
    if source in SHAPES:
        return synthetic_lengths(source, n, seed, max_total)
    if source == "chat":
        return chat_lengths(n, seed)
    if source.endswith(".csv"):
        pool = load_csv(source)
    elif source.endswith(".json"):
        pool = load_sharegpt(source, count_tokens, max_total)
    else:
        raise ValueError(f"trace {source!r}: use {' or '.join(SHAPES)} (synthetic), a ShareGPT "
                         ".json file or a .csv file")
    order = np.random.default_rng(seed).permutation(len(pool))
    return [pool[order[i % len(pool)]] for i in range(n)]


def poisson_arrivals(n: int, qps: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of rate ``qps``, the first after one gap."""
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    gaps = np.random.default_rng(seed).exponential(1.0 / qps, n)
    return np.cumsum(gaps).tolist()


def gamma_arrivals(n: int, qps: float, cv: float, seed: int) -> list[float]:
    """Gamma-distributed gaps with mean ``1/qps`` and coefficient of variation ``cv``
    (``cv = 1`` is Poisson; larger is burstier)."""
    if qps <= 0 or cv <= 0:
        raise ValueError(f"qps and cv must be > 0, got {qps}, {cv}")
    shape = 1.0 / (cv * cv)
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (qps * shape), n)
    return np.cumsum(gaps).tolist()


def arrivals(n: int, qps: float, seed: int, process: str = "poisson", cv: float = 1.0
             ) -> list[float]:
    """``n`` arrival times at rate ``qps``; ``qps = inf`` puts every request at time 0."""
    if math.isinf(qps):
        return [0.0] * n
    if process == "poisson":
        return poisson_arrivals(n, qps, seed)
    if process == "gamma":
        return gamma_arrivals(n, qps, cv, seed)
    raise ValueError(f"arrival process must be poisson or gamma, got {process!r}")


def build_trace(samples: Sequence[LengthSample], times: Sequence[float]) -> list[TraceRequest]:
    if len(samples) != len(times):
        raise ValueError(f"{len(samples)} samples for {len(times)} arrival times")
    return [TraceRequest(t, s.prompt_len, s.gen_len, s.prompt) for s, t in zip(samples, times)]


def with_shared_prompts(trace: Sequence[TraceRequest], shared_prefix: int, samples: int,
                        vocab: int, seed: int, avoid: int | None = None) -> list[TraceRequest]:
    """``trace`` with prompts as token ids (``vocab`` of them, never ``avoid``, the mask): the
    first ``shared_prefix`` the same for every request, the rest its own; each request
    ``samples`` times at its arrival. Unchanged when neither is asked for (0 and 1)."""
    if shared_prefix < 0 or samples < 1:
        raise ValueError(f"shared_prefix must be >= 0 and samples >= 1, got {shared_prefix}, "
                         f"{samples}")
    if not shared_prefix and samples == 1:
        return list(trace)
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        out = rng.integers(0, vocab, n)
        if avoid is not None:
            out[out == avoid] = (avoid + 1) % vocab
        return out.tolist()

    prefix = ids(shared_prefix)
    out = []
    for t in trace:
        prompt = prefix[:t.prompt_len] + ids(max(0, t.prompt_len - shared_prefix))
        out += [TraceRequest(t.arrival_time, t.prompt_len, t.gen_len, prompt)] * samples
    return out


def add_prompt_sharing_args(group) -> None:
    """The prompt-sharing flags of ``sangam-bench serve`` and ``sim`` (one definition)."""
    group.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                       help="every prompt begins with these many tokens in common (a system "
                            "prompt), the rest its own (prefix caching's workload)")
    group.add_argument("--samples", type=int, default=1, metavar="N",
                       help="send each prompt N times at its arrival (n samples of it)")


def scale_lengths(samples: Sequence[LengthSample], scale: float) -> list[LengthSample]:
    """Shrink lengths by ``scale`` (at least one token each) so a trace fits a tiny CPU model;
    the prompt text is dropped when lengths change, because it no longer matches them."""
    if not 0 < scale <= 1:
        raise ValueError(f"length scale must be in (0, 1], got {scale}")
    if scale == 1:
        return list(samples)
    return [LengthSample(max(1, round(s.prompt_len * scale)), max(1, round(s.gen_len * scale)))
            for s in samples]
