"""The reasoning split over HTTP: the real app on a fake manager that streams a crafted thinking reply
one token per delta (the bundled model does not think), so markers arrive cut across deltas."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import pytest
from fastapi import FastAPI

from tests.server.fake_server import FakeManager, bundled_tokenizer, client_of
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.serving_chat import ChatServing
from tokenmill.frontend.reasoning_parser import get_reasoning_parser
from tokenmill.frontend.sequences import Seq
from tokenmill.ipc.messages import TextOutput

THOUGHT = "The user asks for 2 + 2, which is 4."
ANSWER = "The answer is 4."
REPLY = f"<think>{THOUGHT}</think>{ANSWER}"
CHAT = {"messages": [{"role": "user", "content": "2 + 2?"}]}


class TokenByTokenManager(FakeManager):
    """Sends the reply one token per TextOutput, as a decoding engine does."""

    async def generate(
        self, request_id: str, seqs: Sequence[Seq], *, arrival: float, prompt_param: str = "prompt",
        cache_salt: str | None = None, internal: bool = False, stages: object = None,
    ) -> AsyncIterator[tuple[int, TextOutput]]:
        self.validate(seqs, prompt_param, internal)
        ids = self.reply_ids
        for i in range(len(seqs)):
            sent = ""
            for k in range(1, len(ids) + 1):
                text = self.tokenizer.decode(ids[:k])
                done = k == len(ids)
                yield i, TextOutput(request_id=f"{request_id}-{i}", text=text[len(sent):], token_ids=[ids[k - 1]],
                                    finished=done, finish_reason="stop" if done else None, stop_reason=None,
                                    num_output_tokens=k)
                sent = text


def app_with(parser: str | None, reply: str = REPLY) -> tuple[FastAPI, FakeManager]:
    manager = TokenByTokenManager(bundled_tokenizer(), reply)
    state = ServerState()
    state.attach(manager, ServerMetrics(lambda: None))  # type: ignore[arg-type]
    if parser is not None:
        state.chat = ChatServing(manager, get_reasoning_parser(parser))  # type: ignore[arg-type]
    return build_app(ServerConfig(), state=state), manager


def thinking_tokens(manager: FakeManager) -> int:
    """Tokens up to and including the one that completes `</think>` in the reply's own tokens."""
    ids = manager.reply_ids
    return next(k for k in range(1, len(ids) + 1) if "</think>" in manager.tokenizer.decode(ids[:k]))


def stream_events(app: FastAPI, body: dict) -> list[dict]:
    with client_of(app) as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_non_streaming_splits_reasoning_from_content(parser):
    app, manager = app_with(parser)
    with client_of(app) as http:
        body = http.post("/v1/chat/completions", json={**CHAT, "n": 2}).json()
    for choice in body["choices"]:
        assert choice["message"]["reasoning_content"] == THOUGHT
        assert choice["message"]["content"] == ANSWER
    usage = body["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 2 * thinking_tokens(manager)
    assert usage["completion_tokens"] == 2 * len(manager.reply_ids)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_streaming_deltas_split_with_no_markup_and_count_reasoning_tokens(parser):
    app, manager = app_with(parser)
    assert manager.tokenizer.decode(manager.reply_ids[:1]) != "<think>"  # the markers really are cut
    events = stream_events(app, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas if "content" in d]
    assert "".join(reasoning) == THOUGHT and "".join(content) == ANSWER
    assert len(reasoning) > 1  # streamed, not gathered at the end
    assert not any(tag in piece for piece in reasoning + content for tag in ("<", ">", "think"))
    usage = events[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == thinking_tokens(manager)


def test_deepseek_r1_reads_a_thought_opened_by_the_template():
    app, manager = app_with("deepseek_r1", reply=f"{THOUGHT}</think>{ANSWER}")
    with client_of(app) as http:
        body = http.post("/v1/chat/completions", json=CHAT).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "reasoning_content": THOUGHT, "content": ANSWER}
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == thinking_tokens(manager)


def test_qwen3_without_a_thought_is_all_content():
    app, _ = app_with("qwen3", reply=ANSWER)
    with client_of(app) as http:
        body = http.post("/v1/chat/completions", json=CHAT).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "reasoning_content": None, "content": ANSWER}
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_without_a_parser_nothing_changes():
    app, _ = app_with(None)
    with client_of(app) as http:
        body = http.post("/v1/chat/completions", json=CHAT).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert "completion_tokens_details" not in body["usage"]
    events = stream_events(app, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == REPLY
    assert not any("reasoning_content" in d for d in deltas)
    assert "completion_tokens_details" not in events[-1]["usage"]
