"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), validated strictly.

Strict mode: a JSON string is not a number and `true` is not 1, so a wrong type is a 400 naming the
field instead of a silent coercion. Range checks live in SamplingParams, the one place that knows
them; these models only check shapes. Unknown fields are ignored, as OpenAI-compatible servers do.
Responses are built as plain dicts in the serving modules (no validation needed on the way out).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# msgpack (and torch seeds) carry at most 64-bit integers; bigger ones are a range error, not a crash.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


class SamplingFields(BaseModel):
    """Fields shared by chat and completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    n: Int64 | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    cache_salt: str | None = None
    prompt_logprobs: Int64 | None = None
    priority: Int64 | None = 0  # lower runs sooner; needs `serve --scheduling-policy priority`
    # The request's own stage timing in the response (engine/timeline.py): SGLang's three numbers.
    include_timing: bool | None = False
    # Structured output: OpenAI's response_format, or vLLM's guided_* fields (at most one of them all).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None  # EBNF
    guided_choice: list[str] | None = None


class ChatCompletionRequest(SamplingFields):
    # Messages stay plain JSON: the chat template module validates roles and content (string or a
    # list of text parts) and names the offending message.
    messages: list[Any]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (the grammar's, when forced)
    add_generation_prompt: bool | None = True
    # vLLM's: the reply continues the final message (with add_generation_prompt false), and `echo`
    # starts the reply's content with that message's text when it is the assistant's.
    continue_final_message: bool | None = False
    echo: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # Text, a batch of texts, token ids, or a batch of token-id lists (what lm-eval sends).
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Int64 | None = None


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a text `prompt`, or chat `messages` rendered by the model's template."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = True  # a prompt only: messages are tokenized as chat completions do
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids back to text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[TokenId]
