"""POST /v1/chat/completions: messages -> the model's chat template -> tokens -> choices.

The prompt is rendered by the same Tokenizer.apply_chat_template as the offline `LLM.chat` (sandboxed
jinja2, tools and chat_template_kwargs passed to the template), so both give the same prompt ids.
The generation is started by chat_run.ChatRunner (shared with the Responses and Messages APIs), and
this module only translates each choice's events (frontend/choice_events.py) to chat's wire format:
with a reasoning parser (`--reasoning-parser`), `reasoning_content` beside `content`, and usage counts
the reasoning tokens; with a tool-call parser (`--tool-call-parser`, or the one the template writes),
a request with `tools` (and `tool_choice` not "none") gets the message's `tool_calls` and
`finish_reason: "tool_calls"`, or, streamed, one delta with each call's index, id and name, then its
arguments, as OpenAI sends them. tool_choice "required" or a named function is generated under the
tools' schemas (params.forced_call_schema); a forced reply cut by max_tokens returns the calls it
completed with finish_reason "length", never its JSON as content. vLLM's `continue_final_message`
continues the final message (frontend/final_message.py) and `echo` starts the content with it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill.entrypoints.openai.chat_run import ChatRun, ChatRunner
from tokenmill.entrypoints.openai.errors import as_request_error
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.serving_common import (
    DONE,
    SSE_HEADERS,
    ClientDisconnected,
    chat_logprobs,
    disconnected_response,
    json_response,
    now_s,
    parse_body,
    request_timing,
    sse,
    sse_error,
    stamp_last_byte,
    unless_disconnected,
    with_timing,
)
from tokenmill.frontend.choice_events import CallArguments, CallStarted, Event, Reasoning, Text
from tokenmill.frontend.final_message import message_text
from tokenmill.frontend.tool_call import ToolCall


class ChatServing(ChatRunner):
    async def create(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(raw, ChatCompletionRequest)
        run = await self.start(raw, req, arrival)
        want_logprobs = run.params.logprobs is not None
        role = _reply_role(req)
        echo = _echoed(req, role)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = self._stream(run, want_logprobs, include_usage, role, echo)
            if req.include_timing:
                head = {"id": run.request_id, "object": "chat.completion.chunk", "created": now_s(), "model": run.model}
                stream = with_timing(stream, self.manager, run.request_id, head)
            stream = stamp_last_byte(stream, self.manager, run.request_id, arrival)
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            await unless_disconnected(raw, run.collect())
        except ClientDisconnected:
            return disconnected_response()
        body = self._body(run, want_logprobs, role, echo)
        run.record.set_usage(body["usage"])
        if req.include_timing:
            body["timing"] = await request_timing(self.manager, run.request_id)
        return json_response(body, self.manager, run.request_id, arrival)

    def _body(self, run: ChatRun, want_logprobs: bool, role: str, echo: str) -> dict:
        def message(i: int) -> dict:
            stream = run.streams[i]
            body: dict = {"role": role, "content": stream.text}
            if run.count_reasoning:
                body["reasoning_content"] = stream.reasoning_text or None
            if stream.calls or stream.forced:
                body["content"] = body["content"] or None  # a forced reply is calls, never text
            if echo:
                body["content"] = echo + (body["content"] or "")
            if stream.calls:
                body["tool_calls"] = [_call_json(call) for call in stream.calls]
            return body

        return {
            "id": run.request_id,
            "object": "chat.completion",
            "created": now_s(),
            "model": run.model,
            "choices": [
                {
                    "index": i,
                    "message": message(i),
                    "logprobs": chat_logprobs(s.logprobs, self.texts) if want_logprobs else None,
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                }
                for i, s in enumerate(run.streams)
            ],
            "usage": run.usage(),
        }

    async def _stream(self, run: ChatRun, want_logprobs: bool, include_usage: bool, role: str,
                      echo: str) -> AsyncIterator[str]:
        base = {"id": run.request_id, "object": "chat.completion.chunk", "created": now_s(), "model": run.model}

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None,
                  stop_reason: int | str | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            payload = {**base, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        try:
            for i in range(len(run.streams)):
                yield chunk(i, {"role": role, "content": ""})
                if echo:
                    yield chunk(i, {"content": echo})
            async for i, out, events in run.events():
                deltas = _deltas_of(events)
                if not (deltas or out.logprobs or out.finished):
                    continue  # text held back (half a character, a possible stop string or marker)
                logprobs = chat_logprobs(out.logprobs, self.texts) if want_logprobs and out.logprobs else None
                deltas = deltas or [{}]
                for k, delta in enumerate(deltas):
                    last = out.finished and k == len(deltas) - 1
                    finish = run.streams[i].finish_reason if last else None
                    yield chunk(i, delta, logprobs if k == 0 else None, finish, out.stop_reason)
        except Exception as exc:  # includes RequestError: the stream ends as an error, never hangs
            run.record.set_usage(run.usage())
            error = as_request_error(exc)
            for i, s in enumerate(run.streams):
                if s.finish_reason is None:
                    yield chunk(i, {}, finish="abort")
            yield sse_error(error)
            yield DONE
            return
        final_usage = run.usage()
        run.record.set_usage(final_usage)
        if include_usage:
            yield sse({**base, "choices": [], "usage": final_usage})
        yield DONE


def _reply_role(req: ChatCompletionRequest) -> str:
    """The reply's role (vLLM's rule): the assistant's, unless the request opens no new turn
    (add_generation_prompt false): then the final message's, whose turn the reply goes on with."""
    last = req.messages[-1] if req.messages else None
    if req.add_generation_prompt is not False or not isinstance(last, dict) or not isinstance(last.get("role"), str):
        return "assistant"
    return last["role"]


def _echoed(req: ChatCompletionRequest, role: str) -> str:
    """What `echo` puts before each reply (vLLM's rule): the final message's whole text where that
    message is the reply's role; nothing otherwise."""
    last = req.messages[-1] if req.messages else None
    if not req.echo or not isinstance(last, dict) or last.get("role") != role:
        return ""
    return message_text(last)


def _deltas_of(events: list[Event]) -> list[dict]:
    """One output's chunk deltas: its thought and text together, then per call one delta with its
    index, id and name and one per piece of its arguments."""
    delta: dict = {}
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    text = "".join(e.text for e in events if isinstance(e, Text))
    if reasoning:
        delta["reasoning_content"] = reasoning
    if text:
        delta["content"] = text
    deltas = [delta] if delta else []
    for event in events:
        if isinstance(event, CallStarted):
            head = {"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
            deltas.append({"tool_calls": [{"index": event.index, **head}]})
        elif isinstance(event, CallArguments):
            deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.delta}}]})
    return deltas


def _call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
