"""The router's remembered sampling check gives every request the verdict of `to_sampling_params`."""
from __future__ import annotations

import pytest

from router.sampling_check import SamplingCheck
from shared.errors import InvalidRequest
from shared.openai.convert import to_sampling_params
from shared.openai.requests import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]
BODIES = [
    {"model": "m", "messages": MSG},
    {"model": "m", "messages": MSG, "stream": True},
    {"model": "m", "messages": MSG, "temperature": 0.5, "top_p": 0.9, "seed": 3},
    {"model": "m", "messages": MSG, "temperature": -1.0},                    # refused
    {"model": "m", "messages": MSG, "max_tokens": 0},                        # refused
    {"model": "m", "messages": MSG, "top_k": 0},
    {"model": "m", "messages": MSG, "use_beam_search": True},                # refused (an extra field)
    {"model": "m", "messages": MSG, "stop": ["x"], "logit_bias": {"5": 1.0}},  # not keyed: always checked
    {"model": "m", "messages": MSG, "logit_bias": {"x": 1.0}},               # refused, not keyed
]


def _verdict(fn, req) -> str | None:
    try:
        fn(req)
    except InvalidRequest as exc:
        return f"{type(exc).__name__}: {exc.param}: {exc}"
    return None


@pytest.mark.parametrize("rounds", [1, 3])
def test_every_request_gets_the_verdict_of_a_full_check(rounds: int) -> None:
    check = SamplingCheck()
    for _ in range(rounds):                       # cold, then from what the check remembers
        for body in BODIES:
            req = ChatCompletionRequest.model_validate(body)
            assert _verdict(check, req) == _verdict(to_sampling_params, req), body
    assert len(check._accepted) == 4              # the four accepted all-scalar parameter sets


def test_keys_tell_types_and_endpoints_apart() -> None:
    check = SamplingCheck()
    seed = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "seed": 1})
    flag = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "seed": 1, "x_extra": True})
    flag_int = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "seed": 1, "x_extra": 1})
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "seed": 1})
    other_prompt = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "yo"}],
                                                         "seed": 1})
    assert len({check._key(r) for r in (seed, flag, flag_int, completion)}) == 4      # True == 1, but not here
    assert check._key(other_prompt) == check._key(seed)                             # the prompt is not a parameter
    assert check._key(ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "stop": ["x"]})) is None


def test_bounded() -> None:
    check = SamplingCheck(max_keys=3)
    for i in range(10):
        check(ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "seed": i}))
    assert len(check._accepted) <= 3
