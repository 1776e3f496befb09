"""Framing shared by every transport's control connection (`kv_transfer.handshake` opens it).

After the handshake every frame is (protocol version 2):

    u32 header_len | msgpack header | 16-byte tag | body (header["n"] bytes) | 16-byte body tag

tag = GMAC(frame key, nonce "H"|direction|seq, header); the body tag (only when n > 0) =
GMAC(frame key, nonce "B"|direction|seq, body). `seq` counts frames per direction, so frames
cannot be dropped, reordered or replayed; the header is verified before its body is read, the
body before anyone may use it. The frame key derives from the handshake's session key, and every
(key, nonce) pair is used once.

The body tag trails the body so both sides can run one cache-hot pass: the sender MACs each
256 KiB piece just before the kernel copies it into the socket, the receiver just after the
kernel copied it into the destination tensor. Memory bandwidth, not the MAC, is the scarce
resource: on the benchmark host GMAC runs at 10-22 GiB/s per core over memory in cache but only
2.4-4 over cold memory (`python -m benchmarks.transfer` prints both).

Why GMAC (AES-256-GCM with the bytes as associated data, from `cryptography`/OpenSSL): it is a
standard MAC, and with AES-NI/VAES it is about 3x keyed BLAKE3 (5.6-6.2 GiB/s per core here) and
10x SHA-256 (1.5), so authenticating every byte costs a small fraction of moving it.

Two ways to drive a channel: the `async` methods (control frames, on the event loop) and the
`*_blocking` ones, which a transport runs in a thread of its own (`in_thread`) for the bulk data
phase: blocking `recv_into(..., MSG_WAITALL)` straight into tensor memory, and a MAC that releases
the GIL, so streams and their hashing run in parallel on every core.
Every read and write is bounded by the channel's timeout (`PeerTimeout`); EOF or reset is
`PeerClosed`; anything malformed is `CorruptFrame`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

import msgpack
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kv_transfer.errors import (
    CorruptFrame,
    PeerClosed,
    PeerTimeout,
    TransferError,
    error_from_code,
)

MAC_LEN = 16
MAX_MAC_INPUT = (1 << 31) - 1     # OpenSSL's limit for one one-shot GCM call
PIECE = 256 << 10                 # MAC'd and copied together, so the MAC reads from cache
MAX_HANDSHAKE = 64 << 10
MAX_HEADER = 32 << 20
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_FRAME_CONTEXT = b"kimi-pd kv_transfer v2 frame key"
T = TypeVar("T")


def hmac_sha256(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the concatenated parts (handshake proofs and the session key)."""
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def derive_key(context: bytes, material: bytes) -> bytes:
    """A 32-byte key for one purpose (`context`) from the session key."""
    return hmac_sha256(material, context)


class Gmac:
    """AES-256-GMAC under one key. Thread-safe; each nonce must be used once per key."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._aead = AESGCM(key)

    def incremental(self, nonce: bytes):
        """A running GMAC: `.authenticate_additional_data(piece)` per piece, then `finalize()`
        and `.tag` (the same tag `tag` computes over the concatenated pieces)."""
        return Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()

    def tag(self, nonce: bytes, data: memoryview | bytes) -> bytes:
        """The 16-byte tag of `data` (releases the GIL, so call it from threads for big inputs)."""
        if len(data) > MAX_MAC_INPUT:
            raise ValueError(f"cannot tag {len(data)} bytes at once (max {MAX_MAC_INPUT})")
        return self._aead.encrypt(nonce, b"", data)

    def check(self, nonce: bytes, data: memoryview | bytes, tag: object) -> bool:
        return isinstance(tag, bytes) and hmac.compare_digest(self.tag(nonce, data), tag)


def _nonce(kind: bytes, direction: bytes, seq: int) -> bytes:
    return kind + direction + _SEQ.pack(seq) + b"\0\0"


def _close(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Close now, even with a cancelled read or write pending: unregistering the fd first cancels
    the loop's handles, so their late clean-up cannot touch another socket reusing the fd number."""
    fd = sock.fileno()
    if fd >= 0:
        loop.remove_reader(fd)
        loop.remove_writer(fd)
    sock.close()


def _unpack(raw: bytes) -> dict:
    try:
        obj = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types for garbage
        raise CorruptFrame("undecodable frame header") from exc
    if not isinstance(obj, dict):
        raise CorruptFrame("frame header is not a map")
    return obj


def _typed(exc: BaseException, limit: float) -> TransferError:
    if isinstance(exc, (TimeoutError, BlockingIOError)):
        return PeerTimeout(f"peer did not complete a frame within {limit:.3g}s")
    return PeerClosed(f"connection lost: {exc.__class__.__name__}")


class Channel:
    """One connection. Until `authenticate`, frames are plain (handshake); afterwards tagged.

    At most one task (or one `in_thread` job) sends and one receives at a time. After any error
    the channel is in an undefined state and must be closed.
    """

    def __init__(self, sock: socket.socket, timeout_s: float, is_client: bool) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._mac: Gmac | None = None
        self._session_key: bytes | None = None
        self._out_dir, self._in_dir = (b"C", b"S") if is_client else (b"S", b"C")
        self._out_seq = self._in_seq = 0

    def authenticate(self, session_key: bytes) -> None:
        self._session_key = session_key
        self._mac = Gmac(derive_key(_FRAME_CONTEXT, session_key))

    def derived_key(self, context: bytes) -> bytes:
        """A key for another purpose of this session (e.g. a sideband's bulk-data MAC)."""
        if self._session_key is None:
            raise CorruptFrame("keys need an authenticated channel")
        return derive_key(context, self._session_key)

    def close(self) -> None:
        _close(self._loop, self.sock)

    def _body_nonce(self, sending: bool) -> bytes:
        if sending:
            return _nonce(b"B", self._out_dir, self._out_seq)
        return _nonce(b"B", self._in_dir, self._in_seq - 1)      # of the header just read

    def _body_mac(self) -> Gmac:
        if self._mac is None:
            raise CorruptFrame("bodies need an authenticated channel")
        return self._mac

    # -- framing (pure: no I/O) ------------------------------------------------------------

    def _encode(self, header: dict, body: memoryview | None) -> bytes:
        header["n"] = 0 if body is None else len(body)
        raw = msgpack.packb(header, use_bin_type=True)
        parts = [_LEN.pack(len(raw)), raw]
        if self._mac is not None:
            parts.append(self._mac.tag(_nonce(b"H", self._out_dir, self._out_seq), raw))
            self._out_seq += 1
        return b"".join(parts)

    def _header_size(self, prefix: bytes) -> int:
        limit = MAX_HEADER if self._mac is not None else MAX_HANDSHAKE
        size = _LEN.unpack(prefix)[0]
        if size > limit:
            raise CorruptFrame(f"frame header of {size} bytes exceeds {limit}")
        return size

    def _decode(self, raw: bytes, tag: bytes | None) -> dict:
        if self._mac is not None:
            if not self._mac.check(_nonce(b"H", self._in_dir, self._in_seq), raw, tag):
                raise CorruptFrame("frame MAC mismatch (tampered, replayed or reordered frame)")
            self._in_seq += 1
        header = _unpack(raw)
        if not isinstance(header.get("n", 0), int) or header.get("n", 0) < 0:
            raise CorruptFrame("bad body length")
        header.setdefault("n", 0)
        return header

    # -- async (event loop) ----------------------------------------------------------------

    async def send(self, header: dict, body: memoryview | None = None) -> None:
        """Send one frame; `header["n"]` is set to the body length."""
        trailer = b""
        if body is not None and len(body) and self._mac is not None:
            trailer = self._mac.tag(self._body_nonce(sending=True), body)
        await self._io(self._loop.sock_sendall(self.sock, self._encode(header, body)))
        if body is not None and len(body):
            await self._io(self._loop.sock_sendall(self.sock, body))
            await self._io(self._loop.sock_sendall(self.sock, trailer))

    async def recv(self, timeout_s: float | None = None) -> dict:
        """Read and authenticate one header. The caller must then consume `header["n"]` body bytes."""
        size = self._header_size(await self.read_exact(_LEN.size, timeout_s))
        raw = await self.read_exact(size)
        tag = await self.read_exact(MAC_LEN) if self._mac is not None else None
        return self._decode(raw, tag)

    async def recv_body_into(self, view: memoryview) -> None:
        """Read the body announced by the header just read (`len(view)` bytes) into `view`,
        then its trailing tag; `CorruptFrame` unless it verifies."""
        await self._read_into(view)
        if len(view):
            tag = await self.read_exact(MAC_LEN)
            if not self._body_mac().check(self._body_nonce(sending=False), view, tag):
                raise CorruptFrame("body checksum mismatch")

    async def recv_message(self, kind: str, timeout_s: float | None = None) -> dict:
        """Read a body-less frame of type `kind`; an error frame is raised as its typed error."""
        return _expect(await self.recv(timeout_s), kind)

    async def send_error(self, err: TransferError) -> None:
        await self.send({"t": "error", "code": err.code, "msg": str(err)})

    async def send_raw(self, data: bytes) -> None:
        await self._io(self._loop.sock_sendall(self.sock, data))

    async def read_exact(self, n: int, timeout_s: float | None = None) -> bytes:
        buf = bytearray(n)
        await self._read_into(memoryview(buf), timeout_s)
        return bytes(buf)

    async def _read_into(self, view: memoryview, timeout_s: float | None = None) -> None:
        async def loop() -> None:
            rest = view
            while len(rest):
                got = await self._loop.sock_recv_into(self.sock, rest)
                if got == 0:
                    raise PeerClosed("peer closed the connection mid-frame" if rest is not view
                                     else "peer closed the connection")
                rest = rest[got:]

        await self._io(loop(), timeout_s)

    async def _io(self, coro, timeout_s: float | None = None) -> None:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                await coro
        except (TimeoutError, ConnectionError, OSError) as exc:
            raise _typed(exc, limit) from exc

    # -- blocking (inside `in_thread` only) ------------------------------------------------

    def send_blocking(self, header: dict, body: memoryview | None = None) -> None:
        """Send one frame; a body is MAC'd piece by piece as it goes out (one cache-hot pass)."""
        mac = self._body_mac().incremental(self._body_nonce(sending=True)) if body else None
        try:
            self.sock.sendall(self._encode(header, body))
            if mac is None or body is None:
                return
            for offset in range(0, len(body), PIECE):
                piece = body[offset:offset + PIECE]
                mac.authenticate_additional_data(piece)
                self.sock.sendall(piece)
            mac.finalize()
            self.sock.sendall(mac.tag)
        except OSError as exc:
            raise _typed(exc, self.timeout_s) from exc

    def recv_body_blocking(self, view: memoryview) -> None:
        """Read the body announced by the header just read straight into `view`, MAC'ing each
        piece as it lands, then check the trailing tag (`CorruptFrame` if it differs)."""
        if not len(view):
            return
        mac = self._body_mac().incremental(self._body_nonce(sending=False))
        for offset in range(0, len(view), PIECE):
            piece = view[offset:offset + PIECE]
            self.recv_into_blocking(piece)
            mac.authenticate_additional_data(piece)
        mac.finalize()
        if not hmac.compare_digest(mac.tag, self._read_exact_blocking(MAC_LEN)):
            raise CorruptFrame("body checksum mismatch")

    def recv_blocking(self) -> dict:
        size = self._header_size(self._read_exact_blocking(_LEN.size))
        raw = self._read_exact_blocking(size)
        tag = self._read_exact_blocking(MAC_LEN) if self._mac is not None else None
        return self._decode(raw, tag)

    def recv_message_blocking(self, kind: str) -> dict:
        return _expect(self.recv_blocking(), kind)

    def recv_into_blocking(self, view: memoryview) -> None:
        """Read exactly `len(view)` bytes into `view` (the caller verifies them)."""
        rest = view
        try:
            while len(rest):
                got = self.sock.recv_into(rest, len(rest), socket.MSG_WAITALL)
                if got == 0:
                    raise PeerClosed("peer closed the connection mid-frame" if rest is not view
                                     else "peer closed the connection")
                rest = rest[got:]
        except OSError as exc:
            raise _typed(exc, self.timeout_s) from exc

    def _read_exact_blocking(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into_blocking(memoryview(buf))
        return bytes(buf)


def _expect(header: dict, kind: str) -> dict:
    if header.get("t") == "error":
        raise error_from_code(header.get("code"), header.get("msg"))
    if header.get("t") != kind or header["n"]:
        raise CorruptFrame(f"expected a {kind!r} frame, got {header.get('t')!r}")
    return header


async def in_thread(chan: Channel, job: Callable[[], T]) -> T:
    """Run `job` (which drives `chan` with its `*_blocking` methods) in a thread of its own.

    A dedicated thread, not a bounded pool: streams block on the peer, and a sender and a
    receiver in one process must never wait for each other's pool slot. If we are cancelled, the
    socket is shut down (the job's next read or write fails at once) and we wait for the job to
    end, so it never touches buffers or the fd after we return.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def succeed(value: T) -> None:
        if not done.done():
            done.set_result(value)

    def fail(exc: BaseException) -> None:
        if not done.done():
            done.set_exception(exc)

    def target() -> None:
        try:
            settle = functools.partial(succeed, job())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            settle = functools.partial(fail, exc)
        with contextlib.suppress(RuntimeError):           # the loop is gone: nobody waits
            loop.call_soon_threadsafe(settle)

    sock = chan.sock
    sock.setblocking(True)
    timeval = struct.pack("ll", int(chan.timeout_s), int(chan.timeout_s % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    threading.Thread(target=target, name="kv-transfer-stream", daemon=True).start()
    try:
        result = await asyncio.shield(done)
    except asyncio.CancelledError:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(BaseException):
            await done
        raise
    finally:
        if done.done() and sock.fileno() >= 0:
            sock.setblocking(False)
    return result


async def connect(host: str, port: int, connect_timeout_s: float, timeout_s: float) -> Channel:
    """Open a TCP connection within `connect_timeout_s`; refused or unreachable is `PeerClosed`."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(connect_timeout_s):
            await loop.sock_connect(sock, (host, port))
    except TimeoutError as exc:
        _close(loop, sock)
        raise PeerTimeout(f"connect to {host}:{port} timed out after {connect_timeout_s}s") from exc
    except OSError as exc:
        _close(loop, sock)
        raise PeerClosed(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
    except BaseException:
        _close(loop, sock)
        raise
    return Channel(sock, timeout_s, is_client=True)
