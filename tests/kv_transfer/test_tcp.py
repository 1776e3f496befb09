"""tcp transport, in one process over loopback: round trips, releases and every lease path."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from kv_transfer import tcp
from kv_transfer.client import Target
from kv_transfer.errors import (
    AuthenticationFailed,
    DuplicateRequest,
    IdentityMismatch,
    LeaseExpired,
    PeerClosed,
    RequestAborted,
    SenderShutdown,
    UnknownRequest,
)
from kv_transfer.interface import make_receiver, make_sender
from kv_transfer.tcp import TcpReceiver, TcpSender
from tests.kv_transfer.helpers import (
    Clock,
    FreeLog,
    assert_same,
    config,
    eventually,
    hybrid_payload,
    metrics,
    open_sockets,
    run,
    sample,
    serving,
    with_identity,
)

pytestmark = pytest.mark.timeout(30)


def test_round_trip_is_bit_exact_and_release_frees_once() -> None:
    m = metrics()
    payload = hybrid_payload()

    async def go() -> None:
        async with serving(make_sender(config(), m)) as sender:
            sockets = open_sockets()
            log = FreeLog()
            params = sender.publish(payload, None, log)
            assert params.remote_port == sender.port and params.remote_host == "127.0.0.1"
            assert (params.remote_num_tokens, params.state_bytes) == (2048, payload.nbytes())
            assert params.remote_block_ids == list(range(32)) and params.do_remote_prefill
            receiver = make_receiver(config(), m)
            got = await receiver.pull(params)
            assert_same(payload, got)
            assert sample(m, "kimi_pd_kv_held_leases", transport="tcp") == 1
            assert await receiver.release(params) is True
            assert await receiver.release(params) is False
            assert log.calls == [("req-1", "released")] and sender.held_count() == 0
            await eventually(lambda: open_sockets() == sockets)

    run(go())
    nbytes = payload.nbytes()
    assert sample(m, "kimi_pd_kv_transfer_bytes_total", direction="recv", transport="tcp") == nbytes
    assert sample(m, "kimi_pd_kv_transfer_bytes_total", direction="send", transport="tcp") == nbytes
    assert sample(m, "kimi_pd_kv_transfers_total", direction="recv", transport="tcp") == 1
    assert sample(m, "kimi_pd_kv_transfer_seconds_count", direction="recv", transport="tcp") == 1
    assert sample(m, "kimi_pd_kv_held_leases", transport="tcp") == 0


@pytest.mark.parametrize("streams", [1, 4])
def test_concurrent_pulls_of_several_requests(streams: int) -> None:
    payloads = [hybrid_payload(f"r{i}", tokens=512 * (i + 1), seed=i) for i in range(4)]

    async def go() -> None:
        async with serving(make_sender(config(), metrics())) as sender:
            log = FreeLog()
            params = [sender.publish(p, None, log) for p in payloads]
            receiver = make_receiver(config(streams=streams, chunk_bytes=256 << 10), metrics())
            got = await asyncio.gather(*(receiver.pull(p) for p in params))
            for want, have in zip(payloads, got, strict=True):
                assert_same(want, have)
            assert all(await asyncio.gather(*(receiver.release(p) for p in params)))
            assert sorted(log.calls) == [(f"r{i}", "released") for i in range(4)]

    run(go())


def test_unknown_request_is_a_typed_error() -> None:
    m = metrics()

    async def go() -> None:
        async with serving(make_sender(config(), m)) as sender:
            log = FreeLog()
            params = sender.publish(hybrid_payload(tokens=64), None, log)
            stranger = dataclasses.replace(params, remote_request_id="nobody")
            with pytest.raises(UnknownRequest):
                await make_receiver(config(), m).pull(stranger)
            assert await make_receiver(config(), m).release(stranger) is False
            assert sender.held_count() == 1
            assert await make_receiver(config(), m).release(params) is True
            assert log.calls == [("req-1", "released")] and sender.held_count() == 0

    run(go())
    assert sample(m, "kimi_pd_kv_transfer_failures_total", direction="recv", transport="tcp",
                  reason="unknown_request") == 1


def test_expired_lease_is_never_read() -> None:
    m, clock = metrics(), Clock()

    async def go() -> None:
        async with serving(TcpSender(config(), m, clock=clock)) as sender:
            log = FreeLog()
            params = sender.publish(hybrid_payload(tokens=64), 5.0, log)
            clock.now += 5.0
            receiver = make_receiver(config(), m)
            with pytest.raises(LeaseExpired):
                await receiver.pull(params)
            assert log.calls == [("req-1", "expired")] and sender.held_count() == 0
            assert await receiver.release(params) is False
            with pytest.raises(LeaseExpired):
                await receiver.pull(params)
            assert log.calls == [("req-1", "expired")]

    run(go())
    assert sample(m, "kimi_pd_kv_expired_leases_total", transport="tcp") == 1


@pytest.mark.parametrize("event", ["expire", "abort"])
def test_lease_ending_mid_transfer_fails_the_pull(event: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender sends chunk after chunk; while it sends the second one the lease ends under it."""
    clock = Clock()
    digests = 0
    real_send = tcp.send_chunk

    async def go() -> None:
        async with serving(TcpSender(config(), metrics(), clock=clock)) as sender:
            log = FreeLog()

            def send_then_end(chan, header: dict, body: memoryview) -> None:   # stream's thread
                nonlocal digests
                digests += 1
                if digests == 2:
                    clock.now += 100 if event == "expire" else 0
                    if event == "abort":
                        assert sender.abort("req-1") is True
                real_send(chan, header, body)

            monkeypatch.setattr(tcp, "send_chunk", send_then_end)
            params = sender.publish(hybrid_payload(), 30.0, log)
            with pytest.raises(LeaseExpired if event == "expire" else RequestAborted):
                await make_receiver(config(streams=1), metrics()).pull(params)
            await eventually(lambda: sender.held_count() == 0)
            assert log.calls == [("req-1", "expired" if event == "expire" else "aborted")]

    run(go())
    assert digests >= 2


def test_sweeper_frees_expired_leases() -> None:
    m = metrics()

    async def go() -> None:
        async with serving(make_sender(config(sweep_interval_s=0.02), m)) as sender:
            log = FreeLog()
            params = sender.publish(hybrid_payload(tokens=64), 0.1, log)
            keep = sender.publish(hybrid_payload("keep", tokens=64), 30.0, log)
            await eventually(lambda: sender.held_count() == 1, timeout_s=3.0)
            assert log.calls == [("req-1", "expired")]
            with pytest.raises(LeaseExpired):
                await make_receiver(config(), m).pull(params)
            assert_same(hybrid_payload("keep", tokens=64), await make_receiver(config(), m).pull(keep))

    run(go())
    assert sample(m, "kimi_pd_kv_expired_leases_total", transport="tcp") == 1


def test_stop_frees_everything_and_fails_inflight_pulls(monkeypatch: pytest.MonkeyPatch) -> None:
    entered = asyncio.Event

    async def go() -> None:
        started = entered()
        sender = TcpSender(config(), metrics())
        log = FreeLog()

        loop = asyncio.get_running_loop()

        def stall(chan, header: dict, body: memoryview) -> None:   # in the stream's thread
            loop.call_soon_threadsafe(started.set)
            deadline = time.monotonic() + 20
            while sender._listener is not None and time.monotonic() < deadline:   # until stop()
                time.sleep(0.01)

        async with serving(sender):
            monkeypatch.setattr(tcp, "send_chunk", stall)
            params = sender.publish(hybrid_payload(), None, log)
            sender.publish(hybrid_payload("idle", tokens=64), None, log)
            pull = asyncio.ensure_future(make_receiver(config(streams=1), metrics()).pull(params))
            await started.wait()
        with pytest.raises(PeerClosed):
            await pull
        assert sorted(log.calls) == [("idle", "shutdown"), ("req-1", "shutdown")]
        assert sender.held_count() == 0

    run(go())


def test_identity_mismatch_and_wrong_secret_are_refused() -> None:
    async def go() -> None:
        async with serving(make_sender(config(), metrics())) as sender:
            log = FreeLog()
            params = sender.publish(hybrid_payload(tokens=64), None, log)
            odd = make_receiver(config(identity=with_identity(block_size=128)), metrics())
            with pytest.raises(IdentityMismatch, match="block_size: receiver has 128, sender has 64"):
                await odd.pull(params)
            with pytest.raises(IdentityMismatch):
                await odd.release(params)
            intruder = make_receiver(config(secret=b"not-the-right-secret-at-all"), metrics())
            with pytest.raises(AuthenticationFailed):
                await intruder.pull(params)
            with pytest.raises(AuthenticationFailed):
                await intruder.release(params)
            assert sender.held_count() == 1 and log.calls == []
            assert await make_receiver(config(), metrics()).release(params) is True
            assert log.calls == [("req-1", "released")]

    run(go())


def test_publish_refuses_duplicates_and_bad_meta() -> None:
    with pytest.raises(SenderShutdown):
        make_sender(config(), metrics()).publish(hybrid_payload(tokens=64), None, FreeLog())

    async def go() -> None:
        async with serving(make_sender(config(), metrics())) as sender:
            log = FreeLog()
            sender.publish(hybrid_payload(tokens=64), None, log)
            with pytest.raises(DuplicateRequest):
                sender.publish(hybrid_payload(tokens=64), None, log)
            bad = hybrid_payload("bad", tokens=64)
            bad.meta["oops"] = object()
            with pytest.raises(TypeError):
                sender.publish(bad, None, log)
            assert sender.held_count() == 1
            assert sender.abort("req-1") is True and sender.abort("req-1") is False
            assert log.calls == [("req-1", "aborted")]

    run(go())


def test_small_states_use_one_stream() -> None:
    receiver = TcpReceiver(config(streams=8, chunk_bytes=1 << 20), metrics())
    small = Target("h", 1, "r", 100)
    assert receiver._stream_count(small) == 1
    assert receiver._stream_count(dataclasses.replace(small, state_bytes=5 << 20)) == 5
    assert receiver._stream_count(dataclasses.replace(small, state_bytes=None)) == 8
