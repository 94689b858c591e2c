"""Uniform-state diffusion (DiffusionGemma's decoding, docs/design.md §2.12): a canvas of
uniformly random tokens, re-sampled every step, nothing committed until the canvas ends.

One step of one canvas, from the decoder's fp32 logits ``[C, V]``:

1. temperature: a linear schedule from ``t_max`` at the first step to ``t_min`` at the last
   (transformers' ``LinearTemperatureScheduleLogitsProcessor``, computed as it is: in fp32
   from the number of steps left);
2. a denoised canvas sampled from softmax(logits / t) (:func:`categorical`), and its argmax;
3. the entropy-bound sampler: the lowest-entropy positions are accepted while the sum of
   their entropies minus the largest of them stays within ``entropy_bound``; accepted
   positions take the sampled tokens, the others are renoised with uniform draws
   (:func:`uniform_tokens`);
4. adaptive stopping: the argmax canvas unchanged over the last ``stability_threshold`` steps
   and the mean entropy below ``confidence_threshold`` (0 turns it off: an entropy is never
   negative); else the canvas stops after ``max_denoising_steps``.

The canvas ends as its last argmax. The processed logits become the next step's
self-conditioning (the model's ``soft_embeddings``).

Noise is a pure function of (seed, canvas, step or draw, position) — the seed being the
request's — so a request's tokens do not depend on its batch, and an outside sampler (a test
patching transformers' ``torch.multinomial`` and ``initialize_canvas``) can draw the same:

- ``uniform_tokens(seed, canvas, draw, positions, V)``: draw 0 is the canvas's initial one,
  draw j + 1 the renoise after step j (0-based). Token = (h * V) >> 32 for the 32-bit hash
  h = row_key(mix32(noise_key(seed, canvas, draw) ^ UNIFORM_TAG), position).
- ``categorical(probs, keys)``: step j's sample at a position is argmax_v(log p_v + G_v), G
  the Gumbel noise ``gumbel_noise`` of row_key(noise_key(seed, canvas, j), position), in fp64.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from sangam.decoding.family import StepPlan
from sangam.decoding.noise import gumbel_noise, mix32, mix32_tensor, noise_key, row_keys
from sangam.sampling_params import UniformStateParams

if TYPE_CHECKING:
    from sangam.decoding.state import DecodeState

UNIFORM_TAG = 0x5EED7A6E  # separates the uniform draws' keys from the Gumbel ones
GUMBEL_ROWS = 32  # rows of [rows, V] fp64 noise made at a time: bounds the sampler's memory


def temperature(params: UniformStateParams, step: int, device: torch.device) -> torch.Tensor:
    """Step ``step``'s (0-based) temperature, an fp32 scalar tensor: t_min + (t_max - t_min) *
    (steps left / max_denoising_steps), with the division and products in fp32 as
    transformers' schedule makes them (its step count is an int32 tensor)."""
    left = torch.tensor(params.max_denoising_steps - step, dtype=torch.int32, device=device)
    return params.t_min + (params.t_max - params.t_min) * (left / params.max_denoising_steps)


def uniform_key(seed: int, canvas: int, draw: int) -> int:
    return mix32(noise_key(seed, canvas, draw) ^ UNIFORM_TAG)


def uniform_tokens(seed: int, canvas: int, draw: int, positions: torch.Tensor,
                   vocab_size: int) -> torch.Tensor:
    """Uniform tokens in [0, vocab_size) at canvas ``positions`` (int64): the module's
    documented draw."""
    key = uniform_key(seed, canvas, draw)
    h = mix32_tensor(key ^ mix32_tensor(positions.to(torch.int64)))
    return (h * vocab_size) >> 32


def step_keys(seed: int, canvas: int, step: int, positions: np.ndarray) -> np.ndarray:
    """The Gumbel row keys of one step's canvas positions."""
    return row_keys(noise_key(seed, canvas, step), positions)


def categorical(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One sample per row of ``probs`` ``[R, V]``: argmax(log p + G), G the Gumbel noise of
    each row's key, in fp64 (rows in chunks, to bound the noise's memory)."""
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for lo in range(0, probs.shape[0], GUMBEL_ROWS):
        p = probs[lo:lo + GUMBEL_ROWS].to(torch.float64)
        g = gumbel_noise(keys[lo:lo + GUMBEL_ROWS], p.shape[1], torch.float64)
        out[lo:lo + GUMBEL_ROWS] = (p.log() + g).argmax(-1)
    return out


@dataclass(frozen=True)
class CanvasSpec:
    """What a uniform-state request's canvases are: its options and the model's canvas."""

    params: UniformStateParams
    length: int  # canvas_length: positions per canvas (a block)
    vocab_size: int
    window: int  # the model's sliding window (what its attention's key bounds read)


@dataclass
class Canvas:
    """One request's canvas in progress."""

    index: int  # the request's canvas number (0: the first after the prompt)
    tokens: torch.Tensor  # int64 [C]: the current (noisy) canvas
    argmax: torch.Tensor | None = None  # the last step's argmax canvas
    steps: int = 0  # steps (decoder forwards) taken
    soft: torch.Tensor | None = None  # self-conditioning for the next step; None: zeros
    history: list[torch.Tensor] = field(default_factory=list)  # the last argmax canvases
    done: bool = False
    # The last step's processed logits, until the runner turns them into ``soft`` (the model's
    # soft_embeddings): a [C, V] tensor is not kept longer than that.
    processed: torch.Tensor | None = None

    def to(self, device: torch.device) -> Canvas:
        """This canvas with its tensors on ``device`` (in place; a canvas that crossed
        processes arrives on the CPU)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        self.tokens, self.argmax, self.soft = (move(t) for t in (self.tokens, self.argmax,
                                                                 self.soft))
        self.history = [h.to(device) for h in self.history]
        return self

    def __getstate__(self) -> dict:
        """Pickled (a request moving between workers) with its tensors on the CPU."""
        if self.processed is not None:
            raise RuntimeError("a canvas is pickled between a step and its self-conditioning")
        state = dict(self.__dict__)
        state.update(tokens=self.tokens.cpu(), history=[h.cpu() for h in self.history],
                     argmax=None if self.argmax is None else self.argmax.cpu(),
                     soft=None if self.soft is None else self.soft.cpu())
        return state

    @classmethod
    def start(cls, seed: int, index: int, length: int, vocab_size: int,
              device: torch.device) -> Canvas:
        positions = torch.arange(length, device=device)
        return cls(index, uniform_tokens(seed, index, 0, positions, vocab_size))


def denoise_step(canvas: Canvas, logits: torch.Tensor, params: UniformStateParams,
                 seed: int) -> torch.Tensor:
    """Apply one step's logits (fp32 ``[C, V]``) to ``canvas`` in place (module docstring);
    ``canvas.done`` when adaptive stopping fires or the steps run out. Returns the processed
    logits (logits / temperature, fp32): the next step's self-conditioning input."""
    device = logits.device
    length, vocab = logits.shape
    j = canvas.steps
    processed = logits / temperature(params, j, device)
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    keys = torch.from_numpy(step_keys(seed, canvas.index, j, np.arange(length))).to(device)
    sampled = categorical(probs, keys)
    argmax = processed.argmax(-1)
    entropy = torch.distributions.Categorical(logits=processed).entropy()
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    chosen = torch.cumsum(ordered, dim=-1) - ordered <= params.entropy_bound
    accept = torch.zeros_like(chosen).scatter(0, order, chosen)
    positions = torch.arange(length, device=device)
    noise = uniform_tokens(seed, canvas.index, j + 1, positions, vocab)
    canvas.tokens = torch.where(accept, sampled, noise)
    stable = all(bool((h == argmax).all()) for h in canvas.history) and (
        len(canvas.history) == params.stability_threshold)
    if params.stability_threshold:
        canvas.history = (canvas.history + [argmax])[-params.stability_threshold:]
    confident = bool(entropy.mean() < params.confidence_threshold)
    canvas.argmax = argmax
    canvas.steps = j + 1
    canvas.done = (stable and confident) or canvas.steps >= params.max_denoising_steps
    return processed


class CanvasGrammar:
    """Structured output on a uniform-state canvas (docs/decoding.md, "Structured output"):
    the canvas denoises as it would unconstrained (its steps, noise and stopping unchanged),
    and ends as read left to right under the grammar: each response position takes the
    grammar-masked argmax of the last step's logits, through ``GrammarState.fit`` (so the
    response ends complete within max_tokens); past the grammar's end (or max_tokens), its
    end token. Freezing the grammar's prefix at each step instead was measured and cost exact
    match (docs/results.md)."""

    def __init__(self, st: DecodeState):
        c = st.cursor
        s, _ = c.block_bounds()
        self.grammar = st.grammar
        self.before = st.tokens[c.prompt_len:s]  # the response's finished canvases
        self.offset = s - c.prompt_len  # the canvas's first response position
        self.max_tokens = st.params.max_tokens

    def final(self, processed: torch.Tensor) -> torch.Tensor:
        """The finished canvas, from the last step's processed logits ``[C, V]``."""
        g = self.grammar
        g.sync_to(self.before)
        out = []
        for i in range(processed.shape[0]):
            if self.offset + i >= self.max_tokens or g.done():
                out.append(g.end_token)
                continue
            allowed = torch.from_numpy(g.allowed(processed.shape[1])).to(processed.device)
            token = int(processed[i].masked_fill(~allowed, float("-inf")).argmax())
            token = g.fit(token)
            g.consume(token)
            out.append(token)
        return torch.tensor(out, dtype=torch.int64, device=processed.device)


class UniformState:
    """The uniform-state family (docs/design.md §2.12): a step is a decoder forward over the
    request's canvas whose rows all come back whole; nothing is committed until the canvas
    ends, as its last argmax; the request then stops at a stop id or its length, else the
    next canvas starts (its first step fused with the encoder over the finished one)."""

    __slots__ = ()
    reads_logits = True  # every canvas row comes back whole...
    device_logits = True  # ...and stays on the device
    host_commits = False

    def __reduce__(self) -> tuple:
        return _uniform_state, ()

    def plan(self, st: DecodeState) -> StepPlan:
        """The span (``BlockCursor``'s) and the canvas rows; a canvas starts here, with the
        request's uniform draw 0 for it."""
        c = st.cursor
        start, end = c.span()
        s, e = c.block_bounds()
        if end <= s:  # a prefill chunk: encoder rows only
            empty = np.zeros(0, dtype=np.int64)
            return StepPlan(start, end, empty, 0, empty, empty)
        if st.canvas is None or st.canvas.index != c.block:
            spec = st.canvas_spec
            st.canvas = Canvas.start(st.seed, c.block, spec.length, spec.vocab_size,
                                     torch.device("cpu"))
            st.tokens[s:e] = st.canvas.tokens.numpy()
        positions = np.arange(s, e, dtype=np.int64)
        return StepPlan(start, end, positions, 0, positions - start,
                        np.zeros(len(positions), dtype=np.int64))

    def commit(self, st: DecodeState, positions: np.ndarray, num_forced: int,
               tokens: np.ndarray | None, conf: np.ndarray | None, num_editable: int = 0,
               logits: torch.Tensor | None = None, keys: np.ndarray | None = None) -> bool:
        """One denoising step from the canvas rows' fp32 ``logits`` ``[C, V]``; whether the
        canvas (the block) ended."""
        if st.begin_step():
            return False
        c, canvas = st.cursor, st.canvas
        if canvas.tokens.device != logits.device:
            canvas.to(logits.device)
        canvas.processed = denoise_step(canvas, logits, st.canvas_spec.params, st.seed)
        s, e = c.block_bounds()
        if not canvas.done:
            st.tokens[s:e] = canvas.tokens.cpu().numpy()
            c.advance(block_done=False, finished=False)
            return False
        if st.grammar is not None:  # structured output: the canvas read under the grammar
            canvas.argmax = CanvasGrammar(st).final(canvas.processed)
        st.tokens[s:e] = canvas.argmax.cpu().numpy()
        if st.trajectory is not None:  # each token's log-probability under the last step
            lp = torch.log_softmax(canvas.processed.double(), -1)
            st.note(np.arange(s, e), lp.gather(1, canvas.argmax[:, None]).squeeze(1).cpu().numpy())
        canvas.processed = None  # the canvas is over: nothing conditions on it
        response = st.tokens[c.prompt_len:min(e, c.prompt_len + st.params.max_tokens)]
        if st.stop_index(response) < len(response):
            st.finish("stop")
        elif c.block + 1 == c.num_blocks:
            st.finish("length")
        c.advance(block_done=True, finished=st.finished)
        return True


UNIFORM_STATE = UniformState()


def _uniform_state() -> UniformState:
    return UNIFORM_STATE
