"""One packed forward per iteration: batch assembly, the model, and unmasking.

Refresh spans (a whole sequence) and cached spans (a block, or block + suffix) of many requests
are concatenated into one varlen batch; the LM head runs only on rows that predict a masked
position of a request's current block (DESIGN.md §2). The host work around the forward
(planning, packing, committing) is the HostBatcher's: C++ when built, else Python.
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.state import DecodeState
from sangam.engine.host_batch import make_host_batcher
from sangam.engine.kv_pool import KVPool
from sangam.engine.loaded_model import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, pool: KVPool, host_impl: str | None = None):
        self.loaded = loaded
        self.pool = pool
        self.device = loaded.device
        self.host = make_host_batcher(pool.page_size, host_impl)

    @torch.inference_mode()
    def execute(self, states: list[DecodeState], pages: list[list[int]]) -> list[bool]:
        """Run one step of every request in one forward; returns, per request, whether its
        current block was completed."""
        batch = self.host.build(states, pages)
        dev = self.device
        logits = self.loaded.model(
            torch.from_numpy(batch.input_ids).to(dev), torch.from_numpy(batch.positions).to(dev),
            batch.metadata(dev), self.pool.kv, torch.from_numpy(batch.logits_indices).to(dev))
        tokens, conf = score_logits(logits, self.loaded.config.mask_token_id,
                                    torch.from_numpy(batch.temperatures),
                                    torch.from_numpy(batch.row_keys))
        tokens = tokens.cpu().numpy()
        conf = conf.cpu().numpy().astype(np.float64)
        return self.host.apply(states, batch, tokens, conf)
