"""Every bad sampling parameter is refused with an InvalidRequest naming it."""

from __future__ import annotations

import math

import pytest

from tokenmill.errors import InvalidRequest
from tokenmill.sample.sampling_params import SamplingParams

BAD = [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", 2.0),
    ("min_p", -0.1),
    ("min_p", math.nan),
    ("n", 0),
    ("n", -1),
    ("n", True),
    ("n", 10**9),  # each sample is an engine request: this once queued for minutes without a word
    ("logprobs", 21),
    ("logprobs", -1),
    ("prompt_logprobs", 21),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.1),
    ("frequency_penalty", math.nan),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {3: 101.0}),
    ("logit_bias", {3: math.nan}),
    ("logit_bias", {"3": 1.0}),
    ("bad_words_token_ids", [-1]),
    ("bad_words_token_ids", [1.5]),
    ("stop_token_ids", [-3]),
    ("seed", 1.5),
    ("seed", False),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stream_interval", 0),
]


@pytest.mark.parametrize(("param", "value"), BAD, ids=[f"{p}={v!r}" for p, v in BAD])
def test_bad_value_names_param(param: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{param: value})
    assert info.value.param == param


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert info.value.param == "min_tokens"


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0),
        dict(top_k=0),
        dict(top_k=-1),
        dict(top_k=1),
        dict(top_p=1.0),
        dict(min_p=1.0),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(presence_penalty=-2.0),
        dict(logit_bias={0: -100.0}),
        dict(seed=0),
        dict(max_tokens=None),
        dict(stop="x"),
    ],
)
def test_good_values_accepted(kw: dict) -> None:
    SamplingParams(**kw)


@pytest.mark.parametrize(
    ("param", "kw"),
    [
        ("logit_bias", dict(logit_bias={100: 1.0})),
        ("stop_token_ids", dict(stop_token_ids=[101])),
        ("bad_words_token_ids", dict(bad_words_token_ids=[5, 100])),
    ],
)
def test_check_token_ids_rejects_out_of_vocab(param: str, kw: dict) -> None:
    params = SamplingParams(**kw)
    with pytest.raises(InvalidRequest) as info:
        params.check_token_ids(100)
    assert info.value.param == param
    params.check_token_ids(102)


def test_seed_must_fit_in_64_bits():
    import pytest

    from tokenmill.errors import InvalidRequest
    from tokenmill.sample.sampling_params import SamplingParams

    SamplingParams(seed=2**64 - 1)
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(seed=2**64)
    assert e.value.param == "seed"
