"""The demo model's character-level tokenizer, in Hugging Face layout.

One token per character of printable ASCII (plus newline), a handful of LLaDA-style special
tokens and a LLaDA-like chat template. ``write_tokenizer(dir)`` writes ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` so that
``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)`` loads it; decoding
ids gives back the characters exactly (no spaces are added between tokens). Characters outside
the alphabet encode to ``<|unk|>``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
UNK = "<|unk|>"
MASK = "<|mdm_mask|>"

# Ids 0..5 are special, then the characters; the mask token is the last id (as in tiny_config).
SPECIALS_BEFORE_CHARS = (BOS, EOS, START_HEADER, END_HEADER, EOT, UNK)
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB: tuple[str, ...] = (*SPECIALS_BEFORE_CHARS, *CHARS, MASK)
VOCAB_SIZE = len(VOCAB)
TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}
BOS_ID, EOS_ID, EOT_ID, MASK_ID = TOKEN_ID[BOS], TOKEN_ID[EOS], TOKEN_ID[EOT], TOKEN_ID[MASK]
SPECIAL_TOKENS = (*SPECIALS_BEFORE_CHARS, MASK)

# LLaDA-8B-Instruct's template: BOS, then each turn as header + content + <|eot_id|>; with
# add_generation_prompt, the assistant header the response follows.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


# The Gemma layout (DiffusionGemma's demo): Gemma's special ids (<pad> 0, <eos> 1, <bos> 2) and
# turns as <start_of_turn>role ... <end_of_turn>, the assistant's role named "model".
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", UNK, "<start_of_turn>", "<end_of_turn>")
GEMMA_VOCAB: tuple[str, ...] = (*GEMMA_SPECIALS, *CHARS)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def chat_prompt(user_message: str) -> str:
    """The text ``apply_chat_template`` renders for one user turn plus the assistant header."""
    return (f"{BOS}{START_HEADER}user{END_HEADER}\n\n{user_message.strip()}{EOT}"
            f"{START_HEADER}assistant{END_HEADER}\n\n")


def build_tokenizer(layout: str = "llada") -> Tokenizer:
    """The ``tokenizers`` object: each character one token, special tokens matched whole;
    ``layout`` "gemma": Gemma's special tokens and ids instead of LLaDA's."""
    vocab, specials = (GEMMA_VOCAB, GEMMA_SPECIALS) if layout == "gemma" else \
        (VOCAB, SPECIAL_TOKENS)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    return tok


@functools.cache
def _shared_tokenizer() -> Tokenizer:
    return build_tokenizer()


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (special tokens written out as text are recognised)."""
    return _shared_tokenizer().encode(text, add_special_tokens=False).ids


def write_tokenizer(path: str | os.PathLike, layout: str = "llada") -> None:
    """Write the tokenizer files into directory ``path`` (created if needed); ``layout``:
    "llada" or "gemma" (``build_tokenizer``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(layout).save(str(path / "tokenizer.json"))
    gemma = layout == "gemma"
    special = ({"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": UNK,
                "pad_token": "<pad>"} if gemma else
               {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": EOS,
                "mask_token": MASK})
    turns = ["<start_of_turn>", "<end_of_turn>"] if gemma else [START_HEADER, END_HEADER, EOT]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": turns,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "padding_side": "left",
        "chat_template": GEMMA_CHAT_TEMPLATE if gemma else CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {**special, "additional_special_tokens": turns}
    (path / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
