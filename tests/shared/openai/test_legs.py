"""The prefill and decode legs of vLLM's P/D protocol, built from the client's request."""
from __future__ import annotations

from shared.kv_transfer_params import KVTransferParams
from shared.openai.convert import to_sampling_params
from shared.openai.legs import decode_body, prefill_body
from shared.openai.models import ChatCompletionRequest, CompletionRequest

CLIENT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": True,
          "stream_options": {"include_usage": True}, "max_completion_tokens": 300, "max_tokens": 200,
          "min_tokens": 5, "logprobs": True, "top_logprobs": 2, "vendor_hint": {"keep": True}}
P_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-1",
            "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.2", "remote_port": 7100, "extra_ours": 1}
# what the decode worker receives: the answer's fields (unknown ones too) and the interface version
P_FORWARDED = {**P_ANSWER, "interface_version": 1}


def test_prefill_leg_generates_exactly_one_token_without_streaming():
    req = ChatCompletionRequest.model_validate(CLIENT)
    body = prefill_body(req)
    assert "stream_options" not in body and body["stream"] is False
    assert body["kv_transfer_params"] == {"do_remote_prefill": False, "do_remote_decode": True, "interface_version": 1}
    assert KVTransferParams.from_dict(body["kv_transfer_params"]).leg == "prefill"
    assert (body["max_tokens"], body["max_completion_tokens"], body["min_tokens"]) == (1, 1, 1)
    assert body["vendor_hint"] == {"keep": True} and body["top_logprobs"] == 2
    params = to_sampling_params(ChatCompletionRequest.model_validate(body))  # valid for the prefill worker
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (1, 1, 2)
    assert req.stream and req.kv_transfer_params is None  # the client's request is left as it was


def test_decode_leg_is_the_client_request_plus_the_prefill_answer():
    req = ChatCompletionRequest.model_validate(CLIENT)
    assert decode_body(req, KVTransferParams.from_dict(P_ANSWER)) == {**CLIENT, "kv_transfer_params": P_FORWARDED}


def test_completion_legs():
    req = CompletionRequest.model_validate({"model": "kimi-k3", "prompt": [[5, 6, 7]], "stream": True})
    body = prefill_body(req)
    assert (body["prompt"], body["max_tokens"], body["stream"]) == ([5, 6, 7], 1, False)
    assert "max_completion_tokens" not in body and "min_tokens" not in body
    assert decode_body(req, KVTransferParams.from_dict(P_ANSWER))["kv_transfer_params"] == P_FORWARDED
