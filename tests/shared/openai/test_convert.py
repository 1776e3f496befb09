"""Requests -> engine inputs (sampling params, render options) and logprobs builders."""
from __future__ import annotations

import json
import math

import pytest

from shared.errors import InvalidRequest, InvalidSamplingParams
from shared.openai.convert import (
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    image_urls,
    render_options,
    to_sampling_params,
)
from shared.openai.errors import error_from_exception
from shared.openai.models import ChatCompletionRequest, CompletionRequest
from shared.prompt.chat import render_chat
from shared.prompt.tokenizer import KimiTokenizer

PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5E"
       "rkJggg==")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "kimi-k3", "prompt": "Once upon", **fields})


def rejected(fn, *args, **kwargs) -> tuple[int, str | None, str]:
    with pytest.raises(InvalidRequest) as info:
        fn(*args, **kwargs)
    status, body = error_from_exception(info.value)
    return status, body.error.param, body.error.message


# ---- to_sampling_params --------------------------------------------------------------------------

def test_chat_fields_map_to_sampling_params():
    params = to_sampling_params(chat(
        temperature=0.3, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.5, seed=7, stop=["\n\n", "END"], stop_token_ids=[3], max_completion_tokens=64,
        max_tokens=5, min_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=4, include_stop_str_in_output=True))
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.3, 0.9, 40, 0.05)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.1, 0.5, -0.5)
    assert (params.seed, params.stop, params.stop_token_ids) == (7, ["\n\n", "END"], [3])
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (64, 2, True)  # max_completion_tokens wins
    assert (params.logprobs, params.include_stop_str_in_output, params.n) == (4, True, 1)
    assert params.skip_special_tokens is False  # the K3 parsers need the markers (stripped after parsing)


@pytest.mark.parametrize("fields, max_tokens", [({}, None), ({"max_tokens": 9}, 9), ({"max_completion_tokens": 8}, 8)])
def test_chat_max_tokens(fields, max_tokens):
    assert to_sampling_params(chat(**fields)).max_tokens == max_tokens


@pytest.mark.parametrize("fields, logprobs", [({}, None), ({"logprobs": True}, 0),
                                              ({"logprobs": True, "top_logprobs": 5}, 5), ({"top_logprobs": 0}, None)])
def test_chat_logprobs_mapping(fields, logprobs):
    assert to_sampling_params(chat(**fields)).logprobs == logprobs


def test_completion_fields_and_vllm_defaults():
    params = to_sampling_params(completion(stop="\n", logprobs=3, skip_special_tokens=False))
    assert (params.max_tokens, params.stop, params.logprobs, params.skip_special_tokens) == (16, ["\n"], 3, False)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (1, 1, 0, 0, 1)
    assert to_sampling_params(completion(max_tokens=None)).max_tokens == 16  # null means the default


def test_server_defaults_fill_only_omitted_fields():
    defaults = {"temperature": 0.6, "top_p": 0.95, "max_tokens": 512}
    params = to_sampling_params(chat(temperature=0.2), defaults=defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.95, 512)
    assert to_sampling_params(chat(max_completion_tokens=3), defaults=defaults).max_tokens == 3
    with pytest.raises(ValueError, match="unknown default"):
        to_sampling_params(chat(), defaults={"temprature": 0.6})


@pytest.mark.parametrize("request_, param, words", [
    (chat(temperature=-1), "temperature", "temperature must be"),
    (chat(top_p=0), "top_p", "top_p must be"),
    (chat(seed=2**64), "seed", "seed must be"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs must be"),
    (chat(max_completion_tokens=0), "max_completion_tokens", "max_completion_tokens must be"),
    (chat(max_tokens=0), "max_tokens", "max_tokens must be"),
    (chat(min_tokens=5, max_tokens=2), "min_tokens", "at most max_tokens"),
    (chat(stop=[""]), "stop", "non-empty"),
    (completion(logprobs=21), "logprobs", "logprobs must be"),
    (completion(max_tokens=0), "max_tokens", "unless echo or prompt_logprobs"),
])
def test_out_of_range_values_name_the_request_field(request_, param, words):
    status, got_param, message = rejected(to_sampling_params, request_)
    assert (status, got_param) == (400, param)
    assert words in message


def test_stop_token_ids_checked_against_the_vocabulary():
    assert rejected(to_sampling_params, chat(stop_token_ids=[5, 99]), vocab_size=50)[1] == "stop_token_ids"
    assert to_sampling_params(chat(stop_token_ids=[5, 99])).stop_token_ids == [5, 99]  # router: no vocab


@pytest.mark.parametrize("fields, param", [
    ({"logprobs_processors_x": None, "logits_processors": ["x"]}, "logits_processors"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"best_of": 2}, "best_of"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_unsupported_features_are_refused_not_ignored(fields, param):
    assert rejected(to_sampling_params, chat(**fields))[:2] == (400, param)


def test_harmless_settings_of_unsupported_features_pass():
    to_sampling_params(chat(response_format={"type": "text"}, logit_bias={}, best_of=1))


# ---- render_options / chat_messages --------------------------------------------------------------

def test_render_options_defaults_and_aliases():
    assert render_options(chat()) == {"tools": None, "thinking": True, "thinking_effort": None}
    assert render_options(chat(reasoning_effort="low"))["thinking_effort"] == "low"
    assert render_options(chat(chat_template_kwargs={"thinking_effort": "high"}))["thinking_effort"] == "high"
    for kwargs in ({"thinking": False}, {"enable_thinking": False}):
        assert render_options(chat(chat_template_kwargs=kwargs, reasoning_effort="max")) == {
            "tools": None, "thinking": False, "thinking_effort": None}


def test_reasoning_effort_none_turns_thinking_off_and_medium_is_accepted():
    assert render_options(chat(reasoning_effort="none")) == {"tools": None, "thinking": False, "thinking_effort": None}
    assert render_options(chat(reasoning_effort="medium"))["thinking_effort"] == "medium"


def test_vllm_032_efforts_minimal_and_xhigh_are_the_nearest_k3_efforts():
    assert render_options(chat(reasoning_effort="minimal")) == render_options(chat(reasoning_effort="low"))
    assert render_options(chat(reasoning_effort="xhigh")) == render_options(chat(reasoning_effort="max"))
    assert render_options(chat(reasoning_effort="xhigh"))["thinking"] is True


def test_the_effort_text_lists_exactly_the_accepted_values():
    import re

    from shared.prompt.chat import THINKING_EFFORT_BODY, THINKING_EFFORTS
    assert tuple(re.findall(r"`(\w+)`", THINKING_EFFORT_BODY.split("\n")[0])[1:]) == THINKING_EFFORTS


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"thinking": "no"}}, "chat_template_kwargs.thinking"),
    ({"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"thinking_effort": "extreme"}}, "chat_template_kwargs.thinking_effort"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"thinking_effort": "max"}}, "reasoning_effort"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice"),
])
def test_render_options_refusals(fields, param):
    assert rejected(render_options, chat(**fields))[:2] == (400, param)


def test_tools_declared_unless_tool_choice_none():
    declared = render_options(chat(tools=[WEATHER_TOOL]))["tools"]
    assert declared == [WEATHER_TOOL]
    assert chat(tools=[WEATHER_TOOL]).tools_requested
    assert render_options(chat(tools=[WEATHER_TOOL], tool_choice="none"))["tools"] is None
    assert not chat(tools=[WEATHER_TOOL], tool_choice="none").tools_requested


AGENT_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather where this was taken?"},
                                 {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}}]},
    {"role": "assistant", "content": None, "reasoning_content": "Paris, by the tower.",
     "tool_calls": [{"id": "get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "get_weather:0", "content": "18C, sunny"},
]


def test_openai_conversation_renders_identically_after_a_round_trip():
    tokenizer = KimiTokenizer.generated()
    req = chat(messages=AGENT_TURNS, tools=[WEATHER_TOOL], reasoning_effort="high")
    again = ChatCompletionRequest.model_validate_json(json.dumps(req.model_dump(mode="json", exclude_unset=True)))

    def render(r):
        return render_chat(tokenizer, chat_messages(r), **render_options(r), image_token_counts=[4],
                           image_sizes=[(1, 1)]).token_ids

    ids = render(req)
    assert ids == render(again)  # the router's prefix hashes match the worker's prompt
    text = tokenizer.decode(ids)
    assert "get_weather" in text and "18C, sunny" in text and "Paris, by the tower." in text
    assert text.count("<|media_pad|>") == 4
    assert image_urls(req) == [PNG]


# ---- logprobs ------------------------------------------------------------------------------------

VOCAB = {1: "Hel", 2: "lo", 3: "!", 4: "lo"}


def test_chat_logprobs_shape():
    out = chat_logprobs([1, 2], [-0.1, -math.inf], [[(1, -0.1), (3, -2.5)], None], VOCAB.__getitem__,
                        token_bytes=lambda i: VOCAB[i].encode() + (b"\xe2" if i == 2 else b""))
    first, second = out.model_dump()["content"]
    assert first == {"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108], "top_logprobs": [
        {"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108]}, {"token": "!", "logprob": -2.5, "bytes": [33]}]}
    assert second == {"token": "lo", "logprob": -9999.0, "bytes": [108, 111, 0xE2], "top_logprobs": []}


def test_completion_logprobs_shape():
    out = completion_logprobs([1, 2, 3], [-0.5, -1.0, -0.25], [[(2, -0.7), (4, -0.9)], [(4, -0.2)], None],
                              VOCAB.__getitem__, text_offset=10)
    assert out.tokens == ["Hel", "lo", "!"]
    assert out.token_logprobs == [-0.5, -1.0, -0.25]
    assert out.text_offset == [10, 13, 15]
    # sampled token added; "lo" twice (ids 2 and 4) keeps the better logprob
    assert out.top_logprobs == [{"lo": -0.7, "Hel": -0.5}, {"lo": -0.2}, None]
    with pytest.raises(ValueError):
        completion_logprobs([1, 2], [-0.5], None, VOCAB.__getitem__)


def test_sampling_errors_are_engine_typed():
    with pytest.raises(InvalidSamplingParams):
        to_sampling_params(chat(top_k=-2))


@pytest.mark.parametrize("make, fields, param", [
    (chat, {"add_generation_prompt": False}, "add_generation_prompt"),
    (chat, {"continue_final_message": True}, "continue_final_message"),
    (chat, {"include_reasoning": False}, "include_reasoning"),
    (completion, {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    (chat, {"thinking_token_budget": 100}, "thinking_token_budget"),
])
def test_fields_that_would_be_ignored_are_refused_by_name(make, fields, param):
    status, got, message = rejected(to_sampling_params, make(**fields))
    assert (status, got) == (400, param) and message.startswith(param)


def test_those_fields_at_their_defaults_pass():
    to_sampling_params(chat(add_generation_prompt=True, continue_final_message=False, include_reasoning=True,
                            return_token_ids=False, skip_special_tokens=False, cache_salt=None))
    to_sampling_params(completion(skip_special_tokens=True, stream=True, stream_options={"include_usage": True}))


def test_forced_tool_choice_becomes_a_tool_call_grammar():
    forced = to_sampling_params(chat(tools=[WEATHER_TOOL], tool_choice="required")).structured_output
    assert forced.kind == "xtml" and 'get_weather' in forced.value
    named = chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert to_sampling_params(named).structured_output.kind == "xtml"
    both = chat(tools=[WEATHER_TOOL], tool_choice="required", response_format={"type": "json_object"})
    assert rejected(to_sampling_params, both)[:2] == (400, "tool_choice")


def test_with_thinking_on_a_chat_grammar_starts_after_the_reasoning():
    """vLLM's reasoning-aware structured output: the grammar constrains the answer, not the reasoning."""
    fields = [{"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "[0-9]+"}},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}}]
    for given in fields:
        assert to_sampling_params(chat(**given)).structured_output.after_reasoning
        for off in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": False}}):
            assert not to_sampling_params(chat(**given, **off)).structured_output.after_reasoning
        assert not to_sampling_params(completion(**given)).structured_output.after_reasoning
    forced = to_sampling_params(chat(tools=[WEATHER_TOOL], tool_choice="required")).structured_output
    assert not forced.after_reasoning               # the tool-call grammar closes the reasoning itself


@pytest.mark.parametrize("make, fields, param", [
    (chat, {"watermarking": True}, "watermarking"),
    (completion, {"length_penalty": 0.5}, "length_penalty"),
    (chat, {"logprob_token_ids": [1, 2]}, "logprob_token_ids"),
    (completion, {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    (chat, {"documents": [{"title": "a", "text": "b"}]}, "documents"),
    (chat, {"media_io_kwargs": {"image": {}}}, "media_io_kwargs"),
    (chat, {"mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
    (completion, {"ec_transfer_params": {"a": 1}}, "ec_transfer_params"),
    (chat, {"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    (chat, {"routed_experts_prompt_start": 3}, "routed_experts_prompt_start"),
    (completion, {"stream_interval": 4}, "stream_interval"),
    (chat, {"echo": True}, "echo"),
    (chat, {"truncation_side": "middle"}, "truncation_side"),
    (chat, {"repetition_detection": {"max_pattern_size": 4, "min_count": 1}}, "repetition_detection.min_count"),
    (chat, {"repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}},
     "repetition_detection"),
    (chat, {"repetition_detection": {"window": 3}}, "repetition_detection"),
])
def test_vllm_032_fields_that_would_be_ignored_are_refused_by_name(make, fields, param):
    status, got, message = rejected(to_sampling_params, make(**fields))
    assert (status, got) == (400, param) and param.split(".")[0] in message


def test_vllm_032_fields_at_their_defaults_or_without_effect_pass():
    to_sampling_params(chat(watermarking=False, length_penalty=1.0, stream_interval=1, echo=False,
                            routed_experts_prompt_start=0, truncation_side="left", documents=[], session_id="s",
                            return_token_offsets=True, mm_payload="none", spaces_between_special_tokens=False,
                            add_special_tokens=True, return_tokens_as_token_ids=True, return_prompt_text=True))
    detect = {"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3}
    assert to_sampling_params(completion(repetition_detection=detect)).repetition_detection == (4, 2, 3)
    assert to_sampling_params(completion(repetition_detection={"max_pattern_size": 0})).repetition_detection is None


def test_repetition_detection_matches_vllms_rule():
    from shared.sampling_params import repetition_detected
    assert repetition_detected([9, 1, 2, 1, 2, 1, 2], 2, 1, 3)          # "12" three times at the end
    assert not repetition_detected([9, 1, 2, 1, 2, 1, 3], 2, 1, 3)
    assert not repetition_detected([1, 2, 1, 2], 2, 1, 3)               # only twice
    assert repetition_detected([5, 5, 5], 3, 1, 3)                      # a one-token pattern
    assert not repetition_detected([1, 2, 3, 1, 2, 3], 3, 3, 3)
