"""One packed forward per iteration: batch assembly, the model, and unmasking.

Refresh spans (a whole sequence) and cached spans (a block, or block + suffix) of many requests
are concatenated into one varlen batch; the LM head runs only on rows that predict a masked
position of a request's current block (DESIGN.md §2).
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.state import DecodeState, StepPlan
from sangam.engine.kv_pool import KVPool
from sangam.engine.loaded_model import LoadedModel
from sangam.models import AttentionMetadata


class PackedBatch:
    """Host-side arrays of one forward, built with numpy and moved to the device at once."""

    def __init__(self, states: list[DecodeState], plans: list[StepPlan],
                 pages: list[list[int]], page_size: int):
        query_lens = [p.span_len for p in plans]
        kv_lens = [st.total_len for st in states]
        spans = [np.arange(p.span_start, p.span_end) for p in plans]
        self.positions = np.concatenate(spans)
        self.input_ids = np.concatenate(
            [st.tokens[p.span_start:p.span_end] for st, p in zip(states, plans)])
        self.slot_mapping = np.concatenate(
            [np.asarray(pg)[s // page_size] * page_size + s % page_size
             for pg, s in zip(pages, spans)])
        width = max(len(pg) for pg in pages)
        self.block_tables = np.zeros((len(pages), width), dtype=np.int32)
        for r, pg in enumerate(pages):
            self.block_tables[r, :len(pg)] = pg
        self.cu_seqlens_q = np.zeros(len(plans) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=self.cu_seqlens_q[1:])
        self.logits_indices = np.concatenate(
            [p.rows + off for p, off in zip(plans, self.cu_seqlens_q[:-1])])
        self.cu_rows = np.zeros(len(plans) + 1, dtype=np.int64)
        np.cumsum([len(p.rows) for p in plans], out=self.cu_rows[1:])
        self.row_keys = np.concatenate([p.row_keys for p in plans])
        self.query_lens = query_lens
        self.kv_lens = kv_lens

    def metadata(self, device: torch.device) -> AttentionMetadata:
        def dev(a):
            return torch.from_numpy(a).to(device, non_blocking=True)

        return AttentionMetadata(
            cu_seqlens_q=dev(self.cu_seqlens_q),
            kv_lens=dev(np.asarray(self.kv_lens, dtype=np.int32)),
            block_tables=dev(self.block_tables),
            slot_mapping=dev(self.slot_mapping.astype(np.int64)),
            query_lens=self.query_lens, kv_lens_host=self.kv_lens)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, pool: KVPool):
        self.loaded = loaded
        self.pool = pool
        self.device = loaded.device

    @torch.inference_mode()
    def execute(self, states: list[DecodeState], pages: list[list[int]]) -> list[bool]:
        """Run one step of every request in one forward; returns, per request, whether its
        current block was completed."""
        plans = [st.plan() for st in states]
        batch = PackedBatch(states, plans, pages, self.pool.page_size)
        dev = self.device
        logits = self.loaded.model(
            torch.from_numpy(batch.input_ids).to(dev), torch.from_numpy(batch.positions).to(dev),
            batch.metadata(dev), self.pool.kv, torch.from_numpy(batch.logits_indices).to(dev))
        temps = np.repeat([st.params.temperature for st in states], np.diff(batch.cu_rows))
        tokens, conf = score_logits(logits, self.loaded.config.mask_token_id,
                                    torch.from_numpy(temps), torch.from_numpy(batch.row_keys))
        tokens = tokens.cpu().numpy()
        conf = conf.cpu().numpy().astype(np.float64)
        done = []
        for r, (st, plan) in enumerate(zip(states, plans)):
            a, b = batch.cu_rows[r], batch.cu_rows[r + 1]
            done.append(st.apply(plan, tokens[a:b], conf[a:b]))
        return done
