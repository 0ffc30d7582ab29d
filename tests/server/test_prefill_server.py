"""A final assistant message continued, not answered, on every route that has one (fake manager that
records each prompt): chat completions under vLLM's `continue_final_message` (and `echo`), /tokenize,
Anthropic's prefill, Ollama's chat; what cannot be continued is a 400 naming the field."""

from __future__ import annotations

import anthropic
import pytest

from tests.server.fake_server import bundled_tokenizer, client_of, sdk_client
from tests.server.test_responses_api import RecordingManager, app_with
from tokenmill.entrypoints.openai.api_server import ServerConfig, ServerState, build_app
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.frontend.reasoning_parser import get_reasoning_parser

QUESTION = {"role": "user", "content": "What is the capital of France?"}
START = "The capital of France is"
PREFILLED = [QUESTION, {"role": "assistant", "content": START}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def ends_inside_the_turn(prompt: str) -> bool:
    return prompt.endswith("<|im_start|>assistant\n" + START)


def test_chat_continues_the_final_message_and_echo_starts_the_content_with_it():
    app, manager = app_with(" Paris.")
    with client_of(app) as http:
        client = sdk_client(http)
        plain = client.chat.completions.create(model="fake-model", messages=PREFILLED, extra_body=CONTINUE)
        echoed = client.chat.completions.create(model="fake-model", messages=PREFILLED,
                                                extra_body={**CONTINUE, "echo": True})
        stream = client.chat.completions.create(model="fake-model", messages=PREFILLED, stream=True,
                                                extra_body={**CONTINUE, "echo": True})
        streamed = "".join(c.choices[0].delta.content or "" for c in stream)
        new_turn = client.chat.completions.create(model="fake-model", messages=PREFILLED, extra_body={"echo": True})
        ids = http.post("/tokenize", json={"model": "fake-model", "messages": PREFILLED, **CONTINUE}).json()["tokens"]
    assert all(ends_inside_the_turn(p) for p in manager.prompts[:3])
    assert plain.choices[0].message.content == " Paris."
    assert echoed.choices[0].message.content == streamed == START + " Paris."
    # echo repeats an assistant's final turn even when the reply opens a new one (vLLM's rule)
    assert manager.prompts[3].endswith(START + "<|im_end|>\n<|im_start|>assistant\n")
    assert new_turn.choices[0].message.content == START + " Paris."
    assert manager.tokenizer.decode(ids, skip_special_tokens=False) == manager.prompts[0]


def test_echo_is_the_final_message_s_whole_text_in_its_role():
    app, manager = app_with(" 4, 5,")
    parts = [{"type": "text", "text": "The capital"}, {"type": "text", "text": "of France is"}]
    with client_of(app) as http:
        client = sdk_client(http)
        joined = client.chat.completions.create(model="fake-model", extra_body={**CONTINUE, "echo": True},
                                                messages=[QUESTION, {"role": "assistant", "content": parts}])
        counting = [{"role": "user", "content": "Count: 1, 2, 3,"}]
        user = client.chat.completions.create(model="fake-model", messages=counting, extra_body={**CONTINUE, "echo": True})
        stream = client.chat.completions.create(model="fake-model", messages=counting, stream=True,
                                                extra_body={**CONTINUE, "echo": True})
        chunks = list(stream)
    assert manager.prompts[0].endswith("The capital\nof France is")
    assert joined.choices[0].message.content == "The capital\nof France is 4, 5,"
    # with no new turn the reply goes on with the final message's turn: its role, its text echoed (vLLM)
    assert (user.choices[0].message.role, user.choices[0].message.content) == ("user", "Count: 1, 2, 3, 4, 5,")
    assert chunks[0].choices[0].delta.role == "user"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Count: 1, 2, 3, 4, 5,"


@pytest.mark.parametrize(("body", "says"), [
    ({"continue_final_message": True}, "cannot both be true"),
    ({**CONTINUE, "messages": [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "needs a final message with text"),
])
def test_what_cannot_be_continued_is_a_400(body, says):
    app, _ = app_with("x")
    with client_of(app) as http:
        reply = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": PREFILLED, **body})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert says in error["message"] and error["param"] == "continue_final_message"


def test_anthropic_prefill_is_continued_and_the_reply_is_only_what_follows():
    app, manager = app_with(" Paris.")
    with client_of(app) as http:
        client = anthropic.Anthropic(base_url=str(http.base_url), api_key="k", http_client=http, max_retries=0)
        msg = client.messages.create(model="fake-model", max_tokens=5, messages=PREFILLED)
        count = client.messages.count_tokens(model="fake-model", messages=PREFILLED)
        empty = client.messages.create(model="fake-model", max_tokens=5, messages=[
            QUESTION, {"role": "assistant", "content": []}])
        with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
            client.messages.create(model="fake-model", max_tokens=5, messages=[
                QUESTION, {"role": "assistant", "content": START + " "}])
        with pytest.raises(anthropic.BadRequestError, match="only an empty assistant turn"):
            client.messages.create(model="fake-model", max_tokens=5, messages=[{"role": "assistant", "content": []}])
    assert ends_inside_the_turn(manager.prompts[0]) and msg.content[0].text == " Paris."
    assert count.input_tokens == msg.usage.input_tokens
    # an empty final turn is no prefill: the reply opens its own turn
    assert manager.prompts[1].endswith(QUESTION["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert empty.content[0].text == " Paris."


def test_ollama_chat_continues_a_final_assistant_message():
    app, manager = app_with(" Paris.")
    with client_of(app) as http:
        reply = http.post("/api/chat", json={"model": "fake-model", "messages": PREFILLED, "stream": False}).json()
        asked = http.post("/api/chat", json={"model": "fake-model", "messages": [QUESTION], "stream": False}).json()
        empty = http.post("/api/chat", json={"model": "fake-model", "stream": False, "messages": [
            QUESTION, {"role": "assistant", "content": ""}]}).json()
    assert ends_inside_the_turn(manager.prompts[0]) and reply["message"]["content"] == " Paris."
    assert manager.prompts[1].endswith("<|im_start|>assistant\n") and asked["message"]["content"] == " Paris."
    assert manager.prompts[2] == manager.prompts[1] and empty["message"]["content"] == " Paris."  # the open turn


TRIMMING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def app_of(tokenizer, reply: str, reasoning: str | None = None):
    manager = RecordingManager(tokenizer, reply)
    state = ServerState()
    state.attach(manager, ServerMetrics(lambda: None),  # type: ignore[arg-type]
                 get_reasoning_parser(reasoning) if reasoning else None)
    return build_app(ServerConfig(), state=state), manager


def test_an_empty_final_assistant_message_opens_the_turn_even_under_a_trimming_template():
    app, manager = app_of(bundled_tokenizer().with_chat_template(TRIMMING), " Paris.")
    with client_of(app) as http:
        for messages in ([QUESTION, {"role": "assistant", "content": ""}], [QUESTION]):
            assert http.post("/api/chat", json={"model": "fake-model", "messages": messages,
                                                "stream": False}).status_code == 200
    assert manager.prompts[0] == manager.prompts[1] and manager.prompts[0].endswith("<|im_start|>assistant\n")


def test_a_prefilled_answer_is_no_thought_under_deepseek_r1_s_parser():
    # DeepSeek-R1's parser reads a new turn's output as thinking until </think>; a continued answer is
    # an answer (Anthropic's text, Ollama's content), and a prefill that opened a thought goes on thinking.
    app, _ = app_of(bundled_tokenizer(), " Paris.", reasoning="deepseek_r1")
    with client_of(app) as http:
        msg = http.post("/v1/messages", json={"model": "fake-model", "max_tokens": 5, "messages": PREFILLED}).json()
        chat = http.post("/api/chat", json={"model": "fake-model", "messages": PREFILLED, "stream": False}).json()
        thought = http.post("/api/chat", json={"model": "fake-model", "stream": False, "messages": [
            QUESTION, {"role": "assistant", "content": "<think>"}]}).json()
    assert msg["content"] == [{"type": "text", "text": " Paris."}]
    assert chat["message"]["content"] == " Paris." and not chat["message"].get("thinking")
    assert thought["message"]["thinking"] == " Paris." and thought["message"]["content"] == ""
