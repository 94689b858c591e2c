"""Tensor and expert parallelism (docs/design.md §4.10): each rank's shard computes its share of
the whole model; the vocabulary-parallel scoring equals score_logits; a rank's weights are its
share; and worker groups of 2 and 4 processes (gloo, float64) give the single-request reference
decoder's tokens in colocated, disaggregated and hybrid modes, for every architecture, and lose
nothing when one rank of a group is killed."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest
import torch
from test_llada2 import LLADA2
from test_llada2 import _request as llada2_request
from test_llada2 import _upstream as llada2_upstream
from test_multi_worker import (
    WORKLOADS,
    _options,
    _reference,
    _run,
    _settle,
    _tokens,
    _wait_gone,
)
from test_sdar import SDAR, check_modes, run_in_mode
from test_sdar import _request as sdar_request
from test_sdar import _upstream as sdar_upstream

from sangam.config import EngineConfig
from sangam.decoding.confidence import combine_shard_scores, score_logits, shard_scores
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.multi import make_engine
from sangam.kernels.reference import fused_moe_ref
from sangam.models import ShardLayout, load_model, read_config
from sangam.sampling_params import SamplingParams
from sangam.testing import make_tiny_checkpoint, real_shape_config

ARCHS = {  # tiny checkpoints: GQA with fewer KV heads than 4 ranks in dream, sdar and llada2
    "llada": dict(arch="llada"),
    "dream": dict(arch="dream", num_heads=8, num_kv_heads=2),
    "sdar": SDAR,
    "llada2": LLADA2,
    "llada_moe": dict(arch="llada_moe"),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    # 161 tokens: the vocabulary splits unevenly over 2 and 4 ranks.
    return {name: make_tiny_checkpoint(tmp_path_factory.mktemp(name), seed=i, vocab_size=161,
                                       **kw)
            for i, (name, kw) in enumerate(ARCHS.items())}


class _ThreadGroup:
    """An all-reduce between threads, one per rank: the sum in rank order."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def reduce(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()
            return x.copy_(total)
        return all_reduce


@pytest.mark.parametrize("size,ep", [(2, False), (4, False), (2, True), (4, True)])
@pytest.mark.parametrize("name", list(ARCHS))
def test_shards_compute_the_whole_model(paths, name, size, ep):
    """Each rank's forward on its shard, joined by the all-reduces, gives the whole model's
    logits (each rank its columns of the vocabulary)."""
    if ep and ARCHS[name]["arch"] not in ("llada2", "llada_moe"):
        pytest.skip("expert parallelism splits mixtures of experts only")
    whole = load_model(paths[name], "cpu", "float64")
    ids = torch.randint(0, 160, (2, 13), generator=torch.Generator().manual_seed(size))
    want = whole.forward_dense(ids)
    group = _ThreadGroup(size)
    shards = [load_model(paths[name], "cpu", "float64", shard=ShardLayout(r, size, ep))
              for r in range(size)]
    out = [None] * size

    def run(r: int) -> None:
        shards[r].all_reduce = group.reduce(r)
        with torch.no_grad():
            out[r] = shards[r].forward_dense(ids)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat(out, dim=-1), want, rtol=0, atol=1e-12)


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _replicated_bytes(model: torch.nn.Module, layout: ShardLayout) -> int:
    """Bytes every rank holds whole: norms, the embedding, routers, a tied head."""
    from sangam.models.sharding import shard_model

    cut = shard_model(model, layout)
    split_experts = layout.expert_parallel  # a rank's own experts are whole, yet a share
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if n not in cut and not (split_experts and ".experts." in n))


def _kv_bytes(model) -> float:
    """Bytes of the K and V projections (their rows of a fused QKV)."""
    cfg = model.config
    total = 0.0
    for n, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if ".k_proj." in n or ".v_proj." in n:
            total += b
        elif "query_key_value" in n:
            total += b * 2 * cfg.num_kv_heads / (cfg.num_heads + 2 * cfg.num_kv_heads)
    return total


@pytest.mark.parametrize("name,ep", [("llada", False), ("dream", False), ("llada2", False),
                                     ("llada2", True), ("llada_moe", True)])
def test_each_rank_holds_its_share_of_the_weights(paths, name, ep):
    """Each rank's weights are 1/N of the sharded tensors plus the replicated ones, read
    straight from the checkpoint's slices."""
    whole = load_model(paths[name], "cpu", "float64")
    for size in (2, 4):
        layout = ShardLayout(0, size, ep)
        with torch.device("meta"):
            replicated = _replicated_bytes(type(whole)(whole.config).double(), layout)
        ranks = [load_model(paths[name], "cpu", "float64", shard=ShardLayout(r, size, ep))
                 for r in range(size)]
        head = whole.output_head().weight
        for r, m in enumerate(ranks):
            # Each rank holds (whole - replicated) / N, but for the LM head's uneven split.
            lo, hi = m.shard.vocab(whole.config.vocab_size)
            uneven = 0.0 if whole.config.tie_word_embeddings else (
                (hi - lo - whole.config.vocab_size / size) * head[0].numel()
                * head.element_size())
            # Fewer KV heads than ranks: each rank holds one whole KV head, not 1/N of them.
            cfg = whole.config
            kv_over = max(0.0, 1 / cfg.num_kv_heads - 1 / size) * _kv_bytes(whole)
            want = (_bytes(whole) - replicated) / size + replicated + uneven + kv_over
            assert _bytes(m) == pytest.approx(want, abs=1), (name, size, r)
        assert replicated < _bytes(whole) / 4


def test_llada2_flash_shards_on_the_meta_device(tmp_path):
    """LLaDA2.0-flash (100B parameters, ~200 GB in bf16): ``--load-format dummy`` on the meta
    device allocates nothing, and says what each of 8 ranks would hold under expert
    parallelism: an eighth of the model, plus the replicated embedding and norms."""
    (tmp_path / "config.json").write_text(json.dumps(real_shape_config("llada2-flash")))
    whole = load_model(tmp_path, "meta", "bfloat16", "dummy")
    total = _bytes(whole)
    assert 190e9 < total < 215e9
    embed = whole.model.word_embeddings.weight
    replicated = embed.numel() * embed.element_size()
    for rank, ep in ((0, True), (7, False)):  # the widest and the narrowest vocabulary shard
        m = load_model(tmp_path, "meta", "bfloat16", "dummy", ShardLayout(rank, 8, ep))
        assert total / 8 < _bytes(m) < total / 8 + 1.1 * replicated
        assert not any(p.device.type != "meta" for p in m.parameters())


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_vocab_parallel_scores_equal_score_logits(impl):
    """Five numbers a row per shard (the reference, or the fused scoring kernel's partials per
    split of the shard), combined, give score_logits' tokens (greedy and sampled, the mask
    never chosen) and confidences, over uneven splits."""
    if impl == "triton":
        from sangam.kernels.unmask import fused_shard_scores

        def scores(logits, lo, mask, temps, keys):
            return fused_shard_scores(logits, lo, mask, temps, keys, num_splits=2)
    else:
        def scores(logits, lo, mask, temps, keys):
            return shard_scores(logits, lo, mask, temps, keys)[None]
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-14), (torch.float32, 1e-6)):
        for vocab, size in ((161, 4), (160, 2), (37, 3)):
            logits = (3 * torch.randn(40, vocab, generator=g)).to(dtype)
            temps = torch.where(torch.rand(40, generator=g) > 0.5,
                                torch.rand(40, generator=g) + 0.1, torch.zeros(40)).double()
            keys = torch.randint(0, 2 ** 32, (40,), generator=g)
            mask = int(logits[0].argmax())  # the best token of row 0 is the mask: skipped
            want, conf, _ = score_logits(logits, mask, temps, keys)
            parts = []
            for r in range(size):
                lo, hi = ShardLayout(r, size).vocab(vocab)
                parts.append(scores(logits[:, lo:hi], lo, mask, temps, keys))
            got, got_conf = combine_shard_scores(torch.cat(parts), conf.dtype)
            assert torch.equal(got, want) and not (got == mask).any()
            torch.testing.assert_close(got_conf, conf, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_experts_held_elsewhere_contribute_nothing(impl):
    """Expert parallelism's MoE: ids equal to the local expert count are skipped, and the
    ranks' outputs sum to the whole layer's."""
    if impl == "triton":
        from sangam.kernels.fused_moe import fused_moe
    else:
        fused_moe = fused_moe_ref
    g = torch.Generator().manual_seed(1)
    tokens, hidden, inter, experts, k, size = 9, 16, 8, 8, 3, 4
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64)
    w2 = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    total = torch.zeros_like(want)
    per = experts // size
    for r in range(size):
        lo, hi = r * per, (r + 1) * per
        local = torch.where((ids >= lo) & (ids < hi), ids - lo, per)
        total += fused_moe(x, w13[lo:hi].contiguous(), w2[lo:hi].contiguous(), weights, local,
                           partial=True)
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)


def test_flags_and_refusals(paths):
    """vLLM's and SGLang's spellings; a model the group cannot split is refused by name
    before any process starts."""
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    for flag in ("-tp", "--tp", "--tp-size", "--tensor-parallel-size"):
        args = parser.parse_args([flag, "2", "--enable-expert-parallel"])
        config = EngineConfig.from_cli_args(args)
        assert (config.tensor_parallel_size, config.enable_expert_parallel) == (2, True)
        assert config.is_multi_worker
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor-parallel-size 3 cannot split.*8 attention"):
        make_engine(EngineConfig(model=paths["dream"], device="cpu", tensor_parallel_size=3))
    cfg = read_config(paths["llada2"])
    with pytest.raises(ValueError, match="8 experts"):
        ShardLayout(0, 16, expert_parallel=True).check(cfg)
    assert ShardLayout(3, 4).heads(read_config(paths["dream"])) == ((6, 8), (1, 2))


# Worker groups in every mode: the reference decoder's tokens.

TP_MODES = {  # (ranks per worker, layout)
    "llada-tp2-colocated": ("llada", 2, dict(num_workers=2)),
    "llada-tp2-1P1D-streaming": ("llada", 2, dict(
        mode="disaggregated", prefill_workers=1, decode_workers=1, layerwise_kv_streaming=True)),
    "dream-tp4-colocated": ("dream", 4, dict(num_workers=1)),
    "dream-tp2-hybrid": ("dream", 2, dict(mode="hybrid", prefill_workers=1, decode_workers=1,
                                          overflow_threshold=8)),
}


@pytest.fixture(scope="module")
def bidirectional(llada_path, dream_path):
    return {"llada": llada_path, "dream": dream_path}


@pytest.mark.parametrize("case", list(TP_MODES))
def test_bidirectional_groups_match_the_reference(bidirectional, case):
    """test_multi_worker's workload (sampling, top-p, penalties, logprobs alternatives,
    infilling, priorities) on worker groups of 2 and 4 ranks: the same tokens, forwards and
    alternatives as the single-request reference decoder, every K/V transfer whole."""
    arch, size, layout = TP_MODES[case]
    reqs = WORKLOADS[arch][:14]
    want = {r[0]: _reference(bidirectional[arch], arch)[r[0]] for r in reqs}
    engine = make_engine(EngineConfig(**_options(bidirectional[arch], **layout),
                                      tensor_parallel_size=size))
    try:
        outs = _run(engine, reqs)
        assert _tokens(outs) == want
        assert engine.dead_workers == []
        if layout.get("mode", "colocated") != "colocated":
            assert engine.transfers and all(t.ok for t in engine.transfers if not t.drained)
            cfg = engine.loaded.config
            heads = ShardLayout(0, size).heads(cfg)[1]
            # Each rank moves its own KV heads' pages.
            assert {s.layer_page_bytes for s in engine.worker_states()} == {
                4 * (heads[1] - heads[0]) * cfg.head_dim * 8}
        if layout.get("layerwise_kv_streaming"):  # every rank posts its layers mid-forward
            assert max(t.streamed_layers for t in engine.transfers) == cfg.num_layers
        if layout.get("mode") == "hybrid":
            assert engine.placement.counters.overflow_prefills > 0
        _settle(engine)
    finally:
        engine.shutdown()


BLOCK_CAUSAL_TP = {
    "sdar-tp4-colocated": ("sdar", dict(tensor_parallel_size=4)),
    "sdar-tp2-1P1D": ("sdar", dict(mode="disaggregated", prefill_workers=1, decode_workers=1,
                                   tensor_parallel_size=2)),
    "sdar-tp2-hybrid-streaming": ("sdar", dict(
        mode="hybrid", prefill_workers=1, decode_workers=1, overflow_threshold=8,
        layerwise_kv_streaming=True, tensor_parallel_size=2)),
    "llada2-ep4-colocated": ("llada2", dict(tensor_parallel_size=4,
                                            enable_expert_parallel=True)),
    "llada2-ep2-1P1D": ("llada2", dict(mode="disaggregated", prefill_workers=1,
                                       decode_workers=1, tensor_parallel_size=2,
                                       enable_expert_parallel=True)),
    "llada2-tp2-hybrid": ("llada2", dict(mode="hybrid", prefill_workers=1, decode_workers=1,
                                         overflow_threshold=8, tensor_parallel_size=2)),
}


@pytest.mark.parametrize("case", list(BLOCK_CAUSAL_TP))
def test_block_causal_groups_equal_the_upstream_loop(paths, case):
    """SDAR and LLaDA2 (editing on, experts split by width or by expert) on worker groups:
    the upstream loop's tokens and forwards, chunked prefills included, K/V sent once."""
    name, layout = BLOCK_CAUSAL_TP[case]
    loaded = LoadedModel.load(EngineConfig(model=paths[name], device="cpu", dtype="float64"))
    rng = random.Random(7)
    if name == "sdar":
        reqs = [sdar_request(rng, i) for i in range(8)]
        reqs.append(("long", [rng.randrange(2, 150) for _ in range(70)],
                     SamplingParams(max_tokens=12, block_length=4, threshold=0.6, seed=1)))
        want = sdar_upstream(loaded, reqs)
    else:
        reqs = [llada2_request(rng, i, edit=i % 2 == 0) for i in range(6)]
        reqs.append(("long", [rng.randrange(2, 150) for _ in range(70)],
                     SamplingParams(max_tokens=16, block_length=8, threshold=0.6, seed=1,
                                    edit_threshold=0.5)))
        want = llada2_upstream(loaded, reqs)
    if "mode" in layout:
        check_modes(paths[name], reqs, want, layout, kill=None)
        return
    outs = run_in_mode(paths[name], reqs, layout)["outs"]
    assert {r: (o.token_ids, o.num_forwards - (o.metrics["num_refreshes"] - 1))
            for r, o in outs.items()} == want


KILLS = {  # (layout, the worker hit, its rank killed, at which output)
    # Two colocated workers: either rank of worker 0.
    "colocated-rank0": (dict(num_workers=2), 0, 0, 6),
    "colocated-rank1": (dict(num_workers=2), 0, 1, 6),
    # 1P2D: a decode group's rank 1 while K/V flows to it; the prefill group's ranks all abort
    # their pairs with it (the peer's death is mirrored).
    "1P2D-decode-rank1": (dict(mode="disaggregated", prefill_workers=1, decode_workers=2,
                               transfer_timeout=20.0), 2, 1, 5),
}


@pytest.mark.parametrize("case", list(KILLS))
def test_a_killed_rank_takes_its_group_down_and_loses_nothing(bidirectional, case):
    """SIGKILL one rank of a two-rank worker mid-run: the front declares that worker dead,
    its other rank is gone too (stopped by the front, or ended by itself when rank 0's sockets
    close), and every request finishes on the survivors with the reference tokens."""
    layout, worker, rank, at = KILLS[case]
    reqs = WORKLOADS["llada"][:12]
    want = {r[0]: _reference(bidirectional["llada"], "llada")[r[0]] for r in reqs}
    engine = make_engine(EngineConfig(**_options(bidirectional["llada"], **layout),
                                      tensor_parallel_size=2, watchdog_timeout=5.0))
    ranks = engine._procs[worker].ranks
    seen = []

    def kill_midway(out):
        seen.append(out)
        if len(seen) == at:
            os.kill(ranks[rank].pid, signal.SIGKILL)

    try:
        outs = _run(engine, reqs, on_output=kill_midway)
        assert engine.dead_workers == [worker]
        assert _tokens(outs) == want
        _wait_gone([p.pid for p in ranks], timeout=10)
        _settle(engine)
    finally:
        engine.shutdown()


def test_hundreds_of_streams_on_a_group(llada_path):
    """150 concurrent streams through AsyncEngine on one two-rank worker with a small pool,
    a fifth of the clients walking away after their first block: the others get the
    reference tokens, and every page comes back."""
    import asyncio

    from sangam.engine.async_engine import AsyncEngine
    from sangam.engine.reference_decoder import ReferenceDecoder
    from sangam.engine.validation import new_state

    rng = random.Random(9)
    reqs = [(f"s{i}", [rng.randrange(2, 150) for _ in range(rng.randint(1, 30))],
             SamplingParams(max_tokens=rng.choice([4, 8, 16]), block_length=rng.choice([4, 8]),
                            temperature=rng.choice([0.0, 1.0]), seed=i))
            for i in range(150)]
    leave = {rid for rid, *_ in reqs if rng.random() < 0.2}
    lm = LoadedModel.load(EngineConfig(model=llada_path, device="cpu", dtype="float64"))
    want = {rid: ReferenceDecoder(lm.model).run(new_state(lm, prompt, params, random.Random(0))
                                                ).output_token_ids()
            for rid, prompt, params in reqs if rid not in leave}
    engine = AsyncEngine(EngineConfig(**_options(llada_path), tensor_parallel_size=2))

    async def client(rid, prompt, params):
        gen = engine.generate(prompt, params, rid)
        outs = []
        try:
            async for out in gen:
                outs.append(out)
                if rid in leave:
                    break
        finally:
            await gen.aclose()
        return rid, outs[-1].token_ids

    async def main():
        return dict(await asyncio.gather(*(client(*r) for r in reqs)))

    try:
        got = asyncio.run(main())
        assert {rid: t for rid, t in got.items() if rid not in leave} == want
        front = engine.engine
        deadline = time.monotonic() + 20
        while not all(s.free_pages == s.num_pages for s in front.worker_states()):
            assert time.monotonic() < deadline, front.worker_states()
            time.sleep(0.1)
    finally:
        engine.shutdown()
