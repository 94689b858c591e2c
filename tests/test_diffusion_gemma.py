"""DiffusionGemma against transformers' own implementation (``models/diffusion_gemma``), on
tiny random checkpoints written by transformers' ``save_pretrained``, in float64:

- the forward: the encoder over a prompt and a finished canvas, then the decoder over a
  canvas, with and without self-conditioning, past the sliding window; hidden states to 1e-10,
  the fp32 logits equal;
- generation: ``generate_canvases`` against transformers' ``generate`` with its sampler patched
  to draw Sangam's documented noise — token for token, several canvases, adaptive stopping on
  and off, a stop id mid-canvas;
- loading: the vision tower is not read; what Sangam does not serve is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
dg = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

from transformers import DiffusionGemmaForBlockDiffusion  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from sangam.decoding.uniform import (  # noqa: E402
    UniformStateParams,
    categorical,
    step_keys,
    uniform_tokens,
)
from sangam.engine.reference_canvas import generate_canvases  # noqa: E402
from sangam.models import CheckpointError, load_model, read_config  # noqa: E402
from sangam.models.diffusion_gemma import DenseKV  # noqa: E402
from sangam.models.kernel_table import kernel_table  # noqa: E402
from tests.gemma_checkpoint import (  # noqa: E402
    CANVAS,
    VOCAB,
    reference_tokens,
    write_checkpoint,
)
from tests.test_sdar import BLOCK_CAUSAL_LAYOUTS, run_in_mode  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dgemma"))


@pytest.fixture(scope="module")
def models(checkpoint):
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(
        checkpoint, dtype=torch.float64, experts_implementation="eager").eval()
    return ref, load_model(checkpoint, dtype="float64")


def _ref_cache(ref):
    return DynamicCache(config=ref.config.get_text_config(decoder=True))


def test_config_reads_the_text_model(checkpoint):
    cfg = read_config(checkpoint)
    g = cfg.gemma
    assert g.sliding == (True, False, True, False)
    assert (g.full_head_dim, g.full_kv_heads, g.sliding_window) == (16, 1, 6)
    assert (g.canvas_length, g.logit_softcap) == (CANVAS, 30.0)
    assert cfg.moe.activation == "gelu_tanh" and cfg.moe.score == "softmax"
    # KV bytes count each layer's own shape.
    per_layer = [2 * 8, 1 * 16, 2 * 8, 1 * 16]
    assert cfg.kv_bytes_per_token(8) == 2 * 8 * sum(per_layer)


@pytest.mark.parametrize("self_conditioning", [False, True])
def test_forward_equals_transformers(models, self_conditioning):
    """Prompt of 9 (past the window of 6), a finished canvas encoded, then a canvas decoded."""
    ref, ours = models
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (9,), generator=g)
    first = torch.randint(0, VOCAB, (CANVAS,), generator=g)
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=g)
    sc = torch.randn(CANVAS, VOCAB, generator=g, dtype=torch.float64) if self_conditioning \
        else None
    cache = _ref_cache(ref)
    with torch.no_grad():
        ref.model.encoder(input_ids=prompt[None], cache=cache)
        ref.model.encoder(input_ids=first[None], cache=cache,
                          position_ids=torch.arange(9, 9 + CANVAS)[None])
        out = ref.model(cache=cache, decoder_input_ids=canvas[None],
                        self_conditioning_logits=None if sc is None else sc[None])
        ref_hidden = out.last_hidden_state[0]
        ref_logits = ref.lm_head(out.last_hidden_state).float()
        ref_logits = (torch.tanh(ref_logits / 30.0) * 30.0)[0]
    kv = DenseKV(ours)
    ours.encode(prompt, kv)
    ours.encode(first, kv)
    soft = None if sc is None else ours.soft_embeddings(sc)
    h = ours.decode_hidden(canvas, kv, soft)
    torch.testing.assert_close(h, ref_hidden, atol=1e-10, rtol=1e-10)
    logits = ours.decode(canvas, kv, soft)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors need TRITON_INTERPRET=1")
def test_triton_kernels_give_the_reference_forward(models):
    """The worker's Triton row (softmax routing, GeGLU fused experts) against the torch one."""
    _, ours = models
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (7,), generator=g)
    canvas = torch.randint(0, VOCAB, (CANVAS,), generator=g)
    logits = {}
    for name in ("torch", "triton"):
        kv = DenseKV(ours)
        ours.encode(prompt, kv, kernels=kernel_table(name))
        logits[name] = ours.decode(canvas, kv, kernels=kernel_table(name))
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-6, rtol=0)


class _Noise:
    """Patches transformers' sampler to draw Sangam's noise for one request (batch 1):
    ``initialize_canvas`` (the canvas's first draw, then each step's renoise) and
    ``torch.multinomial`` (each step's sample), counting canvases, steps and draws."""

    def __init__(self, seed):
        self.seed, self.canvas, self.step, self.draw = seed, -1, 0, 0

    def install(self, monkeypatch):
        mixin = dg.DiffusionGemmaGenerationMixin
        prepare = mixin._prepare_denoiser_inputs

        def prepare_denoiser_inputs(model, *args, **kwargs):
            self.canvas, self.step, self.draw = self.canvas + 1, 0, 0
            return prepare(model, *args, **kwargs)

        def initialize_canvas(sampler, batch_size, device):
            assert batch_size == 1
            draw = uniform_tokens(self.seed, self.canvas, self.draw,
                                  torch.arange(sampler.canvas_length), sampler.vocab_size)
            self.draw += 1
            return draw[None].to(device)

        def multinomial(probs, num_samples):
            keys = torch.from_numpy(step_keys(self.seed, self.canvas, self.step,
                                              torch.arange(probs.shape[0]).numpy()))
            self.step += 1
            return categorical(probs, keys)[:, None]

        monkeypatch.setattr(mixin, "_prepare_denoiser_inputs", prepare_denoiser_inputs)
        monkeypatch.setattr(dg.EntropyBoundSampler, "initialize_canvas", initialize_canvas)
        monkeypatch.setattr(dg.torch, "multinomial", multinomial)


def _reference_generate(ref, prompt, params, seed, max_tokens, eos, monkeypatch):
    with monkeypatch.context() as mp:
        _Noise(seed).install(mp)
        adaptive = params.confidence_threshold > 0
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens,
            max_denoising_steps=params.max_denoising_steps,
            sampler_config=dg.EntropyBoundSamplerConfig(entropy_bound=params.entropy_bound),
            t_min=params.t_min, t_max=params.t_max,
            stability_threshold=params.stability_threshold if adaptive else None,
            confidence_threshold=params.confidence_threshold if adaptive else None,
            eos_token_id=eos, pad_token_id=-1)
    tokens = out.sequences[0, len(prompt):].tolist()
    if -1 in tokens:
        tokens = tokens[:tokens.index(-1)]
    return tokens[:max_tokens]


CASES = [  # (entropy_bound, steps, t_min, t_max, stability, confidence)
    (0.1, 6, 0.4, 0.8, 1, 0.005),
    (2.0, 5, 0.3, 0.9, 1, 5.0),  # always confident (ln 96 < 5): stops once the argmax holds
    (2.0, 5, 0.3, 0.9, 0, 5.0),  # no stability wanted: every canvas stops after one step
    (0.5, 4, 0.4, 0.8, 2, 0.0),  # adaptive stopping off: every canvas runs its 4 steps
]


@pytest.mark.parametrize("case", CASES)
def test_generation_equals_transformers(models, monkeypatch, case):
    ref, ours = models
    bound, steps, t_min, t_max, stable, conf = case
    params = UniformStateParams(steps, bound, t_min, t_max, stable, conf)
    for seed, prompt in [(7, [5, 9, 11, 3]), (123, list(range(2, 13)))]:
        got = generate_canvases(ours, prompt, params, seed, max_tokens=3 * CANVAS)
        want = _reference_generate(ref, prompt, params, seed, 3 * CANVAS, None, monkeypatch)
        assert got.tokens == want
        assert got.finish_reason == "length" and len(got.forwards) == 3
        if conf == 0.0:
            assert got.forwards == [steps] * 3
        if stable == 0:
            assert got.forwards == [1] * 3


def test_generation_stops_at_a_stop_id(models, monkeypatch):
    """A token of the second canvas made the stop id: both end there, the stop id kept."""
    ref, ours = models
    params = UniformStateParams(5, 0.3, 0.4, 0.8, 1, 0.005)
    prompt = [4, 8, 15, 16, 23, 42]
    free = generate_canvases(ours, prompt, params, 3, max_tokens=3 * CANVAS)
    stop = free.tokens[CANVAS + 3]
    cut = free.tokens.index(stop) + 1
    got = generate_canvases(ours, prompt, params, 3, 3 * CANVAS, stop_ids=[stop])
    assert got.tokens == free.tokens[:cut] and got.finish_reason == "stop"
    assert got.tokens == _reference_generate(ref, prompt, params, 3, 3 * CANVAS, stop,
                                             monkeypatch)


def test_noise_is_a_function_of_its_arguments():
    pos = torch.arange(64)
    a = uniform_tokens(1, 0, 0, pos, 1000)
    assert torch.equal(a, uniform_tokens(1, 0, 0, pos, 1000))
    assert ((0 <= a) & (a < 1000)).all() and len(set(a.tolist())) > 50
    for other in (uniform_tokens(2, 0, 0, pos, 1000), uniform_tokens(1, 1, 0, pos, 1000),
                  uniform_tokens(1, 0, 1, pos, 1000)):
        assert not torch.equal(a, other)
    # A position's draw does not depend on which other positions are drawn with it.
    assert torch.equal(uniform_tokens(1, 0, 0, pos[10:20], 1000), a[10:20])


def test_categorical_follows_the_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0]]).repeat(4000, 1)
    keys = torch.from_numpy(step_keys(5, 0, 0, torch.arange(4000).numpy()))
    counts = torch.bincount(categorical(probs, keys), minlength=4).double() / 4000
    torch.testing.assert_close(counts, torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64),
                               atol=0.03, rtol=0)


@pytest.mark.parametrize("bad,match", [
    (dict(max_denoising_steps=0), "max_denoising_steps"),
    (dict(entropy_bound=0.0), "entropy_bound"),
    (dict(t_min=0.9, t_max=0.5), "t_min"),
    (dict(stability_threshold=-1), "stability_threshold"),
    (dict(confidence_threshold=float("nan")), "confidence_threshold"),
    (dict(max_denoising_steps=True), "max_denoising_steps"),
])
def test_params_are_bounded(bad, match):
    with pytest.raises(ValueError, match=match):
        UniformStateParams(**bad)


def test_vision_tower_is_not_loaded(checkpoint, models):
    _, ours = models
    assert not any("vision" in k for k in ours.state_dict())


def test_a_masked_option_as_a_flag_is_refused_at_start_up(checkpoint):
    from sangam import LLM

    with pytest.raises(CheckpointError, match="block_length"):
        LLM(model=str(checkpoint), dtype="float64", block_length=32)


def test_options_of_the_other_family_are_refused(checkpoint, tmp_path):
    """A masked option on a uniform-state request, a uniform option on a masked one: each
    refused with a message, never ignored."""
    from sangam import LLM, SamplingParams
    from sangam.testing import make_tiny_checkpoint

    llm = LLM(model=str(checkpoint), dtype="float64")
    ids = [{"prompt_token_ids": [3, 4, 5]}]
    for bad, name in [(dict(threshold=0.5), "threshold"), (dict(temperature=1.0), "temperature"),
                      (dict(block_length=8), "block_length"), (dict(logprobs=1), "logprobs")]:
        with pytest.raises(ValueError, match=name):
            llm.generate(ids, SamplingParams(max_tokens=8, **bad))
    with pytest.raises(ValueError, match="t_min"):
        llm.generate(ids, SamplingParams(max_tokens=8, t_min=0.9, t_max=0.5))
    masked = LLM(model=str(make_tiny_checkpoint(tmp_path / "llada")), dtype="float64")
    with pytest.raises(ValueError, match="entropy_bound apply to uniform-state"):
        masked.generate(ids, SamplingParams(max_tokens=8, entropy_bound=0.5))


@pytest.mark.parametrize("edit,match", [
    (dict(use_bidirectional_attention="all"), "bidirectional"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_activation="relu"), "hidden_activation"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                           "full_attention": {"rope_type": "proportional",
                                              "rope_theta": 1e6}}), "rope_parameters"),
])
def test_unsupported_configs_are_refused(checkpoint, tmp_path, edit, match):
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["text_config"].update(edit)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=match):
        read_config(tmp_path)
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["tie_word_embeddings"] = False  # untied encoder, decoder and head: not what we load
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        read_config(tmp_path)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_forward_equals_the_dense_passes(models, backend):
    """Two packed forwards over paged K/V (two page shapes), as the engine runs them: first a
    prompt with its first canvas step (A) beside two prompt prefills (B, C); then B's
    finished canvas encoded in the same forward as its next canvas's first step, beside a
    plain canvas step of C. Every canvas row equals the dense passes'."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    from sangam.models.attention import AttentionMetadata, PagedKV
    from sangam.models.diffusion_gemma import CanvasRows, canvas_key_bounds

    _, ours = models
    cfg = ours.config
    ours.attention_backend = kernel_table(backend).attention()
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g)  # noqa: E731
    pa, pb, pc = rand(9), rand(5), rand(7)
    ca, fb, cb, cc = rand(CANVAS), rand(CANVAS), rand(CANVAS), rand(CANVAS)
    soft_b, soft_c = (torch.randn(CANVAS, 32, generator=g, dtype=torch.float64)
                      for _ in range(2))
    page = 4
    kv = PagedKV.for_model(cfg, 32, page, torch.float64, "cpu")
    assert len(kv.buffers) == 2
    tables = [list(range(0, 6)), list(range(10, 16)), list(range(20, 26))]  # A, B, C

    def forward(spans):  # (request, start, tokens, canvas [s, e) or None, soft)
        ids = torch.cat([t for _, _, t, _, _ in spans])
        pos = np.concatenate([np.arange(a, a + len(t)) for _, a, t, _, _ in spans])
        starts, ends, rows, softs, at = [], [], [], [], 0
        for _, a, t, c, soft in spans:
            s, e = c or (0, 0)
            dec = (np.arange(a, a + len(t)) >= s) & (e > 0)
            starts.append(np.where(dec, s, 0))
            ends.append(np.where(dec, e, 0))
            rows += (at + np.flatnonzero(dec)).tolist()
            if c:
                softs.append(torch.zeros(CANVAS, 32, dtype=torch.float64) if soft is None
                             else soft)
            at += len(t)
        lo, hi, win = canvas_key_bounds(pos, np.concatenate(starts), np.concatenate(ends),
                                        cfg.gemma.sliding_window)
        slots = [tables[r][p // page] * page + p % page
                 for r, a, t, _, _ in spans for p in range(a, a + len(t))]
        cu = np.cumsum([0] + [len(t) for _, _, t, _, _ in spans])
        kv_lens = [a + len(t) for _, a, t, _, _ in spans]
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
            block_tables=torch.tensor([tables[r] for r, *_ in spans], dtype=torch.int32),
            slot_mapping=torch.tensor(slots), query_lens=np.diff(cu).tolist(),
            kv_lens_host=kv_lens, key_lo=torch.from_numpy(lo), key_hi=torch.from_numpy(hi),
            window_lo=torch.from_numpy(win))
        canvas = CanvasRows(torch.tensor(rows, dtype=torch.int64), torch.cat(softs))
        h = ours.hidden_states(ids, torch.from_numpy(pos), meta, kv, canvas)
        return ours.logits(h, canvas.rows).split(CANVAS)

    got_a, = forward([(0, 0, torch.cat([pa, ca]), (9, 9 + CANVAS), None),
                      (1, 0, pb, None, None), (2, 0, pc, None, None)])
    got_b, got_c = forward([(1, 5, torch.cat([fb, cb]), (5 + CANVAS, 5 + 2 * CANVAS), soft_b),
                            (2, 7, cc, (7, 7 + CANVAS), soft_c)])

    def dense(prompt, canvas, soft, *finished):
        cache = DenseKV(ours)
        for chunk in (prompt, *finished):
            ours.encode(chunk, cache)
        return ours.decode(canvas, cache, soft)

    ours.attention_backend = None
    for got, want in [(got_a, dense(pa, ca, None)), (got_b, dense(pb, cb, soft_b, fb)),
                      (got_c, dense(pc, cc, soft_c))]:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_the_engine_equals_the_reference_decoder(checkpoint, models, backend):
    """The engine over 12 requests batched with staggered arrivals (a step per arrival),
    several canvases each, adaptive stopping on and off, stop ids, prompts longer than a
    prefill chunk: each request's tokens equal generate_canvases' (and so transformers'), with
    the reference kernels and with the Triton ones."""
    from sangam import LLM, SamplingParams

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    _, ours = models
    llm = LLM(model=str(checkpoint), dtype="float64", page_size=4, token_budget=24,
              max_batch_size=8, attention_backend=backend)
    g = torch.Generator().manual_seed(9)
    cases = []
    for i in range(12):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(3, 30, (1,), generator=g)),),
                               generator=g).tolist()
        params = SamplingParams(max_tokens=[8, 17, 24][i % 3], seed=100 + i,
                                max_denoising_steps=[4, 6][i % 2],
                                entropy_bound=[0.1, 1.0, 3.0][i % 3],
                                confidence_threshold=[0.005, 0.0, 5.0][i % 3],
                                stability_threshold=i % 2, stop_token_ids=[7 + i % 5],
                                stop_at_eos=False)
        cases.append((prompt, params))
    engine, outs = llm.engine, {}

    def step():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)

    for i, (prompt, params) in enumerate(cases):
        engine.add_request(str(i), prompt, params)
        step()
    while engine.has_unfinished_requests():
        step()
    reasons = set()
    for i, (prompt, params) in enumerate(cases):
        want = generate_canvases(ours, prompt, UniformStateParams(**params.uniform_given()),
                                 params.seed, params.max_tokens, params.stop_token_ids)
        got = outs[str(i)].outputs[0]
        # The engine's token_ids end before the stop id (Sangam's outputs), transformers' with it.
        assert got.token_ids == want.tokens[:len(want.tokens) - (want.finish_reason == "stop")], i
        assert got.finish_reason == want.finish_reason, i
        # Its canvases count as committed once finished; its forwards are the oracle's.
        out = outs[str(i)]
        assert out.num_forwards - (out.metrics["num_refreshes"] - 1) == sum(want.forwards), i
        assert out.metrics["tokens_per_forward"] == len(want.forwards) * CANVAS / out.num_forwards
        reasons.add(want.finish_reason)
    assert reasons == {"stop", "length"}
    # They shared forwards: fewer iterations than their steps one by one.
    assert len(engine.stats.iterations) < sum(o.num_forwards for o in outs.values())


def test_prefix_caching_of_the_encoder(checkpoint, models):
    """The causal encoder's K/V of a prompt and of finished canvases is cached by whole pages
    (on by default): a second request with the same prompt, and a next turn holding the first
    one's prompt and first canvas, start from cached pages, with the reference's tokens."""
    from sangam import LLM, SamplingParams

    _, ours = models
    llm = LLM(model=str(checkpoint), dtype="float64", page_size=4)
    assert llm.engine.prefix_caching
    prompt = list(range(3, 33))  # 30 tokens: 7 whole pages
    params = SamplingParams(max_tokens=3 * CANVAS, seed=5, max_denoising_steps=3,
                            confidence_threshold=0.0, stop_at_eos=False)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert first.num_cached_tokens == 0
    turn = prompt + first.token_ids[:CANVAS] + [7, 8, 9]
    outs = llm.generate(prompt_token_ids=[prompt, turn],
                        sampling_params=[dataclasses.replace(params, seed=6)] * 2)
    assert outs[0].num_cached_tokens == 28
    assert outs[1].num_cached_tokens == (30 + CANVAS) // 4 * 4
    for p, out in zip([prompt, turn], outs):
        want = generate_canvases(ours, p, UniformStateParams(3, confidence_threshold=0.0), 6,
                                 3 * CANVAS)
        assert out.token_ids == want.tokens


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """The tiny checkpoint with a Gemma-layout tokenizer and chat template (<pad> 0, <eos> 1,
    <bos> 2, <start_of_turn>/<end_of_turn>) and a generation_config.json of its own."""
    from sangam.demo.tokenizer import GEMMA_VOCAB, write_tokenizer

    path = write_checkpoint(tmp_path_factory.mktemp("dgemma-chat"), seed=3,
                            vocab_size=len(GEMMA_VOCAB))
    write_tokenizer(path, layout="gemma")
    (path / "generation_config.json").write_text(json.dumps({
        "max_denoising_steps": 5, "sampler_config": {"entropy_bound": 0.5,
                                                     "_cls_name": "EntropyBoundSamplerConfig"},
        "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
        "eos_token_id": [1, GEMMA_VOCAB.index("<end_of_turn>")]}))
    return path


def test_chat_through_the_openai_client(chat_checkpoint, tmp_path):
    """The server answers the official client: /tokenize of chat messages equals the
    tokenizer's apply_chat_template; a chat completion and its stream (one chunk per canvas;
    with drafts, a provisional canvas per step between) equal LLM.chat's, with the
    checkpoint's denoising defaults and a request's own."""
    import httpx
    import openai

    from sangam import LLM, SamplingParams
    from tests.test_serve_openai import serve_subprocess

    llm = LLM(str(chat_checkpoint), dtype="float64")
    assert llm.loaded.uniform_defaults() == dict(max_denoising_steps=5, entropy_bound=0.5,
                                                 t_min=0.4, t_max=0.8, stability_threshold=1,
                                                 confidence_threshold=0.005)
    from sangam.demo.tokenizer import GEMMA_VOCAB

    assert GEMMA_VOCAB.index("<end_of_turn>") in llm.loaded.stop_ids
    messages = [{"role": "user", "content": "What is 2+2?"}]
    args = ["--model", str(chat_checkpoint), "--device", "cpu", "--dtype", "float64",
            "--served-model-name", "dg", "--num-pages", "256"]
    with serve_subprocess(args, tmp_path / "server.log") as (_, base):
        ids = httpx.post(f"{base}/tokenize", json={"messages": messages, "model": "dg"}).json()
        want_ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"]
        assert ids["tokens"] == list(want_ids)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for extra in ({}, {"entropy_bound": 2.0, "max_denoising_steps": 3}):
            res = client.chat.completions.create(model="dg", messages=messages, max_tokens=20,
                                                 seed=4, extra_body=extra)
            ref = llm.chat(messages, SamplingParams(max_tokens=20, seed=4, **extra))[0]
            assert res.choices[0].message.content == ref.text
            assert res.usage.completion_tokens == len(ref.token_ids)
            chunks = list(client.chat.completions.create(
                model="dg", messages=messages, max_tokens=20, seed=4, stream=True,
                extra_body=extra))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == ref.text
            drafted = list(client.chat.completions.create(
                model="dg", messages=messages, max_tokens=20, seed=4, stream=True,
                stream_options={"include_drafts": True}, extra_body=extra))
            assert "".join(c.choices[0].delta.content or "" for c in drafted) == ref.text
            drafts = [c.choices[0].model_extra["draft"] for c in drafted
                      if c.choices[0].model_extra.get("draft") is not None]
            # A draft per step that leaves its canvas open: each canvas's last step ends it.
            assert len(drafts) == ref.num_forwards - ref.metrics["num_blocks"] > 0
        with pytest.raises(openai.BadRequestError, match="threshold"):
            client.chat.completions.create(model="dg", messages=messages,
                                           extra_body={"threshold": 0.5})
        image = [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
        with pytest.raises(openai.BadRequestError, match="no vision or audio tower"):
            client.chat.completions.create(model="dg", messages=image)
        with pytest.raises(openai.BadRequestError, match="no vision or audio tower"):
            client.responses.create(model="dg", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])


# ----------------------------------------------------------------------------- every mode

GEMMA_LAYOUTS = {
    "colocated-2": dict(num_workers=2),
    **BLOCK_CAUSAL_LAYOUTS,  # 1P2D, 2P1D with layer-wise streaming, hybrid: SDAR's
    # Tensor parallelism: heads split (the full layers' one KV head replicated), the MLPs by
    # width; expert parallelism: the experts split.
    "tp2": dict(tensor_parallel_size=2),
    "ep2-1P1D": dict(tensor_parallel_size=2, enable_expert_parallel=True,
                     mode="disaggregated", prefill_workers=1, decode_workers=1),
}


@pytest.fixture(scope="module")
def gemma_workload(models):
    """12 requests, several canvases each, adaptive stopping on and off, two long prompts;
    what the reference decoder gives each."""
    _, ours = models
    from sangam import SamplingParams

    g = torch.Generator().manual_seed(11)
    reqs = []
    for i in range(12):
        n = 40 + i if i < 2 else int(torch.randint(3, 20, (1,), generator=g))
        prompt = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        reqs.append((f"r{i}", prompt, SamplingParams(
            max_tokens=[8, 17, 24][i % 3], seed=200 + i, max_denoising_steps=[3, 5][i % 2],
            entropy_bound=[0.2, 2.0][i % 2], confidence_threshold=[0.0, 5.0][i % 2],
            stability_threshold=1, stop_token_ids=[9 + i % 4], stop_at_eos=False)))
    return reqs, reference_tokens(ours, reqs)


@pytest.mark.parametrize("layout,kill", [(layout, None) for layout in sorted(GEMMA_LAYOUTS)]
                         + [("1P2D", 2), ("hybrid-1P2C", 0), ("colocated-2", 1)])
def test_every_mode_equals_the_reference_decoder(checkpoint, gemma_workload, layout, kill):
    """Worker processes (colocated, disaggregated with layer-wise streaming or not, hybrid):
    each request's tokens equal the reference decoder's, its canvas and its K/V crossing
    processes (the K/V once: a finished canvas's K/V is exact, as a block-causal block's);
    with a worker SIGKILLed mid-run, the requests it held restart their canvas elsewhere and
    end with the same tokens (its noise is a function of the canvas and step)."""
    reqs, want = gemma_workload
    run = run_in_mode(str(checkpoint), reqs, GEMMA_LAYOUTS[layout], kill)
    outs = run["outs"]
    assert {r: o.token_ids for r, o in outs.items()} == want
    assert run["dead"] == ([] if kill is None else [kill])
    if GEMMA_LAYOUTS[layout].get("mode") and kill is None:
        assert max(o.metrics["kv_transfers"] for o in outs.values()) == 1
