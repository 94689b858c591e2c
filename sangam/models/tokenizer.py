"""Tokenizer loading: the checkpoint's own files, or none (prompts must then be token ids)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# <|role_end|>: the end of a turn in LLaDA-MoE's and LLaDA2's chat format
# (<role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>); <end_of_turn>: Gemma's.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<|role_end|>",
                      "<end_of_turn>")


def load_tokenizer(path: str | os.PathLike, required: bool = False):
    """``transformers.AutoTokenizer`` from the directory, or None when it has no tokenizer
    (an error if ``required``: a tokenizer directory the user named)."""
    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        if required:
            raise ValueError(f"no tokenizer in {str(path)!r}: none of {TOKENIZER_FILES}")
        return None
    from transformers import AutoTokenizer

    # AutoTokenizer reads config.json as a transformers model config and warns that the model
    # type (llada, dream) is not one it knows; Sangam never builds a transformers model.
    config_log = logging.getLogger("transformers.configuration_utils")
    config_log.addFilter(_not_a_transformers_model)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # e.g. a tokenizer class defined by remote code
        if not (path / "tokenizer.json").is_file():
            raise
        logger.warning("AutoTokenizer failed (%s); loading tokenizer.json directly", e)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    finally:
        config_log.removeFilter(_not_a_transformers_model)


def load_chat_template(template: str) -> str:
    """A chat template given as a Jinja file's path or as the template itself (vLLM's
    ``--chat-template``), syntax-checked now rather than at the first chat request."""
    try:
        is_file = Path(template).is_file()
    except (OSError, ValueError):  # a template's text can be no path at all (too long, NUL)
        is_file = False
    if is_file:
        text = Path(template).read_text()
    elif "{{" in template or "{%" in template:
        text = template
    else:
        raise ValueError(f"chat template {template!r}: no such file, and no Jinja template")
    import jinja2  # transformers renders chat templates with it

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {template!r}: line {e.lineno}: {e.message}") from None
    return text


def _not_a_transformers_model(record: logging.LogRecord) -> bool:
    return "to instantiate a model of type" not in record.getMessage()


def stop_token_ids(eos_token_id: int, tokenizer) -> frozenset[int]:
    """EOS from config.json plus the tokenizer's EOS and end-of-turn tokens, if any."""
    ids = {eos_token_id}
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return frozenset(ids)
