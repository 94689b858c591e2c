"""Incremental detokenization gives the whole decode's text at every step, for byte-level BPE
(LLaMA-3 / Qwen2 style, with and without transformers' clean-up of spaces), SentencePiece-style
(Metaspace, and LLaMA-2's byte fallback) and the demo's character tokenizers, on random
token sequences (invalid UTF-8 and special tokens included), while decoding only new tokens."""

from __future__ import annotations

import functools
import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sangam.decoding.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from sangam.demo.tokenizer import write_tokenizer
from sangam.models import load_tokenizer

CORPUS = [
    "Sangam serves diffusion language models: संगम means confluence.",
    "Blocks of 32 positions, committed together. 拡散モデル 🙂🚀 naïve café — ok?",
    "def f(x):\n    return x * 2  # doubled\n\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ∑∫√ ½ ⅓ 😀👍🏽",
] * 4
SPECIALS = ["<|endoftext|>", "<|eot_id|>"]


def _trained(pre_tokenizer, decoder, alphabet=(), clean_up=False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    # A small vocabulary leaves multi-byte characters split over several tokens.
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=list(alphabet)))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0],
                                   additional_special_tokens=SPECIALS[1:],
                                   clean_up_tokenization_spaces=clean_up)


def _byte_fallback() -> PreTrainedTokenizerFast:
    """LLaMA-2 style: SentencePiece pieces, unknown characters as <0xNN> byte tokens, and a
    decoder that fuses the bytes and strips the text's first space."""
    trained = _trained(pre_tokenizers.Metaspace(), decoders.Metaspace())._tokenizer
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0],
                                   additional_special_tokens=SPECIALS[1:])


@pytest.fixture(scope="module", params=["byte_level", "byte_level_clean_up", "metaspace",
                                        "byte_fallback", "demo"])
def tokenizer(request, tmp_path_factory):
    if request.param.startswith("byte_level"):
        # With clean-up, transformers drops the space before punctuation (" ." -> "."): a new
        # token may change the text before it.
        return _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                        pre_tokenizers.ByteLevel.alphabet(), request.param.endswith("clean_up"))
    if request.param == "metaspace":
        return _trained(pre_tokenizers.Metaspace(), decoders.Metaspace())
    if request.param == "byte_fallback":
        return _byte_fallback()
    path = tmp_path_factory.mktemp("demo_tok")
    write_tokenizer(path)
    return load_tokenizer(path)


class Counting:
    """A Decode that records how many tokens each call decodes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def __call__(self, ids: list[int], skip: bool) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_each_step_gives_the_whole_decode(tokenizer, data):
    vocab = len(tokenizer)
    skip = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12),
                                max_size=12))
    decode = Counting(tokenizer)
    detok = functools.partial(IncrementalDetokenizer(skip), decode)
    ids: list[int] = []
    for chunk in chunks:
        ids = ids + chunk
        assert detok(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert detok(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)  # again
        # Other calls are decoded whole and leave the state alone.
        assert detok(ids[:-1], skip) == tokenizer.decode(ids[:-1], skip_special_tokens=skip)
        assert detok(ids, not skip) == tokenizer.decode(ids, skip_special_tokens=not skip)


def test_a_growing_text_decodes_only_its_new_tokens(tokenizer):
    ids = tokenizer(" ".join(CORPUS), add_special_tokens=False)["input_ids"][:640]
    decode = Counting(tokenizer)
    detok = functools.partial(IncrementalDetokenizer(True), decode)
    for end in range(32, len(ids) + 1, 32):
        if end == 320:  # pickled, as it travels with a request's state between workers
            detok = functools.partial(pickle.loads(pickle.dumps(detok.func)), decode)
        assert detok(ids[:end], True) == tokenizer.decode(ids[:end], skip_special_tokens=True)
    # One block and its context per step, but for a character split across blocks (whose
    # decoding waits for its last byte); the whole-text decode would be 6,720 tokens here.
    assert sum(decode.lengths) < 2 * (len(ids) + 2 * CONTEXT_TOKENS * len(ids) // 32)
    assert max(decode.lengths) < 3 * 32


def test_a_different_sequence_is_decoded_whole(tokenizer):
    ids = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    other = tokenizer("a lazy dog indeed", add_special_tokens=False)["input_ids"]
    detok = functools.partial(IncrementalDetokenizer(True), Counting(tokenizer))
    assert detok(ids, True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok(other, True) == tokenizer.decode(other, skip_special_tokens=True)
    assert detok(ids + other, True) == tokenizer.decode(ids + other, skip_special_tokens=True)


def test_without_a_tokenizer_there_is_no_text():
    detok = functools.partial(IncrementalDetokenizer(True), lambda ids, skip: None)
    assert detok([], True) is None and detok([1, 2], True) is None and detok([1, 2], True) is None


def test_special_tokens_before_a_block_are_no_context(tokenizer):
    """Skipped special tokens decode to nothing: the context reaches back to a word, or a
    SentencePiece decoder would take the next word for the first and strip its space."""
    words = tokenizer(" the quick brown fox", add_special_tokens=False)["input_ids"]
    eot = tokenizer.convert_tokens_to_ids(SPECIALS[1])
    ids = words + [eot] * (3 * CONTEXT_TOKENS) + words
    for skip in (True, False):
        detok = functools.partial(IncrementalDetokenizer(skip), Counting(tokenizer))
        cut = len(words) + 3 * CONTEXT_TOKENS
        assert detok(ids[:cut], skip) == tokenizer.decode(ids[:cut], skip_special_tokens=skip)
        assert detok(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
