"""vLLM's ``POST /tokenize`` (a prompt, or messages through the chat template), ``POST
/detokenize`` and ``GET /tokenizer_info``. Their responses may be megabytes: serialized on the
tokenizer thread too."""

from __future__ import annotations

import json

from fastapi.responses import Response

from sangam.serve.errors import ApiError
from sangam.serve.intake import ServedModel
from sangam.serve.offload import Offloader
from sangam.serve.prompts import Prompts
from sangam.serve.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)

IDS_PER_CHUNK = 16_384  # a serializer holds the GIL for one chunk at a time, never a million ids


class ServingTokenization:
    def __init__(self, model: ServedModel, prompts: Prompts, offload: Offloader):
        self.model = model
        self.prompts = prompts
        self.offload = offload

    async def tokenize(self, body: TokenizeRequest) -> Response:
        self.model.check(body.model)
        self.prompts.tokenizer("/tokenize")
        if isinstance(body, TokenizeChatRequest):
            ids = await self.prompts.chat_ids(body.messages, body)
        else:
            ids = await self.prompts.ids(body.prompt, body.add_special_tokens)
        out = TokenizeResponse(count=len(ids), max_model_len=self.model.context_length,
                               tokens=ids)
        return Response(await self.offload.run(_tokenize_json, out),
                        media_type="application/json")

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        self.model.check(body.model)
        tokenizer = self.prompts.tokenizer("/detokenize")
        vocab = self.prompts.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}",
                           param="tokens")
        out = DetokenizeResponse(prompt=await self.offload.run(tokenizer.decode, body.tokens))
        return Response(await self.offload.run(out.model_dump_json),
                        media_type="application/json")

    def tokenizer_info(self) -> TokenizerInfoResponse:
        """vLLM's: the tokenizer's class and configuration, and the chat template served."""
        tokenizer = self.prompts.tokenizer("/tokenizer_info")
        config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if not k.endswith("_file") and k not in ("name_or_path", "tokenizer_object")}
        config = json.loads(json.dumps(config, default=str))  # added tokens and the like
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # as strings
            config[name] = getattr(tokenizer, name, None)
        template = self.prompts.chat_template or getattr(tokenizer, "chat_template", None)
        if template:
            config["chat_template"] = template
        return TokenizerInfoResponse(**{**config, "tokenizer_class": type(tokenizer).__name__})


def _tokenize_json(out: TokenizeResponse) -> str:
    """``out`` as JSON (``TokenizeResponse.model_dump_json``'s text), its token ids written
    chunk by chunk, so that the event loop's thread is never locked out for long."""
    ids = out.tokens
    tokens = ",".join(",".join(map(str, ids[i:i + IDS_PER_CHUNK]))
                      for i in range(0, len(ids), IDS_PER_CHUNK))
    return f'{{"count":{out.count},"max_model_len":{out.max_model_len},"tokens":[{tokens}]}}'
