"""The tool-call parser read from the chat template (frontend/tool_parser_choice.py), on crafted
templates in each family's markup, and the warning when the flag contradicts the template."""

from __future__ import annotations

import json
import logging

import msgspec
import pytest
import tokenizers

from tests.server.fake_server import FakeManager, bundled_tokenizer, client_of
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.serving_chat import ChatServing
from tokenmill.frontend.chat_template import render_chat_template
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.frontend.tool_parser_choice import choose_tool_parser, detect_tool_format, markers_are_special
from tokenmill.frontend.tool_parsers import TOOL_PARSERS, get_tool_parser

# Excerpts in the shape of each family's real template (what the detection keys on).
HERMES = ("{% if tools %}You may call functions. For each call return a json object within <tool_call></tool_call>"
          ' tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>{% endif %}')
GLM45 = ("{% for m in messages %}{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function.name }}\n"
         "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>"
         "{{ v | tojson if v is not string else v }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}"
         "{% else %}{{ m.content }}{% endif %}{% endfor %}")
MISTRAL = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
LLAMA31 = "{% if builtin_tools %}<|python_tag|>{% endif %}<|start_header_id|>ipython<|end_header_id|>"
LLAMA32 = ('Respond with a JSON for a function call in the format {"name": function name, "parameters": '
           "dictionary of argument name and its value}.{% if m.role == 'ipython' %}{% endif %}")
QWEN3_CODER = "<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n</function>"
LLAMA4 = ("If you decide to invoke any of the function(s), you MUST put it in the format of "
          "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]")


@pytest.mark.parametrize(("template", "name"), [
    (HERMES, "hermes"), (GLM45, "glm45"), (MISTRAL, "mistral"), (LLAMA31, "llama3_json"), (LLAMA32, "llama3_json"),
    (QWEN3_CODER, "qwen3_coder"), (LLAMA4, "pythonic"), ("{{ messages[0].content }}", None), (None, None), ("", None),
])
def test_detect_tool_format(template, name):
    assert detect_tool_format(template) == name


def test_the_bundled_smollm2_template_gets_no_parser():
    # It renders no tools at all: the model never saw the tools, so nothing of its text is read as a call.
    template = bundled_tokenizer().chat_template
    assert template and "tools" not in template
    choice = choose_tool_parser(None, template)
    assert choice.parser is None and "not parsed" in choice.message and not choice.mismatch


def test_default_flag_match_and_mismatch():
    choice = choose_tool_parser(None, GLM45)
    assert choice.parser is TOOL_PARSERS["glm45"] and "read from the chat template" in choice.message
    choice = choose_tool_parser("glm45", GLM45)
    assert choice.parser is TOOL_PARSERS["glm45"] and not choice.mismatch
    choice = choose_tool_parser("hermes", GLM45)  # the flag wins, with a warning naming both
    assert choice.parser is TOOL_PARSERS["hermes"] and choice.mismatch
    assert "--tool-call-parser hermes" in choice.message and "glm45" in choice.message
    choice = choose_tool_parser("mistral", "{{ messages[0].content }}")  # nothing to contradict
    assert choice.parser is TOOL_PARSERS["mistral"] and not choice.mismatch


def serving(template: str, flag: str | None) -> ChatServing:
    tokenizer = Tokenizer(bundled_tokenizer().backend, chat_template=template)
    return ChatServing(FakeManager(tokenizer), tool_parser=get_tool_parser(flag) if flag else None)  # type: ignore[arg-type]


def test_chat_handler_picks_the_parser_at_start_up(caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.frontend.tool_parser_choice")
    chat = serving(HERMES, None)
    assert chat.tool_parser is None  # nothing is chosen before the tokenizer is loaded
    chat.choose_tool_parser()
    assert chat.tool_parser is TOOL_PARSERS["hermes"]
    assert any(r.levelno == logging.INFO and "parser hermes (read from the chat template" in r.message
               for r in caplog.records)
    caplog.clear()
    chat = serving(MISTRAL, "hermes")
    chat.choose_tool_parser()
    assert chat.tool_parser is TOOL_PARSERS["hermes"]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "writes mistral-style calls" in caplog.records[0].message


def test_glm45_template_and_parser_are_a_pair():
    # A past call as the template renders it reads back as the same call: arguments reach the template
    # as an object (frontend/tool_messages.py), typed values as JSON, strings raw.
    args = {"city": "Paris", "days": 3, "hourly": False, "zip": "75001"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}
    text = render_chat_template(GLM45, [{"role": "assistant", "content": None, "tool_calls": [call]}])
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"zip": {"type": "string"}}}}}
    found = get_tool_parser("glm45").new_state([tool]).feed(text)
    assert found.content == "" and [(c.name, json.loads(c.arguments)) for c in found.calls] == [("get_weather", args)]


class DecodingManager(FakeManager):
    """Decodes its reply as the real detokenizer would, with each request's skip_special_tokens."""

    async def generate(self, request_id, seqs, **kwargs):  # type: ignore[override]
        async for i, out in super().generate(request_id, seqs, **kwargs):
            skip = seqs[i].params.skip_special_tokens
            yield i, msgspec.structs.replace(out, text=self.tokenizer.decode(out.token_ids, skip_special_tokens=skip))


def test_markers_that_are_special_tokens_are_kept_for_tool_requests():
    # Hermes 2/3 and Mistral tokenizers mark their call markers special: skipped, no call could be read.
    backend = tokenizers.Tokenizer.from_str(bundled_tokenizer().backend.to_str())
    backend.add_special_tokens(["<tool_call>", "</tool_call>"])
    special = Tokenizer(backend, chat_template=HERMES + "{{ messages[0].content }}")
    assert markers_are_special(TOOL_PARSERS["hermes"], special)
    assert not markers_are_special(TOOL_PARSERS["hermes"], bundled_tokenizer())
    state = ServerState()
    state.attach(DecodingManager(special, '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'),
                 ServerMetrics(lambda: None))  # type: ignore[arg-type]
    state.chat.choose_tool_parser()
    tools = [{"type": "function", "function": {"name": "f"}}]
    with client_of(build_app(ServerConfig(), state=state)) as http:
        def message(**body: object) -> dict:
            resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["message"]

        call = message(tools=tools)["tool_calls"][0]["function"]
        assert call == {"name": "f", "arguments": '{"a": 1}'}
        # Without tools (or with tool_choice none) the request's own skip_special_tokens holds.
        assert message()["content"] == '{"name": "f", "arguments": {"a": 1}}'
        assert message(tools=tools, tool_choice="none")["content"] == '{"name": "f", "arguments": {"a": 1}}'
