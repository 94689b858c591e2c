"""One packed forward per iteration: batch assembly, the model, scoring and the commits.

Refresh spans (a whole sequence) and cached spans (a block, or block + suffix) of many requests
are concatenated into one varlen batch; the LM head runs only on rows that predict a masked
position of a request's current block (docs/design.md §2). The host work around the forward
(planning, packing, committing) is the HostBatcher's: C++ when built, else Python; the packed
arrays reach the device in one copy (``device_batch.py``), the inputs of rows scored again
(``Rescore``) included. The rows are scored by the worker's scorer (``scoring.py``: chosen
once), and committed by each request's decoding family (a family that reads its rows' whole
logits gets them). Decode batches of the default block length replay CUDA graphs on GPU
(``cuda_graphs.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.logit_edits import LogitEdits, batch_edits
from sangam.decoding.state import DecodeState
from sangam.engine.cuda_graphs import DecodeGraphRunner
from sangam.engine.device_batch import BatchUploader
from sangam.engine.host_batch import HostBatcher, PackedBatch, make_host_batcher
from sangam.engine.kv_pool import KVPool
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.memory_profile import rescore_chunk_rows
from sangam.engine.scoring import Rows, make_scorer
from sangam.engine.stop_strings import apply_stop_strings
from sangam.engine.tensor_group import Step, TensorGroup
from sangam.models.config import ModelConfig
from sangam.models.diffusion_gemma import CanvasRows, canvas_key_bounds
from sangam.models.kernel_table import kernel_table
from sangam.sched.request import BLOCK_DONE, CONTINUES, StepOutcome

logger = logging.getLogger(__name__)


class ModelRunner:
    """``group``: the worker's tensor-parallel group, when it has several ranks. Rank 0's
    runner broadcasts each forward's ``Step`` before running it; the other ranks' runners run
    it (``follow``). Both sides run the same device code (``_device_step``) and scorer."""

    def __init__(self, loaded: LoadedModel, pool: KVPool, host_impl: str | None = None,
                 graphs: list[DecodeGraphRunner] = (), group: TensorGroup | None = None):
        self.loaded = loaded
        self.pool = pool
        self.device = loaded.device
        # A uniform-state model's requests plan and commit in Python (the C++ host path
        # mirrors the masked family only).
        self.host = make_host_batcher(pool.page_size, "python" if loaded.config.gemma is not None
                                      else host_impl)
        self.graphs = list(graphs)
        self.uploader = BatchUploader(self.device)
        self.group = group
        # Full rescoring runs this many rows at a time: what the memory profile reserved.
        self.rescore_rows = rescore_chunk_rows(loaded.config.vocab_size, loaded.dtype)
        cfg = loaded.config
        self.scorer = make_scorer(kernel_table(loaded.model.attention_backend.name), group,
                                  cfg.mask_token_id, cfg.vocab_size)
        # K/V streamed layer by layer during the next forward (TransferWorker sets them): the
        # other ranks stream their shards of it too.
        self.streams: list[tuple[int, int, list[int]]] = []
        self._stepped = False  # the group began this forward: a failure now is the group's

    @torch.inference_mode()
    def execute(self, states: list[DecodeState], pages: list[list[int]],
                allow_graphs: bool = True, isolate: bool = True,
                rings: list[list[int]] | None = None) -> list[StepOutcome]:
        """Run one step of every request in one forward, moving their cursors; returns each
        one's outcome (a completed block's stop strings are checked here, so a request they
        end is finished on return; a request that failed has its error).
        ``allow_graphs=False`` forces the eager forward (e.g. when a hook must see every
        layer). ``rings``: each request's ring under a hybrid pool (``KVPool.rings``).

        A failure is confined to the requests it concerns. When the batch's forward or scoring
        fails (nothing is committed then, and rewriting a span's K/V from the same tokens is
        idempotent), each request runs again alone, as it would have in any batch; those that
        fail alone end with their error, even when that is all of them (two requests that
        each fail alone are two failed requests, not a broken engine). Commit and
        stop-string errors are per request. A device error is raised: the device is
        unusable. With ``isolate=False`` a batch failure is raised (the caller retries)."""
        self._stepped = False
        try:
            scored = self._score(states, pages, allow_graphs, rings)
        except FATAL_ERRORS:
            raise
        except Exception as e:
            if self._stepped:  # the other ranks are inside the forward: no way back
                raise TensorGroupError(f"a tensor-parallel forward failed on rank 0: {e!r}"
                                       ) from e
            if not isolate:
                raise
            if len(states) == 1:
                return [_failed(e)]
            alone = [self.execute([st], [pages[r]], allow_graphs,
                                  rings=None if rings is None else [rings[r]])[0]
                     for r, st in enumerate(states)]
            logger.warning("a batch of %d failed (%r); alone, %d of them fail and end with "
                           "an error", len(states), e, sum(o.error is not None for o in alone))
            return alone
        return self._commit(states, *scored)

    def _score(self, states: list[DecodeState], pages: list[list[int]], allow_graphs: bool,
               rings: list[list[int]] | None
               ) -> tuple[PackedBatch, np.ndarray, np.ndarray, Rescore | None, tuple | None,
                          dict[int, torch.Tensor]]:
        """The forward and the scoring, read back to the host; changes no request. The rows
        of requests whose family reads its logits come back whole."""
        batch, arrays, rescore = pack_batch(self.host, states, pages, self.scorer.uploads_inputs,
                                            chunk_rows=self.rescore_rows, rings=rings)
        graph = -1
        if allow_graphs and self.graphs and batch.num_rows:
            block_length = None  # a block-causal batch's, when its requests share one
            if states[0].cursor.block_causal:
                lengths = {st.params.block_length for st in states}
                block_length = lengths.pop() if len(lengths) == 1 else 0
            graph = next((i for i, g in enumerate(self.graphs)
                          if g.can_run(batch, block_length)), -1)
        whole = [r for r, st in enumerate(states) if st.family.reads_logits]
        soft = self_conditioning(states, batch, self.loaded.config, self.device)
        if soft is not None and self.group is not None:  # the other ranks condition too
            arrays["canvas_soft"] = soft.to(_HOST_FLOAT[soft.dtype]).cpu().numpy()
        if self.group is not None:
            if whole:  # the rows whose whole vocabulary the group gathers
                arrays["whole_rows"] = whole_row_index(batch, whole)
            self._stepped = True  # from here on a failure (even of the send) is the group's
            self.group.send(Step(arrays, graph, self.streams))
        dev = self.uploader.upload(arrays)
        # A uniform-state request's logits rows are its canvas rows: the decoder's.
        canvas = None if soft is None else CanvasRows(dev["logits_indices"], soft)
        logits, tokens, conf = self._device_step(batch, dev, graph, canvas)
        if logits is None:  # only block-causal prefill chunks: K/V stored, nothing scored
            empty = np.zeros(0, dtype=np.int64)
            return (batch, empty, empty.astype(np.float64), None, None,
                    {r: _NO_ROWS for r in whole})
        top = None
        if rescore is not None:
            top = rescore.score(self.scorer.rows(logits), dev, self.loaded.config.mask_token_id,
                                tokens, conf)
            if top is not None:
                top = tuple(t.cpu().numpy() for t in top)
        rows = {}
        if whole:
            index = (dev["whole_rows"] if self.group is not None else
                     torch.from_numpy(whole_row_index(batch, whole)).to(self.device))
            gathered = self.scorer.rows(logits)(index)
            rows = split_whole_rows(batch, whole, gathered)
            on_host = [r for r in whole if not states[r].family.device_logits]
            if on_host:  # one copy for the families that commit from host rows
                host = gathered.cpu()
                rows.update(split_whole_rows(batch, whole, host, on_host))
        return (batch, tokens.cpu().numpy(), conf.cpu().numpy().astype(np.float64), rescore,
                top, rows)

    def _device_step(self, batch: PackedBatch, dev: dict[str, torch.Tensor], graph: int,
                     canvas: CanvasRows | None = None
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The forward and its first scoring, on every rank of a group alike: (logits —
        this rank's vocabulary columns of them —, tokens, confidences); all None for a batch
        with no logits rows. ``canvas``: a uniform-state model's decoder rows."""
        model = self.loaded.model
        extra = {} if canvas is None else {"canvas": canvas}
        if batch.num_rows == 0:
            model.hidden_states(dev["input_ids"], dev["positions"], batch.metadata(dev),
                                self.pool.kv, **extra)
            return None, None, None
        if graph >= 0:
            hidden = self.graphs[graph].run(batch, dev, canvas)
        else:
            hidden = model.hidden_states(dev["input_ids"], dev["positions"],
                                         batch.metadata(dev), self.pool.kv, **extra)
        logits = model.logits(hidden, dev["logits_indices"])
        tokens, conf = self.scorer.score(logits, batch, dev)
        return logits, tokens, conf

    def follow(self, step: Step) -> None:
        """A follower rank's part of the forward ``step`` rank 0 broadcast: the same device
        work, and the same gathers of whole-vocabulary rows (rescoring, structured output)."""
        arrays = step.arrays
        dev = self.uploader.upload(arrays)
        batch = PackedBatch.from_device_arrays(arrays)
        canvas = (CanvasRows(dev["logits_indices"], dev["canvas_soft"])
                  if self.loaded.config.gemma is not None else None)
        logits, _, _ = self._device_step(batch, dev, step.graph, canvas)
        if logits is None:
            return
        rows = self.scorer.rows(logits)  # the same gathers as rank 0, in the same order
        if "rescore_rows" in dev:
            total = len(arrays["rescore_rows"])
            for a, b in rescore_chunks(total, self.rescore_rows):
                rows(dev["rescore_rows"][a:b])
        if "whole_rows" in dev:
            rows(dev["whole_rows"])

    def _commit(self, states: list[DecodeState], batch: PackedBatch, tokens: np.ndarray,
                conf: np.ndarray, rescore: Rescore | None, top: tuple | None,
                rows: dict[int, torch.Tensor]) -> list[StepOutcome]:
        """Commit the scored rows into each request, then its alternatives and stop strings;
        an error there ends only its request."""
        # return_trajectory: what each masked-family step writes (a canvas notes its own).
        before = {r: st.block_snapshot() for r, st in enumerate(states)
                  if st.trajectory is not None and st.canvas_spec is None}
        block_done, errors = self.host.apply(states, batch, tokens, conf)
        for r, logits in rows.items():  # the requests whose family reads its logits, by index
            if r not in errors:
                a, b = int(batch.cu_rows[r]), int(batch.cu_rows[r + 1])
                try:
                    block_done[r] = states[r].commit(
                        batch.cand_positions[a:b], int(batch.num_forced[r]), None, None,
                        int(batch.num_editable[r]), logits, batch.row_keys[a:b])
                    canvas = states[r].canvas
                    if canvas is not None and canvas.processed is not None:
                        # The next step's self-conditioning, [C, hidden] (not [C, V]).
                        canvas.soft = self.loaded.model.soft_embeddings(canvas.processed)
                        canvas.processed = None
                except Exception as e:
                    errors[r] = e
        for r, snapshot in before.items():
            if r not in errors:
                states[r].note_step(snapshot)
        if top is not None:
            rescore.record_top(batch, *top, errors)
        for r, st in enumerate(states):  # drafts of the blocks that go on
            if st.params.include_drafts and not block_done[r] and r not in errors \
                    and batch.cu_rows[r + 1] > batch.cu_rows[r]:
                a, b = int(batch.cu_rows[r]), int(batch.cu_rows[r + 1])
                st.make_draft(batch.cand_positions[a:b], tokens[a:b])
        outcomes = [CONTINUES] * len(states)  # most steps end no block
        for r in [r for r, done in enumerate(block_done) if done]:
            st = states[r]
            if r not in errors:
                try:
                    apply_stop_strings(st, self.loaded.text.decode)
                except Exception as e:
                    errors[r] = e
            outcomes[r] = step_outcome(st, True)
        for r, e in errors.items():
            outcomes[r] = _failed(e)
        return outcomes


_NO_ROWS = torch.zeros(0, 0)
# Self-conditioning's host dtype between ranks: what holds the model's values exactly.
_HOST_FLOAT = {torch.float64: torch.float64, torch.float32: torch.float32,
               torch.bfloat16: torch.float32, torch.float16: torch.float32}


def whole_row_index(batch: PackedBatch, which: list[int]) -> np.ndarray:
    """The logits rows of the requests ``which`` (those whose family reads its logits), in
    order."""
    return np.concatenate([np.arange(batch.cu_rows[r], batch.cu_rows[r + 1]) for r in which])


def split_whole_rows(batch: PackedBatch, which: list[int], rows: torch.Tensor,
                     keep: list[int] | None = None) -> dict[int, torch.Tensor]:
    """``rows``, the rows of :func:`whole_row_index` (gathered in one go), by request index:
    every such request has an entry (its commit runs from it); ``keep``: only those."""
    out, at = {}, 0
    for r in which:
        n = int(batch.cu_rows[r + 1] - batch.cu_rows[r])
        if keep is None or r in keep:
            out[r] = rows[at:at + n]
        at += n
    return out


def self_conditioning(states: list[DecodeState], batch: PackedBatch, cfg: ModelConfig,
                      device: torch.device) -> torch.Tensor | None:
    """A uniform-state batch's self-conditioning ``[canvas rows, hidden]``, in the order of its
    logits rows (each request with rows has a canvas's: its soft embeddings, zeros at a
    canvas's first step); None for a masked model's batch."""
    if cfg.gemma is None:
        return None
    rows = np.diff(batch.cu_rows)
    soft = [st.canvas.soft.to(device) if st.canvas.soft is not None else
            torch.zeros(n, cfg.hidden_size, device=device)
            for st, n in zip(states, rows.tolist()) if n]
    return torch.cat(soft) if soft else torch.zeros(0, cfg.hidden_size, device=device)


def canvas_arrays(batch: PackedBatch, window: int) -> dict[str, np.ndarray]:
    """A uniform-state batch's attention bounds (``canvas_key_bounds``: ``PackedBatch.metadata``
    reads them), from its packed rows: a request's logits rows are its canvas's positions, in
    order, and every other row of its span is an encoder row."""
    n = len(batch.positions)
    starts, ends = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    counts = np.diff(batch.cu_rows)
    has = counts > 0
    if has.any():
        pos = batch.cand_positions
        first, last = batch.cu_rows[:-1][has], batch.cu_rows[1:][has] - 1
        rows = batch.logits_indices
        starts[rows] = np.repeat(pos[first], counts[has])
        ends[rows] = np.repeat(pos[last] + 1, counts[has])
    lo, hi, win = canvas_key_bounds(batch.positions, starts, ends, window)
    return {"key_lo": lo, "key_hi": hi, "window_lo": win}


def window_arrays(batch: PackedBatch, rings: list[list[int]], page_size: int, window: int
                  ) -> dict[str, np.ndarray]:
    """A hybrid pool's sliding-layer block tables (logical page j of a request is page
    j % ring of its ring: ``sched/window_rings.py``) and its rows' slots there. A span its
    ring cannot hold with the window before it (the scheduler keeps spans within it) is an
    error, never a slot written twice."""
    ring = np.array(rings, dtype=np.int32)
    spans = np.diff(batch.cu_seqlens_q)
    if len(spans) and spans.max() + window - 1 > ring.shape[1] * page_size:
        raise ValueError(f"a forward of {spans.max()} positions overflows a ring of "
                         f"{ring.shape[1]} pages of {page_size} (window {window})")
    tables = np.ascontiguousarray(ring[:, np.arange(batch.block_tables.shape[1]) % ring.shape[1]])
    owner = np.repeat(np.arange(len(rings)), spans)
    pos = batch.positions
    slots = tables[owner, pos // page_size].astype(np.int64) * page_size + pos % page_size
    return {"window_block_tables": tables, "window_slot_mapping": slots}


def step_outcome(state: DecodeState, block_done: bool) -> StepOutcome:
    """What a committed step did to ``state``'s request."""
    if not block_done:
        return CONTINUES
    if state.finished:
        return StepOutcome(True, True, state.finish_reason)
    return BLOCK_DONE


def _failed(error: Exception) -> StepOutcome:
    """A request whose step failed: it ends with this error, alone (the front logs it)."""
    return StepOutcome(error=f"the request failed in the engine: {error!r}")


class TensorGroupError(RuntimeError):
    """A forward failed after the ranks of its tensor-parallel group began it: they are
    inside its collectives and cannot be called back, so the worker (the group) ends."""


# Errors no request causes: the device is unusable, or a group's ranks are out of step; the
# worker must not go on.
FATAL_ERRORS = (TensorGroupError, *((torch.AcceleratorError,)
                                    if hasattr(torch, "AcceleratorError") else ()))


def stage_batch(host: HostBatcher, uploader: BatchUploader, states: list[DecodeState],
                pages: list[list[int]], device_scoring: bool, chunk_rows: int | None = None
                ) -> tuple[PackedBatch, dict[str, torch.Tensor], Rescore | None]:
    """:func:`pack_batch`, then everything the device reads moved in one upload. Returns the
    batch, its device tensors by name, and the rescoring."""
    batch, arrays, rescore = pack_batch(host, states, pages, device_scoring, chunk_rows)
    return batch, uploader.upload(arrays), rescore


def pack_batch(host: HostBatcher, states: list[DecodeState], pages: list[list[int]],
               device_scoring: bool, chunk_rows: int | None = None,
               rings: list[list[int]] | None = None
               ) -> tuple[PackedBatch, dict[str, np.ndarray], Rescore | None]:
    """The host work before a forward: pack the batch and find the requests whose rows are
    scored again (in chunks of ``chunk_rows``; None: one). Returns the batch, the host arrays
    the device reads (the scoring's per-row inputs too with ``device_scoring``: the fused
    kernel's, or a vocabulary-parallel head's; a hybrid pool's sliding-layer pages with
    ``rings``), and the rescoring."""
    batch = host.build(states, pages)
    arrays = batch.device_arrays()
    if rings is not None:
        arrays.update(window_arrays(batch, rings, host.page_size,
                                    states[0].canvas_spec.window))
    if states and states[0].canvas_spec is not None:  # uniform-state: one model per runner
        arrays.update(canvas_arrays(batch, states[0].canvas_spec.window))
    if states and states[0].cursor.block_causal:  # one model per runner: all or none
        arrays["causal_blocks"] = np.array([st.params.block_length for st in states],
                                           dtype=np.int32)
    if device_scoring:  # the scoring's inputs beyond the logits, per row
        arrays.update(temperatures=batch.temperatures, row_keys=batch.row_keys)
    # Read for every request of every iteration: one attribute and one cached property.
    full = [i for i, st in enumerate(states)
            if st.params.full_scoring_blocks and st.cursor.block < st.params.full_scoring_blocks]
    rescore = Rescore.build(batch, states, full, chunk_rows) if full else None
    if rescore is not None:
        arrays.update(rescore.arrays)
    return batch, arrays, rescore


def rescore_chunks(total: int, chunk_rows: int | None) -> list[tuple[int, int]]:
    """[start, end) of each chunk of ``total`` rescored rows, ``chunk_rows`` at a time."""
    step = chunk_rows or total
    return [(a, min(a + step, total)) for a in range(0, total, step)]


_EDIT_ARRAYS = LogitEdits._fields[:-1]  # every field but the width (a host int)


@dataclass
class Rescore:
    """The requests of a batch whose rows are scored again, and the inputs that takes.

    Their scoring ranks or edits the vocabulary (top_p / top_k / min_p sampling, logit_bias,
    penalties, min_tokens, logprobs alternatives): the fused kernel streams the vocabulary once
    and does neither, and the torch path's first pass does neither either. So these rows take
    ``score_logits`` again (a [rows, vocab] copy, for those requests only), in place, on the
    device, before the iteration's one read-back; in chunks of rows (``chunks``), so that its
    [rows, vocab] temporaries stay within what the memory profile reserved (each row's result
    is its own: the chunks change no bit). Their inputs are built before the forward and
    travel in the batch's one upload (``arrays``, names prefixed ``rescore_``; per chunk, the
    sampled rows and the edits, suffixed with the chunk's index)."""

    states: list[DecodeState]
    indices: list[int]  # their positions in the batch
    arrays: dict[str, np.ndarray]
    chunks: list[tuple[int, int]]  # [start, end) of each chunk, in rescored rows
    hot_bounds: list[tuple[int, int]]  # each chunk's span of ``rescore_hot``
    edits_widths: list[int | None]  # each chunk's LogitEdits.width; None: no edits
    top_n: int  # alternatives to rank per row (the most any of them asks for)

    @classmethod
    def build(cls, batch: PackedBatch, states: list[DecodeState], indices: list[int],
              chunk_rows: int | None = None) -> Rescore | None:
        cu = batch.cu_rows
        picked = [states[i] for i in indices]
        firsts = cu[indices]
        sizes = cu[np.asarray(indices) + 1] - firsts
        counts = sizes.tolist()
        total = int(sizes.sum())
        if total == 0:
            return None
        # Each request's rows, in order: firsts[j], firsts[j] + 1, ... (one arange, shifted).
        rows = np.arange(total) + np.repeat(firsts - (np.cumsum(sizes) - sizes), sizes)
        params = [st.params for st in picked]
        temperatures = batch.temperatures[rows]
        hot = np.flatnonzero(temperatures > 0)  # sampled rows: no device search
        arrays = {
            "rescore_rows": rows,
            "rescore_temperature": temperatures,
            "rescore_hot": hot,
            "rescore_row_keys": batch.row_keys[rows],
            "rescore_top_p": np.repeat(np.array([p.top_p for p in params], np.float64), counts),
            "rescore_top_k": np.repeat(np.array([p.top_k for p in params], np.int64), counts),
            "rescore_min_p": np.repeat(np.array([p.min_p for p in params], np.float64), counts),
        }
        chunks = rescore_chunks(total, chunk_rows)
        edits = batch_edits(picked, [batch.cand_positions[cu[i]:cu[i + 1]] for i in indices],
                            counts)
        widths: list[int | None] = []
        for j, (a, b) in enumerate(chunks):
            part = None if edits is None else slice_edits(edits, a, b)
            widths.append(None if part is None else part.width)
            if part is not None:
                arrays.update({f"rescore_{name}_{j}": getattr(part, name)
                               for name in _EDIT_ARRAYS})
        hot_bounds = [tuple(np.searchsorted(hot, (a, b)).tolist()) for a, b in chunks]
        return cls(picked, indices, arrays, chunks, hot_bounds, widths,
                   max(p.logprobs or 0 for p in params))

    def score(self, rows: Rows, dev: dict[str, torch.Tensor],
              mask_token_id: int, tokens: torch.Tensor,
              conf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Score the rows again from ``dev`` (the uploaded arrays), chunk by chunk, writing
        ``tokens`` and ``conf`` in place; returns the rows' alternatives (``Scores.top``) if
        asked for. ``rows(index)``: the logits rows ``index`` over the whole vocabulary."""
        tops = []
        for j, ((a, b), (h0, h1), width) in enumerate(zip(self.chunks, self.hot_bounds,
                                                          self.edits_widths, strict=True)):
            edits = None
            if width is not None:
                edits = LogitEdits(*(dev[f"rescore_{name}_{j}"] for name in _EDIT_ARRAYS),
                                   width=width)
            index = dev["rescore_rows"][a:b]
            t, c, top = score_logits(
                rows(index), mask_token_id, dev["rescore_temperature"][a:b],
                dev["rescore_row_keys"][a:b], dev["rescore_top_p"][a:b],
                dev["rescore_top_k"][a:b], dev["rescore_min_p"][a:b], edits, self.top_n,
                hot=dev["rescore_hot"][h0:h1] - a)
            tokens[index] = t.to(tokens.dtype)
            conf[index] = c.to(conf.dtype)
            tops.append(top)
        if not self.top_n:
            return None
        return torch.cat([t[0] for t in tops]), torch.cat([t[1] for t in tops])

    def record_top(self, batch: PackedBatch, logprobs: np.ndarray, ids: np.ndarray,
                   errors: dict[int, Exception]) -> None:
        """Give each request that asks for alternatives those of its committed rows (call after
        the commit; ``logprobs``, ``ids``: :meth:`score`'s, read back). A request already in
        ``errors`` is skipped; one that fails here is added."""
        start = 0
        for st, i in zip(self.states, self.indices, strict=True):
            a, b = batch.cu_rows[i], batch.cu_rows[i + 1]
            n = st.params.logprobs or 0
            if n and i not in errors:
                end = start + b - a
                try:
                    st.record_top(batch.cand_positions[a:b], logprobs[start:end, :n],
                                  ids[start:end, :n])
                except Exception as e:
                    errors[i] = e
            start += b - a


def slice_edits(edits: LogitEdits, start: int, end: int) -> LogitEdits | None:
    """The edits of rows [start, end) of ``edits`` (host arrays), as edits of a matrix of those
    rows alone: each group clipped to them and renumbered, the entries of the groups left out
    dropped; None if none are left."""
    lo = np.maximum(edits.starts, start)
    hi = np.minimum(edits.starts + edits.counts, end)
    keep = hi > lo
    if not keep.any():
        return None
    renumber = np.cumsum(keep) - 1

    def entries(groups: np.ndarray, *columns: np.ndarray) -> list[np.ndarray]:
        kept = keep[groups]
        return [renumber[groups[kept]], *(c[kept] for c in columns)]

    counts = (hi - lo)[keep]
    return LogitEdits(lo[keep] - start, counts,
                      *entries(edits.add_groups, edits.add_ids, edits.add_values),
                      *entries(edits.rep_groups, edits.rep_ids, edits.rep_values),
                      width=int(counts.max()))
