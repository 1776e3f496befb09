"""The sender half of the control plane every transport shares (`kv_transfer.client` is the
receiver half). Transports subclass both halves and move the tensor bytes their own way:

    receiver                               sender
    pull {rid, ...transport fields}  ───>  acquire lease (typed error frame if unknown / expired)
                                     <───  manifest {rid, meta, tensors, total, ...}
            ... transport-specific data phase ...
                                     <───  end (only if the lease is still valid) | error
    release {rid}                    ───>  end lease "released"
                                     <───  released {freed}
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kv_transfer.errors import CorruptFrame, PeerClosed, PeerTimeout, SenderShutdown, TransferError
from kv_transfer.handshake import server_handshake
from kv_transfer.interface import KVSender, KVTransferParams, OnFree, TransferConfig
from kv_transfer.leases import Lease, LeaseTable
from kv_transfer.metrics import TransferMetrics, get_metrics
from kv_transfer.payload import TensorSpec, TransferPayload, host_contiguous, pack_meta, spec_of
from kv_transfer.wire import Channel

logger = logging.getLogger(__name__)


@dataclass
class HeldState:
    """A published payload as the sender keeps it: specs and meta encoded once, tensors ready."""

    request_id: str
    meta_raw: bytes
    specs: list[TensorSpec]
    tensors: list[torch.Tensor]
    nbytes: int
    extra: dict = field(default_factory=dict)

    def manifest(self, **fields: object) -> dict:
        return {"t": "manifest", "rid": self.request_id, "meta": self.meta_raw,
                "tensors": [s.to_wire() for s in self.specs], "total": self.nbytes, **fields}


class ControlSender(KVSender):
    """Serves pulls of held states; subclasses implement `_serve_pull` (the data phase)."""

    transport_name = "tcp"

    def __init__(self, config: TransferConfig, metrics: TransferMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.metrics = metrics or get_metrics()
        self._leases = LeaseTable(clock, on_end=self._on_end)
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._bound_port = 0

    @property
    def port(self) -> int:
        return self._bound_port

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        address = (self.config.host, self.config.port)
        self._listener = listener = socket.create_server(address, family=family, backlog=256)
        listener.setblocking(False)
        self._bound_port = listener.getsockname()[1]
        self._spawn(self._accept_loop(listener))
        self._spawn(self._sweep_loop())
        logger.info("kv_transfer %s sender listening on %s:%d", self.transport_name,
                    self.config.host, self._bound_port)

    async def stop(self) -> None:
        if self._listener is None:
            return
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        self._listener.close()
        self._listener = None
        self._leases.close()
        await asyncio.gather(*tasks, return_exceptions=True)

    def publish(self, payload: TransferPayload, lease_s: float | None, on_free: OnFree) -> KVTransferParams:
        if self._listener is None:
            raise SenderShutdown("publish on a sender that is not running")
        state = self._hold(payload)
        lease_s = self.config.lease_s if lease_s is None else lease_s
        try:
            self._leases.add(payload.request_id, state, lease_s, self._wrap(on_free, state))
        except BaseException:
            self._drop(state)
            raise
        self.metrics.held.labels(self.transport_name).inc()
        meta = payload.meta
        num_tokens = meta.get("num_tokens", len(meta.get("prompt_token_ids", ())))
        return KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.config.engine_id,
            remote_request_id=payload.request_id, remote_port=self._bound_port,
            remote_host=self.config.advertise_host or self.config.host,
            remote_block_ids=list(meta.get("block_ids", [])), remote_num_tokens=num_tokens,
            remote_blocks_expiry_time=time.time() + lease_s, transport=self.transport_name,
            state_bytes=state.nbytes,
        )

    def abort(self, request_id: str) -> bool:
        return self._leases.end(request_id, "aborted")

    def renew(self, request_ids: list[str], lease_s: float) -> int:
        return sum(self._leases.renew(rid, lease_s, self.config.lease_s) for rid in request_ids)

    def held_count(self) -> int:
        return self._leases.held_count()

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        """Where a held tensor lives; default: contiguous on the host (no copy if already so)."""
        return host_contiguous(tensor)

    def _hold(self, payload: TransferPayload) -> HeldState:
        """Turn a payload into what `_serve_pull` reads: specs and meta encoded once."""
        tensors = [self._place(t) for t in payload.tensors.values()]
        specs = [spec_of(name, t) for name, t in zip(payload.tensors, tensors, strict=True)]
        return HeldState(payload.request_id, pack_meta(payload.meta), specs, tensors,
                         sum(s.nbytes for s in specs))

    def _drop(self, state: HeldState) -> None:
        """Hook run when a held state is freed (or was never held), first: afterwards nothing
        of ours may read its tensors."""

    def _on_freed(self, request_id: str) -> None:
        """Hook run when a lease is freed, before the caller's `on_free`."""

    async def _serve_pull(self, chan: Channel, lease: Lease, request: dict) -> tuple[int, bool]:
        """Send manifest, data and `end` for one pull; returns (bytes sent, completes a transfer)."""
        raise NotImplementedError

    def _wrap(self, on_free: OnFree, state: HeldState) -> OnFree:
        def freed(request_id: str, reason: str) -> None:
            self._drop(state)
            self.metrics.held.labels(self.transport_name).dec()
            self._on_freed(request_id)
            on_free(request_id, reason)
        return freed

    def _on_end(self, reason: str) -> None:
        if reason == "expired":
            self.metrics.expired.labels(self.transport_name).inc()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _addr = await loop.sock_accept(listener)
            except OSError as exc:
                logger.warning("kv_transfer accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            self._spawn(self._serve(conn))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self._leases.sweep()

    async def _serve(self, conn: socket.socket) -> None:
        chan = Channel(conn, self.config.read_timeout_s, is_client=False)
        try:
            await server_handshake(chan, self.config.secret, self.config.identity, self.transport_name)
            while True:
                await self._dispatch(chan, await chan.recv())
        except PeerClosed:
            pass
        except TransferError as err:
            logger.warning("kv_transfer connection dropped: %s: %s", err.code, err)
        except Exception:  # noqa: BLE001 - one bad connection must not take the server down
            logger.exception("kv_transfer connection failed")
        finally:
            chan.close()

    async def _dispatch(self, chan: Channel, request: dict) -> None:
        kind, rid = request.get("t"), request.get("rid")
        if not isinstance(rid, str) or request["n"]:
            raise CorruptFrame("request without a request id")
        if kind == "release":
            await chan.send({"t": "released", "freed": self._leases.end(rid, "released")})
        elif kind == "pull":
            await self._handle_pull(chan, rid, request)
        else:
            raise CorruptFrame(f"unknown request {kind!r}")

    async def _handle_pull(self, chan: Channel, rid: str, request: dict) -> None:
        try:
            lease = self._leases.acquire(rid)
        except TransferError as err:
            self.metrics.failed("send", self.transport_name, err.code)
            await chan.send_error(err)
            return
        start = time.monotonic()
        try:
            nbytes, whole = await self._serve_pull(chan, lease, request)
        except TransferError as err:
            self.metrics.failed("send", self.transport_name, err.code)
            if not isinstance(err, (PeerClosed, PeerTimeout)):
                await chan.send_error(err)
            raise
        finally:
            self._leases.unacquire(lease)
        self.metrics.bytes.labels("send", self.transport_name).inc(nbytes)
        if whole:
            self.metrics.transfers.labels("send", self.transport_name).inc()
            self.metrics.seconds.labels("send", self.transport_name).observe(time.monotonic() - start)
