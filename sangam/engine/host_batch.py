"""The model runner's per-iteration host work: plan every request's step, pack the batch's
arrays, and commit the scored tokens back into the requests (docs/design.md §1, §2).

One API, two implementations:

- ``PythonHostBatcher``: ``DecodeState.plan`` / ``DecodeState.commit`` (the request's decoding
  family's) and ``PackedBatch.from_plans``. The readable reference, and what runs without a
  compiler.
- ``CHostBatcher``: the C++ extension ``sangam._host`` (csrc/host_batch.cpp), which mirrors the
  reference step for step and is an order of magnitude faster; used whenever it was built. It
  reads each request's ``DecodeState.host_buffers`` (its cursor's and decoder's records and its
  arrays), whose layouts it is given here, once, at import. tests/test_host_batch.py checks
  that both produce identical arrays and states.

``SANGAM_NO_CEXT=1`` forces the Python path (tests, A/B measurement).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import numpy as np
import torch

from sangam.decoding.family import StepPlan
from sangam.decoding.rules import RULE_IDS
from sangam.decoding.state import (
    DECODE_FIELDS,
    DECODE_FLOAT_FIELDS,
    FINISH_REASONS,
    HOST_BUFFERS,
    DecodeState,
)
from sangam.models import AttentionMetadata
from sangam.sampling_params import CACHE_MODES
from sangam.sched.block_cursor import CURSOR_FIELDS

try:
    from sangam import _host
except ImportError:  # built without a compiler: the Python path serves
    _host = None
else:  # the records' layouts, defined once (in Python), for the extension to read them by
    _host.configure({
        "cursor": CURSOR_FIELDS, "decode": DECODE_FIELDS, "floats": DECODE_FLOAT_FIELDS,
        "buffers": HOST_BUFFERS, "cache_modes": CACHE_MODES,
        "rules": sorted(RULE_IDS, key=RULE_IDS.get), "finish_reasons": FINISH_REASONS})

IMPLS = ("python", "cext")


def cext_available() -> bool:
    return _host is not None


def default_impl() -> str:
    """The implementation runners use: "cext" when the extension is built and
    ``SANGAM_NO_CEXT`` is unset (or "0"), else "python"."""
    if os.environ.get("SANGAM_NO_CEXT", "0") not in ("", "0") or _host is None:
        return "python"
    return "cext"


@dataclass
class PackedBatch:
    """Host arrays of one packed forward: n requests, N query tokens, M logits rows.

    Request r owns query tokens ``cu_seqlens_q[r]:cu_seqlens_q[r+1]`` and logits rows
    ``cu_rows[r]:cu_rows[r+1]``; row i predicts canvas position ``cand_positions[i]``, and the
    first ``num_forced[r]`` rows of request r are committed whatever the unmasking rule says.
    """

    input_ids: np.ndarray  # int64 [N]
    positions: np.ndarray  # int64 [N]
    slot_mapping: np.ndarray  # int64 [N]: page * page_size + offset of each query position
    block_tables: np.ndarray  # int32 [n, max pages], zero-padded
    cu_seqlens_q: np.ndarray  # int32 [n + 1]
    kv_lens: np.ndarray  # int32 [n]: its whole canvas (block-causal: up to its span's end)
    logits_indices: np.ndarray  # int64 [M]: the packed hidden-state row of each logits row
    cu_rows: np.ndarray  # int64 [n + 1]
    row_keys: np.ndarray  # int64 [M]: noise key of each row (0 when greedy)
    temperatures: np.ndarray  # float64 [M]
    cand_positions: np.ndarray  # int64 [M]
    num_forced: np.ndarray  # int64 [n]
    num_editable: np.ndarray  # int64 [n]: its last rows are filled positions it may edit

    @classmethod
    def from_plans(cls, states: list[DecodeState], plans: list[StepPlan],
                   pages: list[list[int]], page_size: int) -> PackedBatch:
        """The reference packing of one forward from every request's step plan."""
        n = len(plans)
        query_lens = np.array([p.span_len for p in plans], dtype=np.int64)
        cu_seqlens_q = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu_seqlens_q[1:])
        positions = np.concatenate([np.arange(p.span_start, p.span_end) for p in plans])
        input_ids = np.concatenate(
            [st.tokens[p.span_start:p.span_end] for st, p in zip(states, plans)])
        width = max(len(pg) for pg in pages)
        block_tables = np.zeros((n, width), dtype=np.int32)
        for r, pg in enumerate(pages):
            block_tables[r, :len(pg)] = pg
        # Each query position's K/V slot: its page (looked up in its request's table row; a
        # position beyond the request's pages is an error, never the table's zero padding).
        owner = np.repeat(np.arange(n), query_lens)
        page_index = positions // page_size
        num_pages = np.array([len(pg) for pg in pages])
        if (page_index >= num_pages[owner]).any():
            raise IndexError("a span position lies beyond its request's pages")
        slot_mapping = (block_tables[owner, page_index].astype(np.int64) * page_size
                        + positions % page_size)
        num_rows = [len(p.positions) for p in plans]
        cu_rows = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_rows, out=cu_rows[1:])
        logits_indices = (np.concatenate([p.rows for p in plans])
                          + np.repeat(cu_seqlens_q[:-1], num_rows))
        return cls(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
            kv_lens=np.array([st.cursor.keys_attended(p.span_end) for st, p in zip(states, plans)],
                             dtype=np.int32),
            logits_indices=logits_indices, cu_rows=cu_rows,
            row_keys=np.concatenate([p.row_keys for p in plans]),
            temperatures=np.repeat(
                np.array([st.params.temperature for st in states], dtype=np.float64), num_rows),
            cand_positions=np.concatenate([p.positions for p in plans]),
            num_forced=np.array([p.num_forced for p in plans], dtype=np.int64),
            num_editable=np.array([p.num_editable for p in plans], dtype=np.int64))

    @property
    def num_rows(self) -> int:
        return len(self.logits_indices)

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays the forward reads on the device (``BatchUploader.upload`` moves them)."""
        return {"input_ids": self.input_ids, "positions": self.positions,
                "slot_mapping": self.slot_mapping, "block_tables": self.block_tables,
                "cu_seqlens_q": self.cu_seqlens_q, "kv_lens": self.kv_lens,
                "logits_indices": self.logits_indices}

    @classmethod
    def from_device_arrays(cls, arrays: dict[str, np.ndarray]) -> PackedBatch:
        """The batch as far as the forward needs it, from its ``device_arrays()`` (a follower
        rank of a tensor-parallel group, which plans and commits nothing): the rest empty."""
        empty = np.zeros(0, dtype=np.int64)
        kept = {f.name: arrays.get(f.name, empty) for f in fields(cls)}
        return cls(**kept)

    def metadata(self, dev: dict[str, torch.Tensor]) -> AttentionMetadata:
        """The attention metadata over ``dev``, the uploaded ``device_arrays()`` (and, for a
        block-causal model, ``causal_blocks``: each request's block size; for a uniform-state
        one, each row's key bounds)."""
        causal = dev.get("causal_blocks")
        return AttentionMetadata(
            cu_seqlens_q=dev["cu_seqlens_q"], kv_lens=dev["kv_lens"],
            block_tables=dev["block_tables"], slot_mapping=dev["slot_mapping"],
            query_lens=np.diff(self.cu_seqlens_q).tolist(), kv_lens_host=self.kv_lens.tolist(),
            causal_blocks=causal, positions=None if causal is None else dev["positions"],
            key_lo=dev.get("key_lo"), key_hi=dev.get("key_hi"), window_lo=dev.get("window_lo"),
            window_block_tables=dev.get("window_block_tables"),
            window_slot_mapping=dev.get("window_slot_mapping"))


class PythonHostBatcher:
    """The reference: DecodeState.plan, PackedBatch.from_plans, DecodeState.commit."""

    impl = "python"

    def __init__(self, page_size: int):
        self.page_size = page_size

    def build(self, states: list[DecodeState], pages: list[list[int]]) -> PackedBatch:
        """Plan every request's next step and pack them into one forward's arrays."""
        plans = [st.plan() for st in states]
        return PackedBatch.from_plans(states, plans, pages, self.page_size)

    def apply(self, states: list[DecodeState], batch: PackedBatch, tokens: np.ndarray,
              conf: np.ndarray) -> tuple[list[bool], dict[int, Exception]]:
        """Commit the scored rows (``tokens`` int64 and ``conf`` float64, ``[M]``) into each
        request; returns, per request, whether its current block was completed, and the error
        of each request whose commit failed (its failure is its own: the others commit).
        Requests whose family reads its rows' logits are left alone (False): the runner
        commits them with those."""
        cu = batch.cu_rows.tolist()
        done, errors = [], {}
        for r, (st, k, ed) in enumerate(zip(states, batch.num_forced.tolist(),
                                            batch.num_editable.tolist())):
            try:
                done.append(not st.family.reads_logits and st.family.commit(
                    st, batch.cand_positions[cu[r]:cu[r + 1]], k, tokens[cu[r]:cu[r + 1]],
                    conf[cu[r]:cu[r + 1]], ed))
            except Exception as e:
                done.append(False)
                errors[r] = e
        return done, errors


# The arena's arrays in the order sangam._host.build takes them: (name, dtype, sized by).
_FIELDS = (
    ("input_ids", np.int64, "tokens"),
    ("positions", np.int64, "tokens"),
    ("slot_mapping", np.int64, "tokens"),
    ("block_tables", np.int32, "table"),
    ("cu_seqlens_q", np.int32, "requests+1"),
    ("kv_lens", np.int32, "requests"),
    ("logits_indices", np.int64, "rows"),
    ("cu_rows", np.int64, "requests+1"),
    ("row_keys", np.int64, "rows"),
    ("temperatures", np.float64, "rows"),
    ("cand_positions", np.int64, "rows"),
    ("num_forced", np.int64, "requests"),
    ("num_editable", np.int64, "requests"),
)
assert [f[0] for f in _FIELDS] == [f.name for f in fields(PackedBatch)]


class CHostBatcher:
    """The C++ implementation. Packs into a scratch arena owned by this object and grown as
    needed, so a built batch's arrays are views that stay valid until the next ``build``."""

    impl = "cext"

    def __init__(self, page_size: int):
        if _host is None:
            raise RuntimeError("the C++ extension sangam._host is not built")
        self.page_size = page_size
        self._capacity = {"tokens": 0, "rows": 0, "requests": 0, "table": 0}
        self._arena: tuple[np.ndarray, ...] = ()
        self._grow(num_tokens=4096, num_rows=1024, num_requests=64, table=64 * 256)

    def _grow(self, num_tokens: int, num_rows: int, num_requests: int, table: int) -> None:
        # Doubling keeps regrowth rare as load ramps up.
        need = {"tokens": num_tokens, "rows": num_rows, "requests": num_requests, "table": table}
        cap = {k: v if need[k] <= v else 2 * need[k] for k, v in self._capacity.items()}
        self._capacity = cap
        size = {"tokens": cap["tokens"], "rows": cap["rows"], "table": cap["table"],
                "requests": cap["requests"], "requests+1": cap["requests"] + 1}
        self._arena = tuple(np.empty(size[by], dtype=dt) for _, dt, by in _FIELDS)

    def build(self, states: list[DecodeState], pages: list[list[int]]) -> PackedBatch:
        """As ``PythonHostBatcher.build``; the arrays are views into this batcher's arena."""
        n = len(states)
        requests = [st.host_buffers for st in states]
        while True:
            fits, num_tokens, num_rows, width = _host.build(requests, pages, self.page_size,
                                                            self._arena)
            if fits:
                break
            self._grow(num_tokens, num_rows, n, n * width)
        (input_ids, positions, slot_mapping, block_tables, cu_seqlens_q, kv_lens, logits_indices,
         cu_rows, row_keys, temperatures, cand_positions, num_forced, num_editable) = self._arena
        return PackedBatch(
            input_ids[:num_tokens], positions[:num_tokens], slot_mapping[:num_tokens],
            block_tables[:n * width].reshape(n, width), cu_seqlens_q[:n + 1], kv_lens[:n],
            logits_indices[:num_rows], cu_rows[:n + 1], row_keys[:num_rows],
            temperatures[:num_rows], cand_positions[:num_rows], num_forced[:n],
            num_editable[:n])

    def apply(self, states: list[DecodeState], batch: PackedBatch, tokens: np.ndarray,
              conf: np.ndarray) -> tuple[list[bool], dict[int, Exception]]:
        """As ``PythonHostBatcher.apply``."""
        return _host.apply([st.host_buffers for st in states],
                           np.ascontiguousarray(tokens, dtype=np.int64),
                           np.ascontiguousarray(conf, dtype=np.float64), batch.cand_positions,
                           batch.cu_rows, batch.num_forced, batch.num_editable)


HostBatcher = PythonHostBatcher | CHostBatcher


def make_host_batcher(page_size: int, impl: str | None = None) -> HostBatcher:
    """A batcher of the given implementation, or of ``default_impl()``."""
    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return CHostBatcher(page_size) if impl == "cext" else PythonHostBatcher(page_size)
