"""What chat and completions share: body parsing, the model check, SSE framing, client-disconnect
handling, per-choice accumulation and logprob token text."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.openai.errors import error_body, validation_message
from tokenmill.frontend.token_bytes import TokenBytes
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tokenizer_manager import RequestError, TokenizerManager
from tokenmill.ipc.messages import Logprob, TextOutput

M = TypeVar("M", bound=pydantic.BaseModel)
T = TypeVar("T")

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


async def parse_body(raw: Request, model: type[M]) -> M:
    body = await raw.body()
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise RequestError(message, 400, param) from None


def check_model(requested: str | None, served: str, aliases: tuple[str, ...] = ()) -> None:
    if requested is not None and requested not in (served, *aliases):
        raise RequestError(f"the model {requested!r} does not exist; this server serves {served!r}", 404,
                           "model", "model_not_found")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_error(error: RequestError) -> str:
    # The openai SDK raises APIError on a data event carrying "error": the stream ends as an error.
    return sse(error_body(error.message, error.status, error.param, error.code))


class ClientDisconnected(Exception):
    pass


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Runs `work`, cancelling it if the client goes away first (a non-streaming request would
    otherwise run to the end for nobody; cancelling aborts it in the engine)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected
    return task.result()


def disconnected_response() -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"


@dataclass
class Choice:
    """Accumulates one choice's deltas (non-streaming) and remembers its end (both modes)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[Logprob | None] | None = None

    def add(self, out: TextOutput, keep_text: bool = True) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.text and keep_text:
            self.text.append(out.text)
        if out.logprobs and keep_text:
            self.logprobs.extend(out.logprobs)
        self.num_tokens = out.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


class Counted(Protocol):
    """What usage reads of a choice: serving_common.Choice, or frontend/choice_events.ChoiceStream."""

    num_tokens: int
    num_cached_tokens: int


def usage(prompt_tokens: int, choices: Sequence[Counted], n: int, count_completion: bool = True) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per sample); so do cached ones: what was cached
    before the prompt came, i.e. the least any of its samples found (later samples also hit the
    pages the first one just computed), as the offline API counts it."""
    completion = sum(c.num_tokens for c in choices) if count_completion else 0
    cached = sum(min(c.num_cached_tokens for c in choices[i : i + n]) for i in range(0, len(choices), n))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


class TokenTexts:
    """Text of single tokens for logprobs, cached (a vocabulary is small; requests repeat tokens), and
    their raw bytes (`bytes_of`), which the text loses for a token holding part of a character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.bytes_of = TokenBytes(tokenizer.backend)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class ServingBase:
    """What the chat and completion handlers share: the manager, and token texts built lazily
    (the tokenizer exists only once the scheduler is up)."""

    def __init__(self, manager: TokenizerManager) -> None:
        self.manager = manager
        self._texts: TokenTexts | None = None

    @property
    def texts(self) -> TokenTexts:
        if self._texts is None:
            assert self.manager.tokenizer is not None
            self._texts = TokenTexts(self.manager.tokenizer)
        return self._texts


def chat_logprobs(items: list[Logprob], texts: TokenTexts) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts(token_id), "logprob": logprob, "bytes": list(texts.bytes_of(token_id))}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items
    ]}


def completion_logprobs(
    items: list[Logprob | None], texts: TokenTexts, offset: int, token_ids: list[int] | None = None,
    top_n: int | None = None,
) -> dict[str, Any]:
    """The legacy completions shape; text_offset counts characters from `offset` (after any echo).

    An item may be None (the first prompt token has no logprob); token_ids then names the tokens.
    Each top_logprobs entry holds the top_n alternatives plus the token itself, as vLLM returns it.
    """
    ids = token_ids if token_ids is not None else [lp.token_id for lp in items if lp is not None]
    tokens, offsets, values, tops = [], [], [], []
    for token_id, lp in zip(ids, items):
        token = texts(token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        values.append(None if lp is None else lp.logprob)
        if lp is None:
            tops.append(None)
            continue
        top = {texts(t): v for t, v in (lp.top if top_n is None else lp.top[:top_n])}
        top.setdefault(token, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def concat_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                     "text_offset")}


def vllm_prompt_logprobs(items: list[Logprob | None], texts: TokenTexts) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token, {token id: {logprob, rank, decoded_token}}
    for the token itself and its top alternatives (None for the first token)."""
    out: list[dict[str, Any] | None] = []
    for lp in items:
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": texts(t)} for r, (t, v) in enumerate(lp.top)}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": texts(lp.token_id)}
        out.append(entry)
    return out


# The numbers an inline `timing` field reports (engine/timeline.py summary): queue time, first-token
# latency minus queue time, decode throughput, and the first-token latency itself.
TIMING_KEYS = ("queue_time", "prefill_time", "first_token_latency", "decode_throughput")


async def request_timing(manager: TokenizerManager, request_id: str, wait_s: float = 1.0) -> dict[str, Any] | None:
    """The engine's timing of the request's first sequence, in seconds. It comes with the last output,
    or a step later when a stop string ended the text first: wait that long, then give up (None)."""
    deadline = time.monotonic() + wait_s
    while (record := manager.timelines.get(f"{request_id}-0")) is None or record.get("engine") is None:
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.01)
    return {key: record["engine"].get(key) for key in TIMING_KEYS}


async def with_timing(stream: AsyncIterator[str], manager: TokenizerManager, request_id: str,
                      head: dict[str, Any]) -> AsyncIterator[str]:
    """`stream` with one more chunk before [DONE]: no choices, the request's `timing`."""
    async for item in stream:
        if item == DONE:
            yield sse({**head, "choices": [], "timing": await request_timing(manager, request_id)})
        yield item


async def stamp_last_byte(stream: AsyncIterator[str], manager: TokenizerManager, request_id: str,
                          arrival: float) -> AsyncIterator[str]:
    """`stream`, then the timeline's last_byte_sent: the HTTP server asks for the next chunk only once
    it has sent the previous one, so this loop ends after [DONE] was handed over."""
    async for item in stream:
        yield item
    manager.timelines.last_byte_sent(request_id, time.monotonic() - arrival)


def json_response(body: dict[str, Any], manager: TokenizerManager, request_id: str, arrival: float) -> JSONResponse:
    """The non-streamed response, its timeline's last_byte_sent stamped once the body is built."""
    response = JSONResponse(body)
    manager.timelines.last_byte_sent(request_id, time.monotonic() - arrival)
    return response
