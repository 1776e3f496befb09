from __future__ import annotations

import math

import pytest

from shared.errors import (
    EngineDead,
    EngineError,
    InvalidRequest,
    InvalidSamplingParams,
    InvalidTokenIds,
    PromptTooLong,
    RequestTooLarge,
)
from shared.sampling_params import MAX_STOP_STRINGS, SamplingParams

VOCAB = 1280

# (kwargs, param named in the error, fragments the message must contain)
INVALID = [
    ({"temperature": -0.1}, "temperature", ["[0, inf)", "-0.1"]),
    ({"temperature": math.nan}, "temperature", ["[0, inf)", "nan"]),
    ({"temperature": math.inf}, "temperature", ["[0, inf)"]),
    ({"temperature": "0.5"}, "temperature", ["number", "'0.5'"]),
    ({"temperature": True}, "temperature", ["number", "True"]),
    ({"top_p": 0.0}, "top_p", ["(0, 1]", "0.0"]),
    ({"top_p": 1.5}, "top_p", ["(0, 1]", "1.5"]),
    ({"top_k": -2}, "top_k", ["[-1, inf)", "disables", "-2"]),
    ({"top_k": 2.5}, "top_k", ["integer", "2.5"]),
    ({"min_p": -0.01}, "min_p", ["[0, 1]"]),
    ({"min_p": 1.01}, "min_p", ["[0, 1]"]),
    ({"presence_penalty": 2.5}, "presence_penalty", ["[-2, 2]", "2.5"]),
    ({"presence_penalty": -2.01}, "presence_penalty", ["[-2, 2]"]),
    ({"frequency_penalty": -3}, "frequency_penalty", ["[-2, 2]", "-3"]),
    ({"repetition_penalty": 0.0}, "repetition_penalty", ["(0, inf)", "0.0"]),
    ({"repetition_penalty": -1.0}, "repetition_penalty", ["(0, inf)"]),
    ({"max_tokens": 0}, "max_tokens", ["None or an integer in [1, inf)", "got 0"]),
    ({"max_tokens": 1.0}, "max_tokens", ["integer", "1.0"]),
    ({"min_tokens": -1}, "min_tokens", ["[0, inf)", "-1"]),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens", ["at most max_tokens (16)", "17"]),
    ({"logprobs": -1}, "logprobs", ["[0, 20]", "-1"]),
    ({"logprobs": 21}, "logprobs", ["[0, 20]", "21"]),
    ({"seed": 2**63}, "seed", ["integer in [-9223372036854775808, 9223372036854775807]"]),
    ({"seed": "7"}, "seed", ["integer", "'7'"]),
    ({"n": 2}, "n", ["must be 1", "got 2"]),
    ({"ignore_eos": 1}, "ignore_eos", ["true or false", "1"]),
    ({"skip_special_tokens": None}, "skip_special_tokens", ["true or false"]),
    ({"stop": [""]}, "stop", ["non-empty strings", "''"]),
    ({"stop": ["ok", 3]}, "stop", ["non-empty strings", "3"]),
    ({"stop": 3}, "stop", ["string or a list of strings", "3"]),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop", [f"at most {MAX_STOP_STRINGS}", "got 17"]),
    ({"stop_token_ids": [5, VOCAB]}, "stop_token_ids", [f"[0, {VOCAB})", f"[{VOCAB}]"]),
    ({"stop_token_ids": [-1]}, "stop_token_ids", [f"[0, {VOCAB})", "[-1]"]),
    ({"stop_token_ids": ["5"]}, "stop_token_ids", ["['5']"]),
]


@pytest.mark.parametrize(("kwargs", "param", "fragments"), INVALID, ids=[str(k) for k, _, _ in INVALID])
def test_invalid_values_raise_with_useful_message(kwargs, param, fragments):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs).validate(VOCAB)
    err = info.value
    assert err.param == param
    assert str(err).startswith(param + " ")
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))


VALID = [
    {},
    {"temperature": 0},
    {"temperature": 0.0, "top_k": 1},
    {"top_k": -1},
    {"top_k": 100_000},
    {"top_p": 1e-9, "min_p": 1.0},
    {"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1e-3},
    {"max_tokens": None, "min_tokens": 10_000},
    {"min_tokens": 16, "max_tokens": 16},
    {"logprobs": 0},
    {"logprobs": 20},
    {"seed": -(2**63)},
    {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)]},
    {"stop_token_ids": [0, VOCAB - 1]},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[str(k) for k in VALID])
def test_valid_values_pass(kwargs):
    SamplingParams(**kwargs).validate(VOCAB)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.max_tokens, p.min_tokens) == ([], [], 16, 0)
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output, p.n) == (
        False, None, True, False, 1)


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_default_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_is_greedy_threshold():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().is_greedy


def test_all_stop_token_ids_respects_ignore_eos():
    assert SamplingParams(stop_token_ids=[3]).all_stop_token_ids({7}) == {3, 7}
    assert SamplingParams(stop_token_ids=[3], ignore_eos=True).all_stop_token_ids({7}) == {3}


def test_error_hierarchy_maps_to_client_errors():
    err = InvalidSamplingParams("top_p bad", param="top_p")
    assert isinstance(err, InvalidRequest) and isinstance(err, ValueError) and isinstance(err, EngineError)
    assert err.code == "invalid_sampling_params"


@pytest.mark.parametrize(("err", "cls_code", "fragments"), [
    (PromptTooLong(5000, 4096), "prompt_too_long", ["5000 tokens", "at most 4096", "1..4096"]),
    (InvalidTokenIds([1280, -1, 9999, 1281, 1282, 1283, 1284], VOCAB), "invalid_token_ids",
     ["1280, -1, 9999, 1281, 1282 and 2 more", f"[0, {VOCAB})"]),
    (RequestTooLarge(70_000, 65_536), "request_too_large", ["70000 tokens", "at most 65536"]),
])
def test_request_errors_say_what_is_wrong_and_what_is_allowed(err, cls_code, fragments):
    assert isinstance(err, InvalidRequest) and err.code == cls_code
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))


def test_engine_dead_is_not_a_client_error():
    err = EngineDead()
    assert isinstance(err, EngineError) and not isinstance(err, InvalidRequest)
    assert err.code == "engine_dead" and "stopped" in str(err)
