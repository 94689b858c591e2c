"""Stop strings and stop token ids: where a response ends, what its text shows, what streams
send, and that stopping early frees the request's pages (float64, CPU)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from sangam import LLM, EngineConfig, SamplingParams
from sangam.decoding.detokenizer import CONTEXT_TOKENS
from sangam.decoding.state import DecodeState
from sangam.demo.tokenizer import START_HEADER, TOKEN_ID, VOCAB_SIZE, write_tokenizer
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.stop_strings import apply_stop_strings, find_stop, response_text
from sangam.testing import make_tiny_checkpoint

PROMPTS = ["hello", "abc", "Reverse: sangam", "x"]
BASE = dict(max_tokens=24, block_length=4, stop_at_eos=False, seed=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("stop")
    make_tiny_checkpoint(path, arch="llada", seed=4, vocab_size=VOCAB_SIZE)
    write_tokenizer(path)  # the demo's character-level tokenizer
    return str(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    llm = LLM(ckpt, device="cpu", dtype="float64", page_size=4, num_pages=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(llm):
    """The outputs without any stop, greedy and sampled."""
    return {temp: llm.generate(PROMPTS, SamplingParams(temperature=temp, **BASE))
            for temp in (0.0, 1.0)}


def _late_stop(text: str, block_chars: int) -> str:
    """A 2-character string that first occurs after the first ``block_chars`` characters."""
    for i in range(block_chars, len(text) - 1):
        s = text[i:i + 2]
        if text.find(s) == i:
            return s
    raise AssertionError(f"no late stop string in {text!r}")


def _expected(llm, ref, stop, min_tokens=0, include=False):
    """Brute force: the response ends at the first token whose prefix's text holds a stop
    string ending beyond the text of the first ``min_tokens`` tokens; the text is cut before
    the earliest such string (after it, with ``include``)."""
    decode = llm.engine.loaded.text.decode
    floor = len(decode(ref.token_ids[:min_tokens]))
    for n in range(1, len(ref.token_ids) + 1):
        text = decode(ref.token_ids[:n])
        found = [(i, i + len(s)) for s in stop for i in range(len(text))
                 if text.startswith(s, i) and i + len(s) > floor]
        if found:
            begin, end = min(found)
            return ref.token_ids[:n], text[:end if include else begin]
    return ref.token_ids, ref.text


def _chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def _text(params: SamplingParams, shown: str, finished: bool) -> str:
    """``response_text`` over a decoder of one character per token."""
    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(map(chr, ids))

    return response_text(_chars(shown), params, finished, decode)


def test_response_text():
    assert response_text([1], SamplingParams(stop="x"), True, lambda ids, skip: None) is None
    assert _text(SamplingParams(), "abc", False) == "abc"
    assert _text(SamplingParams(stop=("Question:", "\n")), "ab\nQuestion: c", True) == "ab"
    # Running: a tail that could begin a stop string waits for the next block.
    assert _text(SamplingParams(stop="Question:"), "answer Ques", False) == "answer "
    assert _text(SamplingParams(stop="Question:"), "answer Ques", True) == "answer Ques"
    assert _text(SamplingParams(stop=("Xb", "bX")), "aXb", False) == "a"
    assert _text(SamplingParams(stop=("abc", "zabd")), "xyzab", False) == "xy"  # longer wins
    assert _text(SamplingParams(stop="aaaaab"), "aaaa", False) == ""
    # include_stop_str_in_output: cut after the string, and nothing held back meanwhile.
    shown = SamplingParams(stop=("Question:", "\n"), include_stop_str_in_output=True)
    assert _text(shown, "ab\nQuestion: c", True) == "ab\n"
    assert _text(shown, "answer Ques", False) == "answer Ques"
    # min_tokens: a stop string ending within the first min_tokens tokens' text is no stop.
    late = SamplingParams(stop="e", min_tokens=7, max_tokens=64)  # past " is Lee"
    assert _text(late, " is Lee, and I'm a student", True) == " is Lee, and I'm a stud"
    assert _text(SamplingParams(stop="ee", min_tokens=6, max_tokens=64), " is Lee!", True) \
        == " is L"  # it ends beyond " is Le", though it begins within


def test_find_stop():
    assert find_stop("abcabc", ("c", "ab")) == (0, 2)
    assert find_stop("abcabc", ("c", "ab"), start=2) == (2, 3)
    assert find_stop("abcabc", ("bc",), start=2) == (1, 3)  # ends beyond the first 2
    assert find_stop("abcabc", ("bc",), start=3) == (4, 6)
    assert find_stop("abc", ("x",)) is None


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_stop_strings_end_the_response(llm, reference, temp):
    refs = reference[temp]
    stops = [(_late_stop(r.text, 6),) for r in refs[:3]] + [("\u2603", "never")]
    params = [SamplingParams(temperature=temp, stop=s, **BASE) for s in stops]
    outs = llm.generate(PROMPTS, params)
    for ref, out, stop in zip(refs, outs, stops):
        tokens, text = _expected(llm, ref, stop)
        assert (out.token_ids, out.text) == (tokens, text), (ref.text, stop)
        if len(tokens) < len(ref.token_ids):
            assert (out.finish_reason, out.stop_reason) == ("stop", stop[0])
            assert out.num_forwards < ref.num_forwards  # later blocks were never decoded
        else:  # a stop string that never occurs changes nothing
            assert (out.finish_reason, out.num_forwards) == (ref.finish_reason, ref.num_forwards)
            assert out.stop_reason is None
    assert llm.engine.pool.allocator.num_free == llm.engine.pool.num_pages


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_min_tokens_and_include_stop_str_in_output(llm, reference, temp):
    """vLLM's rules: a stop string within the first min_tokens tokens' text does not count,
    and include_stop_str_in_output keeps the stop string in the text."""
    refs = reference[temp]
    cases = [(ref, (ref.text[1],), min_tokens, include) for ref in refs[:3]
             for min_tokens in (0, 4, 9) for include in (False, True)]
    params = [SamplingParams(temperature=temp, stop=stop, min_tokens=min_tokens,
                             include_stop_str_in_output=include, **BASE)
              for _, stop, min_tokens, include in cases]
    outs = llm.generate([PROMPTS[refs.index(ref)] for ref, *_ in cases], params)
    for (ref, stop, min_tokens, include), out in zip(cases, outs):
        want = _expected(llm, ref, stop, min_tokens, include)
        assert (out.token_ids, out.text) == want, (ref.text, stop, min_tokens, include)
    assert len({len(out.token_ids) for out in outs}) > 2  # min_tokens moved the stops
    assert llm.engine.pool.allocator.num_free == llm.engine.pool.num_pages


def test_skip_special_tokens(llm):
    """The text shows special tokens with skip_special_tokens=False, as vLLM."""
    special = TOKEN_ID[START_HEADER]
    outs = llm.generate(PROMPTS[:1] * 2, [
        SamplingParams(logit_bias={special: 100}, skip_special_tokens=skip, **BASE)
        for skip in (True, False)])
    assert outs[0].token_ids == outs[1].token_ids == [special] * BASE["max_tokens"]
    assert (outs[0].text, outs[1].text) == ("", START_HEADER * BASE["max_tokens"])


def test_each_block_decodes_only_its_own_tokens(llm, monkeypatch):
    """The engine's stop-string search and the outputs' text decode each block once (with a
    few tokens of context), not the whole response at every block, and give the same text."""
    tokenizer = llm.engine.loaded.text.tokenizer
    lengths = []

    def counting_decode(ids, **kw):
        lengths.append(len(ids))
        return type(tokenizer).decode(tokenizer, ids, **kw)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    params = SamplingParams(**{**BASE, "max_tokens": 64}, stop="\u00e9")  # not in the vocab
    llm.engine.add_request("blocks", llm.engine.loaded.text.encode(PROMPTS[2]), params)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    texts = [o.text for o in outs]
    whole = [type(tokenizer).decode(tokenizer, o.token_ids, skip_special_tokens=True)
             for o in outs]
    assert len(outs) == 16 and texts == whole
    # Per block, twice (search and text): the context (6 tokens) alone, then with the block
    # (4). Whole decodes would be 2 * (4 + 8 + ... + 64) = 1,088 tokens.
    assert sum(lengths) <= 2 * 16 * (4 + 2 * CONTEXT_TOKENS), lengths


def test_the_searched_text_travels_with_the_state(llm):
    """Between workers a request's state is pickled at each block: its searched text goes with
    it, so each block is still decoded once, and the stop is found where a whole search says."""
    loaded = llm.engine.loaded
    lengths = []

    def counting_decode(ids, skip):
        lengths.append(len(ids))
        return loaded.text.decode(ids, skip)

    text = "the quick brown fox jumps over the lazy dog; " * 3
    params = SamplingParams(max_tokens=128, block_length=8, stop="dog; the q")
    state = DecodeState(loaded.text.encode("x"), params, loaded.config.mask_token_id, frozenset(),
                        False)
    found = []
    while not state.finished:
        state = pickle.loads(pickle.dumps(state))  # to another worker and back
        s, e = state.cursor.block_bounds()
        p = state.cursor.prompt_len
        state.tokens[s:e] = loaded.text.encode(text[s - p:e - p],
                                          add_special_tokens=False)
        state.cursor.block += 1
        found.append(apply_stop_strings(state, counting_decode))
    end = text.index(params.stop[0]) + len(params.stop[0])  # 50, in the seventh block
    assert found == [False] * 6 + [True]
    assert state.output_token_ids() == loaded.text.encode(text[:end], add_special_tokens=False)
    assert sum(lengths) < 7 * (8 + 2 * CONTEXT_TOKENS) + 3 * 56  # blocks, and the bisection


def test_stop_token_ids_end_the_response_without_stop_at_eos(llm, reference):
    ref = reference[0.0][0]
    tok = ref.token_ids[9]  # in the third block
    first = ref.token_ids.index(tok)
    out = llm.generate(PROMPTS[:1], SamplingParams(stop_token_ids=[tok], **BASE))[0]
    assert out.token_ids == ref.token_ids[:first] and out.finish_reason == "stop"
    assert out.stop_reason == tok  # vLLM's: the stop token id (None for EOS)


def test_streamed_text_never_shows_part_of_a_stop_string(ckpt, reference):
    ref = reference[0.0][2]
    stop = (_late_stop(ref.text, 6),)
    engine = AsyncEngine(EngineConfig(model=ckpt, device="cpu", dtype="float64", page_size=4,
                                      num_pages=256))

    async def stream():
        params = SamplingParams(stop=stop, **BASE)
        return [o async for o in engine.generate(PROMPTS[2], params, "s")]

    try:
        outs = asyncio.run(stream())
    finally:
        engine.shutdown()
    texts = [o.text for o in outs]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts  # only ever grows
    assert not any(stop[0] in t for t in texts)
    assert texts[-1] == ref.text[:ref.text.index(stop[0])]


def test_multi_worker_stops_like_one_worker(ckpt, llm, reference):
    """Stop strings are found on the workers; logprobs travel with the state."""
    refs = reference[0.0]
    params = [SamplingParams(stop=(_late_stop(r.text, 6),), logprobs=0, **BASE)
              for r in refs[:3]]
    want = llm.generate(PROMPTS[:3], params)
    workers = LLM(ckpt, device="cpu", dtype="float64", page_size=4, num_pages=256,
                  mode="disaggregated", prefill_workers=1, decode_workers=1)
    try:
        got = workers.generate(PROMPTS[:3], params)
    finally:
        workers.shutdown()
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason, g.num_forwards) == \
            (w.token_ids, w.text, w.finish_reason, w.stop_reason, w.num_forwards)
        assert g.logprobs == pytest.approx(w.logprobs, rel=1e-12)
        assert len(g.logprobs) == len(g.token_ids)


def test_bad_stops_are_rejected(llada_path):
    for bad in (dict(stop=""), dict(stop=[1]), dict(stop=5), dict(stop_token_ids=[-1]),
                dict(stop_token_ids="7"), dict(stop="x" * 1025), dict(stop=["x"] * 65),
                dict(include_stop_str_in_output=1)):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()
    no_tokenizer = LLM(llada_path, device="cpu", dtype="float64")
    with pytest.raises(ValueError, match="tokenizer"):
        no_tokenizer.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(stop="x"))
    no_tokenizer.shutdown()
