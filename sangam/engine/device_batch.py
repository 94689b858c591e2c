"""An iteration's host arrays on the device, moved by one host-to-device copy.

A packed forward needs about a dozen small arrays on the device: token ids, positions, the
attention metadata, the logits rows and the unmasking parameters. Copied one by one from
pageable numpy memory, each is its own synchronous ``cudaMemcpy`` (a few microseconds of CPU
time and a stall of the CPU's run-ahead, per array, per iteration). ``BatchUploader`` packs
them into one pinned staging buffer, copies it with a single asynchronous transfer, and hands
out typed views of the device copy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

_ALIGN = 16  # every array starts on a 16-byte boundary: any dtype can view it, loads stay wide

_TORCH_DTYPES = {np.dtype(d): t for d, t in (
    (np.int64, torch.int64), (np.int32, torch.int32), (np.float64, torch.float64),
    (np.float32, torch.float32))}


class BatchUploader:
    """Moves named host arrays to ``device`` in one copy; returns device tensors by name.

    The staging buffer is reused and grown by doubling; on CUDA it is pinned, and before it is
    rewritten the previous copy out of it must have finished (an event, normally long complete:
    the runner reads its scores back at the end of every iteration).
    Off CUDA the "copy" is a clone, so the returned tensors never alias the staging buffer
    there either and the path is the same one the GPU runs.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.uint8)
        # Marks the end of the last copy out of the staging buffer (never recorded = done).
        self._copied = torch.cuda.Event() if self._cuda else None
        self.copies = 0  # host-to-device transfers made (observability, tests)

    def upload(self, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        # Element offsets into one typed view of the buffer per dtype (a torch view costs a
        # microsecond or two of Python; a batch has a dozen arrays but few dtypes).
        layout = []
        total = 0
        for name, a in arrays.items():
            if a.dtype not in _TORCH_DTYPES:
                raise TypeError(f"{name}: cannot upload dtype {a.dtype}")
            layout.append((name, a, total // a.itemsize))
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        dtypes = {a.dtype for _, a, _ in layout}
        staging = self._stage(total)[:total]
        host = staging.numpy()
        host_typed = {dt: host.view(dt) for dt in dtypes}
        for _, a, start in layout:
            host_typed[a.dtype][start:start + a.size] = a.reshape(-1)
        if self._cuda:
            packed = staging.to(self.device, non_blocking=True)
            self._copied.record()
        else:
            packed = staging.clone()
        self.copies += 1
        typed = {dt: packed.view(_TORCH_DTYPES[dt]) for dt in dtypes}
        out = {}
        for name, a, start in layout:
            t = typed[a.dtype][start:start + a.size]
            out[name] = t if a.ndim == 1 else t.view(a.shape)
        return out

    def _stage(self, nbytes: int) -> torch.Tensor:
        if self._copied is not None and not self._copied.query():  # query() never blocks
            self._copied.synchronize()
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(max(nbytes, 2 * self._staging.numel()),
                                        dtype=torch.uint8, pin_memory=self._cuda)
        return self._staging
