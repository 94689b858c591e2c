"""A request's prompts as token ids, and token ids as text: the checkpoint's tokenizer and the
served chat template, run on the tokenizer thread (``Offloader``). A request that needs a
tokenizer the model lacks, or token ids beyond its vocabulary, is a 400."""

from __future__ import annotations

from typing import Any

from sangam.engine.loaded_model import LoadedModel
from sangam.serve.errors import ApiError
from sangam.serve.offload import Offloader
from sangam.serve.protocol import ChatMessage, ChatTemplateOptions, ChatTool, FunctionDefinition


class Prompts:
    def __init__(self, loaded: LoadedModel, chat_template: str | None, offload: Offloader):
        self.loaded = loaded
        self.chat_template = chat_template  # the --chat-template text; None: the tokenizer's
        self.offload = offload

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    def tokenizer(self, what: str) -> Any:
        """The tokenizer, which ``what`` needs: a 400 without one."""
        if self.loaded.text.tokenizer is None:
            raise ApiError(400, f"this model has no tokenizer, so {what} cannot be served; "
                           "send /v1/completions a prompt of token ids")
        return self.loaded.text.tokenizer

    def completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]
                           ) -> list[str | list[int]]:
        """A completion body's prompt as a list of prompts (texts or token ids)."""
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(
            prompt[0], int) else [prompt]
        for p in prompts:
            if isinstance(p, str):
                self.tokenizer("text prompts")
            elif any(t >= self.vocab_size for t in p):  # before anything decodes them (echo)
                raise ApiError(400, f"prompt token ids must be in [0, {self.vocab_size}); got "
                               f"{[t for t in p if t >= self.vocab_size][:5]}", param="prompt")
        return prompts

    async def ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return await self.offload.run(self.loaded.text.encode, prompt, add_special_tokens)
        return prompt

    async def suffix_ids(self, suffix: str | None) -> list[int]:
        """The token ids of an infilling ``suffix`` (OpenAI's field), without special tokens."""
        if not suffix:
            return []
        self.tokenizer("a suffix")
        return await self.offload.run(self.loaded.text.encode, suffix, False)

    async def text(self, prompt: str | list[int]) -> str:
        """A prompt's text, for echo: as given, or its token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        self.tokenizer("echo of token prompts")
        return await self.offload.run(self.loaded.text.decode, prompt) or ""

    async def chat_ids(self, messages: list[ChatMessage], options: ChatTemplateOptions
                       ) -> list[int]:
        """A conversation's token ids, through the chat template."""
        self.tokenizer("chat (it needs a chat template)")
        return await self.offload.run(self._render_chat, messages, options)

    def _render_chat(self, messages: list[ChatMessage], options: ChatTemplateOptions
                     ) -> list[int]:
        try:
            return self.loaded.text.encode_chat(
                [m.for_template() for m in messages], self.chat_template,
                options.add_generation_prompt, options.continue_final_message,
                options.chat_template_kwargs, options.tool_dicts())
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None

    def template_shows_tools(self) -> bool:
        """Whether the chat template renders a conversation differently with a tool (LLaDA's,
        for one, does not). Without a tokenizer or template there is nothing to warn about."""
        probe = ChatTemplateOptions(tools=[ChatTool(type="function", function=FunctionDefinition(
            name="probe_tool", description="Sangam's startup check"))])
        try:
            plain = self._render_chat([ChatMessage(role="user", content="hi")],
                                      ChatTemplateOptions())
            with_tool = self._render_chat([ChatMessage(role="user", content="hi")], probe)
        except ApiError:
            return True
        return plain != with_tool

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (``token_id:N`` without a tokenizer, as vLLM)."""
        tokenizer = self.loaded.text.tokenizer
        if tokenizer is None:
            return [f"token_id:{t}" for t in token_ids]
        return [tokenizer.decode([t]) for t in token_ids]
