"""Framing shared by every transport's control connection (`kv_transfer.handshake` opens it).

After the handshake every frame is:

    u32 header_len | msgpack header | 32-byte HMAC(key, direction|seq|header) | body (header["n"] bytes)

`seq` counts frames per direction, so frames cannot be dropped, reordered or replayed. The
header carries `ck` = SHA-256 of the body, so the MAC covers the body too; the body is read
straight into its destination buffer and verified before anyone may use it.
Every read and write is bounded by the channel's timeout (`PeerTimeout`); EOF or reset is
`PeerClosed`; anything malformed is `CorruptFrame`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import struct

import msgpack

from kv_transfer.errors import (
    CorruptFrame,
    PeerClosed,
    PeerTimeout,
    TransferError,
    error_from_code,
)

MAC_LEN = 32
MAX_HANDSHAKE = 64 << 10
MAX_HEADER = 32 << 20
HASH_IN_THREAD = 256 << 10
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the concatenated parts."""
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


async def digest(view: memoryview) -> bytes:
    """SHA-256 of `view`; large buffers are hashed in a thread (hashlib releases the GIL)."""
    if len(view) < HASH_IN_THREAD:
        return hashlib.sha256(view).digest()
    return await asyncio.get_running_loop().run_in_executor(None, _sha256, view)


def _sha256(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


async def verify(view: memoryview, checksum: object) -> None:
    """Raise `CorruptFrame` unless `checksum` is the SHA-256 of `view`."""
    if not isinstance(checksum, bytes) or not hmac.compare_digest(await digest(view), checksum):
        raise CorruptFrame("body checksum mismatch")


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


class Channel:
    """One connection. Until `authenticate`, frames are plain (handshake); afterwards MAC'ed.

    At most one task sends and one task receives at a time. After any error the channel is in
    an undefined state and must be closed.
    """

    def __init__(self, sock: socket.socket, timeout_s: float, is_client: bool) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._key: bytes | None = None
        self._out_dir, self._in_dir = (b"C", b"S") if is_client else (b"S", b"C")
        self._out_seq = self._in_seq = 0

    def authenticate(self, key: bytes) -> None:
        self._key = key

    def close(self) -> None:
        _close(self._loop, self.sock)

    async def send(self, header: dict, body: memoryview | None = None) -> None:
        """Send one frame; `header["n"]` is set to the body length."""
        header["n"] = 0 if body is None else len(body)
        raw = msgpack.packb(header, use_bin_type=True)
        parts = [_LEN.pack(len(raw)), raw]
        if self._key is not None:
            parts.append(mac(self._key, self._out_dir, _SEQ.pack(self._out_seq), raw))
            self._out_seq += 1
        await self._io(self._loop.sock_sendall(self.sock, b"".join(parts)))
        if body is not None and len(body):
            await self._io(self._loop.sock_sendall(self.sock, body))

    async def recv(self, timeout_s: float | None = None) -> dict:
        """Read and authenticate one header. The caller must then consume `header["n"]` body bytes."""
        limit = MAX_HEADER if self._key is not None else MAX_HANDSHAKE
        size = _LEN.unpack(await self.read_exact(_LEN.size, timeout_s))[0]
        if size > limit:
            raise CorruptFrame(f"frame header of {size} bytes exceeds {limit}")
        raw = await self.read_exact(size)
        if self._key is not None:
            tag = await self.read_exact(MAC_LEN)
            want = mac(self._key, self._in_dir, _SEQ.pack(self._in_seq), raw)
            if not hmac.compare_digest(tag, want):
                raise CorruptFrame("frame MAC mismatch (tampered, replayed or reordered frame)")
            self._in_seq += 1
        header = _unpack(raw)
        if not isinstance(header.get("n", 0), int) or header.get("n", 0) < 0:
            raise CorruptFrame("bad body length")
        return header

    async def recv_body(self, view: memoryview) -> None:
        """Read exactly `len(view)` body bytes into `view`; the caller must `verify` them."""
        await self._read_into(view)

    async def recv_body_into(self, view: memoryview, checksum: object) -> None:
        """Read exactly `len(view)` body bytes into `view`, then verify their SHA-256."""
        await self._read_into(view)
        await verify(view, checksum)

    async def recv_message(self, kind: str, timeout_s: float | None = None) -> dict:
        """Read a body-less frame of type `kind`; an error frame is raised as its typed error."""
        header = await self.recv(timeout_s)
        if header.get("t") == "error":
            raise error_from_code(header.get("code"), header.get("msg"))
        if header.get("t") != kind or header["n"]:
            raise CorruptFrame(f"expected a {kind!r} frame, got {header.get('t')!r}")
        return header

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
        except TimeoutError as exc:
            raise PeerTimeout(f"peer did not complete a frame within {limit:.3g}s") from exc
        except (ConnectionError, OSError) as exc:
            raise PeerClosed(f"connection lost: {exc.__class__.__name__}") from exc


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
