"""Chat templates: ids equal transformers' for the bundled model; errors are InvalidRequest."""

from __future__ import annotations

from typing import Any

import pytest
import tokenizers

from tokenmill.errors import InvalidRequest
from tokenmill.frontend.chat_template import render_chat_template
from tokenmill.frontend.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 中文 please 🙂"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  \n\nnewlines"}],
]


def hf_ids(hf: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])  # transformers 5 returns a BatchEncoding


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_ids_match_transformers(
    smol_tokenizer: Tokenizer,
    hf_smol_tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    ours = smol_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_ids(hf_smol_tokenizer, messages, add_generation_prompt)


def test_content_parts_are_flattened(smol_tokenizer: Tokenizer, hf_smol_tokenizer: Any) -> None:
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
    ]
    # SmolLM's template concatenates strings, so parts become one string (joined by newlines, as vLLM does).
    as_strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first\nsecond"}]
    assert smol_tokenizer.apply_chat_template(parts) == hf_ids(hf_smol_tokenizer, as_strings)


def test_templates_that_loop_over_parts_get_parts() -> None:
    template = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat_template(template, messages) == "[a][b]"


def test_template_environment_like_transformers() -> None:
    template = (
        "{{ tools | tojson }}|{{ messages[0].content | tojson }}|{{ bos_token }}{{ eos_token }}|{{ flag }}|"
        "{% generation %}gen{% endgeneration %}|{{ strftime_now('%Y') | length }}|"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    text = render_chat_template(
        template,
        [{"role": "user", "content": "<é>"}],
        tools=[{"name": "f"}],
        bos_token="<s>",
        eos_token="</s>",
        chat_template_kwargs={"flag": True},
    )
    # tojson keeps non-ASCII and does not HTML-escape, unlike Jinja's built-in filter.
    assert text == '[{"name": "f"}]|"<é>"|<s></s>|True|gen|4|01'


def test_trim_and_lstrip_blocks() -> None:
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indentation before one.
    template = "{% for m in messages %}\n    {% if m.content %}{{ m.content }}{% endif %}\n{% endfor %}"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "x"


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "wizard", "content": "hi"}],
        ["not a dict"],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
)
def test_bad_messages(smol_tokenizer: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        smol_tokenizer.apply_chat_template(messages)
    assert info.value.param == "messages"


@pytest.mark.parametrize(("part", "says"), [
    ({"type": "text"}, "a text part's text must be a string"),
    ({"type": "text", "text": 5}, "a text part's text must be a string"),
    ({"type": "image_url", "image_url": {"url": "x"}}, "only text parts are supported, got 'image_url'"),
])
def test_a_bad_content_part_says_what_is_wrong(smol_tokenizer: Tokenizer, part: Any, says: str) -> None:
    with pytest.raises(InvalidRequest, match=f"messages\\[0\\].content: {says}"):
        smol_tokenizer.apply_chat_template([{"role": "user", "content": [part]}])


def test_assistant_tool_call_without_content_is_allowed() -> None:
    # Null content renders as empty text (vLLM's rule) and the arguments as an object, as templates expect.
    template = "{% for m in messages %}{{ m.role }}={{ m.content }}|{{ m.tool_calls[0].function.arguments.a }};" \
               "{% endfor %}"
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 7}'}}
    assert render_chat_template(template, [{"role": "assistant", "tool_calls": [call]}]) == "assistant=|7;"


def test_missing_template(smol_tokenizer: Tokenizer) -> None:
    bare = Tokenizer(tokenizers.Tokenizer.from_str(smol_tokenizer.backend.to_str()), chat_template=None)
    with pytest.raises(InvalidRequest, match="the model has no chat template") as info:
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"


def test_template_errors_name_the_problem() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", messages)
    with pytest.raises(InvalidRequest, match="does not parse"):
        render_chat_template("{% for %}", messages)
    with pytest.raises(InvalidRequest, match="could not render these messages") as info:
        render_chat_template("{{ 'a' + 1 }}", messages)
    assert "TypeError" not in info.value.message  # internals stay in the log
    # The sandbox stops templates from reaching Python internals.
    with pytest.raises(InvalidRequest):
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", messages)
    with pytest.raises(InvalidRequest):
        render_chat_template("{% set ns = namespace(_x=1) %}", messages)


def test_reserved_kwargs_are_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        render_chat_template("x", [{"role": "user", "content": "hi"}], chat_template_kwargs={"messages": []})
    assert info.value.param == "chat_template_kwargs"
