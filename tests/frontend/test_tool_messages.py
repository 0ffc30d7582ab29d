"""Tool-use turns in a chat request: checked with a 400 naming the field, shaped for the template
(frontend/tool_messages.py through chat_template.render_chat_template)."""

from __future__ import annotations

import pytest

from tests.server.fake_server import client_of, fake_app
from tokenmill.errors import InvalidRequest
from tokenmill.frontend.chat_template import render_chat_template

USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ECHO = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
        "{% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %};{% endfor %}")


def render(*messages: dict) -> str:
    return render_chat_template(ECHO, list(messages), add_generation_prompt=False)


def test_a_round_trip_conversation_renders():
    out = render(USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "18C"})
    assert out == 'user:Weather in Paris?;assistant:[get_weather {"city": "Paris"}];tool:18C<call_1>;'
    # Arguments already an object (some clients), or empty (a call without arguments), are accepted.
    no_args = {"function": {"name": "now", "arguments": ""}}
    as_object = {"function": {"name": "f", "arguments": {"a": 1}}}
    assert render({"role": "assistant", "content": "", "tool_calls": [no_args, as_object]}) == \
        'assistant:[now {}][f {"a": 1}];'
    assert render({"role": "assistant", "content": "hi", "tool_calls": None}) == "assistant:hi;"


@pytest.mark.parametrize(("message", "where"), [
    ({"role": "tool", "content": "18C"}, "messages[0].tool_call_id is missing"),
    ({"role": "tool", "content": "18C", "tool_call_id": 7}, "messages[0].tool_call_id must be a non-empty string"),
    ({"role": "assistant", "content": "x", "tool_calls": []}, "messages[0].tool_calls must be a non-empty list"),
    ({"role": "assistant", "content": "x", "tool_calls": "f()"}, "messages[0].tool_calls must be a non-empty list"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "only an assistant message may carry tool calls"),
    ({"role": "assistant", "content": None, "tool_calls": ["f"]}, "messages[0].tool_calls[0] must be an object"),
    ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "type": "code"}]}, "tool_calls[0].type"),
    ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": 1}]}, "tool_calls[0].id must be a string"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, "tool_calls[0].function must be an object"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
     "tool_calls[0].function.name must be a non-empty string"),
    ({"role": "assistant", "content": None, "tool_calls": [CALL, {"function": {"name": "f", "arguments": "{a: 1"}}]},
     "messages[0].tool_calls[1].function.arguments is not valid JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "tool_calls[0].function.arguments must be a JSON object, got list"),
])
def test_malformed_tool_turns(message, where):
    with pytest.raises(InvalidRequest) as info:
        render(message)
    assert info.value.param == "messages" and where in info.value.message


def test_over_http_a_400_in_openai_format():
    app, _ = fake_app()
    bad = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "18C"}]
    with client_of(app) as http:
        resp = http.post("/v1/chat/completions", json={"messages": bad})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "messages" and error["type"] == "invalid_request_error"
        assert "messages[2].tool_call_id is missing" in error["message"]
        good = [*bad[:2], {**bad[2], "tool_call_id": "call_1"}]
        assert http.post("/v1/chat/completions", json={"messages": good, "max_tokens": 2}).status_code == 200
