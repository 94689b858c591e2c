"""Seeded generators of the demo model's tasks: short chat prompts with checkable answers.

Six families, each answer at most 8 characters: addition and subtraction of two-digit numbers
(two-digit results), reversing, sorting and copying short lowercase strings, and counting a
letter in a six-letter string. Every possible instance belongs to exactly one split, decided by
a hash of its prompt (one instance in ``EVAL_MODULUS`` is held out), so evaluation instances
never appear in training whatever seeds are used.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

FAMILIES = ("add", "sub", "reverse", "sort", "copy", "count")
# The shipped demo model's families. Arithmetic is left out: the units digit of a + b is
# independent of each operand digit alone, so a small model's gradient sees no signal until it
# attends to both at once, and a 1M-parameter model does not get there in an hour on two CPU
# cores (measured: 2000 add-only steps left that digit at chance).
DEMO_FAMILIES = ("reverse", "sort", "copy", "count")
SPLITS = ("train", "eval")
EVAL_MODULUS = 8
EVAL_SEED = 1_000_003  # default seed of the held-out instances reported by `sangam-bench quality`
LETTERS = string.ascii_lowercase
COUNT_LETTERS = "abc"  # a small alphabet, so letters repeat and counts are not all 0 or 1
COUNT_LENGTH = 6


@dataclass(frozen=True)
class Task:
    family: str
    prompt: str  # the user message (the chat template is applied by the tokenizer)
    answer: str


def _word(rng: random.Random, lo: int, hi: int, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def sample_task(family: str, rng: random.Random) -> Task:
    """One instance of ``family`` drawn from ``rng`` (either split)."""
    if family == "add":  # 10 <= a, b and a + b <= 99
        a = rng.randint(10, 89)
        b = rng.randint(10, 99 - a)
        return Task(family, f"What is {a}+{b}?", str(a + b))
    if family == "sub":  # a - b >= 10
        a = rng.randint(20, 99)
        b = rng.randint(10, a - 10)
        return Task(family, f"What is {a}-{b}?", str(a - b))
    if family == "reverse":
        w = _word(rng, 3, 8)
        return Task(family, f"Reverse: {w}", w[::-1])
    if family == "sort":
        w = _word(rng, 3, 6)
        return Task(family, f"Sort: {w}", "".join(sorted(w)))
    if family == "copy":
        w = _word(rng, 3, 8)
        return Task(family, f"Repeat: {w}", w)
    if family == "count":
        w = _word(rng, COUNT_LENGTH, COUNT_LENGTH, COUNT_LETTERS)
        c = rng.choice(COUNT_LETTERS)
        return Task(family, f"How many {c}'s in {w}?", str(w.count(c)))
    raise ValueError(f"unknown task family {family!r}; choose from {FAMILIES}")


def split_of(task: Task) -> str:
    """'eval' for the held-out share of all possible instances, else 'train'."""
    h = zlib.crc32(f"{task.family}\n{task.prompt}".encode())
    return "eval" if h % EVAL_MODULUS == 0 else "train"


def _check(family: str, split: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; choose from {FAMILIES}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")


def generate(family: str, n: int, seed: int, split: str = "eval") -> list[Task]:
    """``n`` instances of ``family`` from ``split``, a pure function of the arguments."""
    _check(family, split)
    rng = random.Random(f"{family}/{split}/{seed}")
    out: list[Task] = []
    while len(out) < n:
        task = sample_task(family, rng)
        if split_of(task) == split:
            out.append(task)
    return out


def eval_set(n_per_family: int, seed: int = EVAL_SEED,
             families: tuple[str, ...] = FAMILIES) -> list[Task]:
    """Held-out instances, ``n_per_family`` of each family, families in order."""
    return [t for f in families for t in generate(f, n_per_family, seed, "eval")]


def training_stream(seed: int, families: tuple[str, ...] = FAMILIES) -> Iterator[Task]:
    """Endless training instances; the family of each is drawn uniformly from ``families`` (name
    a family twice to draw it twice as often). Deterministic."""
    for f in families:
        _check(f, "train")
    rng = random.Random(f"train-stream/{seed}")
    while True:
        task = sample_task(rng.choice(families), rng)
        if split_of(task) == "train":
            yield task
