"""The paged K/V pool of one worker: one tensor of pages for all layers (one per K/V shape of
its layers), and its allocator."""

from __future__ import annotations

import logging

import torch

from sangam.config import EngineConfig
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.memory_profile import GIB, page_bytes, plan_for
from sangam.models import ModelConfig, PagedKV
from sangam.sched.page_allocator import PageAllocator

logger = logging.getLogger(__name__)


def pool_num_pages(loaded: LoadedModel, engine: EngineConfig,
                   graph_spans: tuple[int, ...] = ()) -> int:
    """Explicit ``num_pages``; else on GPU what the memory fraction leaves after the weights,
    what others hold and the activations of the largest forward (``memory_profile.py``;
    ``graph_spans``: the block lengths whose decode steps CUDA graphs capture), logged; else
    the CPU budget ``cpu_kv_cache_gb``."""
    if engine.num_pages is not None:
        return engine.num_pages
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        plan = plan_for(loaded, engine, total=total, free=free, graph_spans=graph_spans)
        logger.info("%s", plan.describe())
        return plan.num_pages
    per_page = page_bytes(loaded.model.rank_config, engine.page_size,
                          loaded.dtype, engine.kv_cache_dtype)
    n = int(engine.cpu_kv_cache_gb * GIB // per_page)
    if n < 1:
        raise ValueError(f"--cpu-kv-cache-gb {engine.cpu_kv_cache_gb} holds no KV page of "
                         f"{per_page} bytes; raise it or set --num-pages")
    return n


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, fp8: bool = False):
        """``cfg``: the model's, or under tensor parallelism its rank's
        (``ShardLayout.rank_config``: the KV heads that rank holds); ``fp8``: the FP8 layout
        (``--kv-cache-dtype fp8``)."""
        # torch.empty: pages are always written (by a refresh) before they are read (a
        # block-causal request attends only up to the end of its span, all of it written).
        self.kv = PagedKV.for_model(cfg, num_pages, page_size, dtype, device, empty=True,
                                    fp8=fp8)
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
