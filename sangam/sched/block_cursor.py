"""A request's block geometry and its place in it: the one definition of which positions each
forward covers (docs/design.md §2) and of what a block's first step is (the refresh cadence).

Pure Python. One cursor per request per process: the scheduler's ``Request`` and the decoder's
``DecodeState`` of a request hold the same object, so neither keeps a copy to synchronise.
Who moves it: the decoder's commit (``advance``, ``store_chunk``: the step ran), the scheduler
(``admit_chunk``: it admitted part of a prefill) and a front that takes a request back
(``lose_cache``) or hears another process's progress (``catch_up``).

Geometry (P prompt tokens, a canvas, S suffix tokens; T = P + canvas + S; blocks of B):
- bidirectional models: block b covers [P + bB, P + (b+1)B). Its first step follows the
  cadence: a full refresh spans [0, T), a response-only one [P, T), and a cached first step the
  usual cached span, reaching back to s - 1 when row p - 1 predicts p (``shift``, Dream). Later
  steps span [s, e) (``cache="dual"``) or [s, T) (``"prefix"``); with ``"none"`` every step is
  a refresh over [0, T).
- block-causal models (SDAR): blocks lie on the grid from position 0, block 0 at
  floor(P/B)·B; the canvas ends on the grid. Block 0's first step (the request's refresh) spans
  [prefilled, e): the prompt's K/V not stored yet and the block; a prefill chunk admitted by the
  scheduler spans [prefilled, chunk_end) and scores nothing. A later block's first step spans
  [s - B, e) (it stores the finished block's final K/V), other steps [s, e). Keys: up to the
  span's end (nothing after it is visible, or written yet).
- uniform-state models (DiffusionGemma, ``uniform``): blocks are canvases from the prompt's
  end, [P + bB, P + (b+1)B); the spans are the block-causal ones (block 0's first step: the
  prompt's encoder rows not stored yet and the canvas; a later canvas's first step: the
  finished canvas's encoder rows and the canvas), and so are the keys. Which rows are the
  encoder's and what each sees is the attention's matter (docs/design.md §2.12).

The C++ host path (csrc/host_batch.cpp) reads the cursor's ``record`` (laid out as
``CURSOR_FIELDS``, handed to it at import) and mirrors these rules; tests/test_host_batch.py
drives both.
"""

from __future__ import annotations

from array import array

from sangam.sampling_params import CACHE_MODES, MAX_INT32, SamplingParams

# How a block's first step runs: a full refresh, a response-only refresh, or a cached step.
FULL_REFRESH, RESPONSE_REFRESH, NO_REFRESH = "full", "response", "none"

# The cursor's record: its geometry (fixed at construction) then its progress. chunk_end is -1
# when no chunk is admitted; cache is the index into CACHE_MODES.
CURSOR_FIELDS = (
    "prompt_len", "canvas_end", "total_len", "block_length", "block_origin", "num_blocks",
    "cache", "refresh_interval", "prompt_refresh_interval", "shift", "block_causal",
    "block", "step", "force_refresh", "prefilled", "chunk_end",
)
_BLOCK, _STEP, _FORCE, _PREFILLED, _CHUNK_END = (
    CURSOR_FIELDS.index(n) for n in ("block", "step", "force_refresh", "prefilled", "chunk_end"))


def cadence(block: int, refresh_interval: int, prompt_refresh_interval: int) -> str:
    """How block ``block`` of a bidirectional request starts: every ``refresh_interval``-th
    block refreshes, and every ``prompt_refresh_interval``-th of those fully; block 0 always
    fully."""
    if block % (refresh_interval * prompt_refresh_interval) == 0:
        return FULL_REFRESH
    return RESPONSE_REFRESH if block % refresh_interval == 0 else NO_REFRESH


class BlockCursor:
    """Invariants: ``0 <= block < num_blocks``; ``step`` counts the current block's forwards
    (0: the next is its first); ``prefilled`` (block-causal) is a multiple of B below block 0's
    start; ``chunk_end`` is None or in (prefilled, block_origin]."""

    __slots__ = ("prompt_len", "canvas_end", "total_len", "block_length", "block_origin",
                 "num_blocks", "cache", "refresh_interval", "prompt_refresh_interval", "shift",
                 "block_causal", "uniform", "exact", "record", "_later_len")

    def __init__(self, prompt_len: int, canvas_len: int, block_length: int, *,
                 suffix_len: int = 0, cache: str = "dual", refresh_interval: int = 1,
                 prompt_refresh_interval: int = 1, shift: int = 0, block_causal: bool = False,
                 uniform: bool = False):
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        if not 1 <= block_length <= MAX_INT32 or canvas_len < 1:
            raise ValueError(f"block_length ({block_length}) and canvas_len ({canvas_len}) must "
                             "be >= 1")
        if block_causal and (suffix_len or shift or (prompt_len + canvas_len) % block_length):
            raise ValueError(f"a block-causal canvas ({canvas_len}) must end the prompt "
                             f"({prompt_len}) on the grid of block_length ({block_length}), "
                             "with no suffix and no shifted logits")
        if uniform and (block_causal or suffix_len or shift or cache != "dual"
                        or refresh_interval != 1 or prompt_refresh_interval != 1):
            raise ValueError("a uniform-state request has no infilling, shift, cache mode or "
                             "refresh cadence")
        if not block_causal and canvas_len % block_length:
            raise ValueError(f"canvas_len ({canvas_len}) must be a multiple of block_length "
                             f"({block_length})")
        if suffix_len < 0 or shift not in (0, 1):
            raise ValueError(f"suffix_len must be >= 0 and shift 0 or 1, got {suffix_len}, "
                             f"{shift}")
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
        if not (1 <= refresh_interval <= MAX_INT32 and 1 <= prompt_refresh_interval <= MAX_INT32):
            raise ValueError(f"refresh intervals must be in [1, {MAX_INT32}], got "
                             f"{refresh_interval}, {prompt_refresh_interval}")
        self.prompt_len = prompt_len
        self.canvas_end = prompt_len + canvas_len  # where the suffix begins
        self.total_len = self.canvas_end + suffix_len
        self.block_length = block_length
        self.block_origin = prompt_len // block_length * block_length if block_causal \
            else prompt_len
        self.num_blocks = (self.canvas_end - self.block_origin) // block_length
        self.cache = cache
        self.refresh_interval = refresh_interval
        self.prompt_refresh_interval = prompt_refresh_interval
        self.shift = shift
        self.block_causal = block_causal
        self.uniform = uniform
        # The cache is exact (finished blocks' K/V never changes): the block-causal spans.
        self.exact = block_causal or uniform
        self.record = array("q", (
            prompt_len, self.canvas_end, self.total_len, block_length, self.block_origin,
            self.num_blocks, CACHE_MODES.index(cache), refresh_interval, prompt_refresh_interval,
            shift, int(block_causal), 0, 0, 0, 0, -1))
        # A later step's span length, read for every seated request at every iteration: from
        # span() itself, when the first and the last block agree on it (every cache mode but
        # "prefix", whose span shrinks block by block); None: computed each time.
        first, last = self.span(1, 0), self.span(1, self.num_blocks - 1)
        self._later_len = first[1] - first[0] if first[1] - first[0] == last[1] - last[0] \
            else None

    # Constructors and the geometry of a request's options before it has a cursor.
    @classmethod
    def for_request(cls, params: SamplingParams, prompt_len: int, *, suffix_len: int = 0,
                    shift: int = 0, block_causal: bool = False) -> BlockCursor:
        """The cursor of a request with ``params`` after a prompt of ``prompt_len`` tokens:
        its canvas (``canvas_len``), block length, cache mode and refresh cadence."""
        return cls(prompt_len, cls.canvas_len(prompt_len, params.max_tokens,
                                              params.block_length, block_causal),
                   params.block_length, suffix_len=suffix_len, cache=params.cache,
                   refresh_interval=params.refresh_interval,
                   prompt_refresh_interval=params.prompt_refresh_interval, shift=shift,
                   block_causal=block_causal)

    @classmethod
    def for_canvases(cls, prompt_len: int, max_tokens: int, canvas_length: int) -> BlockCursor:
        """The cursor of a uniform-state request: whole canvases after the prompt, enough for
        ``max_tokens``."""
        return cls(prompt_len, cls.canvas_len(prompt_len, max_tokens, canvas_length),
                   canvas_length, uniform=True)

    @staticmethod
    def canvas_len(prompt_len: int, max_tokens: int, block_length: int,
                   block_causal: bool = False) -> int:
        """The response canvas after a prompt of ``prompt_len``: ``max_tokens`` rounded up to
        whole blocks, or for a block-causal model what ends prompt + max_tokens on the block
        grid from position 0."""
        if block_causal:
            return -(-(prompt_len + max_tokens) // block_length) * block_length - prompt_len
        return -(-max_tokens // block_length) * block_length

    @staticmethod
    def max_canvas_len(max_tokens: int, block_length: int, block_causal: bool = False) -> int:
        """The longest ``canvas_len`` over every prompt length: a block-causal canvas may reach
        B - 1 positions past the plain one."""
        return BlockCursor.canvas_len(0, max_tokens, block_length) + (
            block_length - 1 if block_causal else 0)

    @staticmethod
    def graph_spans(block_length: int, block_causal: bool = False) -> tuple[int, ...]:
        """The span lengths of the DualCache steps a CUDA graph replays (``span``): a block's
        later steps (B) and, for a block-causal model, a later block's first step (2B: it
        stores the finished block). tests/test_block_cursor.py checks them against span."""
        return (block_length, 2 * block_length) if block_causal else (block_length,)

    @staticmethod
    def longest_cached_span(block_length: int, cache: str, context: int, shift: int = 0,
                            block_causal: bool = False) -> int:
        """An upper bound on every cached step's span (``span``) of a request with these
        options within ``context`` positions: a block-causal block's first step rewrites the
        block before; a DualCache step spans its block (one more when it starts a block from
        cache with shifted logits); a PrefixCache step runs to the end. Checked against span
        by tests/test_block_cursor.py."""
        if block_causal:
            return 2 * block_length
        if cache == "dual":
            return block_length + shift
        return context

    def __repr__(self) -> str:
        return (f"BlockCursor(block={self.block}/{self.num_blocks}, step={self.step}, "
                f"T={self.total_len}, cache={self.cache})")

    def copy(self) -> BlockCursor:
        """An independent cursor at the same place (another process's copy of it)."""
        other = object.__new__(BlockCursor)
        for name in BlockCursor.__slots__:
            setattr(other, name, getattr(self, name))  # the geometry: fixed
        other.record = array("q", self.record)
        return other

    # Progress, kept in the record (the C++ host path reads and writes it there).
    @property
    def block(self) -> int:
        return self.record[_BLOCK]

    @block.setter
    def block(self, value: int) -> None:
        self.record[_BLOCK] = value

    @property
    def step(self) -> int:
        return self.record[_STEP]

    @step.setter
    def step(self, value: int) -> None:
        self.record[_STEP] = value

    @property
    def force_refresh(self) -> bool:
        """The current block starts with a full refresh whatever the cadence says: the adaptive
        trigger fired when the block before it ended, or its cached K/V was lost."""
        return bool(self.record[_FORCE])

    @force_refresh.setter
    def force_refresh(self, value: bool) -> None:
        self.record[_FORCE] = int(value)

    @property
    def prefilled(self) -> int:
        """Block-causal: prompt positions whose K/V is stored (whole blocks)."""
        return self.record[_PREFILLED]

    @prefilled.setter
    def prefilled(self, value: int) -> None:
        self.record[_PREFILLED] = value

    @property
    def chunk_end(self) -> int | None:
        """The end of the prefill chunk admitted for the next forward; None: no chunk."""
        end = self.record[_CHUNK_END]
        return None if end < 0 else end

    @chunk_end.setter
    def chunk_end(self, value: int | None) -> None:
        self.record[_CHUNK_END] = -1 if value is None else value

    @property
    def key_block(self) -> int:
        """The span a cached page's K/V depends on is rounded out to (prefix caching's keys):
        a block-causal block (its mask sees the whole block), a single position for a
        uniform-state model's causal encoder."""
        return 1 if self.uniform else self.block_length

    # Rules.
    def block_bounds(self, block: int | None = None) -> tuple[int, int]:
        """Block ``block``'s positions [s, e) (default: the current block's)."""
        s = self.block_origin + (self.record[_BLOCK] if block is None else block) \
            * self.block_length
        return s, s + self.block_length

    def num_pages(self, page_size: int) -> int:
        """KV pages that hold the whole sequence: ceil(T / page_size)."""
        return -(-self.total_len // page_size)

    def block_of(self, position: int) -> int:
        """The block holding canvas position ``position``."""
        return (position - self.block_origin) // self.block_length

    def block_masks(self, block: int) -> int:
        """The masked positions block ``block`` starts with: all B of it, but a block-causal
        block 0 begins with the prompt's tail."""
        s, e = self.block_bounds(block)
        return e - max(s, self.prompt_len)

    def blocks_for(self, response_len: int) -> int:
        """How many blocks hold the first ``response_len`` (>= 1) response positions."""
        return self.block_of(self.prompt_len + response_len - 1) + 1

    def block_refresh(self, block: int) -> str:
        """How ``block`` starts by the cadence (a block-causal or uniform-state request
        refreshes block 0 only: its finished blocks' K/V is exact)."""
        if self.exact:
            return FULL_REFRESH if block == 0 else NO_REFRESH
        return cadence(block, self.refresh_interval, self.prompt_refresh_interval)

    @property
    def block_start(self) -> str:
        """How the current block starts: as the cadence says, or fully if forced."""
        return FULL_REFRESH if self.record[_FORCE] else self.block_refresh(self.record[_BLOCK])

    def span(self, step: int | None = None, block: int | None = None) -> tuple[int, int]:
        """The query positions [start, end) of forward number ``step`` (default: the next one)
        of block ``block`` (default: the current one), by the module docstring's rules."""
        r = self.record
        b = self.block_length
        step = r[_STEP] if step is None else step
        block = r[_BLOCK] if block is None else block
        s = self.block_origin + block * b
        e = s + b
        if self.exact:  # the cache is exact: nothing after a block ever attends to it
            if step:
                return s, e
            if block == 0 or r[_FORCE]:  # the prompt's K/V (what is left of it) and the block
                end = r[_CHUNK_END]
                return r[_PREFILLED], e if end < 0 else end
            return s - b, e
        if self.cache == "none":
            return 0, self.total_len
        if step == 0:
            start = FULL_REFRESH if r[_FORCE] else self.block_refresh(block)
            if start == FULL_REFRESH:
                return 0, self.total_len
            if start == RESPONSE_REFRESH:
                return self.prompt_len, self.total_len
            s -= self.shift  # a cached first step: with shifted logits, row s - 1 predicts s
        return (s, e) if self.cache == "dual" else (s, self.total_len)

    @property
    def span_len(self) -> int:
        """The next forward's span length: its cost in tokens."""
        start, end = self.span()
        return end - start

    @property
    def decode_span(self) -> int:
        """The span length of the current block's next cached step: the next forward's when
        it is one, else (the block starts with a refresh) its second forward's."""
        r = self.record
        if r[_STEP] and self._later_len is not None:
            return self._later_len
        cached = r[_STEP] or self.block_start == NO_REFRESH
        start, end = self.span(None if cached else 1)
        return end - start

    def keys_attended(self, span_end: int) -> int:
        """Cached positions a forward ending at ``span_end`` attends over: all T, or for a
        block-causal model those up to its span's end."""
        return span_end if self.exact else self.total_len

    def chunk_room(self, budget: int | float) -> int:
        """The longest prefill chunk within ``budget`` tokens: whole blocks of the prompt not
        stored yet (the block with the first masks is never split off); 0 if none fits."""
        if not self.exact or self.block_start != FULL_REFRESH:
            return 0
        room = self.block_origin - self.record[_PREFILLED]
        if budget < room:
            room = int(budget) // self.block_length * self.block_length
        return max(0, room)

    # Moves.
    def admit_chunk(self, tokens: int) -> None:
        """The scheduler admitted ``tokens`` of the prompt's K/V (``chunk_room``) alone."""
        self.record[_CHUNK_END] = self.record[_PREFILLED] + tokens

    def store_chunk(self) -> None:
        """The admitted chunk's forward ran: its K/V is stored."""
        r = self.record
        r[_PREFILLED], r[_CHUNK_END] = r[_CHUNK_END], -1

    def advance(self, block_done: bool, finished: bool, force_next: bool = False) -> None:
        """A step committed; with ``block_done`` (and not ``finished``) the next block begins,
        with a full refresh if ``force_next`` (the adaptive trigger)."""
        r = self.record
        if block_done and not finished and r[_BLOCK] + 1 >= self.num_blocks:
            raise ValueError(f"{self!r}: the last block is done, so the request must finish")
        r[_STEP] += 1
        r[_FORCE] = 0
        if block_done and not finished:
            r[_BLOCK] += 1
            r[_STEP] = 0
            r[_FORCE] = int(force_next)

    def lose_cache(self) -> None:
        """The K/V this request had is gone (its worker died, a transfer failed): its current
        block starts over with a full refresh, from position 0."""
        r = self.record
        r[_STEP], r[_FORCE], r[_PREFILLED], r[_CHUNK_END] = 0, 1, 0, -1

    def catch_up(self, block: int, step: int, force_refresh: bool) -> None:
        """Take another process's progress of this request in."""
        r = self.record
        r[_BLOCK], r[_STEP], r[_FORCE] = block, step, int(force_refresh)
