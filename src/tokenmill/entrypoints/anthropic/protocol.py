"""Request bodies of POST /v1/messages and /v1/messages/count_tokens, validated strictly.

`max_tokens` is required, as Anthropic requires it. Messages and content blocks stay plain JSON here:
translate.py reads them and names the offending block. Unknown fields are ignored (`metadata`,
`thinking`, `service_tier`...): the model thinks as its template and the reasoning parser say.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from tokenmill.entrypoints.openai.protocol import Int64


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Int64
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
