"""One chat-shaped generation, started once for every protocol that speaks in messages.

Chat completions, the Responses API and Anthropic's Messages API differ on the wire and agree below
it: a conversation (OpenAI chat messages, tools in OpenAI's shape, tool_choice) is rendered by the
model's chat template, tokenized off the event loop (or in --tokenizer-workers), validated against the
engine's limits, and generated; each choice's outputs become protocol-neutral events
(frontend/choice_events.py). Each protocol translates its body into a ChatCompletionRequest, calls
`ChatRunner.start`, and translates the events of the returned `ChatRun` back, so the request log, the
timelines, metrics, overload 503s and the abort of a request whose client left (closing the event
iterator aborts the engine requests) are the same for all of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tokenmill.entrypoints.openai.params import chat_sampling_params, check_tools
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.request_log import RequestRecord, record_of
from tokenmill.entrypoints.openai.serving_common import ServingBase, check_model, new_id, usage
from tokenmill.frontend.chat_prompt_timing import timed_chat_prompt_ids
from tokenmill.frontend.choice_events import ChoiceStream, Event
from tokenmill.frontend.final_message import final_text
from tokenmill.frontend.forced_calls import ForcedCallState
from tokenmill.frontend.reasoning_parser import ReasoningParser, ReasoningState
from tokenmill.frontend.request_timelines import prompt_stages
from tokenmill.frontend.sequences import Seq, child_params
from tokenmill.frontend.tokenize_pool import run_tokenizer
from tokenmill.frontend.tokenizer_manager import RequestError, TokenizerManager
from tokenmill.frontend.tool_parser_choice import choose_tool_parser, log_choice, markers_are_special
from tokenmill.frontend.tool_parsers import CallReader, ToolParser
from tokenmill.ipc.messages import TextOutput
from tokenmill.sample.sampling_params import SamplingParams


@dataclass
class ChatRun:
    """A started generation: its ids and counts, and the events of its choices as they come."""

    request_id: str
    model: str
    prompt_tokens: int
    params: SamplingParams
    streams: list[ChoiceStream]
    outputs: AsyncIterator[tuple[int, TextOutput]]
    record: RequestRecord
    arrival: float
    count_reasoning: bool  # a reasoning parser runs: usage reports the thinking tokens

    async def events(self) -> AsyncIterator[tuple[int, TextOutput, list[Event]]]:
        """(choice index, the raw output, its events); leaving early aborts the unfinished choices."""
        async for i, out in self.outputs:
            yield i, out, self.streams[i].feed(out)

    async def collect(self) -> None:
        """Runs to the end (non-streamed answers); the streams then hold the text and calls."""
        async for _ in self.events():
            pass
        if any(s.finish_reason == "abort" for s in self.streams):
            raise RequestError("the server aborted the request before it finished", 503)

    def usage(self) -> dict[str, Any]:
        """OpenAI chat's usage; with a reasoning parser, also the tokens spent thinking."""
        body = usage(self.prompt_tokens, self.streams, len(self.streams))
        if self.count_reasoning:
            body["completion_tokens_details"] = {"reasoning_tokens": sum(s.reasoning_tokens for s in self.streams)}
        return body

    @property
    def reasoning_tokens(self) -> int:
        return sum(s.reasoning_tokens for s in self.streams)


class ChatRunner(ServingBase):
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

    async def start(self, raw: Request, req: ChatCompletionRequest, arrival: float, id_prefix: str = "chatcmpl",
                    request_id: str | None = None, params: SamplingParams | None = None) -> ChatRun:
        """Validates, renders, tokenizes and queues `req`; `params` (already derived from `req`) may
        carry a protocol's own extras, e.g. a structured-output constraint under its own field name."""
        self.manager.check_ready()
        assert self.manager.limits is not None and self.manager.tokenizer is not None
        model = self.manager.limits.model_name
        check_model(req.model, model)
        params = params or chat_sampling_params(req)
        if self._keep_markers and req.tools and req.tool_choice in (None, "auto"):
            params = dataclasses.replace(params, skip_special_tokens=False)  # else the call markers vanish
        prompt_ids, prompt_timing = await self.prompt_ids(req)
        tokenized = time.monotonic()
        seqs = [Seq(prompt_ids, child_params(params, k)) for k in range(params.n)]
        self.manager.validate(seqs, "messages")
        request_id = request_id or new_id(id_prefix)
        record = record_of(raw)
        record.request_id, record.prompt_tokens = request_id, len(prompt_ids)
        outputs = self.manager.generate(request_id, seqs, arrival=arrival, prompt_param="messages",
                                        cache_salt=req.cache_salt, stages=prompt_stages(tokenized, prompt_timing))
        prefill = final_text(req.messages) if req.continue_final_message else None
        states = self._reasoning_states(params.n, prefill)
        tools = self._tool_states(req, params.n)
        max_calls = 1 if req.parallel_tool_calls is False else None
        streams = [ChoiceStream(states[k] if states else None, tools[k] if tools else None, max_calls)
                   for k in range(params.n)]
        return ChatRun(request_id, model, len(prompt_ids), params, streams, outputs, record, arrival,
                       self.reasoning_parser is not None)

    async def prompt_ids(self, req: ChatCompletionRequest) -> tuple[list[int], dict[str, Any]]:
        """The rendered, tokenized conversation (and its timing); also what count_tokens counts."""
        self.manager.check_ready()
        assert self.manager.limits is not None
        check_tools(req.tools)
        # Rendering and tokenizing a long conversation takes milliseconds: off the event loop.
        return await run_tokenizer(
            self.manager, timed_chat_prompt_ids, req.messages, self.manager.limits.max_model_len,
            add_generation_prompt=req.add_generation_prompt is not False,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
            continue_final_message=bool(req.continue_final_message),
        )

    def _reasoning_states(self, n: int, prefill: str | None = None) -> list[ReasoningState] | None:
        if self.reasoning_parser is None:
            return None
        if self._end_ids is None:
            assert self.manager.tokenizer is not None
            self._end_ids = self.manager.tokenizer.encode(self.reasoning_parser.end, add_special_tokens=False)
        return [self.reasoning_parser.new_state(self._end_ids, prefill) for _ in range(n)]

    def _tool_states(self, req: ChatCompletionRequest, n: int) -> list[CallReader] | None:
        choice = req.tool_choice
        if choice == "required" or isinstance(choice, dict):  # generated under the tools' grammar
            name = choice["function"]["name"] if isinstance(choice, dict) else None
            return [ForcedCallState(name) for _ in range(n)]
        if self.tool_parser is None or not req.tools or choice == "none":
            return None
        return [self.tool_parser.new_state(req.tools) for _ in range(n)]
