"""The versioned, authenticated handshake that opens every control connection (protocol 3).

Before any key exists each message is `u32 len | msgpack`:

    client                                             server
    MAGIC, {v, transport, nc}            ───────────>  checks v and transport
                                         <───────────  {v, ns, mac: H(secret, "S"|nc|ns)}
    checks mac,
    {mac: H(secret, "C"|ns|nc)}          ───────────>  checks mac
                                         <───────────  {ok: true}   (or {err, msg} at any step)
    then, in tagged frames under the session key:
    {t: identity, id}                    ───────────>  compares identities
                                         <───────────  {t: identity, id} | error frame

H is HMAC-SHA256. Both nonces are fresh per connection, so a recorded handshake or frame never
verifies again. Session key = H(secret, "K"|nc|ns); afterwards the channel tags every frame.
The model identity crosses only after both sides proved the secret, so an unauthenticated
prober learns nothing about the model. A refusal names its reason (e.g. which identity field
differs) on both sides.
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
from kv_transfer.wire import Channel, hmac_sha256

PROTOCOL_VERSION = 3
MAGIC = b"KPDX"


async def client_handshake(
    chan: Channel, secret: bytes, identity: ModelIdentity, transport: str
) -> None:
    """Run the client half; raises the typed error the server reported or that we detected."""
    nc = os.urandom(32)
    await chan.send_raw(MAGIC)
    await chan.send({"v": PROTOCOL_VERSION, "transport": transport, "nc": nc})
    hello = await _reply(chan)
    ns = hello.get("ns")
    if not isinstance(ns, bytes) or not hmac.compare_digest(
        _as_bytes(hello.get("mac")), hmac_sha256(secret, b"S", nc, ns)
    ):
        raise AuthenticationFailed("peer failed to prove the shared secret (wrong secret?)")
    await chan.send({"mac": hmac_sha256(secret, b"C", ns, nc)})
    await _reply(chan)
    chan.authenticate(hmac_sha256(secret, b"K", nc, ns))
    await chan.send({"t": "identity", "id": identity.to_dict()})
    peer = ModelIdentity.from_wire((await chan.recv_message("identity")).get("id"))
    diff = identity.mismatch(peer)
    if diff is not None:
        raise IdentityMismatch(diff)


async def server_handshake(
    chan: Channel, secret: bytes, identity: ModelIdentity, transport: str
) -> None:
    """Run the server half; on refusal tells the client why, then raises the same typed error."""
    if await chan.read_exact(len(MAGIC)) != MAGIC:
        raise CorruptFrame("not a kv_transfer client (bad magic)")
    hello = await chan.recv()
    try:
        nc = _check_hello(hello, transport)
    except TransferError as err:
        await _try_send(chan, {"err": err.code, "msg": str(err)})
        raise
    ns = os.urandom(32)
    await chan.send({"v": PROTOCOL_VERSION, "ns": ns, "mac": hmac_sha256(secret, b"S", nc, ns)})
    proof = await chan.recv()
    if not hmac.compare_digest(_as_bytes(proof.get("mac")), hmac_sha256(secret, b"C", ns, nc)):
        refused = AuthenticationFailed("client failed to prove the shared secret")
        await _try_send(chan, {"err": refused.code, "msg": str(refused)})
        raise refused
    await chan.send({"ok": True})
    chan.authenticate(hmac_sha256(secret, b"K", nc, ns))
    claimed = await chan.recv_message("identity")
    diff = ModelIdentity.from_wire(claimed.get("id")).mismatch(identity)
    if diff is not None:
        mismatch = IdentityMismatch(diff)
        await _try_send(chan, {"t": "error", "code": mismatch.code, "msg": str(mismatch)})
        raise mismatch
    await chan.send({"t": "identity", "id": identity.to_dict()})


def _check_hello(hello: dict, transport: str) -> bytes:
    if hello.get("v") != PROTOCOL_VERSION:
        raise ProtocolMismatch(f"protocol version {hello.get('v')!r}, expected {PROTOCOL_VERSION}")
    if hello.get("transport") != transport:
        raise ProtocolMismatch(f"transport {hello.get('transport')!r}, expected {transport!r}")
    nc = hello.get("nc")
    if not isinstance(nc, bytes) or len(nc) != 32:
        raise CorruptFrame("bad client nonce")
    return nc


async def _reply(chan: Channel) -> dict:
    msg = await chan.recv()
    if "err" in msg:
        raise error_from_code(msg.get("err"), msg.get("msg"))
    return msg


async def _try_send(chan: Channel, frame: dict) -> None:
    with contextlib.suppress(TransferError):
        await chan.send(frame)


def _as_bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else b""
