"""A server with n-gram speculation: same text as the offline API without it, streamed by unsent count
(a step that accepts several tokens sends them in one chunk), usage counts returned tokens only, and
/metrics reports what was proposed and accepted."""

from __future__ import annotations

import openai
import pytest

from tests.frontend.conftest import bundled_gguf_path
from tests.real_model import make_llm
from tests.server.server_process import ServerProcess
from tests.server.test_openai_server import metrics
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]

PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(10)) + " Item 10:"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--speculative-method", "ngram", "--num-speculative-tokens", "4")
    try:
        llm = make_llm(kv_cache_tokens=8192, num_threads=1)  # built while the server loads
        srv.wait_ready()
        yield srv, llm
    finally:
        srv.stop()


def test_streamed_and_whole_text_equal_the_offline_api_without_speculation(server):
    srv, llm = server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]
    whole = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=48)
    assert whole.choices[0].text == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=48, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == expected.text
    # Accepted drafts arrive together: fewer chunks than tokens.
    assert len([t for t in texts if t]) < len(expected.token_ids)
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    m = metrics(srv)
    assert m["tokenmill:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < m["tokenmill:spec_decode_num_accepted_tokens_total"] <= m["tokenmill:spec_decode_num_draft_tokens_total"]
    assert 0 < m["tokenmill:spec_decode_acceptance_rate"] <= 1
    assert m["tokenmill:spec_decode_mean_accepted_length"] > 1
