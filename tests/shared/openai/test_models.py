"""Request and response schemas against payloads shaped like the official OpenAI client's."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shared.openai.errors import error_from_exception
from shared.openai.models import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    DeltaMessage,
    DeltaToolCall,
    ModelCard,
    ModelList,
    Usage,
)

PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5E"
       "rkJggg==")
KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-0",
             "remote_request_id": "chatcmpl-1", "remote_host": "10.0.0.7", "remote_port": 7100,
             "remote_block_ids": [[3, 4, 9]], "remote_num_tokens": 137, "remote_blocks_expiry_time": 1.7e9,
             "a_field_from_the_future": {"nested": [1, None, "x"]}}

# What `client.chat.completions.create(...)` puts on the wire (extra_body merged at the top level).
CLIENT_CHAT = {
    "messages": [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is in this image?"},
                                     {"type": "image_url", "image_url": {"url": PNG, "detail": "auto"}}]},
        {"role": "assistant", "content": None, "refusal": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "lookup", "arguments": "{\"q\": \"pixel\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "a red pixel"}]},
    ],
    "model": "kimi-k3",
    "max_completion_tokens": 256,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.6,
    "top_p": 0.95,
    "stop": ["</answer>"],
    "seed": 42,
    "logprobs": True,
    "top_logprobs": 2,
    "tools": [{"type": "function", "function": {
        "name": "lookup", "description": "Search", "strict": False,
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "user": "u-123",
    "top_k": 20,
    "chat_template_kwargs": {"thinking": True, "thinking_effort": "high"},
    "kv_transfer_params": KV_PARAMS,
    "metadata": {"trace": "abc"},       # a field we do not know: kept, ignored
}


def wire(model) -> dict:
    return model.model_dump(mode="json", exclude_unset=True)


def test_client_chat_payload_parses_and_round_trips_exactly():
    req = ChatCompletionRequest.model_validate_json(json.dumps(CLIENT_CHAT))
    assert req.include_usage and req.tools_requested and req.max_new_tokens == 256
    assert req.messages[1].content[1].image_url.url == PNG
    assert req.messages[2].tool_calls[0].function.name == "lookup"
    assert req.kv_transfer_params == KV_PARAMS
    assert req.model_extra == {"metadata": {"trace": "abc"}}
    assert wire(req) == CLIENT_CHAT  # the router forwards what the client sent, nothing more


def test_nulls_mean_defaults():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                "stream": None, "n": None, "temperature": None, "stop": None})
    assert (req.stream, req.n, req.temperature, req.stop) == (False, 1, None, None)
    assert wire(req) == {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("prompt, normalised", [
    ("Once upon", "Once upon"), ([1, 2, 3], [1, 2, 3]), (["Once upon"], "Once upon"), ([[1, 2]], [1, 2])])
def test_completion_prompt_shapes(prompt, normalised):
    req = CompletionRequest.model_validate({"model": "m", "prompt": prompt, "max_tokens": 5, "logprobs": 2,
                                            "kv_transfer_params": KV_PARAMS})
    assert (req.prompt, req.max_tokens, req.logprobs, req.kv_transfer_params) == (normalised, 5, 2, KV_PARAMS)
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16


def invalid(model, payload) -> tuple[int, str, str | None, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(payload if isinstance(payload, str) else json.dumps(payload))
    status, body = error_from_exception(info.value)
    return status, body.error.type, body.error.param, body.error.message


def chat_with(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def messages(*items) -> dict:
    return {"model": "m", "messages": list(items)}


USER = {"role": "user", "content": "hi"}
IMAGE = {"type": "image_url", "image_url": {"url": PNG}}


@pytest.mark.parametrize("payload, param", [
    ({"model": "m"}, "messages"),
    (messages(), "messages"),
    (messages({"role": "bot", "content": "x"}), "messages[0].role"),
    (messages({"role": "user"}), "messages[0].content"),
    (messages({"role": "user", "content": 5}), "messages[0].content"),
    (messages({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text"),
    (messages({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
     "messages[0].content[0].type"),
    (messages({"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]}),
     "messages[0].content[1].image_url"),
    (messages({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}),
     "messages[0].content[0].image_url.url"),
    (messages({"role": "system", "content": [IMAGE]}), "messages[0].content[0].type"),
    (messages(USER, {"role": "assistant"}), "messages[1].content"),
    (messages(USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}),
     "messages[1].tool_calls[0].function.arguments"),
    (messages(USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}),
     "messages[1].tool_calls[0].function.arguments"),
    (messages({"role": "user", "content": "x", "tool_calls": []}, {"role": "tool", "tool_call_id": "c"}),
     "messages[1].content"),
    (messages({"role": "user", "content": "x",
               "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": ""}}]}), "messages[0].tool_calls"),
    (chat_with(temperature="hot"), "temperature"),
    (chat_with(temperature="0.7"), "temperature"),   # OpenAI does not coerce strings either
    (chat_with(stream="true"), "stream"),
    (chat_with(n=True), "n"),
    (chat_with(stop_token_ids=[1, False]), "stop_token_ids[1]"),
    (chat_with(max_tokens=1.5), "max_tokens"),
    (chat_with(stream_options={"include_usage": True}), "stream_options"),
    (chat_with(top_logprobs=3), "top_logprobs"),
    (chat_with(tool_choice="auto"), "tool_choice"),
    (chat_with(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="any"), "tool_choice"),
    (chat_with(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name"),
    (chat_with(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (chat_with(stop=5), "stop"),
    (chat_with(stop=["ok", 1]), "stop[1]"),
    (chat_with(kv_transfer_params=[1]), "kv_transfer_params"),
])
def test_invalid_chat_requests_name_the_field(payload, param):
    status, type_, got_param, message = invalid(ChatCompletionRequest, payload)
    assert (status, type_, got_param) == (400, "invalid_request_error", param)
    assert message.startswith(f"{param}: ")


@pytest.mark.parametrize("payload, param, words", [
    ({"model": "m"}, "prompt", "Field required"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": ["a", ""]}, "prompt[1]", "must not be empty"),
    ({"prompt": ["a"] * 257}, "prompt", "at most 256 prompts"),
    ({"prompt": [True, 2]}, "prompt", "a list of token ids"),
    ({"prompt": [["a"]]}, "prompt", "a list of token ids"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of", "at least n"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of", "not supported with stream"),
    ({"prompt": "x", "n": 10**18}, "n", "must be an integer in [1, 128]"),          # one sub-request per sequence
    ({"prompt": "x", "n": 0}, "n", "must be an integer in [1, 128]"),
    ({"prompt": "x", "best_of": 129}, "best_of", "at most 128"),
    ({"prompt": ["a"] * 9, "n": 128}, "prompt", "over 1024 sequences"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),  # chat's bool is not completions' int
])
def test_invalid_completion_requests_name_the_field(payload, param, words):
    status, _, got_param, message = invalid(CompletionRequest, payload)
    assert (status, got_param) == (400, param)
    assert words in message


@pytest.mark.parametrize("raw, words", [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_malformed_bodies(raw, words):
    status, _, param, message = invalid(ChatCompletionRequest, raw)
    assert (status, param) == (400, None) and words in message


# ---- responses -----------------------------------------------------------------------------------

def test_chat_completion_serialises_in_openai_shape():
    body = json.loads(ChatCompletion(
        model="kimi-k3", kv_transfer_params=KV_PARAMS,
        choices=[ChatCompletionChoice(message=ChatCompletionMessage(content="4", reasoning_content="2+2"),
                                      finish_reason="stop")],
        usage=Usage.of(12, 3, cached_tokens=8)).model_dump_json())
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "4", "reasoning_content": "2+2",
                                                        "tool_calls": None},
                                "logprobs": None, "finish_reason": "stop", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 8}}
    assert body["kv_transfer_params"] == KV_PARAMS


def test_stream_delta_carries_only_what_changed():
    chunk = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[
        ChatCompletionChunkChoice(delta=DeltaMessage(reasoning_content="hmm"))])
    assert json.loads(chunk.model_dump_json())["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    first = DeltaMessage(role="assistant", content="")
    assert json.loads(first.model_dump_json()) == {"role": "assistant", "content": ""}
    call = DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="f:0", type="function")])
    assert json.loads(call.model_dump_json()) == {"tool_calls": [{"index": 0, "id": "f:0", "type": "function",
                                                                  "function": None}]}


def test_worker_response_round_trips_through_the_router():
    vllm_body = {"id": "cmpl-9", "object": "text_completion", "created": 1, "model": "m",
                 "choices": [{"index": 0, "text": "!", "logprobs": None, "finish_reason": "length",
                              "stop_reason": None, "prompt_logprobs": None}],
                 "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1,
                           "prompt_tokens_details": None},
                 "kv_transfer_params": KV_PARAMS, "service_tier": None, "system_fingerprint": None}
    parsed = Completion.model_validate_json(json.dumps(vllm_body))
    assert parsed.kv_transfer_params == KV_PARAMS
    assert json.loads(parsed.model_dump_json()) == vllm_body


def test_model_list_shape():
    body = ModelList(data=[ModelCard(id="kimi-k3", created=0, max_model_len=8192)]).model_dump()
    assert body == {"object": "list", "data": [{"id": "kimi-k3", "object": "model", "created": 0, "owned_by": "kimi-pd",
                                                "root": None, "parent": None, "max_model_len": 8192}]}


def test_stream_chunks_carry_no_transfer_parameters():
    """As vLLM's stream responses: `kv_transfer_params` belongs to whole answers (the prefill leg's), never to a
    client's chunks, not even as null."""
    chat = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[ChatCompletionChunkChoice(delta=DeltaMessage())])
    text = CompletionChunk(id="cmpl-1", model="m", choices=[CompletionChoice(text="a")])
    assert "kv_transfer_params" not in json.loads(chat.model_dump_json())
    assert "kv_transfer_params" not in json.loads(text.model_dump_json())
