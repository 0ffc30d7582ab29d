"""The real FastAPI app in the test process, on a fake TokenizerManager: no child process, no model.

The fake keeps the real manager's checks (`check_ready`, `validate`) and the real bundled tokenizer
(chat template, vocabulary), and answers every sequence with one scripted reply, so the HTTP layer
(routes, middleware, errors, logprob rendering) is tested in milliseconds per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.frontend.conftest import bundled_gguf_path
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.request_timelines import TimelineRing
from tokenmill.frontend.sequences import Seq
from tokenmill.frontend.server_status import ServerStatus
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tokenizer_manager import TokenizerManager
from tokenmill.ipc.messages import Logprob, SchedulerReady, TextOutput

MODEL = "fake-model"
MAX_MODEL_LEN = 2048


class FakeManager:
    check_ready = TokenizerManager.check_ready
    validate = TokenizerManager.validate
    check_queue = TokenizerManager.check_queue
    queued_bound = TokenizerManager.queued_bound
    num_queued = 0  # every fake request answers at once
    max_queued_requests = None

    def __init__(self, tokenizer: Tokenizer, reply: str = "Hello!") -> None:
        self.status = ServerStatus.UP
        self.unhealthy_reason: str | None = None
        self.draining = False
        self.tokenizer = tokenizer
        self.stats = None
        self.limits = SchedulerReady(model_name=MODEL, max_model_len=MAX_MODEL_LEN, vocab_size=tokenizer.vocab_size,
                                     kv_capacity_tokens=8192, supports_cache_salt=True,
                                     supports_prompt_logprobs=True)
        self.reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        self.fail_with: Exception | None = None  # raised by generate instead of answering
        self.timelines = TimelineRing()  # the serving code stamps last_byte_sent here (none are recorded)

    async def generate(
        self, request_id: str, seqs: Sequence[Seq], *, arrival: float, prompt_param: str = "prompt",
        cache_salt: str | None = None, internal: bool = False, stages: object = None,
    ) -> AsyncIterator[tuple[int, TextOutput]]:
        self.validate(seqs, prompt_param, internal)
        if self.fail_with is not None:
            raise self.fail_with
        ids = self.reply_ids
        for i, seq in enumerate(seqs):
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = [Logprob(t, -0.25, 1, [(t, -0.25)] * seq.params.logprobs) for t in ids]
            yield i, TextOutput(request_id=f"{request_id}-{i}", text=self.tokenizer.decode(ids), token_ids=list(ids),
                                finished=True, finish_reason="length", stop_reason=None,
                                num_output_tokens=len(ids), logprobs=logprobs)


def bundled_tokenizer() -> Tokenizer:
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("the bundled SmolLM2 GGUF is not installed")
    return Tokenizer.from_model_path(path)  # cached per process


def fake_app(reply: str = "Hello!", **config: object) -> tuple[FastAPI, FakeManager]:
    manager = FakeManager(bundled_tokenizer(), reply)
    state = ServerState()
    state.attach(manager, ServerMetrics(lambda: None))  # type: ignore[arg-type]
    return build_app(ServerConfig(**config), state=state), manager  # type: ignore[arg-type]


def client_of(app: FastAPI) -> TestClient:
    return TestClient(app, raise_server_exceptions=False)


def sdk_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
