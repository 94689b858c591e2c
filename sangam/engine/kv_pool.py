"""The paged K/V pool of one worker: one tensor of pages for all layers (one per K/V shape of
its layers), and its allocator; under a hybrid pool, the sliding-window layers' pages apart,
with their own allocator and a ring of them per request (``sched/window_rings.py``)."""

from __future__ import annotations

import logging

import torch

from sangam.config import EngineConfig
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.memory_profile import GIB, plan_for, pool_page_bytes
from sangam.models import ModelConfig, PagedKV
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.window_rings import RingShape, WindowRings

logger = logging.getLogger(__name__)


def pool_num_pages(loaded: LoadedModel, engine: EngineConfig,
                   graph_spans: tuple[int, ...] = (), ring: RingShape | None = None) -> int:
    """Pages of the full layers (of every layer in a single pool): explicit ``num_pages``;
    else on GPU what the memory fraction leaves after the weights, what others hold, the
    activations of the largest forward (``memory_profile.py``; ``graph_spans``: the block
    lengths whose decode steps CUDA graphs capture) and a hybrid pool's rings (``ring``, one a
    seat), logged; else what the CPU budget ``cpu_kv_cache_gb`` leaves after the rings."""
    if engine.num_pages is not None:
        return engine.num_pages
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        plan = plan_for(loaded, engine, total=total, free=free, graph_spans=graph_spans,
                        ring=ring)
        logger.info("%s", plan.describe())
        return plan.num_pages
    per_page, window_page = pool_page_bytes(loaded.model.rank_config, engine, loaded.dtype,
                                            ring is not None)
    rings = 0 if ring is None else ring.pages * engine.scheduler.batch_cap * window_page
    n = int((engine.cpu_kv_cache_gb * GIB - rings) // per_page)
    if n < 1:
        raise ValueError(f"--cpu-kv-cache-gb {engine.cpu_kv_cache_gb} holds no KV page of "
                         f"{per_page} bytes after {rings} bytes of sliding-window rings; raise "
                         "it or set --num-pages")
    return n


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, fp8: bool = False, ring: RingShape | None = None,
                 seats: int = 0):
        """``cfg``: the model's, or under tensor parallelism its rank's
        (``ShardLayout.rank_config``: the KV heads that rank holds); ``fp8``: the FP8 layout
        (``--kv-cache-dtype fp8``); ``ring``: a hybrid pool's rings, for ``seats`` requests
        (``rings``); None: one pool for every layer."""
        # torch.empty: pages are always written (by a refresh) before they are read (a
        # block-causal request attends only up to the end of its span, all of it written).
        self.kv = PagedKV.for_model(cfg, num_pages, page_size, dtype, device, empty=True,
                                    fp8=fp8,
                                    window_pages=None if ring is None else ring.pages * seats)
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.rings = None if ring is None else WindowRings(PageAllocator(ring.pages * seats),
                                                           ring)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def usage(self) -> float:
        return self.allocator.num_used / self.allocator.num_pages
