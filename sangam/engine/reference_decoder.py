"""The single-request reference decoder: one request, one forward at a time, its own pages.

This is the oracle the batched engine must reproduce token for token (DESIGN.md §2, batch
invariance); it is deliberately plain.
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.logit_edits import pack_edits, request_edits
from sangam.decoding.state import DecodeState
from sangam.models.attention import AttentionMetadata, PagedKV
from sangam.models.transformer import DiffusionLM


class ReferenceDecoder:
    def __init__(self, model: DiffusionLM, page_size: int = 16):
        self.model = model
        self.page_size = page_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    @torch.inference_mode()
    def run(self, state: DecodeState) -> DecodeState:
        """Decode ``state`` to completion in place and return it."""
        cfg = self.model.config
        n_pages = -(-state.total_len // self.page_size)
        kv = PagedKV.allocate(cfg.num_layers, n_pages, self.page_size, cfg.num_kv_heads,
                              cfg.head_dim, self.dtype, self.device)
        table = torch.arange(n_pages, dtype=torch.int32, device=self.device)[None]
        temp = torch.tensor([state.params.temperature], dtype=torch.float64)
        while not state.finished:
            plan = state.plan()
            # Pages are numbered in order, so a position's slot is the position itself.
            positions = torch.arange(plan.span_start, plan.span_end, device=self.device)
            meta = AttentionMetadata(
                cu_seqlens_q=torch.tensor([0, plan.span_len], dtype=torch.int32,
                                          device=self.device),
                kv_lens=torch.tensor([state.total_len], dtype=torch.int32, device=self.device),
                block_tables=table, slot_mapping=positions, query_lens=[plan.span_len],
                kv_lens_host=[state.total_len])
            ids = torch.from_numpy(state.tokens[plan.span_start:plan.span_end]).to(self.device)
            logits = self.model(ids, positions, meta, kv,
                                torch.from_numpy(plan.rows).to(self.device))
            n, p = len(plan.rows), state.params
            edits = pack_edits([request_edits(state, plan.positions)], [n])
            tokens, conf, top = score_logits(
                logits, self.model.config.mask_token_id, temp.expand(n),
                torch.from_numpy(plan.row_keys), torch.full((n,), p.top_p, dtype=torch.float64),
                torch.full((n,), p.top_k), torch.full((n,), p.min_p, dtype=torch.float64),
                None if edits is None else edits.map(torch.from_numpy),
                p.logprobs or 0)
            state.apply(plan, tokens.cpu().numpy(), conf.cpu().numpy().astype(np.float64))
            if top is not None:
                state.record_top(plan.positions, *(t.cpu().numpy() for t in top))
        return state
