"""The router core in-process (router/orchestrator.py, router/request/): the prefill leg, the decode leg
and the streamed relay against a scripted fake worker client, without processes or sockets."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from router.transport.upstream import UpstreamError
from tests.router.fake_session import (
    D1,
    D2,
    KTP,
    P1,
    P2,
    FakeSession,
    Reply,
    body_of,
    chat,
    count,
    orchestrator,
    prompt,
    sse,
    trace,
)

PREFILLED = Reply(body={"choices": [], "kv_transfer_params": KTP,
                        "usage": {"prompt_tokens_details": {"cached_tokens": 8}}})
ANSWER = Reply(body={"id": "c1", "choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 40},
                     "kv_transfer_params": {"leak": 1}})


def run(coro):
    return asyncio.run(coro)


def test_prefill_connect_failure_is_retried_on_another_prefill_worker():
    s = FakeSession({D1: [ANSWER]}, [Reply(fail="connect"), PREFILLED])
    orch, t = orchestrator(s, prefill=(P1, P2), decode=(D1,)), trace()
    resp = run(orch.handle(t, chat(), prompt()))
    assert t.decision == "prefill-decode" and t.prefill_worker in (P1, P2) and t.cached_tokens == 8
    prefills = [url for url, _ in s.sent if url in (P1, P2)]
    assert len(prefills) == 2 and prefills[0] != prefills[1]           # never the same worker twice
    assert s.to(D1)[0]["kv_transfer_params"]["remote_request_id"] == "held-1"
    assert count(orch, "retries_total", leg="prefill") == 1
    out = json.loads(resp.body)
    assert "kv_transfer_params" not in out and out["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}


def test_placement_reads_the_ledgers_tail_of_recent_prefills(monkeypatch):
    import router.orchestrator as orchestrator_module
    build, built = orchestrator_module.build_context, []
    monkeypatch.setattr(orchestrator_module, "build_context",
                        lambda *a, **kw: built.append(build(*a, **kw)) or built[-1])
    s = FakeSession({D1: [ANSWER, ANSWER]}, [PREFILLED, PREFILLED])
    orch = orchestrator(s, prefill=(P1,), decode=(D1,))
    run(orch.handle(trace(), chat(), prompt()))
    assert built[-1].tail_prefill_s is None                          # no legs seen yet
    ledger = orch.registry.ledger
    for _ in range(ledger.config.tail_min_legs):
        ledger.settle(ledger.open(P1, 40000), calibrate=False)
    run(orch.handle(trace(), chat(), prompt()))
    assert built[-1].tail_prefill_s == pytest.approx(40000 / ledger.tokens_per_s(P1))


def test_a_failing_prefill_pool_falls_back_to_decode_only():
    s = FakeSession({P1: [Reply(status=500)], D1: [ANSWER]})
    orch, t = orchestrator(s, prefill=(P1,), decode=(D1,)), trace()
    run(orch.handle(t, chat(), prompt()))
    assert t.decision == "decode-only" and t.kv_transfer_params is None
    assert "kv_transfer_params" not in s.to(D1)[0]
    assert count(orch, "prefill_fallbacks_total", reason="http_5xx") == 1


def test_a_prefill_4xx_is_the_clients_error_and_no_fallback():
    s = FakeSession({P1: [Reply(status=400, body={"error": {"message": "bad"}})], D1: []})
    orch = orchestrator(s, prefill=(P1,), decode=(D1,))
    with pytest.raises(UpstreamError) as info:
        run(orch.handle(trace(), chat(), prompt()))
    assert info.value.status == 400 and info.value.body == {"error": {"message": "bad"}} and s.to(D1) == []


def test_a_prefill_state_no_decode_received_is_released():
    released = []

    def admin(request: httpx.Request) -> httpx.Response:
        released.append((request.url.path, json.loads(request.content), request.headers["authorization"]))
        return httpx.Response(200, json={"released": True})

    for proven in (True, False):
        s = FakeSession({P1: [PREFILLED], D1: [Reply(fail="connect")] * 3})
        orch, t = orchestrator(s, prefill=(P1,), decode=(D1,), handler=admin), trace()
        if proven:
            orch.registry.identities[P1] = "kimi-pd"      # it passed the identity check (health_checker.identify)

        async def go(orch=orch, t=t):
            with pytest.raises(UpstreamError):
                await orch.handle(t, chat(), prompt())
            await asyncio.gather(*orch._background)
            await orch.fleet.client.aclose()
        run(go())
        assert not t.decode_connected
        # a static worker not proven ours gets neither the internal call nor the admin token
        assert released == ([("/internal/kv/release", {"request_id": "held-1"}, "Bearer adm")] if proven else [])
        assert count(orch, "prefill_releases_total", outcome="released") == (1 if proven else 0)
        released.clear()


def test_decode_connect_failure_is_retried_on_another_decode_worker():
    s = FakeSession(queue=[Reply(fail="connect"), ANSWER])
    orch, t = orchestrator(s, decode=(D1, D2)), trace()
    run(orch.handle(t, chat(), prompt()))
    urls = [url for url, _ in s.sent]
    assert len(urls) == 2 and urls[0] != urls[1] and t.decode_worker == urls[1]
    assert count(orch, "retries_total", leg="decode") == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prefilled", [False, True])
def test_a_decode_leg_carrying_transfer_parameters_is_never_replayed(prefilled, stream):
    """A dropped connection may have been a worker that consumed the transferred state: the leg is replayed
    as it was only when it carries none (decode-only); otherwise another worker is asked decode-only, so the
    answer survives its worker without the transfer parameters ever being sent twice."""
    answer = Reply(chunks=[sse([5], "o"), sse([6], "k", "stop")]) if stream else ANSWER
    s = FakeSession({P1: [PREFILLED]}, [Reply(fail="disconnect"), answer])
    orch, t = orchestrator(s, prefill=(P1,) if prefilled else (), decode=(D1, D2)), trace()

    async def go():
        resp = await orch.handle(t, chat(stream=stream), prompt())
        return await body_of(resp) if stream else resp.body
    out = run(go())
    (first_worker, first), (second_worker, second) = [(url, body) for url, body in s.sent if url != P1]
    assert second_worker != first_worker and t.decode_worker == second_worker
    assert ("kv_transfer_params" in first) == prefilled and "kv_transfer_params" not in second
    assert (b'"ok"' in out) if not stream else (b'"o"' in out and b'"k"' in out and out.count(b"[DONE]") == 1)
    assert count(orch, "migrations_total", outcome="ok") == (1 if prefilled else 0)


def test_a_whole_answer_lost_to_a_broken_worker_is_asked_again_decode_only():
    s = FakeSession({P1: [PREFILLED]}, [Reply(body=b"not json"), ANSWER])
    orch, t = orchestrator(s, prefill=(P1,), decode=(D1, D2)), trace()
    resp = run(orch.handle(t, chat(), prompt()))
    first, retry = [body for url, body in s.sent if url != P1]
    assert "kv_transfer_params" in first and "kv_transfer_params" not in retry
    assert json.loads(resp.body)["choices"][0]["message"]["content"] == "ok"
    assert count(orch, "migrations_total", outcome="ok") == 1


def test_a_stream_cut_mid_way_migrates_and_the_client_sees_one_stream():
    usage = b'data: {"id": "chatcmpl-2", "created": 2, "choices": [], "usage": {"completion_tokens": 4}}\n\n'
    first = Reply(chunks=[sse([5], "a"), sse([6], "b")], cut=True)
    rest = Reply(chunks=[sse([7], "c", cid="chatcmpl-2"), sse([8], "d", "stop", cid="chatcmpl-2"), usage])
    s = FakeSession(queue=[first, rest])
    orch, t = orchestrator(s, decode=(D1, D2)), trace()

    async def go():
        return await body_of(await orch.handle(t, chat(stream=True), prompt()))
    out = run(go())
    (w1, leg1), (w2, leg2) = s.sent
    assert w1 != w2 and leg1["return_token_ids"] is True
    assert leg2["kimi_pd_resume"]["token_ids"] == [5, 6] and leg2["kimi_pd_resume"]["seed_offset"] == 2
    events = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"]) == "abcd"
    assert {e["id"] for e in events} == {"chatcmpl-1"}                        # the first worker's id throughout
    assert not any("token_ids" in c for e in events for c in e["choices"])    # the client did not ask for ids
    assert sum("usage" in e for e in events) == 1 and out.count(b"[DONE]") == 1
    assert t.outcome == "ok" and count(orch, "migrations_total", outcome="ok") == 1


def test_a_cut_stream_nobody_can_continue_ends_with_an_error_event():
    s = FakeSession({D1: [Reply(chunks=[sse([5])], cut=True)]})
    orch, t = orchestrator(s, decode=(D1,)), trace()

    async def go():
        return await body_of(await orch.handle(t, chat(stream=True), prompt()))
    out = run(go())
    assert b'"decode_failed"' in out and out.endswith(b"data: [DONE]\n\n") and t.outcome == "error"
    assert count(orch, "migrations_total", outcome="failed") == 1


def test_a_prefill_leg_queues_its_pool_loads_at_their_cost(monkeypatch):
    """With a KV pool, the leg a worker is sent is queued in the work ledger as its computed tokens plus its
    pool loads at their cost: P2 loads the 40-token prompt P1 computed (10 blocks of 4) and computes its last token."""
    s = FakeSession({D1: [ANSWER, ANSWER]}, [PREFILLED, PREFILLED])
    orch = orchestrator(s, prefill=(P1, P2), decode=(D1,), kv_pool_blocks=64, kv_pool_load_cost=0.5)
    ledger, opened = orch.registry.ledger, []
    open_leg = ledger.open

    def spy(worker: str, tokens: int):
        opened.append((worker, tokens))
        return open_leg(worker, tokens)
    monkeypatch.setattr(ledger, "open", spy)
    orch.registry.drained.add(P2)
    run(orch.handle(trace(), chat(), prompt()))
    orch.registry.drained.symmetric_difference_update({P1, P2})      # now only P2 takes prefill legs
    run(orch.handle(trace(), chat(), prompt()))
    prefills = [(w, n) for w, n in opened if w in (P1, P2)]
    assert prefills == [(P1, 40), (P2, 1 + 20)]
    assert orch.registry.pool is not None and orch.registry.pool.num_blocks() == 10
