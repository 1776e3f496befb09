"""mooncake transport over its `tcp` protocol with P2PHANDSHAKE metadata, loopback only.

Its data listener binds the wildcard address whatever host is given; these tests only ever
connect to 127.0.0.1. Skipped only when the optional package is not installed.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda")

from kv_transfer import sideband  # noqa: E402
from kv_transfer.errors import CorruptFrame, LeaseExpired, ProtocolMismatch, UnknownRequest  # noqa: E402
from kv_transfer.interface import make_receiver, make_sender  # noqa: E402
from kv_transfer.mooncake import MooncakeSender  # noqa: E402
from kv_transfer.payload import flat_bytes  # noqa: E402
from tests.kv_transfer.helpers import (  # noqa: E402
    Clock,
    FreeLog,
    assert_same,
    config,
    hybrid_payload,
    metrics,
    run,
    sample,
    serving,
)

pytestmark = pytest.mark.timeout(30)


def _config(**overrides):
    return config(transport="mooncake", **overrides)


def test_round_trip_is_bit_exact_and_release_frees_once() -> None:
    m = metrics()
    payloads = [hybrid_payload(), hybrid_payload("second", tokens=256, seed=3)]

    async def go() -> None:
        async with serving(make_sender(_config(), m)) as sender:
            log = FreeLog()
            params = [sender.publish(p, None, log) for p in payloads]
            receiver = make_receiver(_config(), m)
            await receiver.start()
            try:
                for want, p in zip(payloads, params, strict=True):
                    assert_same(want, await receiver.pull(p))
                assert_same(payloads[0], await receiver.pull(params[0]))   # pulled twice: still whole
                assert await receiver.release(params[0]) is True
                assert await receiver.release(params[0]) is False
                with pytest.raises(UnknownRequest):
                    await receiver.pull(params[0])
            finally:
                await receiver.stop()
            assert log.calls == [("req-1", "released")] and sender.held_count() == 1
        assert log.calls == [("req-1", "released"), ("second", "shutdown")]

    run(go())
    assert sample(m, "kimi_pd_kv_transfers_total", direction="recv", transport="mooncake") == 3


def test_expired_lease_is_never_read_and_tcp_params_are_refused() -> None:
    clock = Clock()

    async def go() -> None:
        async with serving(MooncakeSender(_config(), metrics(), clock=clock)) as sender:
            log = FreeLog()
            params = sender.publish(hybrid_payload(tokens=64), 5.0, log)
            receiver = make_receiver(_config(), metrics())
            await receiver.start()
            try:
                clock.now += 5.0
                with pytest.raises(LeaseExpired):
                    await receiver.pull(params)
                with pytest.raises(ProtocolMismatch):
                    await receiver.pull(dataclasses.replace(params, transport="tcp"))
            finally:
                await receiver.stop()
            assert log.calls == [("req-1", "expired")] and sender.held_count() == 0

    run(go())


def test_bytes_that_do_not_match_the_tags_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake moves bytes outside our authenticated frames; the tags in the authenticated
    `end` frame must catch a mismatch (here the sender tagged different bytes at publish)."""
    real = sideband.data_tags

    def wrong_tags(tagger):
        return [bytes(16)] + real(tagger)[1:]

    async def go() -> None:
        async with serving(make_sender(_config(), metrics())) as sender:
            log = FreeLog()
            monkeypatch.setattr(sideband, "data_tags", wrong_tags)
            params = sender.publish(hybrid_payload(tokens=64), None, log)
            await sender.wait_tagged("req-1")
            monkeypatch.setattr(sideband, "data_tags", real)
            good = sender.publish(hybrid_payload("good", tokens=64), None, log)
            receiver = make_receiver(_config(), metrics())
            await receiver.start()
            try:
                with pytest.raises(CorruptFrame, match="tags"):
                    await receiver.pull(params)
                assert_same(hybrid_payload("good", tokens=64), await receiver.pull(good))
                assert await receiver.release(params) is True
                assert await receiver.release(good) is True
            finally:
                await receiver.stop()
            assert log.calls == [("req-1", "released"), ("good", "released")]
            # The refused pull failed after its read had finished and the sender had sent `end`,
            # so no remote read can still be in flight: nothing is kept registered past the lease.
            assert sender._deferred == {}

    run(go())


def test_a_state_changed_after_publish_is_refused() -> None:
    """Tags are computed once, at publish: bytes changed afterwards (a caller that broke the
    publish contract, or memory corrupted in place) fail the pull instead of crossing."""
    payload = hybrid_payload(tokens=64)

    async def go() -> None:
        async with serving(make_sender(_config(), metrics())) as sender:
            params = sender.publish(payload, None, FreeLog())
            receiver = make_receiver(_config(), metrics())
            await receiver.start()
            try:
                assert_same(hybrid_payload(tokens=64), await receiver.pull(params))
                flat_bytes(payload.tensors["mla.3"])[17] ^= 0x5A      # after publish, in place
                with pytest.raises(CorruptFrame, match="tags"):
                    await receiver.pull(params)
            finally:
                await receiver.stop()

    run(go())


def test_a_sender_cannot_switch_verification_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver decides: a sender that answers without tags fails the pull."""
    monkeypatch.setattr(sideband, "data_tags", lambda tagger: None)

    async def go() -> None:
        async with serving(make_sender(_config(), metrics())) as sender:
            params = sender.publish(hybrid_payload(tokens=64), None, FreeLog())
            receiver = make_receiver(_config(), metrics())
            await receiver.start()
            try:
                with pytest.raises(CorruptFrame, match="tags"):
                    await receiver.pull(params)
            finally:
                await receiver.stop()

    run(go())


def test_wrong_secret_and_silent_peer_fail_typed_and_fast() -> None:
    import socket

    from kv_transfer.errors import AuthenticationFailed, PeerTimeout
    from kv_transfer.interface import KVTransferParams

    async def go() -> None:
        async with serving(make_sender(_config(), metrics())) as sender:
            params = sender.publish(hybrid_payload(tokens=64), None, FreeLog())
            intruder = make_receiver(_config(secret=b"not-the-right-secret-at-all"), metrics())
            await intruder.start()
            try:
                with pytest.raises(AuthenticationFailed):
                    await intruder.pull(params)
            finally:
                await intruder.stop()
            assert sender.held_count() == 1
        with socket.create_server(("127.0.0.1", 0)) as silent:
            quiet = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1",
                                     remote_port=silent.getsockname()[1], remote_request_id="r",
                                     transport="mooncake")
            receiver = make_receiver(_config(read_timeout_s=0.3), metrics())
            await receiver.start()
            try:
                with pytest.raises(PeerTimeout):
                    await receiver.pull(quiet)
            finally:
                await receiver.stop()

    run(go())
