"""kimi-pd kv transfer: moves a request's hybrid state from a prefill worker to a decode worker.

    sender = make_sender(config)                 # prefill side; `await sender.start()`
    params = sender.publish(payload, lease_s, on_free)   # -> kv_transfer_params for the router
    receiver = make_receiver(config)             # decode side
    payload = await receiver.pull(params)        # whole state or a TransferError
    await receiver.release(params)               # always, even after a failed pull

Transports (`TransferConfig.transport`): `tcp` (default), `torch-dist`, `mooncake`. The contract
and its invariants are in `kv_transfer.interface`; metric names in `kv_transfer.metrics`.
"""

from kv_transfer.errors import (
    AuthenticationFailed,
    CorruptFrame,
    DuplicateRequest,
    IdentityMismatch,
    LeaseExpired,
    PeerClosed,
    PeerTimeout,
    ProtocolMismatch,
    RequestAborted,
    SenderShutdown,
    TransferConfigError,
    TransferError,
    UnknownRequest,
)
from kv_transfer.interface import (
    INTERFACE_VERSION,
    KVReceiver,
    KVSender,
    KVTransferParams,
    TransferConfig,
    make_receiver,
    make_sender,
    register_transport,
    transports,
)
from kv_transfer.metrics import TransferMetrics, get_metrics
from kv_transfer.payload import ModelIdentity, TransferPayload

__all__ = [
    "INTERFACE_VERSION", "AuthenticationFailed", "TransferConfigError", "CorruptFrame", "DuplicateRequest",
    "IdentityMismatch", "KVReceiver", "KVSender", "KVTransferParams", "LeaseExpired",
    "ModelIdentity", "PeerClosed", "PeerTimeout", "ProtocolMismatch", "RequestAborted",
    "SenderShutdown", "TransferConfig", "TransferError", "TransferMetrics", "TransferPayload",
    "UnknownRequest", "get_metrics", "make_receiver", "make_sender", "register_transport",
    "transports",
]
