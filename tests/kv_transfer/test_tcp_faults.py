"""tcp transport under faults: bad bytes on the wire, silent peers, a sender killed mid-transfer.
Every case ends in a typed error within a bounded time, and nothing stays held or open."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kv_transfer.errors import CorruptFrame, PeerClosed, PeerTimeout
from kv_transfer.handshake import MAGIC
from kv_transfer.interface import KVTransferParams, make_receiver, make_sender
from tests.kv_transfer.helpers import (
    FreeLog,
    assert_same,
    config,
    eventually,
    hybrid_payload,
    metrics,
    open_sockets,
    run,
    serving,
)

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[2]
Tamper = Callable[[int, bytes], bytes | None]   # (stream offset, data) -> data to forward, None = cut


async def _proxy(port: int, tamper: Tamper) -> asyncio.Server:
    """A loopback proxy to `port` that applies `tamper` to what the sender sends back."""
    async def pump(reader, writer, change: Tamper | None) -> None:
        offset = 0
        try:
            while data := await reader.read(1 << 16):
                out = change(offset, data) if change else data
                offset += len(data)
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pump(reader, up_writer, None), pump(up_reader, writer, tamper))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _flip_at(position: int) -> Tamper:
    def tamper(offset: int, data: bytes) -> bytes:
        if offset <= position < offset + len(data):
            i = position - offset
            return data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
        return data
    return tamper


def _rename_first_chunk(offset: int, data: bytes) -> bytes:
    return data.replace(b"chunk", b"chunq", 1)


def _cut_at(position: int) -> Tamper:
    return lambda offset, data: None if offset + len(data) > position else data


@pytest.mark.parametrize(
    ("tamper", "error", "match"),
    [(_flip_at(600_000), CorruptFrame, "checksum"), (_rename_first_chunk, CorruptFrame, "MAC"),
     (_cut_at(600_000), PeerClosed, "mid-frame")],
    ids=["body-bit-flip", "header-edit", "truncated"],
)
def test_bad_frames_fail_the_pull_and_nothing_leaks(tamper: Tamper, error: type, match: str) -> None:
    payload = hybrid_payload()

    async def go() -> None:
        async with serving(make_sender(config(), metrics())) as sender:
            sockets = open_sockets()
            log = FreeLog()
            params = sender.publish(payload, None, log)
            proxy = await _proxy(sender.port, tamper)
            proxied = KVTransferParams.from_dict(
                {**params.to_dict(), "remote_port": proxy.sockets[0].getsockname()[1]})
            receiver = make_receiver(config(), metrics())
            with pytest.raises(error, match=match):
                await receiver.pull(proxied)
            proxy.close()
            await proxy.wait_closed()
            assert sender.held_count() == 1 and log.calls == []
            assert_same(payload, await receiver.pull(params))        # the sender is unharmed
            assert await receiver.release(params) is True
            assert log.calls == [("req-1", "released")] and sender.held_count() == 0
            await eventually(lambda: open_sockets() == sockets)

    run(go())


async def _raw_exchange(port: int, data: bytes, timeout_s: float = 3.0) -> bytes:
    """Send raw bytes to the sender; return everything it answers before it hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    except ConnectionResetError:                        # closed with our bytes unread: a hang-up too
        return b""
    finally:
        writer.close()


def test_sender_drops_garbage_and_silent_clients_and_keeps_serving() -> None:
    async def go() -> None:
        async with serving(make_sender(config(read_timeout_s=0.3), metrics())) as sender:
            log = FreeLog()
            params = sender.publish(hybrid_payload(tokens=64), None, log)
            assert await _raw_exchange(sender.port, b"GET / HTTP/1.1\r\n\r\n") == b""
            assert await _raw_exchange(sender.port, MAGIC + b"\xff\xff\xff\xff") == b""
            assert await _raw_exchange(sender.port, MAGIC + b"\x00\x00\x00\x02\xc1\xc1") == b""
            assert await _raw_exchange(sender.port, MAGIC) == b""        # then silence: timed out
            receiver = make_receiver(config(), metrics())
            assert_same(hybrid_payload(tokens=64), await receiver.pull(params))
            assert await receiver.release(params) is True
            assert log.calls == [("req-1", "released")]

    run(go())


def test_peer_that_never_answers_times_out() -> None:
    async def go() -> None:
        silent = socket.create_server(("127.0.0.1", 0))
        try:
            port = silent.getsockname()[1]
            params = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
                                      remote_request_id="r", transport="tcp")
            receiver = make_receiver(config(read_timeout_s=0.3), metrics())
            sockets = open_sockets()
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(PeerTimeout):
                await receiver.pull(params)
            with pytest.raises(PeerTimeout):
                await receiver.release(params)
            assert loop.time() - start < 3.0
            assert open_sockets() == sockets
        finally:
            silent.close()

    run(go())


def test_unreachable_sender_is_peer_closed() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    params = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
                              remote_request_id="r", transport="tcp")
    with pytest.raises(PeerClosed):
        run(make_receiver(config(), metrics()).pull(params))


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
def test_sender_killed_mid_transfer(transport: str) -> None:
    if transport == "mooncake":
        pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda")

    async def go() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.kv_transfer.sender_child", transport, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=asyncio.subprocess.PIPE)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            params = KVTransferParams.from_dict(json.loads(line))
            receiver = make_receiver(config(transport=transport, read_timeout_s=20.0), metrics())
            await receiver.start()
            sockets = open_sockets()
            pull = asyncio.ensure_future(receiver.pull(params))
            assert (await asyncio.wait_for(proc.stdout.readline(), 10)).strip() == b"MID"
            proc.kill()
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(PeerClosed):
                await pull
            assert loop.time() - start < 2.0          # noticed at once, not at the 20 s timeout
            if transport == "tcp":                    # mooncake's engine keeps sockets of its own
                assert open_sockets() == sockets
            with pytest.raises(PeerClosed):
                await receiver.release(params)
            await receiver.stop()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    run(go(), timeout_s=40)


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize(
    ("tamper", "error", "match"),
    [(_flip_at(5 << 20), CorruptFrame, "checksum"), (_cut_at(5 << 20), PeerClosed, "mid-frame")],
    ids=["bit-flip-deep-in-a-large-frame", "cut-mid-frame"],
)
def test_large_frames_tampered_or_cut_never_yield_state(tamper: Tamper, error: type, match: str,
                                                        streams: int) -> None:
    """8 MiB chunk frames land straight in the destination tensors; one flipped bit 5 MiB into a
    stream, or a stream cut there, fails the whole pull (the other streams are stopped too) and
    returns nothing, while the sender keeps the state for a clean retry."""
    payload = hybrid_payload(tokens=8192)                       # two 9 MiB MLA tensors

    async def go() -> None:
        async with serving(make_sender(config(), metrics())) as sender:
            sockets = open_sockets()
            params = sender.publish(payload, None, FreeLog())
            proxy = await _proxy(sender.port, tamper)
            proxied = KVTransferParams.from_dict(
                {**params.to_dict(), "remote_port": proxy.sockets[0].getsockname()[1]})
            receiver = make_receiver(config(chunk_bytes=8 << 20, streams=streams), metrics())
            with pytest.raises(error, match=match):
                await receiver.pull(proxied)
            proxy.close()
            await proxy.wait_closed()
            assert_same(payload, await receiver.pull(params))
            assert await receiver.release(params) is True
            await eventually(lambda: open_sockets() == sockets)

    run(go())
