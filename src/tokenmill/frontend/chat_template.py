"""Render a model's Jinja chat template the way transformers does, so prompts match Hugging Face's.

Templates come from model files, i.e. from strangers: they run in jinja2's immutable sandbox, and
everything they see is rebuilt from plain JSON types.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.errors import InvalidRequest
from tokenmill.frontend.final_message import cut_at_tag, tag_final_message
from tokenmill.frontend.tool_messages import shape_tool_fields

logger = logging.getLogger(__name__)

# OpenAI's roles, plus Llama 3's "ipython" (tool results in its templates).
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")

# Variables the caller sets through named arguments; chat_template_kwargs may not override them.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt"})

# A template that loops over a message's content wants OpenAI-style parts; one that also tests
# `is string` copes with both, and then plain strings are the safe choice.
_ITERATES_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[\w.\[\]'\"]*content\b")
_TESTS_STRING = re.compile(r"\bis\s+string\b")


def load_chat_template(value: str) -> str:
    """`--chat-template`'s argument (vLLM's rule): a file's text, or the argument itself when it
    looks like a template; a name that looks like a path to a missing file is an error."""
    path = os.path.expanduser(value)
    if os.path.isdir(path):
        raise ValueError(f"--chat-template {value!r} is a folder; give a template file or the template itself")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        where = f"--chat-template {value!r}"
    elif any(c in value for c in "{}\n"):
        text, where = value, "--chat-template"
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template either")
    try:
        _compile(text)  # a syntax error now, not as a 400 blaming the model at the first request
    except InvalidRequest as exc:
        problem = str(exc).replace("the model's chat template", "the template")
        raise ValueError(f"{where}: {problem}") from None
    return text


def render_chat_template(
    template: str | None,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text for `messages`; every user-facing problem is an InvalidRequest. With
    `continue_final_message` the text ends inside the final message (frontend/final_message.py)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true: set "
                             "add_generation_prompt to false to continue the final message",
                             param="continue_final_message")
    if not template:
        raise InvalidRequest(
            "the model has no chat template (a base model?): start the server with --chat-template "
            "FILE_OR_JINJA, or use /v1/completions with a prompt", param="messages")
    extra = dict(chat_template_kwargs or {})
    if clash := sorted(_RESERVED & extra.keys()):
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(clash)}; use the request fields",
            param="chat_template_kwargs",
        )
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequest("tools must be a list of objects", param="tools")
    compiled = _compile(template)
    as_parts = bool(_ITERATES_CONTENT.search(template)) and not _TESTS_STRING.search(template)
    normalized = _normalize_messages(messages, as_parts)
    final = tag_final_message(normalized, messages) if continue_final_message else ""
    variables = {
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
        **_plain(extra),
        "messages": normalized,
        "tools": _plain(tools),
        "add_generation_prompt": bool(add_generation_prompt),
    }
    try:
        rendered = compiled.render(**variables)
    except jinja2.TemplateError as exc:  # raise_exception() in the template, or a sandbox refusal
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
    except Exception as exc:  # e.g. TypeError from `'x' + message['content']` on an unexpected type
        # The exception's text speaks of the template's internals, not of the request: log it only.
        logger.info("the chat template failed: %s: %s", type(exc).__name__, exc)
        raise InvalidRequest(
            "the chat template could not render these messages: a field has a type or value it does not "
            "accept (check each message's role and content)", param="messages",
        ) from exc
    return cut_at_tag(rendered, final) if continue_final_message else rendered


def _normalize_messages(messages: Any, as_parts: bool) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of message objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(
                f"messages[{i}] must be an object, got {type(message).__name__}", param="messages"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}] needs a 'role' string", param="messages")
        if role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(map(repr, ROLES))}, got {role!r}", param="messages"
            )
        message = _plain(dict(message))
        if message.get("content") is None:
            # OpenAI lets an assistant turn that only calls tools omit its content (or send null).
            if not (role == "assistant" and message.get("tool_calls")):
                state = "is null" if "content" in message else "is missing"
                raise InvalidRequest(
                    f"messages[{i}].content {state}: {'an' if role[0] in 'aeiou' else 'a'} {role} message needs "
                    "text content "
                    "(only an assistant message with tool_calls may leave it out)", param="messages",
                )
            # Empty text, as vLLM renders it: templates that concatenate content (SmolLM2's) would fail on None.
            message["content"] = [] if as_parts else ""
        message["content"] = _content(message["content"], i, as_parts)
        shape_tool_fields(message, i)
        out.append(message)
    return out


def _content(content: Any, index: int, as_parts: bool) -> Any:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"messages[{index}].content must be a string or a list of content parts", param="messages"
        )
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            why = ("a text part's text must be a string" if kind == "text"
                   else f"only text parts are supported, got {kind!r}")
            raise InvalidRequest(f"messages[{index}].content: {why}", param="messages")
        texts.append(part["text"])
    if as_parts:
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)  # vLLM joins text parts the same way for string-content templates


def _plain(value: Any) -> Any:
    """A copy made only of JSON types: objects with methods could let a template escape the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise InvalidRequest(
        f"unsupported value of type {type(value).__name__} in the chat request", param="messages"
    )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only render it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes, as transformers does, to keep dunders out of reach."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, ') which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequest(
            f"the model's chat template does not parse (line {exc.lineno}): {exc.message}", param="messages"
        ) from exc
