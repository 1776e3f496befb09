"""Framing and handshake over a socketpair: tampering, replay, truncation, timeouts, identity."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import torch

from kv_transfer.errors import (
    AuthenticationFailed,
    CorruptFrame,
    IdentityMismatch,
    PeerClosed,
    PeerTimeout,
    ProtocolMismatch,
)
from kv_transfer.handshake import MAGIC, PROTOCOL_VERSION, client_handshake, server_handshake
from kv_transfer.wire import MAC_LEN, Channel, in_thread
from tests.kv_transfer.helpers import IDENTITY, SECRET, run, with_identity

pytestmark = pytest.mark.timeout(10)
KEY = b"k" * 32


_OPEN: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_sockets():
    yield
    while _OPEN:
        _OPEN.pop().close()


def _pair(timeout_s: float = 2.0) -> tuple[Channel, Channel, socket.socket, socket.socket]:
    a, b = socket.socketpair()
    _OPEN.extend((a, b))
    return Channel(a, timeout_s, is_client=True), Channel(b, timeout_s, is_client=False), a, b


async def _authed_pair(timeout_s: float = 2.0):
    client, server, a, b = _pair(timeout_s)
    client.authenticate(KEY)
    server.authenticate(KEY)
    return client, server, a, b


def test_frames_round_trip_with_body() -> None:
    async def go() -> None:
        client, server, *_ = await _authed_pair()
        body = memoryview(bytes(range(256)) * 8192)
        out = memoryview(bytearray(len(body)))

        async def receive() -> dict:
            header = await server.recv()
            await server.recv_body_into(out[:header["n"]])
            return header

        sent = client.send({"t": "x"}, body)
        _, header = await asyncio.gather(sent, receive())
        assert out == body and header["t"] == "x" and header["n"] == len(body)
        client.close(), server.close()
    run(go())


def test_tampered_header_fails_mac() -> None:
    async def go() -> None:
        client, _server, _a, b = await _authed_pair()
        raw_reader = Channel(b, 2.0, is_client=False)
        raw_reader.authenticate(b"x" * 32)             # wrong key == any modified header
        await client.send({"t": "x"})
        with pytest.raises(CorruptFrame, match="MAC"):
            await raw_reader.recv()
    run(go())


def test_replayed_frame_fails_mac() -> None:
    async def go() -> None:
        client, server, a, _b = await _authed_pair()
        frames = []
        orig = client._loop.sock_sendall

        async def capture(sock, data):
            frames.append(bytes(data))
            await orig(sock, data)

        client._loop.sock_sendall = capture
        await client.send({"t": "x"})
        assert (await server.recv())["t"] == "x"
        await orig(a, frames[0])                       # the same bytes again: wrong sequence number
        with pytest.raises(CorruptFrame, match="MAC"):
            await server.recv()
    run(go())


def test_corrupt_body_fails_checksum() -> None:
    async def go() -> None:
        client, server, a, _b = await _authed_pair()
        frames = []
        orig = client._loop.sock_sendall

        async def flip_body(sock, data):                # header, body, trailer: flip the body
            data = bytearray(data)
            if len(frames) == 1:
                data[500] ^= 1
            frames.append(bytes(data))
            await orig(sock, data)

        client._loop.sock_sendall = flip_body
        await client.send({"t": "x"}, memoryview(b"a" * 1000))
        header = await server.recv()
        with pytest.raises(CorruptFrame, match="checksum"):
            await server.recv_body_into(memoryview(bytearray(header["n"])))
    run(go())


def test_truncated_frame_is_peer_closed() -> None:
    async def go() -> None:
        client, server, a, _b = await _authed_pair()
        await client.send({"t": "x"}, memoryview(b"abc" * 1000))
        a.close()
        header = await server.recv()
        with pytest.raises(PeerClosed):
            await server.recv_body_into(memoryview(bytearray(header["n"] + 10)))
    run(go())


def test_silence_is_a_timeout() -> None:
    async def go() -> None:
        _client, server, *_ = await _authed_pair(timeout_s=0.2)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(PeerTimeout):
            await server.recv()
        assert loop.time() - start < 1.0
    run(go())


def test_oversized_or_garbage_header_is_corrupt() -> None:
    async def go() -> None:
        _client, server, a, _b = await _authed_pair()
        a.sendall(b"\xff\xff\xff\xff")
        with pytest.raises(CorruptFrame, match="exceeds"):
            await server.recv()
        _client, server, a, _b = _pair()
        a.sendall(b"\x00\x00\x00\x03\xc1\xc1\xc1")      # msgpack reserved bytes, unauthenticated phase
        with pytest.raises(CorruptFrame):
            await server.recv()
    run(go())


async def _handshake(client_identity=IDENTITY, client_secret=SECRET, transport="tcp"):
    client, server, *_ = _pair()

    async def client_side() -> None:
        try:
            await client_handshake(client, client_secret, client_identity, transport)
        except BaseException:
            client.close()                               # as the receiver does on any failure
            raise

    results = await asyncio.gather(
        client_side(), server_handshake(server, SECRET, IDENTITY, "tcp"), return_exceptions=True
    )
    client.close(), server.close()
    return results


def test_handshake_authenticates_both_sides() -> None:
    assert run(_handshake()) == [None, None]


@pytest.mark.parametrize(
    ("change", "field"),
    [({"config_hash": "other"}, "config_hash"), ({"dtype": "float16"}, "dtype"),
     ({"layer_schedule": "KKKM"}, "layer_schedule"), ({"block_size": 128}, "block_size")],
)
def test_identity_mismatch_names_the_field(change: dict, field: str) -> None:
    client_err, server_err = run(_handshake(client_identity=with_identity(**change)))
    assert isinstance(client_err, IdentityMismatch) and isinstance(server_err, IdentityMismatch)
    assert f"mismatch on {field}" in str(client_err)
    assert repr(getattr(IDENTITY, field)) in str(client_err)


def test_wrong_secret_refused() -> None:
    client_err, server_err = run(_handshake(client_secret=b"another-secret-of-32-bytes-long!"))
    assert isinstance(client_err, AuthenticationFailed)
    assert isinstance(server_err, PeerClosed)            # the client hung up before proving anything


def test_wrong_transport_refused() -> None:
    client_err, server_err = run(_handshake(transport="mooncake"))
    assert isinstance(client_err, ProtocolMismatch) and isinstance(server_err, ProtocolMismatch)


def test_client_without_secret_cannot_forge_the_proof() -> None:
    async def go():
        client, server, a, _b = _pair()
        server_task = asyncio.ensure_future(server_handshake(server, SECRET, IDENTITY, "tcp"))
        a.sendall(MAGIC)
        await client.send({"v": PROTOCOL_VERSION, "transport": "tcp", "nc": b"n" * 32})
        hello = await client.recv()
        assert "ns" in hello and "id" not in hello      # no model identity before authentication
        await client.send({"mac": b"\0" * 32})          # a forged proof
        reply = await client.recv()
        assert reply.get("err") == "auth"
        with pytest.raises(AuthenticationFailed):
            await server_task
    run(go())


def test_bad_magic_refused() -> None:
    async def go():
        _client, server, a, _b = _pair()
        a.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(CorruptFrame, match="magic"):
            await server_handshake(server, SECRET, IDENTITY, "tcp")
    run(go())


def _big_body(nbytes: int = 3 * (256 << 10) + 12345) -> memoryview:
    """Several MAC pieces plus a ragged tail, random bits."""
    return memoryview(bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()))


async def _send_in_thread(chan: Channel, body: memoryview) -> None:
    await in_thread(chan, lambda: chan.send_blocking({"t": "x"}, body))


def test_blocking_frames_land_in_place_and_verify() -> None:
    """The bulk path: a sender thread MACs piece by piece as it sends, a receiver thread reads
    straight into the destination and MACs it there; async and blocking framing interoperate."""
    async def go() -> None:
        client, server, *_ = await _authed_pair()
        body = _big_body()
        dest = torch.zeros(len(body) + 64, dtype=torch.uint8)
        window = memoryview(dest.numpy())[32:32 + len(body)]

        def receive() -> dict:
            header = server.recv_blocking()
            server.recv_body_blocking(window[:header["n"]])
            return header

        _, header = await asyncio.gather(_send_in_thread(client, body), in_thread(server, receive))
        assert header["n"] == len(body) and bytes(window) == bytes(body)
        assert not dest[:32].any() and not dest[32 + len(body):].any()     # nothing outside
        await client.send({"t": "y"}, body[:1000])                          # async -> blocking
        assert (await in_thread(server, server.recv_blocking))["t"] == "y"
        await in_thread(server, lambda: server.recv_body_blocking(window[:1000]))
        assert bytes(window[:1000]) == bytes(body[:1000])
    run(go())


@pytest.mark.parametrize("where", ["first-piece", "last-byte", "trailer"])
def test_one_flipped_byte_in_a_large_frame_is_detected(where: str) -> None:
    async def go() -> None:
        client, server, a, _b = await _authed_pair()
        body = _big_body()
        wire = bytearray()

        class Capture:                                  # records what the client would send
            def sendall(self, data) -> None:
                wire.extend(data)

        client.sock = Capture()
        client.send_blocking({"t": "x"}, body)
        header_end = len(wire) - len(body) - MAC_LEN
        index = {"first-piece": header_end + 7, "last-byte": header_end + len(body) - 1,
                 "trailer": len(wire) - 3}[where]
        wire[index] ^= 0x01
        a.setblocking(True)
        writer = threading.Thread(target=a.sendall, args=(bytes(wire),))
        writer.start()

        def receive() -> None:
            header = server.recv_blocking()
            server.recv_body_blocking(memoryview(bytearray(header["n"])))

        with pytest.raises(CorruptFrame, match="checksum"):
            await in_thread(server, receive)
        writer.join(5)
    run(go())


def test_blocking_reads_are_typed_and_bounded() -> None:
    async def go() -> None:
        client, server, a, _b = await _authed_pair(timeout_s=0.3)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(PeerTimeout):                      # silence
            await in_thread(server, server.recv_blocking)
        assert loop.time() - start < 2.0
        client, server, a, _b = await _authed_pair()

        async def send_then_hang_up() -> None:
            await client.send({"t": "x"}, _big_body())
            a.shutdown(socket.SHUT_WR)                        # the frame ends short of the reader

        def receive() -> None:
            header = server.recv_blocking()
            server.recv_body_blocking(memoryview(bytearray(header["n"] + 10)))

        with pytest.raises(PeerClosed, match="mid-frame"):
            await asyncio.gather(send_then_hang_up(), in_thread(server, receive))
    run(go())


def test_cancelled_thread_job_is_waited_for_and_unblocked() -> None:
    """Cancelling `in_thread` shuts the socket down so the job's blocked read ends at once, and
    returns only after the job did: it never touches buffers after the caller moved on."""
    async def go() -> None:
        _client, server, *_ = await _authed_pair(timeout_s=30)
        finished = []

        def job() -> None:
            try:
                server.recv_blocking()
            finally:
                finished.append(True)

        task = asyncio.ensure_future(in_thread(server, job))
        await asyncio.sleep(0.1)
        start = asyncio.get_running_loop().time()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [True] and asyncio.get_running_loop().time() - start < 2.0
    run(go())


def test_old_protocol_version_is_refused() -> None:
    async def go():
        client, server, a, _b = _pair()
        server_task = asyncio.ensure_future(server_handshake(server, SECRET, IDENTITY, "tcp"))
        a.sendall(MAGIC)
        await client.send({"v": 1, "transport": "tcp", "id": IDENTITY.to_dict(), "nc": b"n" * 32})
        assert (await client.recv()).get("err") == "protocol"
        with pytest.raises(ProtocolMismatch, match="version 1"):
            await server_task
    run(go())
