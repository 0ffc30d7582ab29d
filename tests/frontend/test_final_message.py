"""Continuing the final message (frontend/final_message.py): the prompt ends inside the final message,
as transformers' `continue_final_message` renders it, and every way it cannot is a clear 400."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.errors import InvalidRequest
from tokenmill.frontend.chat_template import render_chat_template
from tokenmill.frontend.final_message import message_text, split_prefill
from tokenmill.frontend.tokenizer import Tokenizer

QUESTION = {"role": "user", "content": "What is the capital of France?"}


@pytest.mark.parametrize("start", ["The capital of France is", "Sure: ", "  spaced", "  both  ", "第一"])
def test_ids_match_transformers(smol_tokenizer: Tokenizer, hf_smol_tokenizer: Any, start: str) -> None:
    messages = [QUESTION, {"role": "assistant", "content": start}]
    ours = smol_tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    out = hf_smol_tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                                tokenize=True)
    assert ours == list(out if isinstance(out, list) else out["input_ids"])
    text = smol_tokenizer.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith(start) and "<|im_end|>" not in text[-len(start) - 12:]


def test_an_empty_final_message_continued_is_the_open_turn(smol_tokenizer: Tokenizer) -> None:
    continued = smol_tokenizer.render_chat([QUESTION, {"role": "assistant", "content": ""}],
                                           add_generation_prompt=False, continue_final_message=True)
    assert continued == smol_tokenizer.render_chat([QUESTION], add_generation_prompt=True)


def test_a_template_that_trims_the_message_is_cut_after_what_it_kept() -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello there  "}]
    assert render_chat_template(template, messages, add_generation_prompt=False,
                                continue_final_message=True) == "<user>Hi</s><assistant>Hello there"
    assert messages[1]["content"] == "  Hello there  "  # the caller's messages are left as they were


def test_the_last_text_part_is_the_one_continued() -> None:
    template = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"
    messages = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat_template(template, messages, add_generation_prompt=False, continue_final_message=True) == "[a][b"


@pytest.mark.parametrize(("messages", "flags", "says"), [
    ([QUESTION, {"role": "assistant", "content": "x"}], {}, "cannot both be true"),
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     {"add_generation_prompt": False}, "needs a final message"),
])
def test_what_cannot_be_continued_is_refused(smol_tokenizer: Tokenizer, messages: list, flags: dict, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as info:
        smol_tokenizer.render_chat(messages, continue_final_message=True, **flags)
    assert info.value.param == "continue_final_message"


def test_a_template_that_rewrites_the_message_is_refused() -> None:
    template = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    with pytest.raises(InvalidRequest, match="does not write the final message's text as it is"):
        render_chat_template(template, [{"role": "assistant", "content": "abc"}], add_generation_prompt=False,
                             continue_final_message=True)


def test_split_prefill_continues_a_final_assistant_text_and_leaves_out_an_empty_one() -> None:
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    prefilled = [QUESTION, {"role": "assistant", "content": "The"}]
    assert split_prefill(prefilled) == (prefilled, continued)
    assert split_prefill([QUESTION]) == ([QUESTION], {})
    spaced = [{"type": "text", "text": "The"}, {"type": "text", "text": " "}]  # blank only in its last part
    assert split_prefill([QUESTION, {"role": "assistant", "content": spaced}])[1] == continued
    for empty in ("", " \n", None, [], [{"type": "text", "text": " "}]):
        assert split_prefill([QUESTION, {"role": "assistant", "content": empty}]) == ([QUESTION], {})
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calling = [QUESTION, {"role": "assistant", "content": "x", "tool_calls": [call]}]
    assert split_prefill(calling) == (calling, {})
    with pytest.raises(InvalidRequest, match="only an empty assistant turn"):
        split_prefill([{"role": "assistant", "content": ""}])


def test_message_text_joins_text_parts_as_string_templates_see_them() -> None:
    parts = [{"type": "text", "text": "Paris."}, {"type": "text", "text": "Also,"}]
    assert message_text({"role": "assistant", "content": parts}) == "Paris.\nAlso,"
    assert message_text({"role": "assistant", "content": "x"}) == "x"
