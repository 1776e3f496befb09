"""Typed transfer errors.

Every failure of a pull or release ends in exactly one `TransferError` subclass. Each class has
a stable `code`, which is also what crosses the wire in an error frame, so a sender-side refusal
(unknown request, expired lease, ...) is re-raised on the receiver as the same class.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every kv_transfer failure."""

    code = "transfer_error"


class TransferConfigError(TransferError):
    """The transfer config or the params handed to a transport are unusable."""

    code = "config"


class UnknownRequest(TransferError):
    """The sender holds no lease for this request id (never published, released or aborted)."""

    code = "unknown_request"


class DuplicateRequest(TransferError):
    """A lease for this request id is already held."""

    code = "duplicate_request"


class LeaseExpired(TransferError):
    """The lease ran out before the transfer finished; the sender has freed (or will free) the state."""

    code = "lease_expired"


class RequestAborted(TransferError):
    """The sender aborted the request while it was being pulled."""

    code = "aborted"


class AuthenticationFailed(TransferError):
    """The peer could not prove knowledge of the shared secret, or a frame's MAC is wrong."""

    code = "auth"


class IdentityMismatch(TransferError):
    """The peers serve different models (config hash, dtype, layer schedule or block size)."""

    code = "identity_mismatch"


class ProtocolMismatch(TransferError):
    """The peers speak different protocol versions or transports."""

    code = "protocol"


class CorruptFrame(TransferError):
    """A frame is malformed, out of order, out of bounds, or its body checksum is wrong."""

    code = "corrupt_frame"


class PeerTimeout(TransferError):
    """The peer did not answer (connect, read or write) within the configured time."""

    code = "timeout"


class PeerClosed(TransferError):
    """The peer closed or reset the connection, or could not be reached at all."""

    code = "peer_closed"


class SenderShutdown(TransferError):
    """The sender is stopping; its leases are being freed."""

    code = "shutdown"


_BY_CODE = {
    cls.code: cls
    for cls in (
        TransferError, TransferConfigError, UnknownRequest, DuplicateRequest, LeaseExpired, RequestAborted,
        AuthenticationFailed, IdentityMismatch, ProtocolMismatch, CorruptFrame, PeerTimeout,
        PeerClosed, SenderShutdown,
    )
}


def error_from_code(code: object, message: object) -> TransferError:
    """Rebuild the typed error a peer reported; unknown codes become a plain `TransferError`."""
    cls = _BY_CODE.get(code, TransferError) if isinstance(code, str) else TransferError
    return cls(f"peer reported: {message}")
