"""Which placement headers an answer carries: the decision and id always; the workers (static workers' ids are
their internal URLs) only where clients are not authenticated, or where the operator asks for them."""
from __future__ import annotations

import pytest

from router.request.trace import Trace, trace_headers
from router.settings import RouterSettings


@pytest.mark.parametrize(("keys", "flag", "shown"), [
    ((), None, True),                      # a loopback/dev fleet: tests and tracing read them
    (("client-key",), None, False),        # clients authenticate: never show them internal addresses
    (("client-key",), True, True),         # the operator's explicit choice
    ((), False, False),
])
def test_worker_headers_follow_the_fleet_s_client_keys_unless_set(keys, flag, shown) -> None:
    settings = RouterSettings(model=None, api_keys=keys, placement_headers=flag)
    trace = Trace("chat-1", "chat", decision="prefill-decode", prefill_worker="http://10.0.0.7:8100",
                  decode_worker="http://10.0.0.8:8200")
    headers = trace_headers(trace, settings.shows_placement)
    assert headers["x-request-id"] == "chat-1" and headers["x-kimi-pd-decision"] == "prefill-decode"
    assert ("x-kimi-pd-prefill-worker" in headers) is shown and ("x-kimi-pd-decode-worker" in headers) is shown
    assert not shown or headers["x-kimi-pd-decode-worker"] == "http://10.0.0.8:8200"
