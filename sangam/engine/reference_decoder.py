"""The single-request reference decoder: one request, one forward at a time, its own pages.

This is the oracle the batched engine must reproduce token for token (docs/design.md §2, batch
invariance); it is deliberately plain.
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.logit_edits import pack_edits, request_edits
from sangam.decoding.noise import noise_key, row_keys
from sangam.decoding.state import DecodeState
from sangam.models.attention import AttentionMetadata, PagedKV
from sangam.models.transformer import DiffusionLM


class ReferenceDecoder:
    def __init__(self, model: DiffusionLM, page_size: int = 16, fp8_kv: bool = False):
        """``fp8_kv``: its pages in the FP8 layout (``--kv-cache-dtype fp8``)."""
        self.model = model
        self.page_size = page_size
        self.fp8_kv = fp8_kv
        p = model.head_weight()  # never FP8: the model's dtype
        self.device, self.dtype = p.device, p.dtype

    @torch.inference_mode()
    def run(self, state: DecodeState) -> DecodeState:
        """Decode ``state`` to completion in place and return it."""
        cfg = self.model.config
        n_pages = state.cursor.num_pages(self.page_size)
        kv = PagedKV.for_model(cfg, n_pages, self.page_size, self.dtype, self.device,
                               fp8=self.fp8_kv)
        table = torch.arange(n_pages, dtype=torch.int32, device=self.device)[None]
        while not state.finished:
            plan = state.plan()
            # Pages are numbered in order, so a position's slot is the position itself.
            positions = torch.arange(plan.span_start, plan.span_end, device=self.device)
            kv_len = state.cursor.keys_attended(plan.span_end)
            meta = AttentionMetadata(
                cu_seqlens_q=torch.tensor([0, plan.span_len], dtype=torch.int32,
                                          device=self.device),
                kv_lens=torch.tensor([kv_len], dtype=torch.int32, device=self.device),
                block_tables=table, slot_mapping=positions, query_lens=[plan.span_len],
                kv_lens_host=[kv_len],
                causal_blocks=(torch.tensor([state.params.block_length], dtype=torch.int32)
                               if state.cursor.block_causal else None),
                positions=positions if state.cursor.block_causal else None)
            ids = torch.from_numpy(state.tokens[plan.span_start:plan.span_end]).to(self.device)
            logits = self.model(ids, positions, meta, kv,
                                torch.from_numpy(plan.rows).to(self.device))
            if state.family.reads_logits:  # structured output: the frontier rule
                state.commit(plan.positions, plan.num_forced, None, None, plan.num_editable,
                             logits, plan.row_keys)
                continue
            tokens, conf, top = score_rows(self.model, state, logits, plan.positions,
                                           plan.row_keys)
            state.apply(plan, tokens, conf)
            if top is not None:
                state.record_top(plan.positions, *top)
        return state


def score_rows(model: DiffusionLM, state: DecodeState, logits: torch.Tensor,
               positions: np.ndarray, keys: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """One request's rows scored as docs/design.md §2 says (its sampling, logit edits and
    alternatives): tokens, float64 confidences and, with logprobs, the top alternatives."""
    n, p = len(positions), state.params
    edits = pack_edits([request_edits(state, positions)], [n])
    tokens, conf, top = score_logits(
        logits, model.config.mask_token_id,
        torch.full((n,), p.temperature, dtype=torch.float64), torch.from_numpy(keys),
        torch.full((n,), p.top_p, dtype=torch.float64), torch.full((n,), p.top_k),
        torch.full((n,), p.min_p, dtype=torch.float64),
        None if edits is None else edits.map(torch.from_numpy), p.logprobs or 0)
    return (tokens.cpu().numpy(), conf.cpu().numpy().astype(np.float64),
            None if top is None else tuple(t.cpu().numpy() for t in top))


class UpstreamBlockDiffusion:
    """SDAR's upstream ``block_diffusion_generate`` loop (JetAstra/SDAR ``generate.py``) for one
    request, step for step, with a dense block-causal forward over the sequence so far in place
    of its KV cache (the cache holds the exact K/V of the finished blocks, which the
    block-causal mask makes a function of those blocks' tokens alone).

    Prefill the prompt's whole blocks (one forward, when there is one); then per block, while a
    mask is left: one denoising forward over the block against the cache, committing by the
    rule; then one more forward over the finished block that stores its K/V; stop after a block
    that holds a stop id. Forwards are counted as upstream spends them. Committing follows
    docs/design.md §2 (the mask token is never committed; the threshold rule, which with one token
    per step is upstream's ``low_confidence_dynamic`` up to ties at exactly the threshold).
    The oracle of the engine's block-causal path, which fuses each store forward into the next
    block's first step: it spends ``fused_savings`` fewer forwards and commits the same tokens.
    """

    def __init__(self, model: DiffusionLM):
        self.model = model
        p = next(model.parameters())
        self.device = p.device

    @torch.inference_mode()
    def run(self, state: DecodeState) -> tuple[list[int], int]:
        """Decode ``state`` (a fresh block-causal request) in place; returns its output tokens
        and the forwards upstream spends on it."""
        if not state.cursor.block_causal or state.num_forwards:
            raise ValueError("needs a fresh block-causal request")
        b, p = state.params.block_length, state.params
        forwards = int(state.cursor.block_origin > 0)  # the prompt's whole blocks, stored
        while not state.finished:
            s, e = state.cursor.block_bounds()
            offsets = (state.tokens[s:e] == state.mask_token_id).nonzero()[0]
            ids = torch.from_numpy(state.tokens[:e]).to(self.device)[None]
            logits = self.model.forward_dense(ids, block_size=b)[0, s + offsets]
            keys = (row_keys(noise_key(state.seed, state.cursor.block, state.cursor.step), offsets)
                    if p.temperature > 0 else np.zeros(len(offsets), dtype=np.int64))
            tokens, conf, _ = score_rows(self.model, state, logits, s + offsets, keys)
            forwards += 1
            if state.commit(s + offsets, 0, tokens, conf):
                forwards += 1  # the finished block's store forward
        return state.output_token_ids(), forwards


def fused_savings(state: DecodeState) -> int:
    """The forwards the engine's block-causal path saves on a finished request against the
    upstream loop: the prompt prefill (fused into block 0's first step) and every decoded
    block's store forward (fused into the next block's first step; the last one's is never
    needed)."""
    return int(state.cursor.block_origin > 0) + state.cursor.block + 1


class UpstreamLLaDA2:
    """LLaDA2.x's upstream ``generate`` loop (inclusionAI's modeling code: 2.0's threshold
    decoding, 2.1's JointThreshold editing) for one request, step for step, with a dense
    block-causal forward over the sequence so far in place of its cache; written apart from
    ``DecodeState.commit``, which the engine runs, so that the two are checked against each
    other.

    Per block from the one holding the prompt's tail: while a mask is left, one forward over
    the block commits every masked position above ``threshold`` (at or above: Sangam's rule),
    else the single most confident (M2T), and with ``edit_threshold`` replaces each filled
    response position of the block whose most likely token differs from it and is sure
    strictly beyond ``edit_threshold`` (T2T); with editing, once no mask is left, editing-only
    forwards follow until one changes nothing or ``max_post_steps`` have run; then one forward
    stores the block's K/V. Stop after a block that holds a stop id. Sampling and the mask
    token's exclusion are Sangam's (docs/decoding.md lists how upstream differs).
    """

    def __init__(self, model: DiffusionLM):
        self.model = model
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, state: DecodeState) -> tuple[list[int], int, int]:
        """Decode a fresh block-causal request (threshold rule); returns its output tokens
        (cut before the first stop id), the forwards upstream spends on it, and how many of
        those the engine fuses into others (``fused_savings``: the prompt's store and each
        block's). ``state`` only supplies the canvas, geometry and scoring; its own progress
        is left alone."""
        p = state.params
        if not state.cursor.block_causal or p.unmasking != "threshold":
            raise ValueError("needs a block-causal request with the threshold rule")
        x, mask, b = state.tokens.copy(), state.mask_token_id, p.block_length
        prompt, edit = state.cursor.prompt_len, p.edit_threshold
        forwards = int(state.cursor.block_origin > 0)  # the prompt's whole blocks, stored
        for block in range(state.cursor.num_blocks):
            s = state.cursor.block_origin + block * b
            e, step, post = s + b, 0, 0
            while True:
                masked = [i for i in range(s, e) if x[i] == mask]
                if not masked:
                    post += 1
                    if edit is None or post > p.max_post_steps:
                        break
                editable = ([i for i in range(max(s, prompt), e) if x[i] != mask]
                            if edit is not None else [])
                cand = np.array(masked + editable, dtype=np.int64)
                ids = torch.from_numpy(x[:e]).to(self.device)[None]
                logits = self.model.forward_dense(ids, block_size=b)[0, cand]
                keys = (row_keys(noise_key(state.seed, block, step), cand - s)
                        if p.temperature > 0 else np.zeros(len(cand), dtype=np.int64))
                tokens, conf, _ = score_rows(self.model, state, logits, cand, keys)
                forwards += 1
                step += 1
                n = len(masked)
                fill = [j for j in range(n) if conf[j] >= p.threshold]
                if n and not fill:
                    fill = [max(range(n), key=lambda j: (conf[j], -j))]
                edits = [j for j in range(n, len(cand))
                         if conf[j] > edit and tokens[j] != x[cand[j]]]
                for j in fill + edits:
                    x[cand[j]] = tokens[j]
                if not masked and not edits:
                    break
            forwards += 1  # the finished block's store forward
            fused = int(state.cursor.block_origin > 0) + block + 1
            response = x[prompt:min(e, prompt + p.max_tokens)]
            stops = [i for i, t in enumerate(response.tolist()) if t in state.stop_ids]
            if stops:
                return response[:stops[0]].tolist(), forwards, fused
        return x[prompt:prompt + p.max_tokens].tolist(), forwards, fused
