"""The paged K/V pool of one worker: one tensor of pages for all layers, and its allocator."""

from __future__ import annotations

import torch

from sangam.config import EngineConfig
from sangam.models import ModelConfig, PagedKV
from sangam.sched.page_allocator import PageAllocator

GIB = 1 << 30


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return page_size * cfg.kv_bytes_per_token(elem)


def pool_num_pages(cfg: ModelConfig, engine: EngineConfig, dtype: torch.dtype,
                   device: torch.device) -> int:
    """Explicit ``num_pages``; else what the GPU memory fraction leaves after the weights; else
    the CPU budget ``cpu_kv_cache_gb``."""
    if engine.num_pages is not None:
        return engine.num_pages
    per_page = page_bytes(cfg, engine.page_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - engine.gpu_memory_fraction)
    else:
        budget = engine.cpu_kv_cache_gb * GIB
    n = int(budget // per_page)
    if n < 1:
        raise ValueError(f"no memory left for even one KV page of {per_page} bytes; lower the "
                         "model size or raise --gpu-memory-fraction / --num-pages")
    return n


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        # torch.empty: pages are always written (by a refresh) before they are read (a
        # block-causal request attends only up to the end of its span, all of it written).
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = PagedKV(torch.empty(shape, dtype=dtype, device=device))
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def usage(self) -> float:
        return self.allocator.num_used / self.allocator.num_pages
