"""The versioned, authenticated handshake that opens every control connection.

Before any key exists each message is `u32 len | msgpack`:

    client                                             server
    MAGIC, {v, transport, identity, nc}  ───────────>  checks v, transport, identity
                                         <───────────  {v, identity, ns, mac: H(secret, "S"|nc|ns)}
    checks identity and mac,
    {mac: H(secret, "C"|ns|nc)}          ───────────>  checks mac
                                         <───────────  {ok: true}   (or {err, msg} at any step)

H is HMAC-SHA256. Both nonces are fresh per connection, so a recorded handshake or frame never
verifies again. Session key = H(secret, "K"|nc|ns); afterwards the channel MACs every frame.
A refusal names its reason (e.g. which identity field differs) on both sides.
"""

from __future__ import annotations

import contextlib
import hmac
import os

from kv_transfer.errors import (
    AuthenticationFailed,
    CorruptFrame,
    IdentityMismatch,
    ProtocolMismatch,
    TransferError,
    error_from_code,
)
from kv_transfer.payload import ModelIdentity
from kv_transfer.wire import Channel, mac

PROTOCOL_VERSION = 1
MAGIC = b"KPDX"


async def client_handshake(
    chan: Channel, secret: bytes, identity: ModelIdentity, transport: str
) -> None:
    """Run the client half; raises the typed error the server reported or that we detected."""
    nc = os.urandom(32)
    await chan.send_raw(MAGIC)
    await chan.send({"v": PROTOCOL_VERSION, "transport": transport, "id": identity.to_dict(), "nc": nc})
    hello = await _reply(chan)
    peer = ModelIdentity.from_wire(hello.get("id"))
    diff = identity.mismatch(peer)
    if diff is not None:
        raise IdentityMismatch(diff)
    ns = hello.get("ns")
    if not isinstance(ns, bytes) or not hmac.compare_digest(
        _as_bytes(hello.get("mac")), mac(secret, b"S", nc, ns)
    ):
        raise AuthenticationFailed("peer failed to prove the shared secret (wrong secret?)")
    await chan.send({"mac": mac(secret, b"C", ns, nc)})
    await _reply(chan)
    chan.authenticate(mac(secret, b"K", nc, ns))


async def server_handshake(
    chan: Channel, secret: bytes, identity: ModelIdentity, transport: str
) -> None:
    """Run the server half; on refusal tells the client why, then raises the same typed error."""
    if await chan.read_exact(len(MAGIC)) != MAGIC:
        raise CorruptFrame("not a kv_transfer client (bad magic)")
    hello = await chan.recv()
    try:
        nc = _check_hello(hello, identity, transport)
    except TransferError as err:
        await _try_send_error(chan, err)
        raise
    ns = os.urandom(32)
    await chan.send({"v": PROTOCOL_VERSION, "id": identity.to_dict(), "ns": ns,
                     "mac": mac(secret, b"S", nc, ns)})
    proof = await chan.recv()
    if not hmac.compare_digest(_as_bytes(proof.get("mac")), mac(secret, b"C", ns, nc)):
        err = AuthenticationFailed("client failed to prove the shared secret")
        await _try_send_error(chan, err)
        raise err
    await chan.send({"ok": True})
    chan.authenticate(mac(secret, b"K", nc, ns))


def _check_hello(hello: dict, identity: ModelIdentity, transport: str) -> bytes:
    if hello.get("v") != PROTOCOL_VERSION:
        raise ProtocolMismatch(f"protocol version {hello.get('v')!r}, expected {PROTOCOL_VERSION}")
    if hello.get("transport") != transport:
        raise ProtocolMismatch(f"transport {hello.get('transport')!r}, expected {transport!r}")
    diff = ModelIdentity.from_wire(hello.get("id")).mismatch(identity)
    if diff is not None:
        raise IdentityMismatch(diff)
    nc = hello.get("nc")
    if not isinstance(nc, bytes) or len(nc) != 32:
        raise CorruptFrame("bad client nonce")
    return nc


async def _reply(chan: Channel) -> dict:
    msg = await chan.recv()
    if "err" in msg:
        raise error_from_code(msg.get("err"), msg.get("msg"))
    return msg


async def _try_send_error(chan: Channel, err: TransferError) -> None:
    with contextlib.suppress(TransferError):
        await chan.send({"err": err.code, "msg": str(err)})


def _as_bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else b""
