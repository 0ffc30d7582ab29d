"""Ollama's API: /api/chat, /api/generate (NDJSON streams by default), /api/embed (and the older
/api/embeddings), /api/tags, /api/show, /api/ps, /api/version; pull / push / create / copy /
delete answer 501 (no model store).

Only translation lives here: a body becomes an OpenAI chat request (options.py), whose sampling
params, template rendering and generation run through the same public functions as
/v1/chat/completions (chat_sampling_params, timed_chat_prompt_ids, TokenizerManager.generate),
with the server's reasoning and tool-call parsers; the outputs become Ollama's lines. Errors are
Ollama's `{"error": "..."}` with the HTTP status the OpenAI routes would give. `keep_alive` is
accepted and has nothing to do: the model stays loaded while the server runs; a request without
prompt or messages answers at once (`done_reason` "load", or "unload" with keep_alive 0), which is
how Ollama clients preload or release a model.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from tokenmill.entrypoints.ollama.options import (
    chat_messages,
    check_generate_fields,
    response_format,
    sampling_fields,
    tool_choice,
)
from tokenmill.entrypoints.ollama.replies import (
    OLLAMA_API_VERSION,
    ModelCard,
    Timing,
    created_at,
    done_reason,
)
from tokenmill.entrypoints.openai.errors import as_request_error
from tokenmill.entrypoints.openai.params import chat_sampling_params
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.serving_common import (
    ClientDisconnected,
    disconnected_response,
    new_id,
    unless_disconnected,
)
from tokenmill.entrypoints.openai.serving_embedding import as_floats, embed_inputs
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.chat_prompt_timing import timed_chat_prompt_ids
from tokenmill.frontend.final_message import final_text, split_prefill
from tokenmill.frontend.forced_calls import ForcedCallState
from tokenmill.frontend.model_router import keep_alive_seconds
from tokenmill.frontend.reasoning_parser import ReasoningState
from tokenmill.frontend.sequences import Seq, child_params
from tokenmill.frontend.tokenize_pool import run_tokenizer
from tokenmill.frontend.tokenizer_manager import RequestError, TokenizerManager
from tokenmill.frontend.tool_parsers import CallReader, ToolCall
from tokenmill.ipc.messages import TextOutput

NDJSON = "application/x-ndjson"
MODEL_STORE = ("pull", "push", "create", "copy", "delete", "blobs/{digest}")


def ollama_error(exc: BaseException) -> JSONResponse:
    err = as_request_error(exc)
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)


def line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


class OllamaServing:
    """The routes' work; `server()` is the app's ServerState (manager, metrics, chat parsers)."""

    def __init__(self, server: Callable[[], Any], model_path: str) -> None:
        self.server = server
        self.model_path = model_path
        # One card per model name: behind the model router (model_routing.py) `server()` is the
        # current request's model, so a single cached card would describe another model.
        self._cards: dict[str, ModelCard] = {}

    @property
    def manager(self) -> TokenizerManager:
        return self.server().manager

    def card(self) -> ModelCard:
        manager = self.manager
        manager.check_ready()
        limits = manager.limits
        assert limits is not None
        card = self._cards.get(limits.model_name)
        if card is None:
            path = getattr(manager, "model_path", None) or self.model_path
            card = self._cards[limits.model_name] = ModelCard(limits.model_name, path, limits.max_model_len)
        return card

    def check_model(self, body: dict[str, Any]) -> str:
        """The model the body names (this server's, or 404), its keep_alive read as Ollama reads it (a
        400 for one it would refuse, though one model stays loaded here whatever it says)."""
        try:
            keep_alive_seconds(body.get("keep_alive"))
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="keep_alive") from None
        card = self.card()
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest(f"model must be a string, got {type(name).__name__}", param="model")
        if name is not None and name not in card.names():
            raise RequestError(f"model '{name}' not found; this server serves '{card.name}'", 404)
        return name or card.name

    # ---- generation ------------------------------------------------------------------------------
    async def chat(self, body: dict[str, Any], raw: Request) -> Response:
        arrival = time.monotonic()
        model = self.check_model(body)
        if not body.get("messages"):
            return self._load_reply(model, body, {"message": {"role": "assistant", "content": ""}})
        messages, flags = split_prefill(chat_messages(body["messages"]))  # Ollama continues a final assistant text
        fields: dict[str, Any] = {"messages": messages, **flags}
        choice = tool_choice(body.get("options"))
        if body.get("tools"):
            fields["tools"] = body["tools"]
            if choice is not None:
                fields["tool_choice"] = choice
        elif choice is not None:  # as the OpenAI route answers it: a forced call needs a tool to call
            raise InvalidRequest(f"options.tool_choice {choice!r} needs a non-empty tools list",
                                 param="options.tool_choice")
        return await self._generate(model, body, fields, arrival, raw, chat=True)

    async def generate(self, body: dict[str, Any], raw: Request) -> Response:
        arrival = time.monotonic()
        model = self.check_model(body)
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string", param="prompt")
        if not prompt and not body.get("context"):
            return self._load_reply(model, body, {"response": ""})
        if body.get("images"):
            raise InvalidRequest("images: this model takes no images", param="images")
        check_generate_fields(body)
        messages = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + \
            [{"role": "user", "content": prompt}]
        return await self._generate(model, body, {"messages": messages}, arrival, raw, chat=False)

    def _load_reply(self, model: str, body: dict[str, Any], empty: dict[str, Any]) -> JSONResponse:
        reason = "unload" if body.get("keep_alive") in (0, "0", "0s", "0m") else "load"
        return JSONResponse({"model": model, "created_at": created_at(), **empty, "done": True, "done_reason": reason})

    async def _generate(self, model: str, body: dict[str, Any], fields: dict[str, Any], arrival: float,
                        raw: Request, chat: bool) -> Response:
        manager, serving_chat = self.manager, self.server().chat
        assert manager.limits is not None and manager.tokenizer is not None
        fields.update(sampling_fields(body.get("options")))
        fmt = response_format(body.get("format"))
        if fmt is not None:
            fields["response_format"] = fmt
        req = ChatCompletionRequest.model_validate(fields)
        params = chat_sampling_params(req)
        think = body.get("think")
        parser = serving_chat.reasoning_parser
        if think not in (None, False) and parser is None:
            raise InvalidRequest("think: this server has no reasoning parser (start it with --reasoning-parser)",
                                 param="think")
        kwargs = {"enable_thinking": bool(think)} if think is not None else None
        # Ollama's template for a model that has none is `{{ .Prompt }}`: the prompt as it is, no system
        if not chat and (body.get("raw") or not getattr(manager.tokenizer, "chat_template", None)):
            ids = await run_tokenizer(manager, _encode_raw, body.get("prompt") or "")
        else:
            ids, _ = await run_tokenizer(manager, timed_chat_prompt_ids, req.messages, manager.limits.max_model_len,
                                         add_generation_prompt=req.add_generation_prompt is not False, tools=req.tools,
                                         chat_template_kwargs=kwargs,
                                         continue_final_message=bool(req.continue_final_message))
        context = body.get("context") if not chat else None
        if context:
            if not isinstance(context, list) or not all(_is_token_id(t) for t in context):
                raise InvalidRequest("context must be a list of token ids", param="context")
            ids = list(context) + ids
        reasoning = None
        if parser is not None and think is not False:
            end_ids = manager.tokenizer.encode(parser.end, add_special_tokens=False)
            reasoning = parser.new_state(end_ids, final_text(req.messages) if req.continue_final_message else None)
        calls = _call_reader(req, serving_chat.tool_parser)
        seqs = [Seq(ids, child_params(params, 0))]
        outputs = manager.generate(new_id("ollama"), seqs, arrival=arrival, prompt_param="messages" if chat else "prompt")
        timing = Timing(arrival, prompt_tokens=len(ids))
        parts = _parts(outputs, reasoning, calls, timing)
        shape = _ChatShape() if chat else _GenerateShape(ids)
        head = {"model": model}
        if body.get("stream", True) is False:
            try:  # a client gone before the end aborts the request in the engine
                return JSONResponse(await unless_disconnected(raw, _collect(parts, shape, head, timing)))
            except ClientDisconnected:
                return disconnected_response()
        return StreamingResponse(_stream(parts, shape, head, timing), media_type=NDJSON)

    # ---- the rest ----------------------------------------------------------------------------------
    async def embed(self, body: dict[str, Any], raw: Request) -> Response:
        arrival = time.monotonic()
        model = self.check_model(body)
        if body.get("dimensions") is not None:
            raise InvalidRequest("dimensions is not supported: this model's embeddings have one size", "dimensions")
        inputs = body.get("input")
        if not isinstance(inputs, (str, list)) or not all(isinstance(i, str) for i in ([inputs] if isinstance(
                inputs, str) else inputs)):
            raise InvalidRequest("input must be a string or a list of strings", param="input")
        server = self.server()
        # Ollama cuts an input to the context unless `truncate` is false (then: a 400, as OpenAI's route)
        vectors, tokens = await embed_inputs(self.manager, server.metrics, inputs, new_id("embed"),
                                             truncate=body.get("truncate", True))
        timing = Timing(arrival, prompt_tokens=tokens)
        fields = timing.fields()
        return JSONResponse({"model": model, "embeddings": [as_floats(v) for v in vectors],
                             "total_duration": fields["total_duration"], "load_duration": 0,
                             "prompt_eval_count": tokens})

    async def embeddings(self, body: dict[str, Any], raw: Request) -> Response:
        """The older /api/embeddings: one `prompt`, one `embedding` (what ollama.Client.embeddings sends)."""
        self.check_model(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("prompt must be a non-empty string", param="prompt")
        vectors, _ = await embed_inputs(self.manager, self.server().metrics, prompt, new_id("embed"), "prompt")
        return JSONResponse({"embedding": as_floats(vectors[0])})

    def show(self, body: dict[str, Any], raw: Request) -> JSONResponse:
        card = self.card()
        name = body.get("model") or body.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("model is required: the name of the model to show", param="model")
        if name not in card.names():
            raise RequestError(f"model '{name}' not found", 404)
        chat = self.server().chat
        # a model without one is rendered as Ollama's default template renders it (see _generate)
        template = getattr(self.manager.tokenizer, "chat_template", None) or "{{ .Prompt }}"
        return JSONResponse(card.show(template, chat.tool_parser is not None, chat.reasoning_parser is not None))


def _call_reader(req: ChatCompletionRequest, tool_parser: Any) -> CallReader | None:
    choice = req.tool_choice
    if choice == "required" or isinstance(choice, dict):  # generated under the tools' grammar
        return ForcedCallState(choice["function"]["name"] if isinstance(choice, dict) else None)
    if tool_parser is None or not req.tools or choice == "none":
        return None
    return tool_parser.new_state(req.tools)


class _Part:
    __slots__ = ("thinking", "content", "calls", "out")

    def __init__(self, thinking: str, content: str, calls: list[ToolCall], out: TextOutput) -> None:
        self.thinking, self.content, self.calls, self.out = thinking, content, calls, out


async def _parts(outputs: AsyncIterator[tuple[int, TextOutput]], reasoning: ReasoningState | None,
                 calls: CallReader | None, timing: Timing) -> AsyncIterator[_Part]:
    """Each output split into thought, answer and completed tool calls (the reasoning split first;
    calls are read from the answer only), as the chat path reads them."""
    async for _, out in outputs:
        timing.saw_output(out.num_output_tokens)
        thinking, text = "", out.text
        if reasoning is not None:
            pieces = [reasoning.feed(out.text, out.token_ids)] + ([reasoning.finish()] if out.finished else [])
            thinking, text = "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)
        found: list[ToolCall] = []
        if calls is not None:
            deltas = [calls.feed(text)] + ([calls.finish()] if out.finished else [])
            text, found = "".join(d.content for d in deltas), [c for d in deltas for c in d.calls]
        if out.finished and out.finish_reason == "abort":
            raise RequestError("the server aborted the request before it finished", 503)
        yield _Part(thinking, text, found, out)


def _call_json(call: ToolCall, index: int) -> dict[str, Any]:
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": json.loads(call.arguments)}}


class _ChatShape:
    """`message` with content, thinking and tool_calls."""

    def __init__(self) -> None:
        self.num_calls = 0

    def delta(self, part: _Part) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": part.content}
        if part.thinking:
            message["thinking"] = part.thinking
        if part.calls:
            message["tool_calls"] = [_call_json(c, self.num_calls + k) for k, c in enumerate(part.calls)]
            self.num_calls += len(part.calls)
        return {"message": message}

    def merge(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(p["message"]["content"] for p in parts)}
        thinking = "".join(p["message"].get("thinking", "") for p in parts)
        if thinking:
            message["thinking"] = thinking
        calls = [c for p in parts for c in p["message"].get("tool_calls", [])]
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    def final(self) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": ""}}


class _GenerateShape:
    """`response` (and `thinking`); the last line carries `context`, the conversation's token ids."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.context = list(prompt_ids)

    def delta(self, part: _Part) -> dict[str, Any]:
        self.context.extend(part.out.token_ids)
        body: dict[str, Any] = {"response": part.content}
        if part.thinking:
            body["thinking"] = part.thinking
        return body

    def merge(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"response": "".join(p["response"] for p in parts), "context": self.context}
        thinking = "".join(p.get("thinking", "") for p in parts)
        if thinking:
            body["thinking"] = thinking
        return body

    def final(self) -> dict[str, Any]:
        return {"response": "", "context": self.context}


async def _collect(parts: AsyncIterator[_Part], shape: Any, head: dict[str, Any], timing: Timing) -> dict[str, Any]:
    bodies, finish = [], None
    async for part in parts:
        bodies.append(shape.delta(part))
        if part.out.finished:
            finish = part.out.finish_reason
    return {**head, "created_at": created_at(), **shape.merge(bodies), "done": True,
            "done_reason": done_reason(finish), **timing.fields()}


async def _stream(parts: AsyncIterator[_Part], shape: Any, head: dict[str, Any], timing: Timing) -> AsyncIterator[str]:
    try:
        async for part in parts:
            delta = shape.delta(part)
            if part.content or part.thinking or part.calls:
                yield line({**head, "created_at": created_at(), **delta, "done": False})
            if part.out.finished:
                yield line({**head, "created_at": created_at(), **shape.final(), "done": True,
                            "done_reason": done_reason(part.out.finish_reason), **timing.fields()})
    except Exception as exc:  # the stream ends with an error line (the ollama client raises it), never hangs
        yield line({"error": as_request_error(exc).message})


def install_ollama(app: FastAPI, server: Callable[[], Any], model_path: str, auth: list[Any],
                   multi_model: bool = False) -> None:
    """Adds Ollama's routes to `app`; `server()` gives the state the OpenAI routes use; `multi_model`:
    behind the model router (its models come from --models-dir / --model, not from a store)."""
    serving = OllamaServing(server, model_path)
    router = APIRouter(dependencies=auth)

    def route(method: str, path: str,
              work: Callable[[dict[str, Any], Request], Awaitable[Response] | Response], status_code: int = 200) -> None:
        async def handler(raw: Request) -> Response:
            try:
                body = await read_body(raw) if method == "POST" else {}
                result = work(body, raw)
                return await result if isinstance(result, Awaitable) else result
            except Exception as exc:
                return ollama_error(exc)

        router.add_api_route(path, handler, methods=[method], status_code=status_code)

    route("POST", "/api/chat", serving.chat)
    route("POST", "/api/generate", serving.generate)
    route("POST", "/api/embed", serving.embed)
    route("POST", "/api/embeddings", serving.embeddings)
    route("POST", "/api/show", serving.show)
    route("GET", "/api/tags", lambda *_: JSONResponse({"models": [serving.card().tag()]}))
    route("GET", "/api/ps", lambda *_: JSONResponse({"models": [serving.card().running()]}))
    route("GET", "/api/version", lambda *_: JSONResponse({"version": OLLAMA_API_VERSION}))
    served = ("the models found in --models-dir or named with --model when it started" if multi_model
              else "the model it was started with")
    for name in MODEL_STORE:
        async def store(body: dict[str, Any], raw: Request, name: str = name) -> Response:
            raise RequestError(f"/api/{name.split('/')[0]} is not available: tokenmill serves {served} "
                               "and has no model store", 501)
        # Documented as what they answer: 501, always (the OpenAPI spec and its fuzz test see it so).
        route("DELETE" if name == "delete" else "POST", f"/api/{name}", store, status_code=501)
    # Anything else under /api/ answers in Ollama's shape too (the app's own 404 / 405 are OpenAI's):
    # the last route, so it only sees what no route above took, a known path with another method included.
    methods = {r.path: sorted(r.methods) for r in router.routes if isinstance(r, APIRoute)}

    async def elsewhere(raw: Request) -> JSONResponse:
        allowed = methods.get(raw.url.path)
        if allowed is None:
            return JSONResponse({"error": f"{raw.url.path} not found"}, status_code=404)
        return JSONResponse({"error": f"method {raw.method} not allowed on {raw.url.path}: use {', '.join(allowed)}"},
                            status_code=405, headers={"Allow": ", ".join(allowed)})

    router.add_api_route("/api/{rest:path}", elsewhere, include_in_schema=False,
                         methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    app.include_router(router)


def body_object(body: bytes) -> dict[str, Any]:
    """A POST body's top-level fields (an empty body: none); InvalidRequest when it is not a JSON object."""
    try:
        fields = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return fields


async def read_body(raw: Request) -> dict[str, Any]:
    """A POST body as Ollama's routes take it: a JSON object (InvalidRequest otherwise), its flags checked."""
    body = body_object(await raw.body())
    _check_flags(body)
    return body



def _encode_raw(tokenizer: Any, text: str) -> list[int]:
    """/api/generate with raw: the prompt as it is, no template (module level: tokenizer workers pickle it)."""
    return tokenizer.encode(text)


def _is_token_id(value: Any) -> bool:
    # bool is an int in Python, but not a token id: [true] must be refused here, not reach the engine.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# Ollama's boolean switches: a string such as "no" is truthy in Python, so it would silently mean yes.
_FLAGS = ("stream", "raw", "truncate")


def _check_flags(body: dict[str, Any]) -> None:
    for flag in _FLAGS:
        if flag in body and body[flag] is not None and not isinstance(body[flag], bool):
            raise InvalidRequest(f"{flag} must be true or false, got {body[flag]!r}", param=flag)
