"""A model without a chat template (a base model) gets a 400 on /v1/chat/completions that names
--chat-template; the flag's template (a file or inline Jinja) is then the one the server renders."""

from __future__ import annotations

import pytest

from tests.server.fake_server import FakeManager, bundled_tokenizer, client_of
from tokenmill.entrypoints.cli import main
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.chat_template import load_chat_template
from tokenmill.frontend.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def app_with(tokenizer: Tokenizer):
    manager = FakeManager(tokenizer)
    state = ServerState()
    state.attach(manager, ServerMetrics(lambda: None))  # type: ignore[arg-type]
    return client_of(build_app(ServerConfig(), state=state))  # type: ignore[arg-type]


def without_template() -> Tokenizer:
    return bundled_tokenizer().with_chat_template("")


def test_chat_without_a_template_is_a_400_naming_the_flag():
    response = app_with(without_template()).post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "--chat-template" in error["message"] and error["param"] == "messages"
    # Completions need no template.
    assert app_with(without_template()).post("/v1/completions", json={"model": "fake-model", "prompt": "Hi",
                                                                       "max_tokens": 4}).status_code == 200


def test_the_flag_s_template_is_rendered():
    tokenizer = without_template().with_chat_template(TEMPLATE)
    response = app_with(tokenizer).post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    http = app_with(tokenizer)
    ids = http.post("/tokenize", json={"model": "fake-model", "messages": CHAT["messages"]}).json()["tokens"]
    assert tokenizer.decode(ids) == "<user>Hi\n<a>"


def test_flag_takes_a_file_or_inline_jinja(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template("missing/template.jinja")
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}")
    with pytest.raises(SystemExit) as info:  # the CLI refuses it before anything starts
        main(["serve", "--chat-template", "missing/template.jinja"])
    assert info.value.code == 2
    # A file is parsed at start too: it once passed, and every chat request got a 400 blaming the model.
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}", encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.jinja'?: the template does not parse \(line 1\)"):
        load_chat_template(str(broken))
    with pytest.raises(ValueError, match="is a folder"):
        load_chat_template(str(tmp_path))


def test_ollama_generate_without_a_template_sends_the_prompt_as_it_is():
    # Ollama renders a model that has no template with `{{ .Prompt }}`; its chat route still needs one.
    tokenizer = without_template()
    http = app_with(tokenizer)
    reply = http.post("/api/generate", json={"model": "fake-model", "prompt": "1, 2, 3,", "system": "Count.",
                                             "stream": False})
    assert reply.status_code == 200, reply.text
    prompt = tokenizer.encode("1, 2, 3,")
    context = reply.json()["context"]
    assert context[:len(prompt)] == prompt and len(context) > len(prompt)
    chat = http.post("/api/chat", json={"model": "fake-model", "messages": CHAT["messages"], "stream": False})
    assert chat.status_code == 400 and "--chat-template" in chat.json()["error"]
    assert http.post("/api/show", json={"model": "fake-model"}).json()["template"] == "{{ .Prompt }}"
    # a request's own Go template cannot run here: a 400 that says what does, not a silent ignore
    own = http.post("/api/generate", json={"model": "fake-model", "prompt": "Hi", "template": "{{ .Prompt }}!"})
    assert own.status_code == 400 and "raw: true" in own.json()["error"]
