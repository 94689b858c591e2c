"""A checkpoint's text codec: prompts and conversations to token ids, token ids to text,
through the checkpoint's tokenizer (which a checkpoint may lack: then only token ids serve)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TextCodec:
    tokenizer: object | None  # a Hugging Face tokenizer; None: the checkpoint has none

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: pass prompt_token_ids instead "
                             "of text prompts")
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template (or
        ``chat_template``, a Jinja template's text). As in vLLM: ``add_generation_prompt`` opens
        the assistant's turn; ``continue_final_message`` leaves the last message open, for the
        model to continue; ``chat_template_kwargs`` are extra variables of the template;
        ``tools`` (OpenAI's function definitions) are the template's ``tools``. A missing
        tokenizer or template, or a conversation the template rejects, is a ValueError."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so it cannot chat: pass "
                             "prompt_token_ids instead")
        if not messages:
            raise ValueError("the conversation (messages) is empty")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be "
                             "true: a reply either opens a new turn or continues the last one")
        extra = dict(chat_template_kwargs or {})
        # The template's variables only: never the tokenizer call's own options.
        reserved = set(inspect.signature(self.tokenizer.apply_chat_template).parameters)
        clash = sorted(k for k in extra if k in reserved or not k.isidentifier())
        if clash:
            raise ValueError(f"chat_template_kwargs cannot set {clash}")
        if continue_final_message:  # only then: transformers < 4.45 does not know the option
            extra["continue_final_message"] = True
        import jinja2  # transformers renders chat templates with it; only chat needs it

        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                tools=tools, tokenize=False, **extra)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise ValueError(f"cannot apply the chat template: {e}") from None
        # The template already wrote the special tokens (BOS...): do not add them again.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
