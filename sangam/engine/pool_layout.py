"""What a worker's KV pool holds, decided once from the flags and the model: whether prompt
pages are shared (prefix caching) and whether the sliding-window layers get rings of their own
(a hybrid pool, ``sched/window_rings.py``)."""

from __future__ import annotations

from sangam.config import EngineConfig
from sangam.engine.loaded_model import LoadedModel
from sangam.sched.prefix_cache import caches_prefixes
from sangam.sched.window_rings import RingShape, ring_for


def prefix_caching(config: EngineConfig, loaded: LoadedModel) -> bool:
    """Whether the workers cache prompt blocks' K/V (``--enable-prefix-caching``): by default
    for a block-causal model, whose finished blocks' K/V is exact, and a uniform-state one
    (its causal encoder's), unless ``--kv-pool hybrid`` (whose rings keep no prefix); refused
    for a bidirectional one, whose prompt K/V depends on the response."""
    exact = loaded.config.block_causal or loaded.config.gemma is not None
    if config.enable_prefix_caching and not exact:
        raise ValueError("--enable-prefix-caching needs a block-causal model (SDAR, LLaDA2) or "
                         "a uniform-state one (DiffusionGemma): a bidirectional model's prompt "
                         "K/V depends on the response, so no prompt block can be reused")
    return caches_prefixes(exact, config.enable_prefix_caching, config.kv_pool)


def window_ring(config: EngineConfig, loaded: LoadedModel) -> RingShape | None:
    """Each request's ring of sliding-window pages under a hybrid pool (``ring_for``); None:
    one pool for every layer."""
    cfg = loaded.config
    g = cfg.gemma
    return ring_for(config.kv_pool, cfg.architecture, g.sliding_window if cfg.window_layers else 0,
                    g.canvas_length if g else 0, config.page_size, config.token_budget,
                    config.mode == "colocated", prefix_caching(config, loaded))
