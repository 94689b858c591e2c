"""Generation through the public API: every rule x cache mode, reference loops, stopping."""

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from sangam import LLM, SamplingParams
from sangam.decoding import DecodeState
from sangam.demo.tokenizer import write_tokenizer
from sangam.sched.block_cursor import BlockCursor

RULES = [dict(unmasking="threshold", threshold=0.9), dict(unmasking="factor", factor=1.0),
         dict(unmasking="topk", tokens_per_step=2)]
CACHES = ["dual", "prefix", "none"]
PROMPTS = [[5, 6, 7], list(range(10, 27)), [42]]


@pytest.fixture(scope="module")
def llms(llada_path, dream_path):
    return {"llada": LLM(llada_path, device="cpu", dtype="float64"),
            "dream": LLM(dream_path, device="cpu", dtype="float64")}


def _count_forwards(llm):
    model = llm.loaded.model
    calls = []
    orig = model.hidden_states  # the body of every engine forward

    def counted(*a, **k):
        calls.extend(a[2].query_lens)  # one span per request in this forward
        return orig(*a, **k)

    model.hidden_states = counted
    return calls, lambda: setattr(model, "hidden_states", orig)


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("rule", range(3))
def test_every_rule_and_cache_mode_is_deterministic(llms, arch, cache, rule):
    llm = llms[arch]
    params = SamplingParams(max_tokens=20, block_length=8, cache=cache, stop_at_eos=False,
                            **RULES[rule])
    calls, restore = _count_forwards(llm)
    try:
        a = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    finally:
        restore()
    b = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.num_forwards for o in a) == len(calls)
    mask = llm.loaded.config.mask_token_id
    for o, p in zip(a, PROMPTS):
        assert len(o.token_ids) == 20 and mask not in o.token_ids
        assert o.prompt_token_ids == p and o.text is None and o.finish_reason == "length"
        assert 3 <= o.num_forwards <= 24  # at least one refresh per block, one token per step
    # Span lengths: refreshes cover the whole canvas T = P + 24; cached steps a block or suffix.
    totals = {len(p) + 24 for p in PROMPTS}
    if cache == "none":
        assert set(calls) <= totals
    elif cache == "dual":
        assert set(calls) <= totals | {8}
        assert 8 in calls or all(o.num_forwards == 3 for o in a)


def _llada_reference_generate(model, prompt, gen_length, block_length, suffix=()):
    """LLaDA's reference generate(): steps == gen_length, low-confidence remasking, one token
    per step, a full forward every step (mask token excluded per docs/design.md §2); with a
    ``suffix`` after the masks, its infilling. Returns the tokens and the probability each had
    when it was committed."""
    mask = model.config.mask_token_id
    x = torch.tensor([prompt + [mask] * gen_length + list(suffix)])
    p0 = len(prompt)
    committed = torch.zeros(x.shape[1], dtype=torch.float64)
    for b in range(gen_length // block_length):
        s, e = p0 + b * block_length, p0 + (b + 1) * block_length
        for _ in range(block_length):
            logits = model.forward_dense(x)[0].double()
            logits[:, mask] = -torch.inf
            probs = torch.softmax(logits, dim=-1)
            x0 = probs.argmax(-1)
            conf = probs.gather(1, x0[:, None]).squeeze(1)
            masked = x[0] == mask
            conf = torch.where(masked, conf, -torch.inf)
            conf[:s] = -torch.inf
            conf[e:] = -torch.inf
            i = int(conf.argmax())
            x[0, i] = x0[i]
            committed[i] = conf[i]
    return x[0, p0:p0 + gen_length].tolist(), committed[p0:p0 + gen_length].tolist()


def test_topk_no_cache_equals_llada_reference_loop(llms):
    llm = llms["llada"]
    params = SamplingParams(max_tokens=16, block_length=8, unmasking="topk", tokens_per_step=1,
                            cache="none", stop_at_eos=False, logprobs=0)
    for prompt in PROMPTS:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        with torch.no_grad():
            ref, probs = _llada_reference_generate(llm.loaded.model, prompt, 16, 8)
        assert out.token_ids == ref
        assert out.num_forwards == 16
        # logprobs=0: each token's log-probability at the step that committed it.
        assert out.logprobs == pytest.approx(np.log(probs).tolist(), rel=1e-9)


def test_infilling_equals_llada_reference_loop(llms):
    """A suffix after the canvas (infilling): every forward attends to it, and the response is
    the canvas between prompt and suffix."""
    llm = llms["llada"]
    params = SamplingParams(max_tokens=16, block_length=8, unmasking="topk", tokens_per_step=1,
                            cache="none", stop_at_eos=False)
    suffix = [30, 31, 32, 33, 34]
    outs = llm.generate([{"prompt_token_ids": p, "suffix_token_ids": suffix} for p in PROMPTS],
                        params)
    plain = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref, _ = _llada_reference_generate(llm.loaded.model, prompt, 16, 8, suffix)
        assert (out.token_ids, out.prompt_token_ids) == (ref, prompt)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # the suffix is read


def test_dream_shift_and_first_position_rule(llms):
    """Dream: logits for p come from p - 1; the refresh also commits the block's first
    position; cached steps never touch it."""
    llm = llms["dream"]
    model = llm.loaded.model
    mask = model.config.mask_token_id
    prompt = [9, 8, 7, 6]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=8, block_length=8, unmasking="topk", tokens_per_step=1, cache="none",
        stop_at_eos=False))[0]
    x = torch.tensor([prompt + [mask] * 8])
    with torch.no_grad():
        step = 0
        while (x[0] == mask).any():
            logits = model.forward_dense(x)[0].double()
            logits = torch.cat([logits[:1], logits[:-1]])  # row p predicts p from p - 1
            logits[:, mask] = -torch.inf
            probs = torch.softmax(logits, -1)
            tok = probs.argmax(-1)
            conf = torch.where(x[0] == mask, probs.gather(1, tok[:, None]).squeeze(1), -torch.inf)
            if step == 0:  # first refresh: position s is forced, then one more by the rule
                x[0, 4] = tok[4]
                conf[4] = -torch.inf
            i = int(conf.argmax())
            x[0, i] = tok[i]
            step += 1
    assert out.token_ids == x[0, 4:].tolist()
    assert out.num_forwards == step == 7


def test_stop_at_eos_cuts_and_finishes_early():
    params = SamplingParams(max_tokens=30, block_length=8, unmasking="topk", tokens_per_step=8)
    assert BlockCursor.canvas_len(2, params.max_tokens, params.block_length) == 32
    st = DecodeState([3, 4], params, mask_token_id=99, stop_ids=frozenset({1, 2}),
                     shift_logits=False)
    plan = st.plan()
    assert (plan.span_start, plan.span_end) == (0, 34) and len(plan.positions) == 8
    st.apply(plan, np.array([10, 11, 12, 13, 14, 15, 16, 17]), np.ones(8))
    assert st.cursor.block == 1 and st.cursor.step == 0 and not st.finished
    assert st.output_token_ids() == [10, 11, 12, 13, 14, 15, 16, 17]
    plan = st.plan()
    st.apply(plan, np.array([20, 21, 2, 23, 1, 25, 26, 27]), np.ones(8))
    assert st.finished and st.finish_reason == "stop"
    assert st.output_token_ids() == [10, 11, 12, 13, 14, 15, 16, 17, 20, 21]
    assert st.num_forwards == 2


def test_no_stop_returns_whole_canvas_cut_to_max_tokens():
    params = SamplingParams(max_tokens=10, block_length=8, unmasking="topk", tokens_per_step=8,
                            stop_at_eos=False)
    st = DecodeState([3], params, 99, frozenset({1}), False)
    for b in range(2):
        st.apply(st.plan(), np.full(8, 1 + b), np.ones(8))
    assert st.finished and st.finish_reason == "length"
    assert st.output_token_ids() == [1] * 8 + [2] * 2


def test_cached_spans_per_mode():
    for cache, span in [("dual", (13, 21)), ("prefix", (13, 29)), ("none", (0, 29))]:
        st = DecodeState([1] * 5, SamplingParams(max_tokens=24, block_length=8, cache=cache),
                         99, frozenset(), False)
        st.apply(st.plan(), np.full(8, 7), np.ones(8))  # block 0 done in one step
        assert st.plan().span_start == 0  # every block starts with a refresh
        st.apply(st.plan(), np.full(8, 7), np.eye(8)[0])  # block 1: one committed
        assert (st.plan().span_start, st.plan().span_end) == span
    # Infilling: the suffix follows the canvas; refreshes and prefix spans reach it.
    for cache, span in [("dual", (13, 21)), ("prefix", (13, 32)), ("none", (0, 32))]:
        st = DecodeState([1] * 5, SamplingParams(max_tokens=24, block_length=8, cache=cache,
                                                 stop_at_eos=False),
                         99, frozenset(), False, suffix_ids=[4, 5, 6])
        assert (st.cursor.total_len, st.plan().span_end, st.suffix_ids()) == (32, 32, [4, 5, 6])
        st.apply(st.plan(), np.full(8, 7), np.ones(8))
        st.apply(st.plan(), np.full(8, 7), np.eye(8)[0])
        assert (st.plan().span_start, st.plan().span_end) == span
        while not st.finished:
            n = len(st.plan().positions)
            st.apply(st.plan(), np.full(n, 8), np.ones(n))
        assert st.output_token_ids() == [7] * 9 + [8] * 15 and st.prompt_ids() == [1] * 5


@pytest.mark.parametrize("stop_at", [4, 5])
def test_a_stop_id_beyond_max_tokens_is_no_stop(stop_at):
    """max_tokens=5 in blocks of 4: the canvas's positions 5-7 are padding, so a stop id there
    ends nothing; the response reached its length (as an autoregressive engine would)."""
    st = DecodeState([1] * 3, SamplingParams(max_tokens=5, block_length=4), 99, frozenset({9}),
                     False)
    st.apply(st.plan(), np.full(4, 7), np.ones(4))
    block = np.full(4, 7)
    block[stop_at - 4] = 9
    st.apply(st.plan(), block, np.ones(4))
    want = ("stop", [7] * 4) if stop_at == 4 else ("length", [7] * 5)
    assert (st.finished, st.finish_reason, st.output_token_ids()) == (True, *want)


def test_temperature_sampling_is_seeded(llms):
    llm = llms["llada"]
    p = dict(max_tokens=16, block_length=8, temperature=5.0, stop_at_eos=False)
    a = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(seed=1, **p))
    b = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(seed=1, **p))
    c = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(seed=2, **p))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_vllm_prompt_dicts_and_progress_bar(llms, capsys):
    """vLLM's TokensPrompt / TextPrompt dicts, and its use_tqdm."""
    llm = llms["llada"]
    params = SamplingParams(max_tokens=8, block_length=4, stop_at_eos=False)
    want = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert f"{len(PROMPTS)}/{len(PROMPTS)}" in capsys.readouterr().err
    one = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)
    assert one[0].token_ids == want[0].token_ids
    assert capsys.readouterr().err == ""  # no bar unless asked for
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate([{"prompt": "hello"}])
    for bad in ({"prompt_ids": [1]}, {"prompt": [1]}, [[1, 2]]):
        with pytest.raises(ValueError, match="a prompt is a text"):
            llm.generate([bad])


def test_an_interrupted_generate_leaves_nothing_behind(llms, monkeypatch):
    """Ctrl-C during generate (KeyboardInterrupt out of a step) aborts its requests: their
    pages come back, and the next generate returns its own outputs, in full."""
    llm = llms["llada"]
    engine = llm.engine
    params = SamplingParams(max_tokens=8, block_length=4, stop_at_eos=False)
    want = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    step, calls = engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    monkeypatch.setattr(engine, "step", step)
    assert not engine.has_unfinished_requests()
    assert engine.pool.allocator.num_used == 0
    again = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)
    assert [o.token_ids for o in again] == [want[0].token_ids]


def test_input_validation(llms):
    llm = llms["llada"]
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(ValueError, match="integers in"):
        llm.generate(prompt_token_ids=[[1, 10_000]])
    with pytest.raises(ValueError, match="beyond the model's context"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(max_tokens=5000))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hello"}])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=[SamplingParams()] * 2)
    with pytest.raises(ValueError, match="unmasking must be one of"):
        SamplingParams(unmasking="greedy")
    with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
        SamplingParams(logprobs=21)
    with pytest.raises(TypeError, match="unknown options"):
        LLM(llm.loaded.path, tau=3)


def test_vllm_engine_option_names(llada_path):
    """LLM(...) takes vLLM's names of engine options (tensor_parallel_size is a real one:
    tests/test_tensor_parallel.py)."""
    llm = LLM(llada_path, device="cpu", num_pages=64, gpu_memory_utilization=0.5,
              max_num_seqs=8, tensor_parallel_size=1)
    assert (llm.config.gpu_memory_fraction, llm.config.max_batch_size) == (0.5, 8)
    with pytest.raises(TypeError, match="max_batch_size is given twice"):
        LLM(llada_path, device="cpu", max_batch_size=8, max_num_seqs=4)
    assert llm.config.tensor_parallel_size == 1


def test_tokenizer_from_another_directory(llada_path, tmp_path):
    """--tokenizer / LLM(tokenizer=...): the tokenizer files may live elsewhere; vLLM's
    trust_remote_code is accepted (Sangam never runs checkpoint code)."""
    write_tokenizer(tmp_path / "tok")
    llm = LLM(llada_path, device="cpu", dtype="float64", tokenizer=str(tmp_path / "tok"),
              trust_remote_code=True)
    out = llm.generate(["hi"], SamplingParams(max_tokens=4, block_length=4, stop_at_eos=False))[0]
    assert out.prompt_token_ids == llm.tokenizer("hi")["input_ids"] and isinstance(out.text, str)
    assert llm.get_tokenizer() is llm.tokenizer is not None  # vLLM's name
    with pytest.raises(ValueError, match="no tokenizer in"):
        LLM(llada_path, device="cpu", tokenizer=str(tmp_path))


def test_output_text_is_made_when_read(llada_path, tmp_path):
    """The engine loop never detokenizes: each output's text is decoded when first read, once,
    so a request that is not streamed pays for its final text alone. Text, repr and pickling
    show the same text as decoding the tokens."""
    write_tokenizer(tmp_path / "tok")
    llm = LLM(llada_path, device="cpu", dtype="float64", tokenizer=str(tmp_path / "tok"))
    decoded = []
    decode = llm.tokenizer.decode

    def counted(token_ids, **kw):
        decoded.append(len(token_ids))
        return decode(token_ids, **kw)

    llm.tokenizer.decode = counted
    params = SamplingParams(max_tokens=12, block_length=4, stop_at_eos=False)
    engine = llm.engine
    engine.add_request("r", [5, 6, 7], params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 3 and decoded == []  # three blocks, no text made
    assert outs[-1].text == decode(outs[-1].token_ids, skip_special_tokens=True)
    assert outs[-1].text is outs[-1].text and decoded == [12]  # made once
    assert outs[0].text == decode(outs[0].token_ids, skip_special_tokens=True)
    again = pickle.loads(pickle.dumps(outs[1]))
    assert (again.text, again.token_ids) == (outs[1].text, outs[1].token_ids)
    assert f"text={outs[1].text!r}" in repr(outs[1])
    assert again == outs[1]


def test_max_model_len_caps_requests(llms):
    path = llms["llada"].loaded.path
    capped = LLM(path, device="cpu", dtype="float64", max_model_len=40)
    assert capped.loaded.context_length == 40
    ok = SamplingParams(max_tokens=32, block_length=8, stop_at_eos=False)
    assert len(capped.generate(prompt_token_ids=[[5] * 8], sampling_params=ok)[0].token_ids) == 32
    with pytest.raises(ValueError, match="beyond the model's context of 40"):
        capped.generate(prompt_token_ids=[[5] * 9], sampling_params=ok)
    model_context = llms["llada"].loaded.config.max_position
    with pytest.raises(ValueError, match=f"beyond the model's context of {model_context}"):
        LLM(path, device="cpu", max_model_len=model_context + 1)
    # vLLM's truncate_prompt_tokens: the last k prompt tokens, or (-1) as many as fit.
    prompt = list(range(5, 25))
    for keep, kept in ((3, prompt[-3:]), (-1, prompt[-8:]), (100, prompt)):
        params = dataclasses.replace(ok, truncate_prompt_tokens=keep)
        if kept is prompt:  # too long for the context, and kept whole
            with pytest.raises(ValueError, match="beyond the model's context of 40"):
                capped.generate(prompt_token_ids=[prompt], sampling_params=params)
            continue
        out = capped.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        assert out.prompt_token_ids == kept
        assert out.token_ids == capped.generate(prompt_token_ids=[kept],
                                                sampling_params=ok)[0].token_ids
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_checkpoint_generation_config_sets_defaults(llada_path, tmp_path):
    import json
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(llada_path, path)
    (path / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 6, "block_length": 2, "do_sample": False}))
    llm = LLM(str(path), device="cpu", dtype="float64")
    out = llm.generate(prompt_token_ids=[[5, 6]])[0]
    assert len(out.token_ids) <= 6 and out.num_forwards <= 6
    assert llm.loaded.default_params(max_tokens=9).block_length == 2
    defaults = llm.get_default_sampling_params()  # vLLM's name
    assert (defaults.max_tokens, defaults.block_length) == (6, 2)
    (path / "generation_config.json").write_text(json.dumps({"block_length": 0}))
    with pytest.raises(ValueError, match="block_length"):
        LLM(str(path), device="cpu")


def test_vllm_shaped_outputs(llms):
    """``outputs[0]`` is vLLM's CompletionOutput of the same response, so vLLM code runs."""
    llm = llms["llada"]
    params = SamplingParams(max_tokens=8, block_length=4, stop_at_eos=False, logprobs=2)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0]
    (completion,) = out.outputs
    assert (completion.index, completion.text, completion.token_ids) == (0, out.text,
                                                                         out.token_ids)
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)
    assert completion.cumulative_logprob == pytest.approx(sum(out.logprobs))
    for token, logprob, alternatives, ranked in zip(out.token_ids, out.logprobs,
                                                    out.top_logprobs, completion.logprobs):
        assert next(iter(ranked)) == token and ranked[token].logprob == logprob
        for rank, (alt, alt_logprob) in enumerate(alternatives, start=1):
            assert ranked[alt].rank == rank
            assert ranked[alt].logprob == (logprob if alt == token else alt_logprob)
        if token not in dict(alternatives):
            assert ranked[token].rank is None
    plain = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(
        max_tokens=8, block_length=4, stop_at_eos=False))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_n_samples_per_prompt(llms):
    """vLLM's SamplingParams(n=...): one output per prompt whose ``outputs`` are its n
    samples, sample j exactly a request of its own with seed + j; an engine takes n = 1."""
    llm = llms["dream"]
    sampled = SamplingParams(max_tokens=8, block_length=4, stop_at_eos=False, temperature=1.0,
                             seed=5)
    outs = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=[
        dataclasses.replace(sampled, n=3), dataclasses.replace(sampled, n=1)])
    assert len(outs) == 2 and [len(o.outputs) for o in outs] == [3, 1]
    for j, completion in enumerate(outs[0].outputs):
        alone = llm.generate(prompt_token_ids=[PROMPTS[0]],
                             sampling_params=dataclasses.replace(sampled, seed=5 + j))[0]
        assert (completion.index, completion.token_ids) == (j, alone.token_ids)
    assert outs[0].token_ids == outs[0].outputs[0].token_ids  # the output is its first sample
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # they differ
    with pytest.raises(ValueError, match="a request is one sequence"):
        llm.engine.add_request("many", PROMPTS[0], dataclasses.replace(sampled, n=2))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
