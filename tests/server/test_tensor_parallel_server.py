"""The whole server with tensor parallelism (TP=3 on the bundled model, one thread a rank): greedy
output equal to transformers' and to the offline single-rank engine's, under chunked prefill beside
decode rows; streaming, abort mid-stream, the prefix cache and structured output; and no rank outlives
the server."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.frontend.conftest import bundled_gguf_path
from tests.server.server_process import ServerProcess, alive
from tests.test_fidelity import cases
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]
PROMPT = "The history of the printing press begins"


def tp_workers() -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"tokenmill.parallel.worker" in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def server():
    before = set(tp_workers())
    # A 256-token budget: the long fidelity prompt is prefilled in three chunks.
    srv = ServerProcess("--tensor-parallel-size", "3", "--max-num-batched-tokens", "256")
    try:
        srv.wait_ready()
        srv.tp_workers = [p for p in tp_workers() if p not in before]
        yield srv
    finally:
        srv.stop()
    assert len(srv.tp_workers) == 2
    deadline = time.monotonic() + 10
    while any(alive(p) for p in srv.tp_workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in srv.tp_workers), "a tensor-parallel rank outlived the server"


def complete(server, **body) -> dict:
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_greedy_text_equals_one_ranks(server, reference_llm):
    # 12 tokens: an exact-mode step of three ranks on two cores costs ~0.4 s
    expected = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0]
    assert complete(server, max_tokens=12)["choices"][0]["text"] == expected.outputs[0].text


def test_three_ranks_match_transformers_with_a_long_prompt_in_chunks(server, reference_llm):
    # SmolLM2-135M: 9 query / 3 KV heads, so TP=3 (TP=2 is refused: tests/parallel/test_sharding.py).
    # Exact mode: the all-reduce sums partial products in another order, yet every token agrees.
    # Sent together, the long prompt's chunks share steps with the others' decode rows; 8 new tokens:
    # the first tokens of the long prompt are where chunked prefill over the group would show.
    # (Whole 16-token runs of every prompt: tests/test_fidelity.py on one rank.)
    short, long_, chat = cases()[0], max(cases(), key=lambda c: len(c[0])), cases()[-1]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda c: complete(server, prompt=c[0], max_tokens=8, ignore_eos=True),
                             [short, long_, chat]))
    for out, (_, reference) in zip(outs, [short, long_, chat]):
        assert out["choices"][0]["text"] == reference_llm.tokenizer.decode(reference[:8])


def test_streaming_abort_and_the_prefix_cache(server):
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break  # the client goes away mid-stream: the engine aborts and frees its pages
    long_prompt = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(20))
    first = complete(server, prompt=long_prompt, max_tokens=4)
    again = complete(server, prompt=long_prompt, max_tokens=4)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200


def test_structured_output(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Name a city as JSON."}], "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert resp.status_code == 200, resp.text
    assert isinstance(json.loads(resp.json()["choices"][0]["message"]["content"])["city"], str)
