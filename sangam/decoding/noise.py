"""Counter-based Gumbel noise: a pure function of (seed, block, step, position, token).

Sampling must not depend on batching (docs/design.md §2), so noise comes from a stateless 32-bit
hash rather than a generator's stream. The Triton unmasking kernel computes the same hash with
uint32 arithmetic, so kernel and reference draw identical noise.
"""

from __future__ import annotations

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def mix32(x: int) -> int:
    """Chris Wellons' lowbias32 integer hash on a Python int (uint32 in, uint32 out)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor holding uint32 values (int64 products wrap; low bits hold)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def mix32_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 on a uint64 numpy array holding uint32 values."""
    x = x & MASK32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(_M1)) & MASK32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(_M2)) & MASK32
    return x ^ (x >> np.uint64(16))


def noise_key(seed: int, block: int, step: int) -> int:
    """The uint32 key of one decoding step of one request."""
    k = mix32((seed & MASK32) ^ mix32(seed >> 32))
    return mix32(mix32(k ^ block) ^ step)


def row_key(key: int, pos_in_block: int) -> int:
    return mix32(key ^ mix32(pos_in_block))


def row_keys(key: int, pos_in_block: np.ndarray) -> np.ndarray:
    """``row_key`` for many positions at once (int64 array of uint32 values)."""
    h = mix32_numpy(np.uint64(key) ^ mix32_numpy(pos_in_block.astype(np.uint64)))
    return h.astype(np.int64)


def gumbel_noise(row_keys: torch.Tensor, vocab_size: int, dtype: torch.dtype,
                 start: int = 0) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[rows, vocab]`` for the given per-row keys (int64 ``[rows]``), of
    the tokens ``start .. start + vocab_size - 1`` (a vocabulary shard's)."""
    tokens = torch.arange(start, start + vocab_size, dtype=torch.int64, device=row_keys.device)
    h = mix32_tensor(row_keys.to(torch.int64)[:, None] ^ tokens[None, :])
    u = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)
    return (-torch.log(-torch.log(u))).to(dtype)
