"""Where kernel launches go: compiled for a GPU, or run by Triton's CPU interpreter.

Wrappers size tiles, warps and splits for the one or the other. ``assume_gpu`` makes them size
for a GPU that is not here, which is how ``sangam.kernels.cross_compile`` compiles exactly what
a GPU would launch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_assumed: tuple[int, int] | None = None  # (SMs, shared bytes per program) inside assume_gpu


# Triton picks interpreted or compiled kernels when they are defined (at import), so the
# variable is read once, at import, too, not on every launch that asks.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETING


def compiled(device: torch.device) -> bool:
    """Whether launches for tensors on ``device`` compile for a GPU."""
    return _assumed is not None or (device.type == "cuda" and not interpreting())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU that launches on ``device`` run on."""
    if _assumed is not None:
        return _assumed[0]
    return _cuda_sms(_index(device))


def max_shared_bytes(device: torch.device) -> int:
    """Shared memory one program may use on that GPU: the opt-in maximum, which Triton checks
    each launch against."""
    if _assumed is not None:
        return _assumed[1]
    return _cuda_max_shared(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=8)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=8)
def _cuda_max_shared(index: int) -> int:
    import triton

    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


@contextmanager
def assume_gpu(sms: int, shared_bytes: int) -> Iterator[None]:
    """Within the block, wrappers size every launch for a GPU with ``sms`` SMs and
    ``shared_bytes`` of shared memory per program, whatever the tensors' device."""
    global _assumed
    previous, _assumed = _assumed, (sms, shared_bytes)
    try:
        yield
    finally:
        _assumed = previous
