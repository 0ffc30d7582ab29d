"""Issue 15: a prompt certainly longer than the context is rejected from its length alone, before it
is tokenized, with the same 400 as the token-count check; one that may fit is still tokenized."""

from __future__ import annotations

import pytest

from tests.server.fake_server import MAX_MODEL_LEN, MODEL, client_of, fake_app
from tokenmill.frontend.tokenizer import Tokenizer

HUGE = "All work and no play makes a dull model. " * 8_000  # 328k characters: >= 4050 tokens by the bound


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch):
    app, _ = fake_app()
    calls: list[int] = []
    real_encode = Tokenizer.encode

    def counting_encode(self: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(len(text))
        return real_encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", counting_encode)
    with client_of(app) as c:
        c.encode_calls = calls  # type: ignore[attr-defined]
        yield c


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": HUGE}, "prompt"),
    ("/v1/completions", {"prompt": ["short", HUGE]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
])
def test_certainly_too_long_is_rejected_untokenized(client, route: str, body: dict, param: str) -> None:
    r = client.post(route, json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert error["message"].startswith(f"this model's context length is {MAX_MODEL_LEN} tokens, but the prompt has "
                                       "at least ")
    assert all(n < len(HUGE) for n in client.encode_calls)  # the huge text never reached the tokenizer


def test_a_prompt_under_the_bound_is_still_counted_exactly(client) -> None:
    # ~50k characters: the bound (617) allows it, the real count (~11k tokens) does not.
    text = HUGE[:50_000]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "at least" not in error["message"]
    assert client.encode_calls == [len(text)]
