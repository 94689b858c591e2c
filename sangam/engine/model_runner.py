"""One packed forward per iteration: batch assembly, the model, and unmasking.

Refresh spans (a whole sequence) and cached spans (a block, or block + suffix) of many requests
are concatenated into one varlen batch; the LM head runs only on rows that predict a masked
position of a request's current block (DESIGN.md §2). The host work around the forward
(planning, packing, committing) is the HostBatcher's: C++ when built, else Python. Decode
batches of the default block length replay CUDA graphs on GPU (``cuda_graphs.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.rules import RULE_IDS
from sangam.decoding.state import DecodeState
from sangam.engine.cuda_graphs import DecodeGraphRunner
from sangam.engine.host_batch import PackedBatch, make_host_batcher
from sangam.engine.kv_pool import KVPool
from sangam.engine.loaded_model import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, pool: KVPool, host_impl: str | None = None,
                 graphs: DecodeGraphRunner | None = None):
        self.loaded = loaded
        self.pool = pool
        self.device = loaded.device
        self.host = make_host_batcher(pool.page_size, host_impl)
        self.graphs = graphs
        # With the Triton backend, scoring is the fused online-softmax kernel (no [rows, vocab]
        # fp32 copy); the host then commits by the same rule, as on the reference path.
        self.fused_scoring = loaded.model.attention_backend.name == "triton"

    @torch.inference_mode()
    def execute(self, states: list[DecodeState], pages: list[list[int]],
                allow_graphs: bool = True) -> list[bool]:
        """Run one step of every request in one forward; returns, per request, whether its
        current block was completed. ``allow_graphs=False`` forces the eager forward (e.g. when
        a hook must see every layer)."""
        batch = self.host.build(states, pages)
        dev = self.device
        model = self.loaded.model
        if allow_graphs and self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
        else:
            hidden = model.hidden_states(
                torch.from_numpy(batch.input_ids).to(dev),
                torch.from_numpy(batch.positions).to(dev), batch.metadata(dev), self.pool.kv)
        logits = model.logits(hidden, torch.from_numpy(batch.logits_indices).to(dev))
        if self.fused_scoring:
            tokens, conf = self._fused_scores(logits, batch, states)
        else:
            tokens, conf = score_logits(logits, self.loaded.config.mask_token_id,
                                        torch.from_numpy(batch.temperatures),
                                        torch.from_numpy(batch.row_keys))
        tokens = tokens.cpu().numpy()
        conf = conf.cpu().numpy().astype(np.float64)
        return self.host.apply(states, batch, tokens, conf)

    def _fused_scores(self, logits: torch.Tensor, batch: PackedBatch,
                      states: list[DecodeState]) -> tuple[torch.Tensor, torch.Tensor]:
        from sangam.kernels.unmask import fused_unmask

        dev = logits.device
        params = [st.params for st in states]

        def per_request(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        tokens, conf, _ = fused_unmask(
            logits, self.loaded.config.mask_token_id,
            torch.from_numpy(batch.cu_rows).to(dev, torch.int32),
            torch.from_numpy(batch.num_forced).to(dev, torch.int32),
            per_request([RULE_IDS[p.unmasking] for p in params], torch.int32),
            per_request([p.threshold for p in params], torch.float64),
            per_request([p.factor for p in params], torch.float64),
            per_request([p.tokens_per_step for p in params], torch.int32),
            per_request([p.temperature for p in params], torch.float64),
            torch.from_numpy(batch.row_keys).to(dev))
        return tokens, conf
