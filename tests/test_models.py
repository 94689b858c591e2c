"""Model forward over paged K/V: spans, refreshes, cached steps, loading and its errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sangam.models import (
    AttentionMetadata,
    CheckpointError,
    PagedKV,
    TorchAttentionBackend,
    load_model,
)


def _model(path, dtype="float64"):
    m = load_model(path, "cpu", dtype)
    m.attention_backend = TorchAttentionBackend()
    return m


def _forward(model, kv, seqs, spans, pages, rows=None):
    """Packed forward of several requests: seqs[r] full token list, spans[r] = (a, b)."""
    ps = kv.page_size
    ids, pos, slots, qlens = [], [], [], []
    for seq, (a, b), pg in zip(seqs, spans, pages):
        ids += seq[a:b]
        pos += list(range(a, b))
        slots += [pg[p // ps] * ps + p % ps for p in range(a, b)]
        qlens.append(b - a)
    width = max(len(p) for p in pages)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32),
        kv_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32),
        block_tables=torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), query_lens=qlens, kv_lens_host=[len(s) for s in seqs])
    n = len(ids)
    rows = torch.arange(n) if rows is None else rows
    return model(torch.tensor(ids), torch.tensor(pos), meta, kv, rows)


def _kv(model, num_pages=32, page_size=4):
    c = model.config
    return PagedKV.allocate(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim,
                            torch.float64, "cpu")


def test_full_span_equals_dense_forward(tiny_path):
    model = _model(tiny_path)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 150, (n,), generator=g).tolist() for n in (13, 7, 21)]
    pages = [[5, 2, 9, 30], [0, 17], [1, 3, 4, 6, 8, 10]]  # scattered pages, page size 4
    kv = _kv(model)
    logits = _forward(model, kv, seqs, [(0, len(s)) for s in seqs], pages)
    start = 0
    for s in seqs:
        dense = model.forward_dense(torch.tensor([s]))[0]
        torch.testing.assert_close(logits[start:start + len(s)], dense, rtol=1e-10, atol=1e-10)
        start += len(s)


def test_cached_step_with_unchanged_span_equals_refresh(tiny_path):
    model = _model(tiny_path)
    seq = torch.randint(0, 150, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    kv = _kv(model)
    pages = [[7, 1, 12, 3, 20]]
    refresh = _forward(model, kv, [seq], [(0, 19)], pages)
    for a, b in [(6, 10), (6, 19), (0, 4)]:
        cached = _forward(model, kv, [seq], [(a, b)], pages)
        torch.testing.assert_close(cached, refresh[a:b], rtol=1e-10, atol=1e-10)


def test_cached_step_sees_new_span_tokens(llada_path):
    """A cached step recomputes its span's K/V: changing a span token changes the logits."""
    model = _model(llada_path)
    seq = list(range(10, 26))
    kv = _kv(model)
    pages = [[0, 1, 2, 3]]
    _forward(model, kv, [seq], [(0, 16)], pages)
    changed = seq[:8] + [99] + seq[9:]
    cached = _forward(model, kv, [changed], [(8, 12)], pages)
    dense = model.forward_dense(torch.tensor([changed]))[0, 8:12]
    assert not torch.allclose(cached, dense)  # the suffix K/V outside the span is stale
    fresh = _forward(model, kv, [changed], [(0, 16)], pages)
    torch.testing.assert_close(fresh, model.forward_dense(torch.tensor([changed]))[0])


def test_logits_only_for_requested_rows(llada_path):
    model = _model(llada_path)
    seq = list(range(3, 20))
    full = _forward(model, _kv(model), [seq], [(0, 17)], [[0, 1, 2, 3, 4]])
    rows = torch.tensor([2, 16, 5])
    some = _forward(model, _kv(model), [seq], [(0, 17)], [[0, 1, 2, 3, 4]], rows)
    assert some.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(some, full[rows])


def test_sharded_checkpoint_loads_identically(tiny_path, tmp_path):
    from sangam.models.loader import save_checkpoint

    single = _model(tiny_path)
    raw = json.loads(open(f"{tiny_path}/config.json").read())
    save_checkpoint(single, raw, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    sharded = _model(tmp_path)
    for (k1, v1), (k2, v2) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


def test_real_tensor_names(llada_path, dream_path):
    llada = load_file(f"{llada_path}/model.safetensors")
    assert "model.transformer.wte.weight" in llada
    assert "model.transformer.blocks.1.ff_proj.weight" in llada
    assert "model.transformer.ff_out.weight" in llada
    dream = load_file(f"{dream_path}/model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in dream
    assert "model.layers.1.mlp.gate_proj.weight" in dream
    assert "lm_head.weight" in dream and "model.layers.0.self_attn.o_proj.bias" not in dream


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_load_dtypes(llada_path, dtype):
    m = load_model(llada_path, "cpu", dtype)
    assert next(m.parameters()).dtype == getattr(torch, dtype)


def _broken(src, tmp_path, edit_config=None, edit_tensors=None):
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        t = load_file(dst / "model.safetensors")
        edit_tensors(t)
        save_file(t, dst / "model.safetensors")
    return dst


def test_errors_name_the_problem(llada_path, tmp_path):
    cases = [
        (dict(edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"])),
         "unknown architecture 'GPT2LMHeadModel'"),
        (dict(edit_config=lambda c: c.pop("d_model")), "missing the key 'd_model'"),
        (dict(edit_tensors=lambda t: t.pop("model.transformer.blocks.1.q_proj.weight")),
         "model.transformer.blocks.1.q_proj.weight"),
        (dict(edit_tensors=lambda t: t.update(
            {"model.transformer.ln_f.weight": torch.ones(3)})), "has shape [3]"),
    ]
    for i, (edit, message) in enumerate(cases):
        path = _broken(llada_path, tmp_path / str(i), **edit)
        with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_model(path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(empty)
    shutil.copy(f"{llada_path}/config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(empty)


def test_dummy_load_format_builds_config_shapes_from_config_json_alone(tmp_path):
    from sangam.bench.cost_model import MODELS
    from sangam.config import EngineConfig
    from sangam.models import parse_config
    from sangam.testing import main as testing_main
    from sangam.testing import real_shape_config

    assert testing_main([str(tmp_path), "--config-only"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        load_model(tmp_path)  # auto: the weights are required
    a = load_model(tmp_path, "cpu", "float32", load_format="dummy")
    b = load_model(tmp_path, "cpu", "float32", load_format="dummy")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name  # seeded
        if "norm" in name or ".ln_f." in name:
            assert torch.all(x == 1), name
        else:
            assert 0.015 < x.float().std() < 0.025, name
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(load_format="pt")
    # The real shapes come from the simulator's geometry table, written once.
    for key, g in MODELS.items():
        cfg = parse_config(real_shape_config(key))
        assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                cfg.intermediate_size, cfg.vocab_size) == (
            g.hidden, g.layers, g.heads, g.kv_heads, g.intermediate, g.vocab)
