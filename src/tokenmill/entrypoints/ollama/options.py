"""An Ollama request body -> the OpenAI chat/completion request models, so that sampling params,
structured output and forced tool calls come from the same code as /v1/chat/completions.

Ollama's `options` (model parameters) map onto sampling fields: temperature, top_p, top_k, min_p,
seed, num_predict (-1 and -2, "until done" and "fill the context", are no limit), stop,
repeat_penalty (vLLM's repetition_penalty), presence_penalty, frequency_penalty. `num_ctx` and the
load-time options (num_gpu, num_thread, use_mmap, ...) are accepted and ignored: the context and
the threads are the server's, fixed at start-up, and one request cannot resize them. Options that
change sampling in ways tokenmill does not implement (mirostat, tfs_z, typical_p) are ignored too,
as Ollama ignores options a model does not use. `tool_choice` is tokenmill's own addition (Ollama
has none): "required" or a function name constrains the output to a call by grammar.
"""

from __future__ import annotations

from typing import Any

from tokenmill.errors import InvalidRequest

_NUMBERS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}
_INTEGERS = {"top_k": "top_k", "seed": "seed"}


def sampling_fields(options: Any) -> dict[str, Any]:
    """The OpenAI request fields that `options` stands for; a wrong type is a 400 naming it."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidRequest("options must be an object", param="options")
    out: dict[str, Any] = {}
    for name, target in _NUMBERS.items():
        value = options.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest(f"options.{name} must be a number, got {value!r}", f"options.{name}")
            out[target] = float(value)
    for name, target in _INTEGERS.items():
        value = options.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequest(f"options.{name} must be an integer, got {value!r}", f"options.{name}")
            out[target] = value
    if out.get("top_k") == 0:
        out.pop("top_k")  # Ollama's 0: no top-k
    predict = options.get("num_predict")
    if predict is not None:
        if isinstance(predict, bool) or not isinstance(predict, int) or predict < -2:
            raise InvalidRequest(f"options.num_predict must be an integer >= -2, got {predict!r}", "options.num_predict")
        if predict > 0:
            out["max_tokens"] = predict
        elif predict == 0:
            raise InvalidRequest("options.num_predict 0 asks for no output", "options.num_predict")
    stop = options.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("options.stop must be a list of strings", "options.stop")
        out["stop"] = stop
    return out


def response_format(fmt: Any) -> dict[str, Any] | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema, for the grammar backend."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise InvalidRequest(f'format must be "json" or a JSON schema object, got {fmt!r}', param="format")


def tool_choice(options: Any) -> str | dict[str, Any] | None:
    choice = options.get("tool_choice") if isinstance(options, dict) else None
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, str):
        return {"type": "function", "function": {"name": choice}}
    raise InvalidRequest("options.tool_choice must be auto, none, required or a function name", "options.tool_choice")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Ollama's messages in the shape the chat template path takes: tool calls with a type, a tool
    result with the `tool_call_id` it answers (Ollama names the tool instead: `tool_name`)."""
    if not isinstance(messages, list):
        raise InvalidRequest("messages must be a list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a role", param="messages")
        if m.get("images"):
            raise InvalidRequest(f"messages[{i}].images: this model takes no images", param="messages")
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = [{"id": f"call_{i}_{k}", "type": "function", "function": c.get("function")}
                                 for k, c in enumerate(calls) if isinstance(c, dict)]
        if m["role"] == "tool":
            msg["tool_call_id"] = m.get("tool_name") or f"call_{i}"
            if m.get("tool_name"):
                msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def check_generate_fields(body: dict[str, Any]) -> None:
    """/api/generate's fields this server cannot honour, refused rather than ignored: `suffix` (fill in
    the middle; Ollama too refuses it for a model without that capability) and `template` (a Go
    template for this request: the model's own chat template is what renders here, or `raw: true`)."""
    if body.get("suffix"):
        raise InvalidRequest("suffix: this model does not support insert (fill in the middle)", param="suffix")
    if body.get("template"):
        raise InvalidRequest("template: a request's own Go template is not supported; the model's chat template "
                             "renders the prompt (send raw: true with a prompt you formatted yourself)",
                             param="template")
