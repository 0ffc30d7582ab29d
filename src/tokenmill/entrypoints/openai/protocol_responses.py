"""Response bodies of the API, as pydantic models for the OpenAPI spec only.

The serving modules build responses as plain dicts (no validation on the way out); these models say
what those dicts hold, so /openapi.json documents every answer (client generators get types, and
schemathesis checks each response against them: tests/server/test_schemathesis.py). They list the
fields clients rely on and allow more (`extra="allow"`): optional extras such as `timing`,
`reasoning_content` or vLLM's `prompt_logprobs` need no entry to stay valid.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Open):
    """OpenAI's error format: every 4xx and 5xx of this server."""

    error: ErrorDetail


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(_Open):
    object: str
    data: list[ModelCard]


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class CompletionResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(_Open):
    role: str
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Open):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(_Open):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Open):
    prompt: str


class RequestTimeline(_Open):
    """GET /v1/requests/{id}/timeline: per sequence, the API process's view beside the engine's."""

    id: str
    sequences: list[dict[str, Any]]


class ResponseObject(_Open):
    """The Responses API's Response (POST /v1/responses, GET /v1/responses/{id})."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseDeleted(_Open):
    id: str
    object: str
    deleted: bool


class ResponseItemList(_Open):
    object: str
    data: list[dict[str, Any]]
    has_more: bool


class AnthropicErrorDetail(_Open):
    type: str
    message: str


class AnthropicError(_Open):
    """Anthropic's error format: every 4xx and 5xx of /v1/messages."""

    type: str
    error: AnthropicErrorDetail


class AnthropicMessage(_Open):
    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, Any]


class AnthropicTokenCount(_Open):
    input_tokens: int


class OllamaError(_Open):
    """Ollama's error format: every 4xx and 5xx of /api/*."""

    error: str


RESPONSE_MODELS: list[type[BaseModel]] = [
    ErrorResponse, ModelCard, ModelList, CompletionResponse, ChatCompletionResponse, TokenizeResponse,
    DetokenizeResponse, RequestTimeline, ResponseObject, ResponseDeleted, ResponseItemList, AnthropicError,
    AnthropicMessage, AnthropicTokenCount, OllamaError,
]
