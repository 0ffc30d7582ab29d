"""POST /v1/chat/completions: messages -> the model's chat template -> tokens -> choices.

The prompt is rendered by the same Tokenizer.apply_chat_template as the offline `LLM.chat` (sandboxed
jinja2, tools and chat_template_kwargs passed to the template), so both give the same prompt ids.
With a reasoning parser (`--reasoning-parser`), each choice's output is split into
`reasoning_content` and `content` (frontend/reasoning_parser.py) and usage counts the reasoning tokens.
With a tool-call parser (`--tool-call-parser`), a request with `tools` (and `tool_choice` not "none")
has the calls in the content after the thought read into `tool_calls` (frontend/tool_parsers.py):
the message's `tool_calls` and `finish_reason: "tool_calls"`, or, streamed, one delta with each call's
index, id and name, then one with its arguments, as OpenAI sends them. tool_choice "required" or a
named function is generated under the tools' schemas (params.forced_call_schema) and read back whole.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill.entrypoints.openai.errors import as_request_error
from tokenmill.entrypoints.openai.params import chat_sampling_params
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.request_log import RequestRecord, record_of
from tokenmill.entrypoints.openai.serving_common import (
    DONE,
    SSE_HEADERS,
    Choice,
    ClientDisconnected,
    ServingBase,
    chat_logprobs,
    check_model,
    disconnected_response,
    json_response,
    new_id,
    now_s,
    parse_body,
    request_timing,
    sse,
    sse_error,
    stamp_last_byte,
    unless_disconnected,
    usage,
    with_timing,
)
from tokenmill.frontend.chat_prompt_timing import timed_chat_prompt_ids
from tokenmill.frontend.reasoning_parser import ReasoningDelta, ReasoningParser, ReasoningState
from tokenmill.frontend.request_timelines import prompt_stages
from tokenmill.frontend.tokenize_pool import run_tokenizer
from tokenmill.frontend.tokenizer_manager import RequestError, Seq, TokenizerManager, child_params
from tokenmill.frontend.tool_parser_choice import choose_tool_parser, log_choice, markers_are_special
from tokenmill.frontend.tool_parsers import CallReader, ForcedCallState, ToolCall, ToolParser
from tokenmill.ipc.messages import TextOutput


class ChatServing(ServingBase):
    def __init__(self, manager: TokenizerManager, reasoning_parser: ReasoningParser | None = None,
                 tool_parser: ToolParser | None = None) -> None:
        super().__init__(manager)
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self._end_ids: list[int] | None = None
        self._keep_markers = False  # the parser's marker is a special token: decode without skipping them

    def choose_tool_parser(self) -> None:
        """Once the tokenizer is loaded (start-up): the --tool-call-parser one, else the one the chat
        template writes (frontend/tool_parser_choice.py); logged, with a warning if they disagree."""
        assert self.manager.tokenizer is not None
        flag = self.tool_parser.name if self.tool_parser is not None else None
        choice = choose_tool_parser(flag, self.manager.tokenizer.chat_template)
        log_choice(choice)
        self.tool_parser = choice.parser
        self._keep_markers = choice.parser is not None and markers_are_special(choice.parser, self.manager.tokenizer)

    def _reasoning_states(self, n: int) -> list[ReasoningState] | None:
        if self.reasoning_parser is None:
            return None
        if self._end_ids is None:
            assert self.manager.tokenizer is not None
            self._end_ids = self.manager.tokenizer.encode(self.reasoning_parser.end, add_special_tokens=False)
        return [self.reasoning_parser.new_state(self._end_ids) for _ in range(n)]

    def _tool_states(self, req: ChatCompletionRequest, n: int) -> list[CallReader] | None:
        choice = req.tool_choice
        if choice == "required" or isinstance(choice, dict):  # generated under the tools' grammar
            name = choice["function"]["name"] if isinstance(choice, dict) else None
            return [ForcedCallState(name) for _ in range(n)]
        if self.tool_parser is None or not req.tools or choice == "none":
            return None
        return [self.tool_parser.new_state(req.tools) for _ in range(n)]

    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, ChatCompletionRequest)
        self.manager.check_ready()
        assert self.manager.limits is not None and self.manager.tokenizer is not None
        model = self.manager.limits.model_name
        check_model(req.model, model)
        params = chat_sampling_params(req)
        if self._keep_markers and req.tools and req.tool_choice in (None, "auto"):
            params = dataclasses.replace(params, skip_special_tokens=False)  # else the call markers vanish
        # Rendering and tokenizing a long conversation takes milliseconds: off the event loop.
        prompt_ids, prompt_timing = await run_tokenizer(
            self.manager, timed_chat_prompt_ids, req.messages, self.manager.limits.max_model_len,
            add_generation_prompt=req.add_generation_prompt is not False,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        tokenized = time.monotonic()
        seqs = [Seq(prompt_ids, child_params(params, k)) for k in range(params.n)]
        self.manager.validate(seqs, "messages")
        request_id = new_id("chatcmpl")
        record = record_of(raw)
        record.request_id, record.prompt_tokens = request_id, len(prompt_ids)
        outputs = self.manager.generate(request_id, seqs, arrival=arrival, prompt_param="messages",
                                        cache_salt=req.cache_salt, stages=prompt_stages(tokenized, prompt_timing))
        want_logprobs = params.logprobs is not None
        tools = self._tool_states(req, params.n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = self._stream(outputs, request_id, model, params.n, len(prompt_ids), want_logprobs, include_usage,
                                  record, tools)
            if req.include_timing:
                head = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": model}
                stream = with_timing(stream, self.manager, request_id, head)
            stream = stamp_last_byte(stream, self.manager, request_id, arrival)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            body = await unless_disconnected(
                raw, self._collect(outputs, request_id, model, params.n, len(prompt_ids), want_logprobs, tools)
            )
        except ClientDisconnected:
            return disconnected_response()
        record.set_usage(body["usage"])
        if req.include_timing:
            body["timing"] = await request_timing(self.manager, request_id)
        return json_response(body, self.manager, request_id, arrival)

    async def _collect(
        self, outputs: AsyncIterator[tuple[int, TextOutput]], request_id: str, model: str, n: int,
        prompt_tokens: int, want_logprobs: bool, tools: list[CallReader] | None,
    ) -> dict:
        choices = [Choice() for _ in range(n)]
        states = self._reasoning_states(n)
        reasoning: list[list[str]] = [[] for _ in range(n)]
        calls: list[list[ToolCall]] = [[] for _ in range(n)]
        async for i, out in outputs:
            if states is None and tools is None:
                choices[i].add(out)
                continue
            choices[i].add(out, keep_text=False)
            choices[i].logprobs.extend(out.logprobs or ())
            part = _parse(out, states[i] if states else None, tools[i] if tools else None)
            reasoning[i].append(part.reasoning)
            choices[i].text.append(part.content)
            calls[i].extend(part.calls)
        if any(c.finish_reason == "abort" for c in choices):
            raise RequestError("the server aborted the request before it finished", 503)

        def message(i: int) -> dict:
            body: dict = {"role": "assistant", "content": "".join(choices[i].text)}
            if states is not None:
                body["reasoning_content"] = "".join(reasoning[i]) or None
            if calls[i]:
                body["content"] = body["content"] or None
                body["tool_calls"] = [_call_json(call) for call in calls[i]]
            return body

        return {
            "id": request_id,
            "object": "chat.completion",
            "created": now_s(),
            "model": model,
            "choices": [
                {
                    "index": i,
                    "message": message(i),
                    "logprobs": chat_logprobs(c.logprobs, self.texts) if want_logprobs else None,
                    "finish_reason": "tool_calls" if calls[i] else c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": _usage(prompt_tokens, choices, n, states),
        }

    async def _stream(
        self, outputs: AsyncIterator[tuple[int, TextOutput]], request_id: str, model: str, n: int,
        prompt_tokens: int, want_logprobs: bool, include_usage: bool, record: RequestRecord,
        tools: list[CallReader] | None = None,
    ) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": model}

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None,
                  stop_reason: int | str | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            payload = {**base, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        choices = [Choice() for _ in range(n)]
        states = self._reasoning_states(n)
        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, out in outputs:
                choices[i].add(out, keep_text=False)
                part = _parse(out, states[i] if states else None, tools[i] if tools else None)
                deltas = _deltas_of(part, tools[i].num_calls - len(part.calls) if tools else 0)
                if not (deltas or out.logprobs or out.finished):
                    continue  # text held back (half a character, a possible stop string or marker)
                logprobs = chat_logprobs(out.logprobs, self.texts) if want_logprobs and out.logprobs else None
                deltas = deltas or [{}]
                for k, delta in enumerate(deltas):
                    last = out.finished and k == len(deltas) - 1
                    finish = ("tool_calls" if tools and tools[i].num_calls else out.finish_reason) if last else None
                    yield chunk(i, delta, logprobs if k == 0 else None, finish, out.stop_reason)
        except Exception as exc:  # includes RequestError: the stream ends as an error, never hangs
            record.set_usage(_usage(prompt_tokens, choices, n, states))
            error = as_request_error(exc)
            for i, c in enumerate(choices):
                if c.finish_reason is None:
                    yield chunk(i, {}, finish="abort")
            yield sse_error(error)
            yield DONE
            return
        final_usage = _usage(prompt_tokens, choices, n, states)
        record.set_usage(final_usage)
        if include_usage:
            yield sse({**base, "choices": [], "usage": final_usage})
        yield DONE


def _split(state: ReasoningState, out: TextOutput) -> list[ReasoningDelta]:
    parts = [state.feed(out.text, out.token_ids)]
    if out.finished:
        parts.append(state.finish())
    return parts


@dataclass(frozen=True)
class _Parsed:
    """One output delta of one choice, split: thought, answer text, and the calls it completed."""

    reasoning: str
    content: str
    calls: tuple[ToolCall, ...] = ()


def _parse(out: TextOutput, reasoning: ReasoningState | None, tools: CallReader | None) -> _Parsed:
    """The reasoning split first; tool calls are read from the answer only."""
    thought, text = "", out.text
    if reasoning is not None:
        parts = _split(reasoning, out)
        thought, text = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
    if tools is None:
        return _Parsed(thought, text)
    found = [tools.feed(text)] + ([tools.finish()] if out.finished else [])
    return _Parsed(thought, "".join(d.content for d in found), tuple(c for d in found for c in d.calls))


def _deltas_of(part: _Parsed, first_index: int) -> list[dict]:
    """The chunks' deltas: the text, then per call one with its index, id and name, one with its arguments."""
    delta: dict = {"reasoning_content": part.reasoning} if part.reasoning else {}
    if part.content:
        delta["content"] = part.content
    deltas = [delta] if delta else []
    for index, call in enumerate(part.calls, start=first_index):
        head = _call_json(call, arguments="")
        deltas.append({"tool_calls": [{"index": index, **head}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas


def _call_json(call: ToolCall, arguments: str | None = None) -> dict:
    arguments = call.arguments if arguments is None else arguments
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _usage(prompt_tokens: int, choices: list[Choice], n: int, states: list[ReasoningState] | None) -> dict:
    """OpenAI's usage; with a reasoning parser, also the tokens spent thinking (all choices)."""
    body = usage(prompt_tokens, choices, n)
    if states is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": sum(s.reasoning_tokens for s in states)}
    return body
