"""Structured output on the bundled model: JSON schemas, regex, choice and EBNF through xgrammar's token
bitmasks; a mixed batch whose free rows are untouched; matcher rollback; bad specs rejected up front."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tests.real_model import make_llm  # noqa: E402
from tokenmill.errors import InvalidRequest  # noqa: E402
from tokenmill.sample.sampling_params import SamplingParams, StructuredOutputParams  # noqa: E402

pytestmark = pytest.mark.slow

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
                                  "maxItems": 3}},
        "required": ["colors"],
    },
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "angry"]}, "level": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["mood", "level"],
    },
    "bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age", "score"],
    },
}
PROMPT = [{"role": "user", "content": "Give me a JSON object describing a person."}]


def so(**kw) -> StructuredOutputParams:
    return StructuredOutputParams(**kw)


@pytest.fixture(scope="module")
def llm():
    return make_llm(kv_cache_tokens=8192)  # 2 threads: the suite has the machine to itself


def assert_idle(llm) -> None:
    stats = llm.stats()
    assert stats["kv_pages_in_use"] == 0 and stats["num_requests_running"] == 0
    llm.check_integrity()
    assert not llm.engine.grammars.active()


def test_json_schemas_validate(llm):
    # Each schema greedy and sampled, all in one batch.
    cases = [(n, t) for t in (0.0, 1.0) for n in SCHEMAS]
    params = [
        SamplingParams(temperature=t, seed=7, max_tokens=160, structured_output=so(json_schema=SCHEMAS[n]))
        for n, t in cases
    ]
    outs = llm.chat([PROMPT] * len(cases), params)
    for case, out in zip(cases, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (case, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMAS[case[0]])
    assert_idle(llm)


def test_seeded_structured_output_is_reproducible(llm):
    # The same seed in two rows of a batch gives the same text; a later call with it gives the same
    # first tokens (a smaller max_tokens cuts the text; it does not change the tokens before the cut).
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=160, structured_output=so(json_schema=SCHEMAS["nested"]))
    first, second = (o.outputs[0] for o in llm.chat([PROMPT, PROMPT], [p, p]))
    assert first.text == second.text
    jsonschema.validate(json.loads(first.text), SCHEMAS["nested"])
    again = llm.chat(PROMPT, dataclasses.replace(p, max_tokens=16))[0].outputs[0].token_ids
    assert again == first.token_ids[:16]


def test_json_object_regex_choice_grammar(llm):
    params = [
        SamplingParams(temperature=0.0, max_tokens=160, structured_output=so(json_object=True)),
        SamplingParams(temperature=0.0, max_tokens=40, structured_output=so(regex=r"\d{4}-\d{2}-\d{2}")),
        SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_output=so(choice=["red", "green", "blue"])),
        SamplingParams(temperature=0.0, max_tokens=40, structured_output=so(grammar='root ::= ("yes" | "no") "!"')),
    ]
    prompts = [PROMPT, [{"role": "user", "content": "When did Apollo 11 land?"}],
               [{"role": "user", "content": "Pick a color."}], [{"role": "user", "content": "Is the sky blue?"}]]
    json_obj, date, color, yes_no = (o.outputs[0] for o in llm.chat(prompts, params))
    assert isinstance(json.loads(json_obj.text), dict), json_obj.text
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.text), date.text
    assert color.text in ("red", "green", "blue")
    assert yes_no.text in ("yes!", "no!")
    assert all(o.finish_reason == "stop" for o in (json_obj, date, color, yes_no))
    assert_idle(llm)


def test_mixed_batch_leaves_free_rows_alone(llm):
    free_prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free)]
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=160, structured_output=so(json_schema=SCHEMAS["bounds"])),
        # Bounded, so that any seed's draw ends well within max_tokens (an unbounded [a-z]+ once did not).
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_output=so(regex=r"[a-z]{1,12} [0-9]{3}")),
    ]
    prompts = ["A JSON person:", free_prompts[0], free_prompts[1], "Code:", free_prompts[2]]
    params = [constrained[0], free, free, constrained[1], free]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [outs[1].token_ids, outs[2].token_ids, outs[4].token_ids] == alone
    jsonschema.validate(json.loads(outs[0].text), SCHEMAS["bounds"])
    assert re.fullmatch(r"[a-z]{1,12} [0-9]{3}", outs[3].text), outs[3].text
    assert_idle(llm)


def test_constrained_request_survives_preemption(llm):
    # A 4-page pool (16-token pages): three 14-token prompts fit one page each, then each needs a second;
    # the newest (the constrained one) is preempted, recomputes, and its matcher state must still hold.
    spec = so(json_schema=SCHEMAS["bounds"])
    target = llm.tokenizer.encode("A JSON person with an age and a score:")[:14]
    want = SamplingParams(temperature=1.0, seed=11, max_tokens=40, structured_output=spec)
    alone = llm.generate({"prompt_token_ids": target}, want)[0].outputs[0].token_ids
    tiny = make_llm(kv_cache_tokens=64)
    engine = tiny.engine
    free = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    for i, word in enumerate(("dogs", "ships")):
        engine.add_request(f"f{i}", tiny.tokenizer.encode(f"A short story about {word}, told simply")[:14], free)
    engine.add_request("target", target, want)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "target":
                tokens.extend(out.new_token_ids)
    assert engine.stats()["num_preemptions"] >= 1
    assert tokens == alone
    jsonschema.validate(json.loads(tiny.tokenizer.decode(tokens)), SCHEMAS["bounds"])
    assert_idle(tiny)


def test_n_samples_each_get_a_matcher(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=160, structured_output=so(json_schema=SCHEMAS["enum"]))
    outs = llm.chat(PROMPT, p)[0].outputs
    assert len(outs) == 3
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMAS["enum"])
    assert_idle(llm)


def test_ignore_eos_still_ends_when_the_grammar_does(llm):
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, structured_output=so(choice=["alpha", "beta"]))
    o = llm.generate("Pick one:", p)[0].outputs[0]
    assert o.text in ("alpha", "beta") and o.finish_reason == "stop"


def test_matcher_rollback(llm):
    manager = llm.engine.grammars.manager()
    spec = so(json_schema=SCHEMAS["bounds"])
    matcher = manager.matcher(manager.submit(spec))
    ids = llm.tokenizer.encode('{"age":42,"score":0.5}', add_special_tokens=False)
    vocab = llm.engine.vocab_size

    def allowed() -> list[int]:
        import torch
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_bitmask(mask, 0)
        logits = torch.zeros(1, vocab)
        xgr.apply_token_bitmask_inplace(logits, mask)
        return (logits[0] == 0).nonzero().view(-1).tolist()

    k = 3
    for t in ids[:-k]:
        assert matcher.accept_token(t)
    before = allowed()
    for t in ids[-k:]:
        assert matcher.accept_token(t)
    assert matcher.accept_token(min(llm.tokenizer.eos_token_ids)) and matcher.is_terminated()
    matcher.rollback(k + 1)
    assert not matcher.is_terminated() and allowed() == before
    for t in ids[-k:]:  # the same path is accepted again after the rollback
        assert matcher.accept_token(t)
    assert not matcher.accept_token(ids[0])  # a second object is not part of the grammar
    # The same schema (keys in another order) is compiled once.
    reordered = so(json_schema=json.loads(json.dumps(SCHEMAS["bounds"], sort_keys=True)))
    assert manager.submit(reordered) is manager.submit(spec)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (so(json_schema='{"type": "object"', param="response_format"), "response_format"),
        (so(json_schema={"type": "nonsense"}, param="guided_json"), "guided_json"),
        (so(regex="(unclosed", param="guided_regex"), "guided_regex"),
        (so(grammar="root ::= missing_rule", param="guided_grammar"), "guided_grammar"),
    ],
)
def test_bad_specs_raise_before_queueing(llm, spec, fragment):
    with pytest.raises(InvalidRequest) as err:
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=spec))
    assert err.value.param == fragment and fragment in err.value.message
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished()
    assert not llm.engine.grammars.pending


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json_object": True, "regex": "a"}, {"regex": ""}, {"choice": []}, {"choice": ["a", 1]},
     {"json_schema": 3}, {"json_object": 1}],
)
def test_structured_output_params_validation(kwargs):
    with pytest.raises(InvalidRequest):
        StructuredOutputParams(**kwargs)


def test_compile_failure_aborts_only_that_request(llm, monkeypatch):
    manager = llm.engine.grammars.manager()
    backend = manager.backend

    def broken(spec):
        raise RuntimeError("simulated xgrammar fault")

    monkeypatch.setattr(backend, "compile", broken)
    spec = so(regex=r"[0-9]{7} broken")  # unique: not served from the cache
    engine = llm.engine
    engine.add_request("broken", llm.tokenizer.encode("Hi"), SamplingParams(max_tokens=8, structured_output=spec))
    engine.add_request("fine", llm.tokenizer.encode("Hi"), SamplingParams(temperature=0.0, max_tokens=4))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"broken": "abort", "fine": "length"}
    monkeypatch.undo()
    assert manager.submit(spec).result() is not None  # the failure was not cached
    assert_idle(llm)
