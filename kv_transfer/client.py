"""The receiver half of the control plane (see `kv_transfer.server` for the protocol)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from kv_transfer.arena import ReceiveArenas
from kv_transfer.errors import CorruptFrame, PeerTimeout, ProtocolMismatch, TransferConfigError, TransferError
from kv_transfer.handshake import client_handshake
from kv_transfer.interface import INTERFACE_VERSION, KVReceiver, KVTransferParams, TransferConfig
from kv_transfer.metrics import TransferMetrics, get_metrics
from kv_transfer.payload import TensorSpec, TransferPayload
from kv_transfer.wire import Channel, connect

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """Where a receiver finds one published state."""

    host: str
    port: int
    request_id: str
    state_bytes: int | None


def parse_manifest(header: dict, request_id: str, max_bytes: int) -> tuple[dict, list[TensorSpec]]:
    """Validate a manifest frame: right request, sane specs, total within `max_bytes`."""
    if header.get("t") != "manifest" or header.get("rid") != request_id or header["n"]:
        raise CorruptFrame(f"expected the manifest of {request_id!r}")
    raw_specs = header.get("tensors")
    if not isinstance(raw_specs, list):
        raise CorruptFrame("manifest without a tensor list")
    specs = [TensorSpec.from_wire(s) for s in raw_specs]
    total = sum(s.nbytes for s in specs)
    if total != header.get("total") or total > max_bytes or len({s.name for s in specs}) < len(specs):
        raise CorruptFrame(f"manifest of {total} bytes is inconsistent or over the limit")
    try:
        meta = msgpack.unpackb(header.get("meta"), raw=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types for garbage
        raise CorruptFrame("undecodable meta") from exc
    if not isinstance(meta, dict):
        raise CorruptFrame("meta is not a map")
    return meta, specs


class ControlReceiver(KVReceiver):
    """Pulls and releases; subclasses implement `_fetch` (pull request, manifest, data phase)."""

    transport_name = "tcp"

    def __init__(self, config: TransferConfig, metrics: TransferMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or get_metrics()
        self._arenas = ReceiveArenas(config.recv_pool_bytes)

    def _host_tensors(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Receive tensors on the host, from the reusable arenas (already paged in)."""
        return self._arenas.tensors(specs)

    async def pull(self, params: KVTransferParams) -> TransferPayload:
        target = self._target(params)
        start = time.monotonic()
        try:
            try:
                async with asyncio.timeout(self.config.transfer_timeout_s):
                    payload = await self._fetch(target)
            except TimeoutError as exc:
                limit = self.config.transfer_timeout_s
                raise PeerTimeout(f"transfer did not finish within {limit}s") from exc
        except TransferError as err:
            self.metrics.failed("recv", self.transport_name, err.code)
            logger.warning("kv_transfer pull of %s failed: %s: %s", target.request_id, err.code, err)
            raise
        self.metrics.succeeded("recv", self.transport_name, payload.nbytes(), time.monotonic() - start)
        return payload

    async def release(self, params: KVTransferParams) -> bool:
        target = self._target(params)
        chan = await self._connect(target)
        try:
            await chan.send({"t": "release", "rid": target.request_id})
            return bool((await chan.recv_message("released")).get("freed"))
        finally:
            chan.close()

    async def _fetch(self, target: Target) -> TransferPayload:
        raise NotImplementedError

    async def _connect(self, target: Target) -> Channel:
        cfg = self.config
        chan = await connect(target.host, target.port, cfg.connect_timeout_s, cfg.read_timeout_s)
        try:
            await client_handshake(chan, cfg.secret, cfg.identity, self.transport_name)
        except BaseException:
            chan.close()
            raise
        return chan

    def _target(self, params: KVTransferParams) -> Target:
        if params.interface_version != INTERFACE_VERSION:
            raise ProtocolMismatch(f"params of interface version {params.interface_version!r}, "
                                   f"this receiver speaks {INTERFACE_VERSION}")
        if params.transport not in (None, self.transport_name):
            raise ProtocolMismatch(f"params are for transport {params.transport!r}, "
                                   f"this receiver speaks {self.transport_name!r}")
        host, port, request_id = params.remote_host, params.remote_port, params.remote_request_id
        if not (params.do_remote_prefill and host and request_id) or not isinstance(port, int) or not 0 < port < 65536:
            raise TransferConfigError("kv_transfer_params lack do_remote_prefill/remote_host/port/request_id")
        state_bytes = params.state_bytes if isinstance(params.state_bytes, int) else None
        return Target(host, port, request_id, state_bytes)


async def gather_all(coros: list, discard: Callable[[Any], None] | None = None) -> list:
    """Run coroutines concurrently; on the first failure cancel the rest and raise that failure.

    On failure, `discard` is called with each result that did complete (e.g. to close channels).
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    ok = False
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        ok = True
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not ok and discard is not None:
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    discard(task.result())
