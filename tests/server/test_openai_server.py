"""End to end through one real `tokenmill serve` on the bundled model, with the official openai SDK.

The server is the session's shared one (tests/conftest.py, with --api-key). What ends a server is
tested on servers of their own: a killed scheduler in test_overload.py, SIGTERM in
test_graceful_drain.py.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import API_KEY as KEY
from tests.conftest import AUTH
from tests.frontend.conftest import bundled_gguf_path
from tests.server.server_process import ServerProcess
from tokenmill.sample.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
]

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The history of the printing press begins"


@pytest.fixture(scope="module")
def llm(api_server_starting, reference_llm):
    return reference_llm  # built while the server loads the same model (when this module starts it)


@pytest.fixture(scope="module")
def server(api_server_starting, llm) -> ServerProcess:
    api_server_starting.wait_ready()
    return api_server_starting


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def labeled(server, series: str) -> float:
    """One labelled series of /metrics, e.g. 'tokenmill:request_success_total{finished_reason="abort"}' (0 when absent)."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")), 0.0)


def test_greedy_chat_and_completion_equal_the_offline_api(client, model, llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    chat = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=16)
    assert chat.choices[0].message.content == llm.chat(CHAT, greedy)[0].outputs[0].text
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens == len(llm.chat_prompt_ids(CHAT))
    offline = llm.generate(PROMPT, greedy)[0].outputs[0]
    comp = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=16)
    assert comp.choices[0].text == offline.text
    assert comp.usage.completion_tokens == len(offline.token_ids)
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + comp.usage.completion_tokens


def test_streaming_chat_with_usage(client, model):
    full = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True}
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_streaming_completion_token_prompt_and_echo(client, model, llm):
    ids = llm.tokenizer.encode(PROMPT)
    full = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=8)
    stream = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=8, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.prompt_tokens == len(ids)
    echoed = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=8, echo=True)
    assert echoed.choices[0].text == PROMPT + full.choices[0].text


def test_a_prompt_sent_again_reports_all_but_its_last_token_cached(client, model):
    # The first answer (16 tokens) fills the page that holds the prompt's end, so the repeat copies
    # that page (engine/scheduler.py, the partial page) and computes only its last token.
    prompt = "A question asked twice, about partial pages: " + "how much does a cache hit save? " * 3
    params = dict(model=model, prompt=prompt, temperature=0, max_tokens=16)
    first = client.completions.create(**params)
    again = client.completions.create(**params)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens % 16 != 1  # else whole pages alone would give the same count
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_n_samples_and_batch_prompts(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, n=2, seed=7, max_tokens=6, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1]
    assert 2 <= out.usage.completion_tokens <= 12  # both samples counted, each at most max_tokens
    again = client.chat.completions.create(model=model, messages=CHAT, n=2, seed=7, max_tokens=6, temperature=1.0)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]  # seeded
    batch = client.completions.create(model=model, prompt=["Hello", "Goodbye"], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy samples of one prompt agree


def test_every_extra_field_reaches_the_engine(client, model):
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 3, "stop_token_ids": [2],
              "include_stop_str_in_output": True, "skip_special_tokens": False,
              "spaces_between_special_tokens": False, "cache_salt": "tenant-a", "ignore_eos": False}
    comp = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, seed=3, user="u",
                                     presence_penalty=0.1, frequency_penalty=0.1, logit_bias={"100": -5},
                                     extra_body=extras)
    assert 3 <= comp.usage.completion_tokens <= 4  # min_tokens and max_tokens both honoured
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    chat = client.chat.completions.create(model=model, messages=parts, max_completion_tokens=3, temperature=0,
                                          tools=tools, extra_body={"chat_template_kwargs": {"x": 1}})
    assert chat.usage.completion_tokens <= 3


def test_stop_strings_match_the_offline_api(client, model, llm):
    offline = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    words = offline.text.split()
    stop = words[len(words) // 2]  # a word from the middle of the greedy continuation
    expected = offline.text[: offline.text.index(stop)]
    comp = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=24, stop=[stop],
                                      extra_body={"ignore_eos": True})
    assert comp.choices[0].text == expected
    assert comp.choices[0].finish_reason == "stop"
    assert comp.choices[0].model_extra.get("stop_reason") == stop
    streamed = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=24, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_request_timeline_from_both_processes(client, model, server):
    auth = {"Authorization": f"Bearer {KEY}"}
    done = client.completions.create(model=model, prompt="1, 2, 3, 4, 5,", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    got = httpx.get(f"{server.url}/v1/requests/{done.id}/timeline", headers=auth, timeout=30)
    assert got.status_code == 200, got.text
    seq = got.json()["sequences"][0]
    assert seq["status"] == "finished" and seq["finish_reason"] == "length"
    front = seq["frontend"]  # the API process's clock, from the HTTP arrival
    assert "template_rendered" not in front and "tokenizer" not in seq  # a completion has no template
    order = ["tokenized", "sent_to_scheduler", "first_text", "last_text", "last_byte_sent"]
    assert front["tokenized"] >= 0 and [front[s] for s in order] == sorted(front[s] for s in order)
    detok = seq["detokenizer"]  # the detokenizer's clock: durations only
    assert 0 < detok["busy_s"] <= detok["held_s"]
    # Durations on two clocks may be compared (never stamps): the detokenizer held the sequence for
    # part of the time between the API process tokenizing it and receiving its last text ("sent" is
    # stamped once send() returns, possibly after the detokenizer already heard of it).
    assert detok["held_s"] <= front["last_text"] - front["tokenized"]
    engine = seq["engine"]  # the scheduler's clock, from the engine's arrival
    stages = [e["stage"] for e in engine["events"]]
    assert stages[:2] == ["arrived", "scheduled"] and stages[-1] == "finished" and "first_token" in stages
    assert engine["num_output_tokens"] == 6 and engine["queue_time"] >= 0 and engine["prefill_time"] > 0
    # A stop string ends the text before the engine finishes: the engine's record follows it.
    stopped = client.completions.create(model=model, prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0,
                                        stop=[" 7,"], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 10
    while (seq := httpx.get(f"{server.url}/v1/requests/{stopped.id}/timeline", headers=auth, timeout=30).json()["sequences"][0])[
            "engine"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seq["finish_reason"] == "stop" and seq["engine"]["events"][-1]["reason"] == "stop"
    assert seq["detokenizer"]["held_s"] > 0  # the text ended in the detokenizer: its last text says so
    # A streamed chat: the template is a stage of its own; the last byte follows [DONE].
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0,
                                                 stream=True))
    deadline = time.monotonic() + 10
    while (seq := httpx.get(f"{server.url}/v1/requests/{chunks[0].id}/timeline", headers=auth, timeout=30).json()[
            "sequences"][0])["frontend"]["last_byte_sent"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    front = seq["frontend"]
    order = ["template_rendered", *order]
    assert list(front) == order and front["template_rendered"] >= 0
    assert [front[s] for s in order] == sorted(front[s] for s in order)
    assert seq["tokenizer"]["template_render_s"] > 0 and seq["tokenizer"]["encode_s"] > 0
    assert seq["tokenizer"]["in_worker_process"] is False
    missing = httpx.get(f"{server.url}/v1/requests/cmpl-nope/timeline", headers=auth, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_inline_timing_only_when_asked(client, model):
    keys = {"queue_time", "prefill_time", "first_token_latency", "decode_throughput"}
    plain = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert "timing" not in plain.model_dump()  # off by default
    timed = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4, temperature=0,
                                      extra_body={"include_timing": True, "ignore_eos": True})
    timing = timed.model_extra["timing"]
    assert set(timing) == keys and timing["queue_time"] >= 0 and timing["decode_throughput"] > 0
    assert timing["first_token_latency"] == pytest.approx(timing["queue_time"] + timing["prefill_time"])
    # streamed: one chunk with no choices carries it, just before [DONE]; a stop string ends this one
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count: 1, 2, 3,"}], max_tokens=20, temperature=0,
        stream=True, stop=[","], extra_body={"include_timing": True}))
    last = chunks[-1].model_extra
    assert chunks[-1].choices == [] and set(last["timing"]) == keys and last["timing"]["prefill_time"] > 0


def test_logprobs(client, model):
    chat = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=5, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy picks the best
    comp = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=5, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and lp.text_offset[0] == 0


def test_echo_with_prompt_logprobs_like_lm_eval(client, model, llm):
    ids = llm.tokenizer.encode(PROMPT)
    offline = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    expected = getattr(offline[0], "prompt_logprobs", None)
    body = {"model": model, "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    resp = httpx.post(f"{client.base_url}completions", json=body, headers=AUTH, timeout=60)
    if expected is None:  # an engine without prompt logprobs: a clear 400, never made-up numbers
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"
        return
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["text"] == llm.tokenizer.decode(ids)  # the prompt alone: max_tokens 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-4)
    assert resp.json()["usage"]["completion_tokens"] == 0
    both = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 0})
    assert len(both.choices[0].logprobs.tokens) == len(ids) + 2
    field = both.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and field[1][str(ids[1])]["logprob"] == pytest.approx(expected[1].logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b'{"prompt": "x", ', 400, None),  # invalid JSON
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [100] * 9000}, 400, "prompt"),  # longer than the context
        ("/v1/completions", {"prompt": [100] * 8000, "max_tokens": 500}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [49152]}, 400, "prompt"),  # outside the vocabulary
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=30, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_disconnect_aborts_and_frees_kv(server, model):
    aborted = 'tokenmill:request_success_total{finished_reason="abort"}'
    before = labeled(server, aborted)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH, timeout=60) as resp:
        lines = resp.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data:")) >= 1
        deadline = time.monotonic() + 10
        while metrics(server).get("tokenmill:num_requests_running", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metrics(server)["tokenmill:num_requests_running"] == 1
    assert_idle_soon(server)
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up
        httpx.post(url, json=body, headers=AUTH, timeout=2)
    assert_idle_soon(server)
    assert labeled(server, aborted) == before + 2  # both counted as finished for "abort", as vLLM does


def test_health_probes_are_not_counted_as_traffic(server):
    # /health sends a real one-token request through the engine; the token counters are the callers'.
    before = metrics(server)
    for _ in range(3):
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    time.sleep(1.0)  # the scheduler's stats after the probes' steps
    after = metrics(server)
    for name in ("tokenmill:prompt_tokens_total", "tokenmill:generation_tokens_total"):
        assert after[name] == before[name], name


def assert_idle_soon(server, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(server)
        idle = (m["tokenmill:num_requests_running"], m["tokenmill:num_requests_waiting"],
                m["tokenmill:kv_cache_usage_perc"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, m


def test_metrics_names(server):
    m = metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_hit_tokens_total", "prompt_tokens_total", "generation_tokens_total"):
        assert f"tokenmill:{name}" in m
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert m[f"tokenmill:{hist}_count"] > 0
    assert m["tokenmill:generation_tokens_total"] > 0


def test_conformance_endpoints_on_the_real_server(server, client, model):
    assert client.models.retrieve(model).id == model
    chat = client.chat.completions.with_raw_response.create(model=model, messages=CHAT, max_tokens=2,
                                                            extra_headers={"x-request-id": "trace-7"})
    assert chat.headers["x-request-id"] == "trace-7"
    prompt_tokens = chat.parse().usage.prompt_tokens
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, headers=AUTH, timeout=30).json()
    assert tokenized["count"] == prompt_tokens
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}, headers=AUTH, timeout=30)
    assert CHAT[0]["content"] in text.json()["prompt"]
    assert "POST /v1/chat/completions 200" in server.log_text() and "id=trace-7" in server.log_text()


def test_health_was_503_while_starting(server):
    assert 503 in server.health_codes and server.health_codes[-1] == 200
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_api_key_is_required_everywhere_but_health(server):
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)
            assert resp.status_code == 401, (path, resp.text)
            assert resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.request(method, f"{server.url}{path}", json=body, headers=AUTH, timeout=60).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
