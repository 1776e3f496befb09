"""`mooncake` transport: the receiver reads the sender's registered tensor memory with the Mooncake
Transfer Engine (one-sided batch reads); the control plane is the shared TCP one
(`kv_transfer.sideband`), whose authenticated manifest carries the engine session, the remote
addresses; the receiver keeps about `WINDOW_BYTES` of one-region async reads in flight, tags
(GMAC) each tensor as soon as it landed while later ones are read, then checks the sender's tags
(`kv_transfer.sideband`).

Engine setup: `TransferEngine.initialize(config.host, config.mooncake_metadata_server,
config.mooncake_protocol, config.mooncake_device_name)`: here `P2PHANDSHAKE` metadata and the
`tcp` protocol; on Ascend the `ascend` protocol. Its data listener binds the wildcard address
whatever host is given, so only trusted networks may reach it; its reads are verified by tag.
Its tcp tunables (`MC_TCP_SLICE_SIZE`, `MC_TCP_LANES_PER_PEER`, read from the environment once
per process) stay at Mooncake's defaults: `benchmarks.mooncake_settings` found no setting that
moves more bytes or costs less CPU per GiB on loopback; set them in the environment to tune a
real network.

Memory: a held state is registered with the engine at its first pull and unregistered when its
lease is freed, which the lease table does only after every reader finished (so a remote read
never targets memory we already dropped; a read racing an expiry is refused by the engine and
fails the pull). Install: `pip install mooncake-transfer-engine-non-cuda` (CPU) or
`mooncake-transfer-engine`, plus the system package `libibverbs1`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kv_transfer.errors import CorruptFrame, PeerTimeout, TransferConfigError, TransferError
from kv_transfer.interface import TransferConfig
from kv_transfer.leases import Lease
from kv_transfer.server import HeldState
from kv_transfer.sideband import DataTagger, SidebandReceiver, SidebandSender
from kv_transfer.wire import Channel

logger = logging.getLogger(__name__)
WINDOW_BYTES = 32 << 20  # reads in flight: enough to keep the engine busy, few enough to land in order
POLL_S = 0.0005          # how often landed reads are collected (a 9 MiB tensor takes ~5-15 ms here)
Region = tuple[list[int], list[torch.Tensor]]  # registered addresses, and the tensors they live in


_ENGINES: dict[tuple[str, str, str, str], Any] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(host: str, metadata: str, protocol: str, device: str) -> Any:
    """The process's engine for these settings, created on first use and kept for the process's
    life: Mooncake expects one engine per process, and tearing one down blocks for about 1 s."""
    key = (host, metadata, protocol, device)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = _new_engine(*key)
        return _ENGINES[key]


def _new_engine(host: str, metadata: str, protocol: str, device: str) -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferConfigError("mooncake transport needs `pip install mooncake-transfer-engine-non-cuda` "
                          "(or mooncake-transfer-engine) and the system package libibverbs1") from exc
    engine = TransferEngine()
    if engine.initialize(host, metadata, protocol, device) != 0:
        raise TransferConfigError(f"mooncake engine failed to initialize on {host} ({protocol}, {metadata})")
    return engine


def _engine_for(config: TransferConfig) -> Any:
    return shared_engine(config.host, config.mooncake_metadata_server, config.mooncake_protocol,
                         config.mooncake_device_name)


def _regions(tensors: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    pairs = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
    return [p for p, _ in pairs], [n for _, n in pairs]


def _registration(addrs: list[int], sizes: list[int]) -> tuple[list[int], list[int]]:
    """What to register for these regions: one span when they are laid out in order with only
    alignment gaps (a receive arena: one registration instead of one per tensor), else each."""
    end = addrs[-1] + sizes[-1]
    ordered = all(a + n <= b for a, n, b in zip(addrs, sizes, addrs[1:], strict=False))
    if ordered and end - addrs[0] <= sum(sizes) + 64 * len(sizes):
        return [addrs[0]], [end - addrs[0]]
    return addrs, sizes


_ABANDONED: list[object] = []   # receive buffers an engine read may still write into: never freed


def _read_done(engine: Any, local: list[int], keep: object, read: asyncio.Future) -> None:
    error = None if read.cancelled() else read.exception()
    if isinstance(error, _Abandoned):
        logger.error("mooncake reads abandoned in flight; keeping %d receive regions forever", len(local))
        _ABANDONED.append(keep)
        return
    engine.batch_unregister_memory(local)
    if error is not None:
        logger.warning("mooncake read raised %r", error)


class MooncakeSender(SidebandSender):
    """Registers held tensors with the engine and lets the receiver read them.

    A pull that fails mid-read may leave a remote read in flight, so that state's memory stays
    registered and referenced for `transfer_timeout_s` after its lease is freed.
    """

    transport_name = "mooncake"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._registered: dict[str, Region] = {}
        self._suspect: set[str] = set()
        self._deferred: dict[int, tuple[asyncio.TimerHandle, Region]] = {}
        self._reg_lock = threading.Lock()

    async def start(self) -> None:
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._engine = _engine_for(self.config)
        await super().start()

    async def stop(self) -> None:
        """Stop serving; regions still deferred are unregistered now (nobody may read them)."""
        await super().stop()
        for handle, region in self._deferred.values():
            handle.cancel()
            self._unregister(region)
        self._deferred.clear()

    async def _offer(self, state: HeldState, request: dict) -> dict:
        addrs, sizes = _regions(state.tensors)
        with self._reg_lock:
            if state.request_id not in self._registered:
                if addrs and self._engine.batch_register_memory(addrs, sizes) != 0:
                    raise TransferError("mooncake failed to register the state's memory")
                self._registered[state.request_id] = (addrs, state.tensors)
        host = self.config.advertise_host or self.config.host
        return {"session": f"{host}:{self._engine.get_rpc_port()}", "addrs": addrs}

    async def _serve_pull(self, chan: Channel, lease: Lease, request: dict) -> tuple[int, bool]:
        try:
            return await super()._serve_pull(chan, lease, request)
        except BaseException:
            with self._reg_lock:
                self._suspect.add(lease.request_id)
            raise

    def _on_freed(self, request_id: str) -> None:
        with self._reg_lock:
            region = self._registered.pop(request_id, None)
            suspect = request_id in self._suspect
            self._suspect.discard(request_id)
        if region is None:
            return
        loop = self._loop
        if not suspect or loop is None or loop.is_closed():
            self._unregister(region)
        elif threading.get_ident() == self._loop_thread:
            self._defer(loop, region)
        else:
            loop.call_soon_threadsafe(self._defer, loop, region)

    def _defer(self, loop: asyncio.AbstractEventLoop, region: Region) -> None:
        def expire() -> None:
            self._deferred.pop(id(region), None)
            self._unregister(region)
        handle = loop.call_later(self.config.transfer_timeout_s, expire)
        self._deferred[id(region)] = (handle, region)

    def _unregister(self, region: Region) -> None:
        engine, addrs = self._engine, region[0]
        if addrs and engine is not None and engine.batch_unregister_memory(addrs) != 0:
            logger.warning("mooncake failed to unregister %d regions", len(addrs))


class MooncakeReceiver(SidebandReceiver):
    """Reads a pulled state into freshly registered host tensors."""

    transport_name = "mooncake"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._engine: Any = None

    async def start(self) -> None:
        self._engine = _engine_for(self.config)

    async def stop(self) -> None:
        self._engine = None

    async def _move(self, chan: Channel, manifest: dict, tensors: list[torch.Tensor],
                    tagger: DataTagger | None) -> None:
        engine = self._engine
        if engine is None:
            raise TransferConfigError("MooncakeReceiver.start() was not awaited")
        session, remote = manifest.get("session"), manifest.get("addrs")
        local, sizes = _regions(tensors)
        if not isinstance(session, str) or not isinstance(remote, list) or len(remote) != len(local):
            raise CorruptFrame("mooncake manifest lacks a session or addresses")
        if not local:
            return
        if not all(isinstance(a, int) for a in remote):
            raise CorruptFrame("mooncake manifest has non-integer addresses")
        bases, lengths = _registration(local, sizes)
        if engine.batch_register_memory(bases, lengths) != 0:
            raise TransferError("mooncake failed to register the receive buffers")
        owners = [i for i, t in enumerate(tensors) if t.numel()]
        read = asyncio.get_running_loop().run_in_executor(
            None, _read_windows, engine, session, local, remote, sizes, owners, tagger,
            self.config.transfer_timeout_s)
        # If we are cancelled, the read still writes into `tensors` until it returns: the callback
        # keeps them alive and registered until then (forever if reads were abandoned).
        read.add_done_callback(functools.partial(_read_done, engine, bases, tensors))
        await asyncio.shield(read)


class _Reads:
    """One-region async engine reads, polled (never spun on) until each landed or failed."""

    def __init__(self, engine: Any, session: str) -> None:
        self.engine, self.session = engine, session
        self.pending: dict[int, int] = {}            # region index -> engine batch id
        self.failed: str | None = None

    def submit(self, k: int, local: int, remote: int, size: int) -> None:
        batch = self.engine.batch_transfer_async_read(self.session, [local], [remote], [size])
        if not batch:
            raise TransferError(f"mooncake could not submit a read from {self.session}")
        self.pending[k] = batch

    def landed(self) -> list[int]:
        """Regions whose read completed since the last call; a failed read is remembered
        (`failed`) and its region dropped, so `pending` only holds reads still in flight."""
        done = []
        for k, batch in list(self.pending.items()):
            status = self.engine.transfer_check_status(batch)   # frees the batch once settled
            if status == 0:
                continue
            del self.pending[k]
            if status == 1:
                done.append(k)
            elif status == -2:
                self.pending[k] = batch
                self.failed = self.failed or "timed out in the engine"
            else:
                self.failed = self.failed or f"failed (status {status})"
        return done


def _read_windows(engine: Any, session: str, local: list[int], remote: list[int], sizes: list[int],
                  owners: list[int], tagger: DataTagger | None, deadline_s: float) -> None:
    """Blocking: one engine read per region, about `WINDOW_BYTES` of them in flight (the next
    submitted as soon as one lands), each region tagged in a second thread once it landed
    (still in cache) while later ones are read. Mooncake's sync calls spin a core on the batch
    status; this polls every `POLL_S` instead, which on a host with few cores leaves that core
    to the engine and the MAC.

    Returns only once no read is in flight; past `deadline_s` it raises `_Abandoned` with reads
    still in flight (the caller must then keep their memory forever, see `_read_done`).
    """
    reads = _Reads(engine, session)
    deadline = time.monotonic() + deadline_s
    with ThreadPoolExecutor(1, thread_name_prefix="kv-mooncake-tag") as tagging:
        jobs, k, in_flight = [], 0, 0
        try:
            while k < len(sizes) or reads.pending:
                while k < len(sizes) and (in_flight < WINDOW_BYTES or not reads.pending):
                    reads.submit(k, local[k], remote[k], sizes[k])
                    in_flight += sizes[k]
                    k += 1
                landed = reads.landed()
                if reads.failed is not None:
                    raise TransferError(f"mooncake read from {session} {reads.failed}")
                in_flight -= sum(sizes[j] for j in landed)
                if tagger is not None:
                    jobs += [tagging.submit(tagger.tag, owners[j]) for j in landed]
                if not landed:
                    if time.monotonic() > deadline:
                        raise PeerTimeout(f"mooncake read from {session} did not finish "
                                          f"within {deadline_s:.3g}s")
                    time.sleep(POLL_S)
        finally:
            while reads.pending and time.monotonic() <= deadline:   # never leave a read writing
                reads.landed()
                time.sleep(POLL_S)
            if reads.pending:
                raise _Abandoned(f"mooncake reads from {session} still in flight after {deadline_s:.3g}s")
        for job in jobs:
            job.result()


class _Abandoned(PeerTimeout):
    """Reads still in flight at the deadline: their destination memory must never be reused."""
