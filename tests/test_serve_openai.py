"""The HTTP server through the official ``openai`` client: completions, chat, streaming, the
diffusion options as extra body fields, and exact agreement with ``LLM`` (float64, CPU)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import ssl
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tokenizers import processors

from sangam import LLM, EngineConfig, SamplingParams
from sangam.demo.tokenizer import (
    BOS,
    TOKEN_ID,
    VOCAB_SIZE,
    build_tokenizer,
    encode,
    write_tokenizer,
)
from sangam.engine.async_engine import AsyncEngine
from sangam.serve import ServerConfig, build_app
from sangam.serve.server import add_cli_args, run, uvicorn_server
from sangam.testing import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"
# Server defaults the tests rely on (requests that leave these out get them).
DEFAULTS = dict(block_length=4, max_tokens=16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_subprocess(args: list[str], log: Path, entry: tuple[str, ...] = ("-m", "sangam.serve")
                     ) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python ENTRY ARGS`` (``-m sangam.serve`` by default) on a free loopback port, once
    /health answers."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny model: threads only add overhead
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *entry, "--port", str(port), *args], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs") / "server.log"


@pytest.fixture(scope="module")
def server(chat_ckpt, server_log) -> str:
    args = ["--model", chat_ckpt, "--device", "cpu", "--dtype", "float64",
            "--served-model-name", MODEL, "--block-length", str(DEFAULTS["block_length"]),
            "--max-tokens-default", str(DEFAULTS["max_tokens"]), "--num-pages", "1024",
            "--log-stats-interval", "1", "--enable-log-requests"]
    with serve_subprocess(args, server_log) as (_, base):
        yield base


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # The server process competes for the same cores; OpenMP threads that spin-wait under
    # oversubscription slow every in-process forward a hundredfold.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def llm(chat_ckpt) -> LLM:
    return LLM(chat_ckpt, device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="dummy", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="dummy", max_retries=0)


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{**DEFAULTS, **kw})


def test_tokenize_and_detokenize(server, llm):
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize."""
    tok = llm.tokenizer
    r = httpx.post(f"{server}/tokenize", json={"prompt": "Hello there"}).json()
    assert r == {"count": len(r["tokens"]), "max_model_len": llm.loaded.context_length,
                 "tokens": tok("Hello there")["input_ids"]}
    bare = httpx.post(f"{server}/tokenize", json={"prompt": "Hello there",
                                                   "add_special_tokens": False}).json()
    assert bare["tokens"] == tok("Hello there", add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = httpx.post(f"{server}/tokenize", json={"messages": messages, "model": MODEL}).json()
    assert r["tokens"] == _chat_ids(llm, messages)
    r = httpx.post(f"{server}/detokenize", json={"tokens": bare["tokens"]})
    assert r.json() == {"prompt": "Hello there"}
    for path, body, status in (
            ("/tokenize", {}, 400), ("/tokenize", {"prompt": "a", "messages": messages}, 400),
            ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404),
            ("/detokenize", {"tokens": [VOCAB_SIZE]}, 400), ("/detokenize", {"tokens": "a"}, 400)):
        r = httpx.post(f"{server}{path}", json=body)
        assert r.status_code == status and r.json()["error"]["message"], (path, body, r.text)
    from sangam import __version__
    assert httpx.get(f"{server}/version").json() == {"version": __version__}


def test_completion_matches_llm(client, llm):
    opts = dict(block_length=4, unmasking="factor", factor=1.0, cache="prefix", stop_at_eos=False)
    res = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=10, seed=5,
                                    temperature=0.0, extra_body=opts)
    ref = llm.generate(["Hello there"], _params(max_tokens=10, seed=5, **opts))[0]
    choice = res.choices[0]
    assert choice.text == ref.text
    assert choice.token_ids == ref.token_ids
    assert choice.finish_reason == "length"
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == len(ref.token_ids) == 10
    assert res.usage.total_tokens == res.usage.prompt_tokens + 10
    assert res.usage.num_forwards == ref.num_forwards


def test_server_defaults_apply(client, llm):
    res = client.completions.create(model=MODEL, prompt="abc", extra_body={"stop_at_eos": False})
    ref = llm.generate(["abc"], _params(stop_at_eos=False))[0]
    assert res.choices[0].token_ids == ref.token_ids
    assert res.usage.completion_tokens == DEFAULTS["max_tokens"]


def test_load_adaptive_requests_report_their_block_thresholds(client):
    """min_threshold is opt-in; a response that set it says which threshold each block used
    (a stream: each chunk, its block's), and one that did not has none."""
    extra = {"stop_at_eos": False, "min_threshold": 0.4, "block_length": 4}
    res = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, extra_body=extra)
    thresholds = res.choices[0].model_extra["block_thresholds"]
    assert len(thresholds) == 3 and all(0.4 <= t <= 0.9 for t in thresholds)  # 0.9: default
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, extra_body=extra,
                                          messages=[{"role": "user", "content": "hi"}])
    assert len(chat.choices[0].model_extra["block_thresholds"]) == 2
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=8,
                                   extra_body=extra)
    assert len(resp.model_extra["block_thresholds"]) == 2
    done = [e for e in client.responses.create(model=MODEL, input="hi", max_output_tokens=8,
                                               stream=True, extra_body=extra)
            if e.type == "response.incomplete"]  # it runs to max_output_tokens
    assert len(done[0].response.model_extra["block_thresholds"]) == 2
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=12,
                                            stream=True, extra_body=extra))
    assert [len(c.choices[0].model_extra["block_thresholds"]) for c in chunks] == [1, 1, 1]
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    assert plain.choices[0].model_extra["block_thresholds"] is None
    with pytest.raises(openai.BadRequestError, match="min_threshold"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"min_threshold": 0.99})


def test_top_p_top_k_and_min_p(client, llm):
    """OpenAI's top_p and vLLM's top_k and min_p reach the sampler: the same tokens as LLM's."""
    opts = dict(temperature=1.5, seed=3, top_p=0.4)
    res = client.completions.create(model=MODEL, prompt="nucleus", max_tokens=12, **opts,
                                    extra_body={"top_k": 3, "min_p": 0.1, "stop_at_eos": False})
    ref = llm.generate(["nucleus"], _params(max_tokens=12, top_k=3, min_p=0.1, stop_at_eos=False,
                                            **opts))[0]
    assert res.choices[0].token_ids == ref.token_ids
    free = llm.generate(["nucleus"], _params(max_tokens=12, stop_at_eos=False, temperature=1.5,
                                             seed=3))[0]
    assert free.token_ids != ref.token_ids  # and they do restrict the samples


def test_logit_bias(client, llm):
    ids = llm.tokenizer("aeiou", add_special_tokens=False)["input_ids"]
    bias = {str(t): 100.0 for t in ids}  # JSON keys are strings
    res = client.completions.create(model=MODEL, prompt="vowels", max_tokens=8, logit_bias=bias,
                                    extra_body={"stop_at_eos": False})
    ref = llm.generate(["vowels"], _params(max_tokens=8, stop_at_eos=False,
                                           logit_bias={t: 100.0 for t in ids}))[0]
    assert res.choices[0].token_ids == ref.token_ids
    assert set(ref.token_ids) <= set(ids)  # the largest bias wins every position
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"a": 1.0})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"99999": 1.0})


def test_penalties_and_min_tokens(client, llm):
    """OpenAI's penalties and vLLM's repetition_penalty / min_tokens reach the sampler."""
    prompt, opts = "MRebhOmMKhzfxhcMbm", dict(temperature=1.5, seed=1)  # meets EOS early
    plain = llm.generate([prompt], _params(**opts))[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 14
    extra = dict(repetition_penalty=1.3, min_tokens=14)
    res = client.completions.create(model=MODEL, prompt=prompt, **opts, frequency_penalty=0.5,
                                    presence_penalty=0.25, extra_body=extra)
    ref = llm.generate([prompt], _params(frequency_penalty=0.5, presence_penalty=0.25,
                                         **extra, **opts))[0]
    assert res.choices[0].token_ids == ref.token_ids
    assert len(ref.token_ids) >= 14


def test_ignore_eos_is_the_inverse_of_stop_at_eos(client, llm):
    """vLLM's spelling, which its benchmark client sends. This prompt and seed meet EOS."""
    prompt, opts = "MRebhOmMKhzfxhcMbm", dict(temperature=1.5, seed=1)
    for ignore in (True, False):
        ref = llm.generate([prompt], _params(stop_at_eos=not ignore, **opts))[0]
        res = client.completions.create(model=MODEL, prompt=prompt, **opts,
                                        extra_body={"ignore_eos": ignore})
        assert res.choices[0].token_ids == ref.token_ids
        assert len(ref.token_ids) == (DEFAULTS["max_tokens"] if ignore else 11)
        assert res.choices[0].finish_reason == ("length" if ignore else "stop")
        assert res.choices[0].stop_reason is None  # EOS, as vLLM: no stop string or token


def test_batched_prompts(client, llm):
    prompts = ["first prompt", "second"]
    res = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, seed=1)
    refs = llm.generate(prompts, _params(max_tokens=6, seed=1))
    assert [c.index for c in res.choices] == [0, 1]
    assert [c.token_ids for c in res.choices] == [r.token_ids for r in refs]
    assert res.usage.completion_tokens == sum(len(r.token_ids) for r in refs)


def test_echo(client, llm):
    """echo: each choice's text begins with its prompt's, given as text or as token ids; a
    stream sends it in the choice's first chunk."""
    ids = llm.tokenizer("tokens", add_special_tokens=False)["input_ids"]
    prompts, texts = ["first", "second"], ["first", llm.tokenizer.decode(ids)]
    refs = llm.generate(prompts, _params(max_tokens=6, seed=1, stop_at_eos=False))
    opts = dict(model=MODEL, max_tokens=6, seed=1, n=2, echo=True,
                extra_body={"stop_at_eos": False})
    res = client.completions.create(prompt=prompts, **opts)
    assert [c.text for c in res.choices][::2] == [p + r.text for p, r in zip(prompts, refs)]
    assert [c.token_ids for c in res.choices][::2] == [r.token_ids for r in refs]
    assert res.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    by_ids = client.completions.create(prompt=ids, **opts)
    assert all(c.text.startswith(texts[1]) for c in by_ids.choices)
    chunks = list(client.completions.create(prompt=prompts, stream=True, **opts))
    for i in range(4):
        mine = [c.choices[0].text for c in chunks if c.choices[0].index == i]
        assert mine[0].startswith(prompts[i // 2]) and "".join(mine) == res.choices[i].text


def test_suffix_infills(client, llm):
    """OpenAI's suffix: the response fills the gap between prompt and suffix, as LLM's
    {"prompt", "suffix"} prompts do; streamed alike."""
    opts = dict(max_tokens=8, stop_at_eos=False)
    ref = llm.generate([{"prompt": "Once upon", "suffix": " happily ever after."}],
                       _params(**opts))[0]
    plain = llm.generate(["Once upon"], _params(**opts))[0]
    assert ref.token_ids != plain.token_ids  # the model reads the suffix
    res = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8,
                                    suffix=" happily ever after.",
                                    extra_body={"stop_at_eos": False})
    assert (res.choices[0].token_ids, res.choices[0].text) == (ref.token_ids, ref.text)
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8,
                                            suffix=" happily ever after.", stream=True,
                                            extra_body={"stop_at_eos": False}))
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_truncate_prompt_tokens(client, llm):
    """vLLM's truncate_prompt_tokens: only the prompt's last k tokens are read (and counted);
    its priority changes no token."""
    ids = llm.tokenizer("a longer prompt", add_special_tokens=False)["input_ids"]
    ref = llm.generate(prompt_token_ids=[ids[-4:]], sampling_params=_params(max_tokens=6))[0]
    res = client.completions.create(model=MODEL, prompt=ids, max_tokens=6,
                                    extra_body={"truncate_prompt_tokens": 4, "priority": -5})
    assert res.choices[0].token_ids == ref.token_ids and res.usage.prompt_tokens == 4


def test_batched_streaming(client, llm):
    prompts = ["one", "two two"]
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"stop_at_eos": False, "block_length": 2})
    chunks = list(stream)
    refs = llm.generate(prompts, _params(max_tokens=6, block_length=2, stop_at_eos=False))
    for i, ref in enumerate(refs):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert len(mine) == 3
        assert "".join(c.text for c in mine) == ref.text
        assert [t for c in mine for t in c.token_ids] == ref.token_ids
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: each chunk carries its choice's usage so far.
    stream = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"stop_at_eos": False, "block_length": 2})
    chunks = list(stream)
    for i, ref in enumerate(refs):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        assert [c.usage.completion_tokens for c in mine] == [2, 4, 6]
        assert {c.usage.prompt_tokens for c in mine} == {len(ref.prompt_token_ids)}
    assert chunks[-1].usage.completion_tokens == 12  # the total, last, as without it


def _chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_matches_llm(client, llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]
    res = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=2,
                                         extra_body={"threshold": 0.5, "stop_at_eos": False})
    ids = _chat_ids(llm, messages)
    ref = llm.generate(prompt_token_ids=[ids],
                       sampling_params=_params(max_tokens=12, seed=2, threshold=0.5,
                                               stop_at_eos=False))[0]
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == ref.text
    assert res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens == len(ids)
    assert res.usage.num_forwards == ref.num_forwards
    # The offline API: one conversation, or several.
    params = _params(max_tokens=12, seed=2, threshold=0.5, stop_at_eos=False)
    assert llm.chat(messages, params)[0].token_ids == ref.token_ids
    other = [{"role": "user", "content": "Hi"}]
    both = llm.chat([messages, other], params)
    assert [o.prompt_token_ids for o in both] == [ids, _chat_ids(llm, other)]
    assert both[0].token_ids == ref.token_ids


def test_chat_streaming(client, llm):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                             {"type": "text", "text": "a story"}]}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=11, stream=True,
        stream_options={"include_usage": True}, extra_body={"block_length": 3,
                                                             "stop_at_eos": False})
    chunks = list(stream)
    ids = _chat_ids(llm, [{"role": "user", "content": "Tell me a story"}])
    ref = llm.generate(prompt_token_ids=[ids], sampling_params=_params(
        max_tokens=11, block_length=3, stop_at_eos=False))[0]
    content = [c for c in chunks if c.choices]
    assert len(content) == 4  # one chunk per committed block: ceil(11 / 3)
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in content) == ref.text
    assert [c.choices[0].finish_reason for c in content] == [None, None, None, "length"]
    assert all(c.usage is None for c in content)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11
    assert chunks[-1].usage.num_forwards == ref.num_forwards


def test_completion_streaming_blocks(client, llm):
    stream = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=10,
                                       stream=True, extra_body={"stop_at_eos": False})
    chunks = list(stream)
    ref = llm.generate(["Stream me"], _params(max_tokens=10, stop_at_eos=False))[0]
    assert [len(c.choices[0].token_ids) for c in chunks] == [4, 4, 2]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_stop_strings_match_llm(client, llm):
    """OpenAI's ``stop`` (and vLLM's ``stop_token_ids``): the same response as ``LLM``, and a
    stream that never sends part of the stop string."""
    full = llm.generate(["Stop me"], _params(max_tokens=16, stop_at_eos=False))[0]
    stop = [full.text[6:8], "\u2603"]
    params = _params(max_tokens=16, stop_at_eos=False, stop=stop)
    ref = llm.generate(["Stop me"], params)[0]
    assert ref.finish_reason == "stop" and len(ref.text) < len(full.text)
    res = client.completions.create(model=MODEL, prompt="Stop me", max_tokens=16, stop=stop,
                                    extra_body={"stop_at_eos": False})
    assert (res.choices[0].text, res.choices[0].finish_reason) == (ref.text, "stop")
    assert res.choices[0].stop_reason == ref.stop_reason == stop[0]  # vLLM's field
    assert res.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt="Stop me", max_tokens=16,
                                            stop=stop, stream=True,
                                            extra_body={"stop_at_eos": False}))
    sent = [c.choices[0].text for c in chunks]
    assert "".join(sent) == ref.text and chunks[-1].choices[0].finish_reason == "stop"
    assert [c.choices[0].stop_reason for c in chunks][-2:] == [None, stop[0]]
    tok = full.token_ids[5]
    res = client.completions.create(model=MODEL, prompt="Stop me", max_tokens=16,
                                    extra_body={"stop_at_eos": False, "stop_token_ids": [tok]})
    assert (res.choices[0].finish_reason, res.choices[0].stop_reason) == ("stop", tok)
    assert res.usage.completion_tokens == full.token_ids.index(tok)


def test_vllm_stop_and_text_options_match_llm(client, llm):
    """vLLM's include_stop_str_in_output, min_tokens (which also delays stop strings) and
    skip_special_tokens: the same text as LLM's, streamed or not."""
    full = llm.generate(["Stop me"], _params(max_tokens=16, stop_at_eos=False))[0]
    extra = {"stop_at_eos": False, "include_stop_str_in_output": True, "min_tokens": 3,
             "skip_special_tokens": False}
    stop = [full.text[5]]  # one character per token: it ends beyond min_tokens
    ref = llm.generate(["Stop me"], _params(max_tokens=16, stop=stop, **extra))[0]
    assert ref.finish_reason == "stop" and ref.text.endswith(stop[0])
    res = client.completions.create(model=MODEL, prompt="Stop me", max_tokens=16, stop=stop,
                                    extra_body=extra)
    assert (res.choices[0].text, res.choices[0].token_ids) == (ref.text, ref.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt="Stop me", max_tokens=16,
                                            stop=stop, stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_n_choices_match_llm(client, llm):
    """``n`` choices per prompt are independent requests; with a seed, choice j samples with
    seed + j. Usage counts each prompt once and every choice's tokens."""
    prompts = ["first", "second prompt"]
    res = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=3, seed=7,
                                    temperature=1.0, extra_body={"stop_at_eos": False})
    refs = llm.generate([p for p in prompts for _ in range(3)],
                        [_params(max_tokens=8, seed=7 + j, temperature=1.0, stop_at_eos=False)
                         for _ in prompts for j in range(3)])
    assert [c.index for c in res.choices] == list(range(6))
    assert [c.text for c in res.choices] == [r.text for r in refs]
    assert len({c.text for c in res.choices[:3]}) > 1  # the samples differ
    assert res.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs[::3])
    assert res.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    messages = [{"role": "user", "content": "hi"}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].delta.content
    # Greedy: both choices are the one-choice decode.
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}
    assert chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 2 * one.usage.completion_tokens


def test_logprobs_match_llm(client, llm):
    """``logprobs=0`` (completions) and ``logprobs: true`` (chat): each token's log-probability
    at the step that committed it, equal to ``LLM``'s, in OpenAI's formats."""
    ref = llm.generate(["Log me"], _params(max_tokens=10, stop_at_eos=False, logprobs=0))[0]
    res = client.completions.create(model=MODEL, prompt="Log me", max_tokens=10, logprobs=0,
                                    extra_body={"stop_at_eos": False})
    lp = res.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs, rel=1e-12)
    assert "".join(lp.tokens) == res.choices[0].text == ref.text  # one character per token
    assert lp.text_offset == list(range(len(ref.token_ids)))
    assert [list(d) for d in lp.top_logprobs] == [[t] for t in lp.tokens]
    chunks = list(client.completions.create(model=MODEL, prompt="Log me", max_tokens=10,
                                            logprobs=0, stream=True,
                                            extra_body={"stop_at_eos": False}))
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == \
        lp.token_logprobs
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt="Log me", max_tokens=10)
    assert plain.choices[0].logprobs is None

    messages = [{"role": "user", "content": "Log me"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                          logprobs=True, extra_body={"stop_at_eos": False})
    ref = llm.chat(messages, _params(max_tokens=6, stop_at_eos=False, logprobs=0))[0]
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(ref.logprobs, rel=1e-12)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.bytes == list(c.token.encode()) and c.top_logprobs == [] for c in content)


def test_top_logprobs_match_llm(client, llm):
    """``logprobs=n`` (completions) and ``top_logprobs: n`` (chat): the step's n most probable
    tokens with their log-probabilities, equal to ``LLM``'s, streamed or not."""
    opts = dict(max_tokens=10, stop_at_eos=False, temperature=1.0, seed=5)
    ref = llm.generate(["Top me"], _params(logprobs=3, **opts))[0]
    assert all(len(alt) == 3 for alt in ref.top_logprobs)
    want = [{llm.tokenizer.decode([t]): lp for t, lp in alt} for alt in ref.top_logprobs]
    body = dict(model=MODEL, prompt="Top me", logprobs=3, max_tokens=10, temperature=1.0, seed=5,
                extra_body={"stop_at_eos": False})
    lp = client.completions.create(**body).choices[0].logprobs
    for token, top, alt in zip(lp.tokens, lp.top_logprobs, want, strict=True):
        assert top.keys() == alt.keys() | {token}  # the chosen token, and the alternatives
        assert [top[t] for t in alt] == pytest.approx(list(alt.values()), rel=1e-12)
    chunks = list(client.completions.create(**body, stream=True))
    assert sum((c.choices[0].logprobs.top_logprobs for c in chunks), []) == lp.top_logprobs

    messages = [{"role": "user", "content": "Top me"}]
    ref = llm.chat(messages, _params(logprobs=2, **opts))[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True,
                                          top_logprobs=2, max_tokens=10, temperature=1.0, seed=5,
                                          extra_body={"stop_at_eos": False})
    content = chat.choices[0].logprobs.content
    for c, alt in zip(content, ref.top_logprobs, strict=True):
        assert [t.token for t in c.top_logprobs] == [llm.tokenizer.decode([t]) for t, _ in alt]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in alt])
        assert all(t.bytes == list(t.token.encode()) for t in c.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=messages, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="x", logprobs=21)


def _workload(n: int) -> list[tuple[str, dict]]:
    rng = random.Random(0)
    cadence = random.Random(1)
    rules = [dict(unmasking="threshold", threshold=0.9), dict(unmasking="threshold",
                                                                threshold=0.3),
             dict(unmasking="factor", factor=2.0), dict(unmasking="topk", tokens_per_step=2)]
    reqs = []
    for i in range(n):
        prompt = "".join(rng.choice(string.ascii_letters + " ,.")
                         for _ in range(rng.randint(1, 40)))
        opts = dict(max_tokens=rng.choice([5, 8, 13, 20]), block_length=rng.choice([2, 4, 8]),
                    cache=rng.choice(["dual", "prefix", "none"]),
                    temperature=rng.choice([0.0, 0.0, 1.5]), seed=1000 + i,
                    stop_at_eos=rng.random() < 0.5, **rng.choice(rules))
        if opts["cache"] != "none":
            opts.update(refresh_interval=cadence.choice([1, 1, 2]),
                        prompt_refresh_interval=cadence.choice([1, 2]),
                        refresh_confidence=cadence.choice([0.0, 0.5]))
        reqs.append((prompt, opts))
    return reqs


async def _stream(aclient: openai.AsyncOpenAI, prompt: str, opts: dict):
    std = {k: opts[k] for k in ("max_tokens", "temperature", "seed")}
    extra = {k: v for k, v in opts.items() if k not in std}
    stream = await aclient.completions.create(model=MODEL, prompt=prompt, stream=True,
                                              extra_body=extra, **std)
    return [chunk.choices[0] async for chunk in stream]


def test_concurrent_streams_match_llm(aclient, llm):
    reqs = _workload(20)

    async def run_all():
        return await asyncio.gather(*(_stream(aclient, p, o) for p, o in reqs))

    streamed = asyncio.run(run_all())
    refs = llm.generate([p for p, _ in reqs], [SamplingParams(**o) for _, o in reqs])
    for (_, opts), chunks, ref in zip(reqs, streamed, refs):
        assert "".join(c.text for c in chunks) == ref.text
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [
            ref.finish_reason]
        # Every chunk but the last is one whole committed block.
        assert all(len(c.token_ids) == opts["block_length"] for c in chunks[:-1])
        if not opts["stop_at_eos"]:
            assert len(chunks) == -(-opts["max_tokens"] // opts["block_length"])


def test_models(client):
    """/v1/models lists the model; /v1/models/{id} (OpenAI's retrieve) shows it, or 404s."""
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_metrics_after_traffic(server, client):
    res = client.completions.create(model=MODEL, prompt="abc", max_tokens=8,
                                    extra_body={"stop_at_eos": False})
    assert res.choices[0].finish_reason == "length"
    text = httpx.get(f"{server}/metrics").text
    for name in ("sangam_requests_waiting", "sangam_requests_seated", "sangam_deficit_tokens",
                 "sangam_iteration_tokens_bucket", "sangam_iteration_seconds_bucket",
                 "sangam_request_latency_seconds_bucket", "sangam_kv_pool_usage_ratio",
                 'sangam_requests_finished_total{finish_reason="length"}',
                 "sangam_requests_aborted_total", "sangam_time_to_first_block_seconds_count"):
        assert name in text, name
    assert "sangam_kv_pool_pages_used 0.0" in text


def test_token_metrics(chat_ckpt):
    """vLLM's prompt and generation token counters, and the parallelism each finished request
    got, match what the responses report."""
    with serve_in_thread(chat_ckpt) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        plain = client.completions.create(model=MODEL, prompt="count me", max_tokens=8,
                                          extra_body={"stop_at_eos": False})
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "and me"}], max_tokens=12,
            stream=True, stream_options={"include_usage": True},
            extra_body={"stop_at_eos": False}))
        usages = [plain.usage, chunks[-1].usage]
        values = {}
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith("sangam_") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
    assert values["sangam_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert values["sangam_generation_tokens_total"] == 8 + 12
    assert values["sangam_request_tokens_per_forward_count"] == 2
    assert values["sangam_request_tokens_per_forward_sum"] == pytest.approx(
        sum(u.completion_tokens / u.num_forwards for u in usages))


def test_stats_are_logged_periodically(server, server_log):
    """--log-stats-interval: a line of throughput, queue and KV use while there is traffic."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    deadline = time.monotonic() + 30
    while "engine: generation" not in server_log.read_text():
        assert time.monotonic() < deadline, server_log.read_text()[-2000:]
        client.completions.create(model=MODEL, prompt="keep busy", max_tokens=8)
        time.sleep(0.2)
    line = next(x for x in server_log.read_text().splitlines() if "engine: generation" in x)
    assert "prefill" in line and "decode" in line and "tok/s" in line and "KV pool" in line
    assert "in flight" in line


def test_startup_says_what_serves(server, server_log):
    """The first log line names the model, precision, context, and how many tokens the KV
    pool holds."""
    line = next(x for x in server_log.read_text().splitlines() if "serving " in x)
    assert "LLaDAModelLM from" in line and "float64 on cpu" in line
    assert "KV pool 1024 pages x 16 = 16384 tokens" in line and "policy deficit" in line


def test_requests_are_logged(client, server_log):
    """--enable-log-requests: a line when a request arrives and one when it ends."""
    res = client.completions.create(model=MODEL, prompt="log me", max_tokens=8,
                                    extra_body={"stop_at_eos": False})
    deadline = time.monotonic() + 10
    while f"Finished request {res.id}:" not in server_log.read_text():
        assert time.monotonic() < deadline, server_log.read_text()[-2000:]
        time.sleep(0.1)
    log = server_log.read_text()
    assert f"Received request {res.id}: 6 prompt tokens, SamplingParams(max_tokens=8," in log
    assert f"Finished request {res.id}: length, 8 tokens, {res.usage.num_forwards} forwards" in log


def test_stats_line_is_quiet_when_idle(dream_path):
    from sangam.serve.metrics import ServerMetrics

    engine = AsyncEngine(EngineConfig(model=dream_path, device="cpu", dtype="float64",
                                      num_pages=64))
    metrics = ServerMetrics(engine)

    async def one_request():
        params = SamplingParams(max_tokens=4, block_length=4, stop_at_eos=False)
        return [o async for o in engine.generate([5, 6, 7], params)]

    try:
        assert metrics.stats_line() is None
        asyncio.run(one_request())
        line = metrics.stats_line()
        assert line is not None and "0 in flight (0 waiting, 0 seated)" in line
        assert "decode 0.0 tok/s" not in line  # the decode rate counted the request
        assert metrics.stats_line() is None  # nothing since
    finally:
        engine.shutdown()


@contextmanager
def serve_in_thread(model: str, **server_options) -> Iterator[str]:
    """A server for ``model`` (float64, CPU) in a thread of this process; yields its URL."""
    engine = AsyncEngine(EngineConfig(model=model, device="cpu", dtype="float64",
                                      num_pages=256, block_length=4))
    config = ServerConfig(port=0, served_model_name=MODEL, log_level="warning",
                          **server_options)
    server = uvicorn_server(build_app(engine, config), config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"{'https' if config.ssl_certfile else 'http'}://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
    assert engine.dead is None


def test_profile_endpoints(chat_ckpt, server, tmp_path):
    """--profiler-dir serves vLLM's /start_profile and /stop_profile: a trace of the requests
    between them; without the flag the routes do not exist."""
    assert httpx.post(f"{server}/start_profile").status_code == 404
    with serve_in_thread(chat_ckpt, profiler_dir=str(tmp_path)) as url:
        assert httpx.post(f"{url}/stop_profile").status_code == 400
        assert httpx.post(f"{url}/start_profile").json() == {"status": "profiling"}
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 4})
        assert r.status_code == 200
        trace = Path(httpx.post(f"{url}/stop_profile").json()["trace"])
    assert trace.parent == tmp_path and "traceEvents" in trace.read_text()


def test_request_ids(chat_ckpt):
    """A request's X-Request-Id header (else vLLM's request_id field) names it: the response id,
    and with --enable-request-id-headers an X-Request-Id header back. While it runs, another
    request with the same id is refused and harms nothing."""
    with serve_in_thread(chat_ckpt, enable_request_id_headers=True) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
        assert r.json()["id"] == "cmpl-trace-7" and r.headers["x-request-id"] == "cmpl-trace-7"
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "request_id": "mine"})
        assert r.json()["id"] == "chatcmpl-mine" and r.headers["x-request-id"] == "chatcmpl-mine"
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.headers["x-request-id"] == r.json()["id"] and len(r.json()["id"]) > len("cmpl-")
        # 512 forwards (one token each): it is still running when the second request comes.
        long = {**body, "max_tokens": 512, "threshold": 1.0, "stream": True,
                "stop_at_eos": False}
        with httpx.stream("POST", f"{url}/v1/completions", json=long,
                          headers={"X-Request-Id": "dup"}) as first:
            assert first.headers["x-request-id"] == "cmpl-dup"
            lines = first.iter_lines()
            assert '"id":"cmpl-dup"' in next(line for line in lines if line)
            again = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "dup"})
            assert again.status_code == 400 and "already in use" in again.text
            finals = [line for line in lines if '"finish_reason":"length"' in line]
        assert len(finals) == 1  # the first request ran to its end
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "dup"})
        assert r.status_code == 200  # its id is free again
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "a\tb"})
        assert r.status_code == 400 and "printable" in r.text
    with serve_in_thread(chat_ckpt) as url:  # no header back by default
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "t"})
        assert r.json()["id"] == "cmpl-t" and "x-request-id" not in r.headers


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_https(chat_ckpt, tmp_path):
    """--ssl-certfile/--ssl-keyfile serve HTTPS; plain HTTP gets nothing there."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with serve_in_thread(chat_ckpt, ssl_keyfile=str(key), ssl_certfile=str(cert)) as url:
        assert url.startswith("https://")
        # Closed before the server stops: an idle TLS connection holds uvicorn's shutdown
        # until its grace period ends, waiting for the client's reply to close_notify.
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as http:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                   http_client=http)
            res = client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
            assert res.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https", "http") + "/health", timeout=1)
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is not trusted
            httpx.get(f"{url}/health", timeout=1)
    with pytest.raises(ValueError, match="ssl_keyfile needs ssl_certfile"):
        ServerConfig(ssl_keyfile=str(key))
    with pytest.raises(ValueError, match="no such file"):
        ServerConfig(ssl_certfile=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="need HTTPS"):
        ServerConfig(ssl_cert_reqs=2)


def test_cors(chat_ckpt, server):
    """--allowed-origins lets those origins' pages call the API, preflights included (answered
    before the API key is asked for, as browsers send none); by default no origin may."""
    origin = "http://ui.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert "access-control-allow-origin" not in httpx.post(
        f"{server}/v1/completions", json=body, headers={"Origin": origin}).headers
    with serve_in_thread(chat_ckpt, allowed_origins=f'["{origin}"]', api_key="k") as url:
        r = httpx.options(f"{url}/v1/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        r = httpx.post(f"{url}/v1/completions", json=body,
                       headers={"Origin": origin, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Origin": "http://evil"})
        assert r.status_code == 401 and "access-control-allow-origin" not in r.headers
    assert ServerConfig(allowed_origins="http://a, http://b").origins() == ("http://a",
                                                                           "http://b")
    assert ServerConfig(allowed_origins='["*"]').origins() == ("*",)
    for bad in ("[1]", "[oops", "a,,b"):
        with pytest.raises(ValueError, match="allowed_origins"):
            ServerConfig(allowed_origins=bad)


def test_add_special_tokens(tmp_path):
    """vLLM's add_special_tokens: a tokenizer that adds BOS does so to text prompts unless the
    request says false (its prompt already holds them), in /v1/completions and /tokenize."""
    ckpt = make_tiny_checkpoint(tmp_path / "bos", arch="llada", seed=4, vocab_size=VOCAB_SIZE)
    write_tokenizer(ckpt)
    tokenizer = build_tokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, TOKEN_ID[BOS])])
    tokenizer.save(str(Path(ckpt) / "tokenizer.json"))
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
    with serve_in_thread(str(ckpt)) as url:
        for add, want in ((True, [TOKEN_ID[BOS], *encode("abc")]), (False, encode("abc"))):
            extra = {} if add else {"add_special_tokens": False}
            res = httpx.post(f"{url}/v1/completions", json={**body, **extra}).json()
            assert res["usage"]["prompt_tokens"] == len(want)
            tokenized = httpx.post(f"{url}/tokenize", json={"prompt": "abc", **extra}).json()
            assert tokenized["tokens"] == want


# A checkpoint without a tokenizer (Dream).
@pytest.fixture(scope="module")
def tokenless_server(dream_path) -> Iterator[str]:
    with serve_in_thread(dream_path) as url:
        yield url


def test_token_id_prompt_without_tokenizer(tokenless_server, dream_path):
    client = openai.OpenAI(base_url=f"{tokenless_server}/v1", api_key="x", max_retries=0)
    prompt = [5, 17, 42, 99, 3]
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, seed=4,
                                    extra_body={"stop_at_eos": False, "cache": "dual"})
    ref = LLM(dream_path, device="cpu", dtype="float64").generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(
            max_tokens=9, block_length=4, seed=4, stop_at_eos=False))[0]
    assert res.choices[0].token_ids == ref.token_ids
    assert res.choices[0].text == ""
    assert res.usage.prompt_tokens == 5 and res.usage.completion_tokens == 9
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        client.completions.create(model=MODEL, prompt="text", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="no tokenizer, so echo"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True)
    with pytest.raises(openai.BadRequestError, match="no tokenizer, so a suffix"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, suffix="x")


# A template of our own, replacing the tokenizer's (vLLM's --chat-template).
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_template_option(chat_ckpt, llm, tmp_path):
    messages = [{"role": "user", "content": "Say hi"}]
    ids = llm.tokenizer("<user>Say hi\n<assistant>", add_special_tokens=False)["input_ids"]
    params = _params(max_tokens=8, stop_at_eos=False)
    ref = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    template_file = tmp_path / "template.jinja"
    template_file.write_text(CHAT_TEMPLATE)
    for given in (CHAT_TEMPLATE, str(template_file)):  # the template, or a file holding it
        out = llm.chat(messages, params, chat_template=given)[0]
        assert (out.prompt_token_ids, out.token_ids) == (ids, ref.token_ids)
    assert llm.chat(messages, params)[0].prompt_token_ids != ids  # the tokenizer's own
    with serve_in_thread(chat_ckpt, chat_template=str(template_file)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        res = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                             extra_body={"stop_at_eos": False})
        assert res.choices[0].message.content == ref.text
        assert res.usage.prompt_tokens == len(ids)
        tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
        assert tokenized["tokens"] == ids


def test_chat_template_options(chat_ckpt, llm, client, server):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs, in
    LLM.chat, /v1/chat/completions and /tokenize alike."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ mark }}\n"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hel"}]
    cases = [  # options, the prompt they render
        (dict(chat_template_kwargs={"mark": "!"}),
         "<user>Say hi!\n<assistant>Hel!\n<assistant>"),
        (dict(add_generation_prompt=False), "<user>Say hi\n<assistant>Hel\n"),
        (dict(add_generation_prompt=False, continue_final_message=True),
         "<user>Say hi\n<assistant>Hel")]
    params = _params(max_tokens=8, stop_at_eos=False)
    for options, rendered in cases:
        ids = llm.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        out = llm.chat(messages, params, chat_template=template, **options)[0]
        assert out.prompt_token_ids == ids, options
    # The server's template is the tokenizer's: compare with LLM.chat under it.
    options = dict(add_generation_prompt=False, continue_final_message=True)
    ref = llm.chat(messages, params, **options)[0]
    assert ref.prompt_token_ids != llm.chat(messages, params)[0].prompt_token_ids
    res = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                         extra_body={"stop_at_eos": False, **options})
    assert (res.choices[0].token_ids, res.usage.prompt_tokens) == (
        ref.token_ids, len(ref.prompt_token_ids))
    tokenized = httpx.post(f"{server}/tokenize", json={"messages": messages, **options}).json()
    assert tokenized["tokens"] == ref.prompt_token_ids
    for bad, match in ((dict(continue_final_message=True), "both"),
                       (dict(chat_template_kwargs={"tokenize": True}), "tokenize")):
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, params, **bad)
        r = httpx.post(f"{server}/v1/chat/completions",
                       json={"model": MODEL, "messages": messages, **bad})
        assert r.status_code == 400 and match in r.json()["error"]["message"]


# A template that shows the model its tools and writes past calls with their arguments as JSON
# objects, as Qwen2.5's (Dream's) does.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }}:"
    "{{ t['function']['parameters'] | tojson }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m.get('tool_call_id', '') }}{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Now, at a place",
                                            "parameters": {"type": "object"}}}
TOOL_TURNS = [  # a user's question, the call the assistant made, the tool's answer
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
# What the model "writes" in the tests that script its text.
SCRIPTED = ('Checking.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')


def script_text(patch: pytest.MonkeyPatch, skips: list[bool] | None = None) -> None:
    """Make each output's text the first len(tokens) / 16 of SCRIPTED (no tiny model writes
    tool calls), recording each request's skip_special_tokens in ``skips``."""
    def scripted(tokens, params, finished, decode):
        if skips is not None:
            skips.append(params.skip_special_tokens)
        return SCRIPTED[:len(SCRIPTED) * len(tokens) // 16]

    patch.setattr("sangam.engine.outputs.response_text", scripted)


@pytest.fixture(scope="module")
def tool_server(chat_ckpt) -> Iterator[str]:
    with serve_in_thread(chat_ckpt, chat_template=TOOL_TEMPLATE, enable_auto_tool_choice=True,
                         tool_call_parser="hermes") as url:
        yield url


def test_a_template_that_ignores_tools_is_reported(chat_ckpt, caplog):
    """--enable-auto-tool-choice with a chat template that never shows the model its tools
    (the demo's, as LLaDA's) logs a warning at startup; one that renders them does not."""
    for template, warned in ((None, True), (TOOL_TEMPLATE, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="sangam.serve.app"):
            with serve_in_thread(chat_ckpt, chat_template=template, enable_auto_tool_choice=True,
                                 tool_call_parser="hermes"):
                pass
        assert ("this chat template ignores tools" in caplog.text) == warned


def test_tool_call_arguments_that_are_not_json_reach_the_template_as_written(llm, tool_server):
    """OpenAI's models may write a call whose arguments are not JSON, and a client sends the
    history back as it is: the template gets that string (here written with ``tojson``)."""
    turns = [TOOL_TURNS[0], {**TOOL_TURNS[1], "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{x"}}]},
        TOOL_TURNS[2]]
    rendered = ('<tools>weather:{"type": "object"};\n<user>Weather in Paris?\n<assistant>'
                '<tool_call>weather "{x"</tool_call>\n<tool>c1sunny\n<assistant>')
    tokenized = httpx.post(f"{tool_server}/tokenize",
                           json={"messages": turns, "tools": [WEATHER]})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == llm.tokenizer(rendered, add_special_tokens=False)[
        "input_ids"]


def test_tools_reach_the_chat_template(llm, tool_server):
    """Tools and a conversation with tool calls render through the template as in vLLM (the
    calls' arguments as objects), in /tokenize, /v1/chat/completions and LLM.chat alike."""
    rendered = ('<tools>weather:{"type": "object"};\n<user>Weather in Paris?\n<assistant>'
                '<tool_call>weather {"city": "Paris"}</tool_call>\n<tool>c1sunny\n<assistant>')
    ids = llm.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    tokenized = httpx.post(f"{tool_server}/tokenize",
                           json={"messages": TOOL_TURNS, "tools": [WEATHER]}).json()
    assert tokenized["tokens"] == ids
    params = _params(max_tokens=8, stop_at_eos=False)
    as_objects = [{**m, "tool_calls": [{**c, "function": {"name": "weather",
                                                          "arguments": {"city": "Paris"}}}
                                       for c in m["tool_calls"]]} if "tool_calls" in m else m
                  for m in TOOL_TURNS]
    ref = llm.chat(as_objects, params, chat_template=TOOL_TEMPLATE, tools=[WEATHER])[0]
    assert ref.prompt_token_ids == ids
    client = openai.OpenAI(base_url=f"{tool_server}/v1", api_key="x", max_retries=0)
    for choice in ("none", "auto"):  # "auto": the model wrote no call, so all is content
        res = client.chat.completions.create(model=MODEL, messages=TOOL_TURNS, tools=[WEATHER],
                                             tool_choice=choice, max_tokens=8,
                                             extra_body={"stop_at_eos": False})
        assert res.usage.prompt_tokens == len(ids)
        assert res.choices[0].message.content == ref.text
        assert not res.choices[0].message.tool_calls
        assert res.choices[0].finish_reason == "length"


def test_tool_calls_in_responses(tool_server, monkeypatch):
    """With --enable-auto-tool-choice, the calls the model writes come back as OpenAI
    tool_calls, the text before them as content; streamed, they add up to the same."""
    skips = []  # each text's skip_special_tokens
    script_text(monkeypatch, skips)
    client = openai.OpenAI(base_url=f"{tool_server}/v1", api_key="x", max_retries=0)
    ask = dict(model=MODEL, messages=TOOL_TURNS[:1], tools=[WEATHER], max_tokens=16,
               extra_body={"stop_at_eos": False})
    res = client.chat.completions.create(**ask, n=2)
    # As vLLM: the parser's tags may be special tokens, so the text keeps special tokens...
    assert set(skips) == {False}
    skips.clear()
    client.chat.completions.create(**{**ask, "extra_body": {"stop_at_eos": False,
                                                            "skip_special_tokens": True}})
    assert set(skips) == {True}  # ...unless the request says otherwise
    for choice in res.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        calls = choice.message.tool_calls
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("function", "weather", {"city": "Paris"}), ("function", "time", {})]
        assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("chatcmpl-tool-")
    one = client.chat.completions.create(**ask, parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["weather"]
    plain = client.chat.completions.create(**ask, tool_choice="none")
    assert plain.choices[0].message.content == SCRIPTED
    assert not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert len(chunks) == 4  # one per block of 4 tokens
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and deltas[0].content == "Checking."
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert [d.tool_calls for d in deltas[:-1]] == [None] * 3
    last = deltas[-1].tool_calls
    assert [(c.index, c.function.name, c.function.arguments) for c in last] == [
        (k, c.function.name, c.function.arguments)
        for k, c in enumerate(res.choices[0].message.tool_calls)]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "tool_calls"]


@pytest.mark.parametrize("bad,match", [
    ("/no/such/template.jinja", "no such file"),
    ("{% for m in messages %}{{ m }}", "line 1"),  # unclosed for
])
def test_bad_chat_template_is_refused_up_front(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig(chat_template=bad)
    with pytest.raises(ValueError, match=match):
        llm.chat([{"role": "user", "content": "hi"}], chat_template=bad)


def test_every_config_field_is_a_flag():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([])
    assert EngineConfig.from_cli_args(args) == EngineConfig()
    assert ServerConfig.from_cli_args(args) == ServerConfig()
    args = parser.parse_args(["--token-budget", "512", "--api-key", "k", "--port", "9",
                              "--enable-log-requests"])
    assert EngineConfig.from_cli_args(args).token_budget == 512
    assert ServerConfig.from_cli_args(args).api_key == "k"
    assert ServerConfig.from_cli_args(args).enable_log_requests
    # vLLM's spellings, so its command lines run.
    args = parser.parse_args(["--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
                              "--tokenizer", "/tok", "--trust-remote-code"])
    config = EngineConfig.from_cli_args(args)
    assert (config.max_batch_size, config.gpu_memory_fraction, config.tokenizer) == (
        8, 0.5, "/tok")
    server = ServerConfig.from_cli_args(parser.parse_args(
        ["--disable-log-stats", "--uvicorn-log-level", "debug"]))
    assert (server.log_stats_interval, server.log_level) == (0.0, "debug")
    assert parser.parse_args(["-tp", "2"]).tensor_parallel_size == 2
    assert run(parser.parse_args(["--tensor-parallel-size", "0"])) == 2  # refused, no model
