"""The known models' shapes are written once (sangam.models.registry): the config.json that
``python -m sangam.testing --shape`` writes of each parses back to the simulator's geometry."""

from __future__ import annotations

import json

import pytest

from sangam import testing
from sangam.bench.cost_model import MODELS, ModelGeometry
from sangam.models.checkpoint import parse_config
from sangam.models.registry import MODEL_SHAPES


def test_the_cost_model_knows_the_registry_models():
    assert list(MODELS) == list(MODEL_SHAPES)


@pytest.mark.parametrize("key", list(MODEL_SHAPES))
def test_written_config_parses_to_the_cost_models_geometry(tmp_path, key):
    assert testing.main([str(tmp_path), "--shape", key]) == 0
    cfg = parse_config(json.loads((tmp_path / "config.json").read_text()), str(tmp_path))
    shape, geometry = MODEL_SHAPES[key], MODELS[key]
    assert ModelGeometry.of(shape.name, cfg) == geometry
    assert (cfg.head_dim, cfg.block_causal, cfg.tie_word_embeddings) == (
        shape.head_dim, shape.block_causal, shape.tie_word_embeddings)
    assert cfg.kv_bytes_per_token(2) == geometry.kv_bytes_per_token(2)


@pytest.mark.parametrize("key,total,active", [("llada2-mini", 16.3e9, 1.44e9),
                                              ("llada2-flash", 103e9, 6.1e9)])
def test_moe_geometry_counts_active_and_resident_weights(key, total, active):
    """The published sizes (mini: 16B total, 1.4B active; flash: 100B, ~6B), embedding and LM
    head included; a decode step's 32 x 64 tokens read nearly every expert."""
    g = MODELS[key]
    tables = 2 * g.head_params
    assert g.weight_bytes(1) == pytest.approx(total, rel=0.03)
    assert g.active_params + tables == pytest.approx(active, rel=0.03)
    assert g.weights_read(1) == pytest.approx(g.active_params)  # one token: its experts
    assert g.weights_read(64 * 32) == pytest.approx(g.weight_bytes(1) - tables, rel=1e-3)
