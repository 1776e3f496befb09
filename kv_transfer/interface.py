"""The kv_transfer interface (version 1): prefill publishes under a lease, decode pulls then releases.

    prefill worker                                   decode worker
    sender.publish(payload, lease_s, on_free) ─params─> receiver.pull(params)  -> TransferPayload
                                                       receiver.release(params) (always, even after
    on_free(request_id, reason)  <── release / lease expiry / abort / stop      a failed pull)

Invariants every transport keeps:
- `on_free` is called exactly once per published request, with reason `released`, `expired`,
  `aborted` or `shutdown`, and never while a pull is still reading that request's tensors.
- A pull returns the whole state or raises a `TransferError`; it never returns partial state, and
  a pull that outlives its lease raises `LeaseExpired` even if every byte arrived.
- Every network wait is bounded by a timeout in `TransferConfig`.
"""

from __future__ import annotations

import abc
import importlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_transfer.errors import TransferConfigError
from kv_transfer.metrics import TransferMetrics
from kv_transfer.payload import ModelIdentity, TransferPayload
from shared.kv_transfer_params import INTERFACE_VERSION, KVTransferParams  # noqa: F401 - the transports use both

OnFree = Callable[[str, str], None]


@dataclass(frozen=True)
class TransferConfig:
    """Everything a transport needs, parsed once at the process edge.

    `host`/`port` is where a sender listens (port 0 = any free port); `advertise_host` is what it
    puts in params (defaults to `host`). `secret` authenticates every frame and is never logged.
    `verify_data=False` skips the MAC check of the bulk bytes on both sides; it is meant only for
    fabrics that authenticate themselves (mooncake over RDMA/Ascend, torch-dist over nccl/hccl)
    and is refused wherever the bytes cross plain TCP (`tcp`, mooncake's `tcp` protocol, gloo);
    control frames are always authenticated. `streams` (parallel tcp connections, each with its
    own thread and MAC) should not exceed the cores a transfer may use: on the 2-core benchmark
    host 2-3 streams of 8 MiB chunks reach 0.82-0.92 of a plain socket, 4 streams 0.74-0.79.
    `recv_pool_bytes` bounds the idle receive buffers a receiver keeps paged in for the next
    pull (`kv_transfer.arena`; 0 = allocate per pull).
    """

    identity: ModelIdentity
    secret: bytes = field(repr=False)
    transport: str = "tcp"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    streams: int = 2
    chunk_bytes: int = 8 << 20
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    transfer_timeout_s: float = 120.0
    lease_s: float = 30.0
    renewed_lease_s: float = 5.0        # a state its router renews (x-kimi-pd-lease-renew): each renewal's span
    sweep_interval_s: float = 0.5
    max_state_bytes: int = 64 << 30
    device: str = "cpu"
    mooncake_protocol: str = "tcp"
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    mooncake_device_name: str = ""
    verify_data: bool = True
    recv_pool_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise TransferConfigError("secret must be bytes, at least 16 of them")
        if not 1 <= self.streams <= 64:
            raise TransferConfigError("streams must be in [1, 64]")
        if not 64 << 10 <= self.chunk_bytes <= 256 << 20:
            raise TransferConfigError("chunk_bytes must be in [64 KiB, 256 MiB]")
        if self.verify_data is not True and self.verify_data is not False:
            raise TransferConfigError("verify_data must be a bool")
        if not self.verify_data and (self.transport == "tcp" or (
                self.transport == "mooncake" and self.mooncake_protocol == "tcp")):
            raise TransferConfigError(f"verify_data=False is refused for {self.transport!r} over TCP: "
                              "only a fabric that authenticates itself may skip the MAC check")
        if self.recv_pool_bytes < 0:
            raise TransferConfigError("recv_pool_bytes must be >= 0")
        timeouts = (self.connect_timeout_s, self.read_timeout_s, self.transfer_timeout_s)
        if min(*timeouts, self.lease_s, self.renewed_lease_s, self.sweep_interval_s) <= 0:
            raise TransferConfigError("timeouts, lease_s, renewed_lease_s and sweep_interval_s must be positive")


class KVSender(abc.ABC):
    """Prefill side: holds published states under leases and serves pulls and releases."""

    transport_name: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Bind and start serving; afterwards `publish` may be called."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop serving, end in-flight pulls and free every lease with reason `shutdown`."""

    @abc.abstractmethod
    def publish(self, payload: TransferPayload, lease_s: float | None, on_free: OnFree) -> KVTransferParams:
        """Hold `payload` for `lease_s` seconds (config default when None); thread-safe.

        Raises `DuplicateRequest` if the id is already held, `TypeError` if meta is not msgpack-able.
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Free a held request with reason `aborted`; False if it was not held. Thread-safe."""

    def renew(self, request_ids: list[str], lease_s: float) -> int:
        """Hold these published states `lease_s` more seconds, never past the config's `lease_s` from their
        publication (a router renewing the states its requests wait for); how many were renewed."""
        return 0

    @abc.abstractmethod
    def held_count(self) -> int:
        """Leases whose `on_free` has not run yet."""

    @property
    @abc.abstractmethod
    def port(self) -> int:
        """The bound control port (valid after `start`)."""


class KVReceiver(abc.ABC):
    """Decode side: pulls a published state, then releases it on the sender."""

    transport_name: str

    async def start(self) -> None:  # noqa: B027 - an optional hook: the default is a deliberate no-op
        """Acquire transport resources (no-op for transports that need none)."""

    async def stop(self) -> None:  # noqa: B027 - an optional hook: the default is a deliberate no-op
        """Release transport resources; idempotent."""

    @abc.abstractmethod
    async def pull(self, params: KVTransferParams) -> TransferPayload:
        """Fetch the whole state or raise a `TransferError`; never returns partial state."""

    @abc.abstractmethod
    async def release(self, params: KVTransferParams) -> bool:
        """Ask the sender to free the lease; True if this call freed it, False if already gone.

        Call it after every pull, failed ones included, so prefill blocks are never stranded.
        Raises `TransferError` only when the sender cannot be reached or refuses us.
        """


_TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "tcp": ("kv_transfer.tcp", "TcpSender", "TcpReceiver"),
    "torch-dist": ("kv_transfer.torch_dist", "TorchDistSender", "TorchDistReceiver"),
    "mooncake": ("kv_transfer.mooncake", "MooncakeSender", "MooncakeReceiver"),
}


def register_transport(name: str, module: str, sender_cls: str, receiver_cls: str) -> None:
    """Add a transport; the module is imported only when the transport is first used."""
    _TRANSPORTS[name] = (module, sender_cls, receiver_cls)


def transports() -> list[str]:
    return sorted(_TRANSPORTS)


def _resolve(name: str, index: int) -> type:
    if name not in _TRANSPORTS:
        raise TransferConfigError(f"unknown transport {name!r}; known: {', '.join(transports())}")
    module = importlib.import_module(_TRANSPORTS[name][0])
    return getattr(module, _TRANSPORTS[name][index])


def make_sender(config: TransferConfig, metrics: TransferMetrics | None = None) -> KVSender:
    return _resolve(config.transport, 1)(config, metrics)


def make_receiver(config: TransferConfig, metrics: TransferMetrics | None = None) -> KVReceiver:
    return _resolve(config.transport, 2)(config, metrics)
