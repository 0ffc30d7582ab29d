"""OpenAI request fields -> SamplingParams: defaults, renames and the checks only the API has.

Every range check stays in SamplingParams (one place, raising InvalidRequest with the field's name);
this module only decides what each OpenAI field means.
"""

from __future__ import annotations

import dataclasses

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import MAX_LOGPROBS, OutputKind, SamplingParams, StructuredOutputParams

# n samples become n engine requests; more than this is a typo or an attack, not a use case.
MAX_N = 128
# Engine requests one HTTP request may create (prompts x n): lm-eval batches stay far below.
MAX_CHOICES = 4096


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    # max_completion_tokens is the newer name; it wins when both are given, as in OpenAI's API.
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.top_logprobs is not None and not (isinstance(req.top_logprobs, int) and 0 <= req.top_logprobs <= MAX_LOGPROBS):
        # checked here: SamplingParams would name its own field, `logprobs`, which chat's clients never sent
        raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs!r}",
                             param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.prompt_logprobs is not None:
        raise InvalidRequest("prompt_logprobs is supported on /v1/completions only", param="prompt_logprobs")
    check_tools(req.tools)
    forced = forced_call_schema(req.tool_choice, req.tools, parallel=req.parallel_tool_calls is not False)
    params = _common(req, max_tokens, logprobs)
    if forced is None:
        return params
    if params.structured_output is not None:
        raise InvalidRequest("tool_choice 'required' or a named function already constrains the output: "
                             "drop response_format / guided_*", param="tool_choice")
    # param "tools": a schema the grammar compiler rejects is the tools' fault.
    return dataclasses.replace(params, structured_output=StructuredOutputParams(json_schema=forced, param="tools"))


def forced_call_schema(choice: str | dict | None, tools: list[dict] | None, parallel: bool = True) -> dict | None:
    """The JSON schema tool_choice "required" or a named function generates under (None otherwise):
    the named function's parameters, or an array of one or more {"name", "parameters"} calls of any
    tool (what frontend/forced_calls.ForcedCallState reads back); not `parallel`: exactly one such
    object, no array, so the grammar itself allows one call only."""
    name = check_tool_choice(choice, tools)
    if name is None and choice != "required":
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools or []}
    if name is not None:
        return schemas[name]
    calls = [
        {"type": "object", "properties": {"name": {"const": n}, "parameters": schema},
         "required": ["name", "parameters"]}
        for n, schema in schemas.items()
    ]
    if not parallel:
        return calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def check_tool_choice(choice: str | dict | None, tools: list[dict] | None) -> str | None:
    """OpenAI's tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    naming one of `tools`; returns that name (None for the strings). Only "none" may come without tools."""
    if choice is None or choice == "none":
        return None
    if not tools:
        raise InvalidRequest(f"tool_choice {choice!r} needs a non-empty tools list", param="tool_choice")
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                                 param="tool_choice")
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest('tool_choice must look like {"type": "function", "function": {"name": ...}}',
                             param="tool_choice")
    known = [tool["function"]["name"] for tool in tools]
    if name not in known:
        raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools ({', '.join(known)})",
                             param="tool_choice")
    return name


def check_tools(tools: list[dict] | None) -> None:
    """OpenAI's tool shape, {"type": "function", "function": {"name": ..., ...}}: templates index into
    it, so anything else would render a broken prompt (or fail inside the template)."""
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise InvalidRequest(f"tools[{i}].type must be 'function', got {tool.get('type')!r}", param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"tools[{i}].function must be an object with a 'name'", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string", param="tools")
        for key, kind in (("description", str), ("parameters", dict)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise InvalidRequest(f"tools[{i}].function.{key} must be a{' string' if kind is str else 'n object'}",
                                     param="tools")
        # A call's arguments are a JSON object (as OpenAI requires): a schema of another type would make
        # a forced call generate a value no tool call can carry.
        kind = (function.get("parameters") or {}).get("type", "object")
        if kind != "object":
            raise InvalidRequest(f"tools[{i}].function.parameters must be an object schema (type 'object'), "
                                 f"got type {kind!r}", param="tools")


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise InvalidRequest("best_of is not supported (only best_of == n)", param="best_of")
    max_tokens = req.max_tokens
    if req.echo and max_tokens == 0:
        # Scoring the prompt only (lm-eval's loglikelihood): the engine always samples at least one
        # token; the serving layer drops it (echo_only).
        max_tokens = 1
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        # Echo with logprobs scores the prompt's tokens too, with the same top-N.
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    return _common(req, max_tokens, req.logprobs, prompt_logprobs)


def echo_only(req: CompletionRequest) -> bool:
    return bool(req.echo) and req.max_tokens == 0


def _common(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    n = 1 if req.n is None else req.n
    if n > MAX_N:
        raise InvalidRequest(f"n must be at most {MAX_N}, got {n}", param="n")
    if req.cache_salt is not None and not req.cache_salt:
        raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")
    return SamplingParams(
        n=n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=-1 if req.top_k is None else req.top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=_logit_bias(req.logit_bias),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
        spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        output_kind=OutputKind.DELTA,
        structured_output=structured_output(req),
        priority=req.priority or 0,
    )


def structured_output(req: SamplingFields) -> StructuredOutputParams | None:
    """response_format / guided_* -> one constraint; a bad schema is found later by the engine's parse,
    which still answers 400 before the request is queued."""
    given: list[tuple[str, StructuredOutputParams]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            given.append(("response_format", StructuredOutputParams(json_object=True, param="response_format")))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, str)):
                raise InvalidRequest(
                    "response_format of type 'json_schema' needs json_schema.schema (a JSON Schema object)",
                    param="response_format",
                )
            given.append(("response_format", StructuredOutputParams(json_schema=schema, param="response_format")))
        elif kind != "text":
            raise InvalidRequest(
                f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                param="response_format",
            )
    for name, field in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                        ("guided_grammar", "grammar"), ("guided_choice", "choice")):
        value = getattr(req, name)
        if value is not None:
            given.append((name, StructuredOutputParams(**{field: value}, param=name)))
    if len(given) > 1:
        names = ", ".join(n for n, _ in given)
        raise InvalidRequest(f"give at most one structured-output constraint, got {names}", param=given[1][0])
    return given[0][1] if given else None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token_id < 2**63:
            raise InvalidRequest(f"logit_bias key {key} is not a token id", param="logit_bias")
        out[token_id] = value
    return out
