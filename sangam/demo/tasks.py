"""Seeded generators of the demo models' tasks: chat prompts with checkable answers.

Six short families, each answer at most 8 characters: addition and subtraction of two-digit
numbers (two-digit results), reversing, sorting and copying short lowercase strings, and
counting a letter in a six-letter string. Three long ones, answers of 64-150 characters (4-10
blocks of 16): copying a string, shifting each of its letters by 1-3 places in the alphabet (a
Caesar shift), and tallying it (digit j: how many a's in its first j + 1 letters, modulo 10, so
each digit depends on the one before it, across block boundaries). A long task's string sits in
a fixed-width field of dots (``FIELD``), so answer character j is always the same distance after
prompt character j: a 1M-parameter model learns that lookup in minutes, where a distance that
grows with the string's length (an unpadded copy) kept its letters at chance for the
1,000-2,300 steps tried.
Every possible instance belongs to exactly one split, decided by a hash of its prompt (one
instance in ``EVAL_MODULUS`` is held out), so evaluation instances never appear in training
whatever seeds are used.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

FAMILIES = ("add", "sub", "reverse", "sort", "copy", "count", "copy_long", "shift", "tally")
# The shipped demo model's families. Arithmetic is left out: the units digit of a + b is
# independent of each operand digit alone, so a small model's gradient sees no signal until it
# attends to both at once, and a 1M-parameter model does not get there in an hour on two CPU
# cores (measured: 2000 add-only steps left that digit at chance).
DEMO_FAMILIES = ("reverse", "sort", "copy", "count")
# sangam-demo-long's (``train_demo_model.py --preset long``): answers of LONG_ANSWER characters,
# at least 4 blocks of 16, each position a function of the prompt (and, tallying, of the answer
# before it).
LONG_FAMILIES = ("copy_long", "shift", "tally")
LONG_ANSWER = (64, 150)  # answer length range of held-out instances, characters (= tokens)
FIELD = LONG_ANSWER[1]  # width of a long task's dot-padded field
VERB_WIDTH = 10  # a long task's instruction, padded so every family's field starts alike
TALLY_LETTERS = "ab"
# Training draws shorter ones too, whose letters rarely repeat.
LONG_TRAIN_ANSWER = (8, 150)
SHIFTS = (1, 2, 3)  # Caesar shifts of the shift family
SPLITS = ("train", "eval")
EVAL_MODULUS = 8
EVAL_SEED = 1_000_003  # default seed of the held-out instances reported by `sangam-bench quality`
LETTERS = string.ascii_lowercase
COUNT_LETTERS = "abc"  # a small alphabet, so letters repeat and counts are not all 0 or 1
COUNT_LENGTH = 6


# Each family's answer format as a regex (the whole answer, as ``re.fullmatch`` reads it and as
# structured output's ``regex`` constrains it), from the generators' bounds: sums 20-99,
# differences 10-89, short strings of their lengths, a count of 0 to COUNT_LENGTH, long answers
# of LONG_ANSWER characters (a tally's digits). `sangam-bench quality --structured` uses them.
ANSWER_FORMATS = {
    "add": "[2-9][0-9]",
    "sub": "[1-8][0-9]",
    "reverse": "[a-z]{3,8}",
    "sort": "[a-z]{3,6}",
    "copy": "[a-z]{3,8}",
    "count": f"[0-{COUNT_LENGTH}]",
    "copy_long": f"[a-z]{{{LONG_ANSWER[0]},{LONG_ANSWER[1]}}}",
    "shift": f"[a-z]{{{LONG_ANSWER[0]},{LONG_ANSWER[1]}}}",
    "tally": f"[0-9]{{{LONG_ANSWER[0]},{LONG_ANSWER[1]}}}",
}


@dataclass(frozen=True)
class Task:
    family: str
    prompt: str  # the user message (the chat template is applied by the tokenizer)
    answer: str


def _word(rng: random.Random, lo: int, hi: int, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def sample_task(family: str, rng: random.Random,
                long_answer: tuple[int, int] = LONG_ANSWER) -> Task:
    """One instance of ``family`` drawn from ``rng`` (either split); a long family's answer has
    a length in ``long_answer``."""
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
    lo, hi = long_answer
    w = _word(rng, lo, hi, TALLY_LETTERS if family == "tally" else LETTERS)
    if family == "copy_long":
        return _field_task(family, "Repeat:", w, w)
    if family == "shift":
        k = rng.choice(SHIFTS)
        return _field_task(family, f"Shift {k}:", w, "".join(_shifted(c, k) for c in w))
    if family == "tally":
        return _field_task(family, "Tally a:", w, _running_count(w, "a"))
    raise ValueError(f"unknown task family {family!r}; choose from {FAMILIES}")


def _field_task(family: str, verb: str, word: str, answer: str) -> Task:
    """A long task: ``verb`` padded to ``VERB_WIDTH``, then ``word`` in a ``FIELD``-wide field of
    dots, so answer character j always sits the same distance after prompt character j."""
    return Task(family, f"{verb:<{VERB_WIDTH}}{word:.<{FIELD}}", answer)


def _running_count(word: str, letter: str) -> str:
    """Digit j is the count of ``letter`` in ``word[: j + 1]``, modulo 10."""
    out, n = [], 0
    for c in word:
        n += c == letter
        out.append(str(n % 10))
    return "".join(out)


def _shifted(c: str, k: int) -> str:
    return LETTERS[(LETTERS.index(c) + k) % len(LETTERS)]


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
    a family twice to draw it twice as often), long answers from ``LONG_TRAIN_ANSWER``.
    Deterministic."""
    for f in families:
        _check(f, "train")
    rng = random.Random(f"train-stream/{seed}")
    while True:
        task = sample_task(rng.choice(families), rng, LONG_TRAIN_ANSWER)
        if split_of(task) == "train":
            yield task
