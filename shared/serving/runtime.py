"""Everything a worker process runs besides HTTP: the async engine, its transfer endpoint(s) and
its presence in the state store. Started and stopped once, in the app's lifespan."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from decode_worker.pull import StatePuller
from engine.async_engine import AsyncEngine
from engine.core.engine import LLMEngine
from kv_transfer.interface import KVReceiver, KVSender, TransferConfig, make_receiver, make_sender
from kv_transfer.metrics import get_metrics
from kv_transfer.payload import ModelIdentity
from prefill_worker.handoff import PrefillHandoff
from shared.serving.metrics import WorkerMetrics
from shared.serving.presence import WorkerPresence
from shared.serving.settings import WorkerSettings
from shared.store.factory import make_store
from shared.workers import WorkerInfo

log = logging.getLogger(__name__)


@dataclass
class WorkerRuntime:
    settings: WorkerSettings
    engine: AsyncEngine
    metrics: WorkerMetrics
    sender: KVSender | None = None
    receiver: KVReceiver | None = None
    handoff: PrefillHandoff | None = None
    puller: StatePuller | None = None
    presence: WorkerPresence | None = None
    draining: bool = False
    spec_metrics: object | None = None          # decode_worker.spec_metrics.SpecDecodeMetrics when speculating

    @classmethod
    def build(cls, settings: WorkerSettings) -> "WorkerRuntime":
        settings.validate()
        engine = AsyncEngine(engine=LLMEngine(settings.engine))
        runtime = cls(settings, engine, WorkerMetrics())
        spec = engine.engine.spec
        if spec is not None:
            from decode_worker.spec_metrics import SpecDecodeMetrics
            runtime.spec_metrics = SpecDecodeMetrics(runtime.metrics.registry, spec.num_speculative_tokens)
            log.info("speculative decoding: dspark draft %s, %d tokens, %s drafts", spec.model,
                     spec.num_speculative_tokens, spec.draft_sample_method)
        return runtime

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.engine.model.config

    def transfer_config(self) -> TransferConfig:
        i = self.engine.engine.identity
        s = self.settings
        return TransferConfig(identity=ModelIdentity(i.config_hash, i.dtype, i.layer_schedule, i.block_size),
                              secret=s.transfer_secret, transport=s.transfer_transport, engine_id=s.worker_id,
                              host=s.transfer_host, port=s.transfer_port, streams=s.transfer_streams,
                              lease_s=s.kv_lease_s)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        s = self.settings
        if s.role in ("prefill", "decode") or s.transfer_secret:
            xfer_metrics = get_metrics(self.metrics.registry)
            if s.role in ("prefill", "both"):
                self.sender = make_sender(self.transfer_config(), xfer_metrics)
                await self.sender.start()
                self.handoff = PrefillHandoff(self.engine, self.sender, s.kv_lease_s)
            if s.role in ("decode", "both"):
                self.receiver = make_receiver(self.transfer_config(), xfer_metrics)
                await self.receiver.start()
                self.puller = StatePuller(self.receiver, s.kv_load_failure_policy)
        if s.store_url:
            store = make_store(s.store_url, s.namespace)
            self.presence = WorkerPresence(store, self.worker_info(), self.engine, s.heartbeat_s, s.registration_ttl_s)
            self.presence.start()
        log.info("worker %s (%s) serving %s at %s", s.worker_id, s.role, s.served_model_name, s.url)

    def worker_info(self) -> WorkerInfo:
        s, eng = self.settings, self.engine.engine
        return WorkerInfo(worker_id=s.worker_id, role=s.role, url=s.url, model_id=s.served_model_name,
                          transfer_host=s.transfer_host, transfer_port=self.sender.port if self.sender else 0,
                          transfer_engine_id=s.worker_id, block_size=eng.config.block_size,
                          capacity_tokens=eng.capacity_tokens, hash_root=eng.hash_root, started_at=time.time())

    def begin_drain(self) -> None:
        """First step of a shutdown (called from the signal handler): report draining and deregister now,
        so routers stop sending new work while requests in flight finish."""
        self.draining = True
        loop = getattr(self, "_loop", None)
        if self.presence is not None and loop is not None:
            self.presence.draining = True
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.presence.stop()))

    async def stop(self) -> None:
        """Deregister first (routers stop sending), then stop transfers and the engine."""
        if self.presence:
            await self.presence.stop()
        if self.sender:
            await self.sender.stop()
        if self.receiver:
            await self.receiver.stop()
        self.engine.shutdown()
