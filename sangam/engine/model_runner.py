"""One packed forward per iteration: batch assembly, the model, and unmasking.

Refresh spans (a whole sequence) and cached spans (a block, or block + suffix) of many requests
are concatenated into one varlen batch; the LM head runs only on rows that predict a masked
position of a request's current block (DESIGN.md §2). The host work around the forward
(planning, packing, committing) is the HostBatcher's: C++ when built, else Python; the packed
arrays reach the device in one copy (``device_batch.py``). Decode
batches of the default block length replay CUDA graphs on GPU (``cuda_graphs.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.logit_edits import pack_edits, request_edits
from sangam.decoding.rules import RULE_IDS
from sangam.decoding.state import DecodeState
from sangam.engine.cuda_graphs import DecodeGraphRunner
from sangam.engine.device_batch import BatchUploader
from sangam.engine.host_batch import PackedBatch, make_host_batcher
from sangam.engine.kv_pool import KVPool
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.stop_strings import apply_stop_strings


class ModelRunner:
    def __init__(self, loaded: LoadedModel, pool: KVPool, host_impl: str | None = None,
                 graphs: DecodeGraphRunner | None = None):
        self.loaded = loaded
        self.pool = pool
        self.device = loaded.device
        self.host = make_host_batcher(pool.page_size, host_impl)
        self.graphs = graphs
        self.uploader = BatchUploader(self.device)
        # With the Triton backend, scoring is the fused online-softmax kernel (no [rows, vocab]
        # fp32 copy); the host then commits by the same rule, as on the reference path.
        self.fused_scoring = loaded.model.attention_backend.name == "triton"
        if self.fused_scoring:  # imported here: the CPU reference path never loads Triton
            from sangam.kernels.unmask import fused_unmask

            self._fused_unmask = fused_unmask

    @torch.inference_mode()
    def execute(self, states: list[DecodeState], pages: list[list[int]],
                allow_graphs: bool = True) -> list[bool]:
        """Run one step of every request in one forward; returns, per request, whether its
        current block was completed (a completed block's stop strings are checked here, so a
        request they end is finished on return). ``allow_graphs=False`` forces the eager
        forward (e.g. when a hook must see every layer)."""
        batch = self.host.build(states, pages)
        arrays = batch.device_arrays()
        if self.fused_scoring:
            arrays.update(unmask_arrays(batch, states))
        dev = self.uploader.upload(arrays)
        model = self.loaded.model
        if allow_graphs and self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch, dev)
        else:
            hidden = model.hidden_states(dev["input_ids"], dev["positions"],
                                         batch.metadata(dev), self.pool.kv)
        logits = model.logits(hidden, dev["logits_indices"])
        if self.fused_scoring:
            tokens, conf, _ = self._fused_unmask(
                logits, self.loaded.config.mask_token_id, dev["cu_rows"], dev["num_forced"],
                dev["rule"], dev["threshold"], dev["factor"], dev["tokens_per_step"],
                dev["temperature"], dev["row_keys"])
        else:
            tokens, conf, _ = score_logits(logits, self.loaded.config.mask_token_id,
                                           torch.from_numpy(batch.temperatures),
                                           torch.from_numpy(batch.row_keys))
        # st.needs_full_scoring, inlined: the property call would double this scan's cost.
        full = [i for i, st in enumerate(states) if st.block < st.params.full_scoring_blocks]
        picked = [states[i] for i in full]
        top = self._rescore_full(logits, batch, picked, full, tokens, conf) if full else None
        tokens = tokens.cpu().numpy()
        conf = conf.cpu().numpy().astype(np.float64)
        block_done = self.host.apply(states, batch, tokens, conf)
        if top is not None:
            _record_top(batch, picked, full, *(t.cpu().numpy() for t in top))
        for st, done in zip(states, block_done):
            if done:
                apply_stop_strings(st, self.loaded.decode)
        return block_done

    def _rescore_full(self, logits: torch.Tensor, batch: PackedBatch,
                      picked: list[DecodeState], picked_ids: list[int], tokens: torch.Tensor,
                      conf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Score again, in place and on the device, the rows of the requests ``picked_ids``
        (batch positions; ``picked``: their states), whose scoring ranks or edits the
        vocabulary (top_p / top_k sampling, logit_bias, penalties, min_tokens, logprobs
        alternatives): the fused kernel streams the vocabulary once and does neither, so these
        rows take the reference path (a [rows, vocab] copy, for those requests only). Returns
        the rows' most probable tokens (:class:`Scores`' ``top``, rows in ``picked_ids`` order)
        when a request asks for them."""
        cu = batch.cu_rows.tolist()
        counts = [cu[i + 1] - cu[i] for i in picked_ids]
        rows = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in picked_ids])
        if rows.size == 0:
            return None

        def dev(a: np.ndarray) -> torch.Tensor:  # never waits for the GPU
            return torch.from_numpy(np.ascontiguousarray(a)).to(logits.device, non_blocking=True)

        edits = pack_edits([request_edits(st, batch.cand_positions[cu[i]:cu[i + 1]])
                            for st, i in zip(picked, picked_ids)], counts)
        params = [st.params for st in picked]
        index = dev(rows)
        t, c, top = score_logits(logits[index], self.loaded.config.mask_token_id,
                                 dev(batch.temperatures[rows]), dev(batch.row_keys[rows]),
                                 dev(np.repeat([p.top_p for p in params], counts)),
                                 dev(np.repeat([p.top_k for p in params], counts)),
                                 None if edits is None else edits.map(dev),
                                 max(p.logprobs or 0 for p in params))
        tokens[index] = t.to(tokens.dtype)
        conf[index] = c.to(conf.dtype)
        return top


def _record_top(batch: PackedBatch, picked: list[DecodeState], picked_ids: list[int],
                logprobs: np.ndarray, ids: np.ndarray) -> None:
    """Give each picked request that asks for alternatives those of its committed rows
    (``logprobs``, ``ids``: the picked requests' rows, in order; as many columns as the most
    any of them asks for)."""
    start = 0
    for st, i in zip(picked, picked_ids, strict=True):
        a, b = batch.cu_rows[i], batch.cu_rows[i + 1]
        n = st.params.logprobs or 0
        if n:
            end = start + b - a
            st.record_top(batch.cand_positions[a:b], logprobs[start:end, :n], ids[start:end, :n])
        start += b - a


def unmask_arrays(batch: PackedBatch, states: list[DecodeState]) -> dict[str, np.ndarray]:
    """The fused unmasking kernel's inputs beyond the logits: row ranges, forced rows, and each
    request's rule parameters (float64, so the kernel compares exactly as the host rules do)."""
    params = [st.params for st in states]
    return {
        "cu_rows": batch.cu_rows.astype(np.int32),
        "num_forced": batch.num_forced.astype(np.int32),
        "rule": np.array([RULE_IDS[p.unmasking] for p in params], dtype=np.int32),
        "threshold": np.array([p.threshold for p in params], dtype=np.float64),
        "factor": np.array([p.factor for p in params], dtype=np.float64),
        "tokens_per_step": np.array([p.tokens_per_step for p in params], dtype=np.int32),
        "temperature": np.array([p.temperature for p in params], dtype=np.float64),
        "row_keys": batch.row_keys,
    }
