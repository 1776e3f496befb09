"""A prefill-decode request's wire body is dumped once for both legs (router/request/trace.py `wire_of`), and
each leg edits its own copy: the bodies are exactly the ones built from the request alone."""
from __future__ import annotations

import router.request.trace as trace_module
from router.request.trace import Trace, wire_of
from shared.openai.legs import prefill_body, wire_body
from shared.openai.models import ChatCompletionRequest

CLIENT = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "stream": True,
          "stream_options": {"include_usage": True}, "max_completion_tokens": 300, "min_tokens": 5,
          "vendor_hint": {"keep": True}}


def test_both_legs_share_one_dump_and_neither_sees_the_others_edits(monkeypatch) -> None:
    dumped: list[object] = []

    def counted(req):
        dumped.append(req)
        return wire_body(req)
    monkeypatch.setattr(trace_module, "wire_body", counted)
    req, trace = ChatCompletionRequest.model_validate(CLIENT), Trace("r-1", "chat")
    prefill = prefill_body(req, wire_of(trace, req))
    decode = wire_of(trace, req)
    decode["kv_transfer_params"] = {"do_remote_prefill": True}
    assert dumped == [req]                                      # one dump for both legs
    assert prefill == prefill_body(req)                         # the prefill leg as built alone
    assert wire_of(trace, req) == wire_body(req)                # neither leg's edits reached the next copy
    again = ChatCompletionRequest.model_validate({**CLIENT, "max_completion_tokens": 7})    # a re-run's request
    assert wire_of(trace, again)["max_completion_tokens"] == 7 and dumped == [req, again]
