"""The single-request reference decoder of uniform-state models (DiffusionGemma): one request,
the dense encoder and decoder passes, one canvas after another (docs/design.md §2.12).

The oracle a batched, paged path must reproduce token for token; tested against transformers'
own ``generate`` with its sampler drawing this module's documented noise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from sangam.decoding.uniform import Canvas, UniformStateParams, denoise_step
from sangam.models.diffusion_gemma import DenseKV, DiffusionGemmaModel


@dataclass
class CanvasOutput:
    tokens: list[int]  # the response: whole canvases, cut after a stop id or at max_tokens
    finish_reason: str  # "stop" | "length"
    forwards: list[int] = field(default_factory=list)  # decoder forwards per canvas


@torch.inference_mode()
def generate_canvases(model: DiffusionGemmaModel, prompt: Sequence[int],
                      params: UniformStateParams, seed: int, max_tokens: int,
                      stop_ids: Iterable[int] = ()) -> CanvasOutput:
    """Decode one request: the encoder over the prompt, then canvases of ``canvas_length``
    until one holds a stop id (the response ends with it) or ``max_tokens`` are out; each
    finished canvas is encoded before the next starts."""
    if not prompt or max_tokens < 1:
        raise ValueError("a request needs a prompt and max_tokens >= 1")
    cfg = model.config
    device = next(model.parameters()).device
    length, stops = cfg.gemma.canvas_length, set(stop_ids)
    kv = DenseKV(model)
    model.encode(torch.tensor(list(prompt), device=device), kv)
    out = CanvasOutput([], "length")
    index = 0
    while len(out.tokens) < max_tokens:
        canvas = Canvas.start(seed, index, length, cfg.vocab_size, device)
        while not canvas.done:
            logits = model.decode(canvas.tokens, kv, canvas.soft)
            canvas.soft = model.soft_embeddings(denoise_step(canvas, logits, params, seed))
        out.forwards.append(canvas.steps)
        finished = canvas.argmax.tolist()
        stop = next((i for i, t in enumerate(finished) if t in stops), None)
        if stop is not None:
            out.tokens += finished[:stop + 1]
            out.finish_reason = "stop"
            break
        out.tokens += finished
        if len(out.tokens) < max_tokens:
            model.encode(canvas.argmax, kv)
        index += 1
    if len(out.tokens) > max_tokens:
        out.tokens, out.finish_reason = out.tokens[:max_tokens], "length"
    return out
