"""The request body of POST /v1/responses, validated strictly (a wrong type is a 400 naming the field).

Items of `input` stay plain JSON here: input_items.py reads them and names the offending item.
Unknown fields are ignored, as elsewhere in this server (`include`, `truncation`, `service_tier`...).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from tokenmill.entrypoints.openai.protocol import Int64


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | "json_object", ...}}
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's extra sampling fields, as on chat
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    priority: Int64 | None = 0  # vLLM's extra field, as on chat: lower runs sooner (`--scheduling-policy priority`)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: accepted; the model thinks as it does
    user: str | None = None
