"""vLLM's POST /tokenize and POST /detokenize: the server's own tokenizer, for clients that count or
cut tokens themselves (lm-eval asks the server for its tokenizer before it loads one locally).

/tokenize takes a `prompt` (text) or chat `messages` (rendered by the same chat template as
/v1/chat/completions, so the ids equal that endpoint's prompt) and answers
{"count", "max_model_len", "tokens"}; /detokenize takes {"tokens": [...]} and answers {"prompt"}.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.entrypoints.openai.params import check_tools
from tokenmill.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.entrypoints.openai.request_log import record_of
from tokenmill.entrypoints.openai.serving_common import check_model, parse_body
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.tokenize_pool import run_tokenizer
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tokenizer_manager import TokenizerManager


class TokenizeServing:
    def __init__(self, manager: TokenizerManager) -> None:
        self.manager = manager

    def _ready(self, requested_model: str | None) -> Tokenizer:
        self.manager.check_ready()
        assert self.manager.limits is not None and self.manager.tokenizer is not None
        check_model(requested_model, self.manager.limits.model_name)
        return self.manager.tokenizer

    async def tokenize(self, raw: Request) -> JSONResponse:
        req = await parse_body(raw, TokenizeRequest)
        self._ready(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give either 'prompt' (text) or 'messages' (a chat), not both or neither",
                                 param="prompt" if req.prompt is not None else "messages")
        # A long text takes milliseconds to tokenize: off the event loop, like the generation endpoints.
        if req.messages is not None:
            check_tools(req.tools)
            ids = await run_tokenizer(
                self.manager, Tokenizer.apply_chat_template, req.messages,
                add_generation_prompt=req.add_generation_prompt is not False, tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs, continue_final_message=bool(req.continue_final_message),
            )
        else:
            ids = await run_tokenizer(self.manager, Tokenizer.encode, req.prompt, req.add_special_tokens is not False)
        record_of(raw).prompt_tokens = len(ids)
        assert self.manager.limits is not None
        return JSONResponse({"count": len(ids), "max_model_len": self.manager.limits.max_model_len, "tokens": ids})

    async def detokenize(self, raw: Request) -> JSONResponse:
        req = await parse_body(raw, DetokenizeRequest)
        tok = self._ready(req.model)
        vocab = tok.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"tokens[{bad}] = {req.tokens[bad]} is outside the vocabulary (ids 0 to {vocab - 1})", param="tokens"
            )
        record_of(raw).prompt_tokens = len(req.tokens)
        text = await asyncio.to_thread(tok.decode, req.tokens, False)
        return JSONResponse({"prompt": text})
