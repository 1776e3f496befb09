"""Everything a worker process runs besides HTTP: the async engine, its role's legs (and their
transfer endpoints) and its presence in the state store. Started and stopped once, in the app's lifespan."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.async_engine import AsyncEngine
from engine.parallel.dp_engine import create_engine
from kv_transfer.interface import TransferConfig
from kv_transfer.metrics import get_metrics
from kv_transfer.payload import ModelIdentity
from shared.kv_transfer_params import KVTransferParams, LegKind
from shared.loop_watch import watch_loop
from shared.model_config import ModelConfig
from shared.prompt.tokenizer import KimiTokenizer
from shared.store.factory import make_store
from shared.workers import WorkerInfo
from worker.engine_call import EngineCall
from worker.metrics import WorkerMetrics
from worker.presence import WorkerPresence
from worker.role import Leg, Role
from worker.settings import WorkerSettings
from worker.vllm_metrics import VllmMetrics

if TYPE_CHECKING:  # imported lazily at run time: only speculating workers load it
    from worker.spec_metrics import SpecDecodeMetrics

log = logging.getLogger(__name__)


@dataclass
class WorkerRuntime:
    settings: WorkerSettings
    role: Role
    engine: AsyncEngine
    metrics: WorkerMetrics
    legs: dict[LegKind, Leg] = field(default_factory=dict)
    presence: WorkerPresence | None = None
    draining: bool = False
    spec_metrics: SpecDecodeMetrics | None = None          # when speculating
    generate: EngineCall = field(init=False)    # the engine call, handed to every leg
    vllm_metrics: VllmMetrics = field(init=False)           # vLLM's names, beside ours, in the same registry

    def __post_init__(self) -> None:
        eng = self.engine.engine
        self.vllm_metrics = VllmMetrics(self.metrics.registry, self.settings.served_model_name, eng.max_model_len)
        cache = eng.cache_config
        self.vllm_metrics.set_cache_config(cache.block_size, cache.capacity_tokens // cache.block_size,
                                           cache.enable_prefix_caching)
        self.generate = EngineCall(self.engine, self.metrics, self.vllm_metrics)

    @classmethod
    def build(cls, settings: WorkerSettings, role: Role) -> WorkerRuntime:
        role.validate(settings.transfer_secret)
        settings.validate()
        engine = AsyncEngine(engine=create_engine(settings.engine), grammar_budget=settings.grammar_budget)
        runtime = cls(settings, role, engine, WorkerMetrics())
        spec, stats = engine.engine.spec, engine.engine.spec_stats
        if spec is not None and stats is not None:             # both or neither: the engine speculates
            from worker.spec_metrics import SpecDecodeMetrics
            runtime.spec_metrics = SpecDecodeMetrics(runtime.metrics.registry, stats.num_speculative_tokens,
                                                     runtime.vllm_metrics.labels)
            log.info("speculative decoding: dspark draft %s, %d tokens, %s drafts", spec.model,
                     spec.num_speculative_tokens, spec.draft_sample_method)
        return runtime

    @property
    def tokenizer(self) -> KimiTokenizer:
        return self.engine.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.engine.model.config

    def transfer_config(self) -> TransferConfig:
        i = self.engine.engine.identity
        s = self.settings
        return TransferConfig(identity=ModelIdentity(i.config_hash, i.dtype, i.layer_schedule, i.block_size),
                              secret=s.transfer_secret, transport=s.transfer_transport, engine_id=s.worker_id,
                              host=s.transfer_host, port=s.transfer_port, streams=s.transfer_streams,
                              lease_s=s.kv_lease_s, renewed_lease_s=min(s.kv_renewed_lease_s, s.kv_lease_s),
                              advertise_host=s.transfer_advertise_host)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        s = self.settings
        if self.role.serves_transfers(s.transfer_secret):
            config, xfer_metrics = self.transfer_config(), get_metrics(self.metrics.registry)
            for make_leg in self.role.legs:
                leg = make_leg(self, config, xfer_metrics, self.generate)
                await leg.start()
                self.legs[leg.kind] = leg
        if s.store_url:
            store = make_store(s.store_url, s.namespace)
            self.presence = WorkerPresence(store, self.worker_info(), self.engine, s.heartbeat_s, s.registration_ttl_s)
            self.presence.start()
        from worker.watchdog import watch_engine
        self._watchdog = asyncio.create_task(watch_engine(self), name="engine-watchdog")
        self._stalls = asyncio.create_task(watch_loop(asyncio.Event(), self.metrics.loop_lag.observe,
                                                      f"worker {s.worker_id}"), name="stall-watch")
        log.info("worker %s (%s) serving %s at %s", s.worker_id, self.role.name, s.served_model_name, s.url)

    def worker_info(self) -> WorkerInfo:
        s, eng = self.settings, self.engine.engine
        port = next((leg.transfer_port for leg in self.legs.values() if leg.transfer_port), 0)
        return WorkerInfo(worker_id=s.worker_id, role=self.role.name, url=s.url, model_id=s.served_model_name,
                          transfer_host=s.transfer_address, transfer_port=port,
                          transfer_engine_id=s.worker_id, block_size=eng.config.block_size,
                          capacity_tokens=eng.capacity_tokens, hash_root=eng.hash_root, started_at=time.time())

    def streams(self, ktp: KVTransferParams | None) -> bool:
        """Whether the leg this request asks for streams its answer (a local request does)."""
        leg = self.legs.get(ktp.leg) if ktp is not None and ktp.leg != "local" else None
        return True if leg is None else leg.streams

    def begin_drain(self) -> None:
        """First step of a shutdown (called from the signal handler): report draining and deregister now,
        so routers stop sending new work while requests in flight finish."""
        self.draining = True
        loop = getattr(self, "_loop", None)
        if self.presence is not None and loop is not None:
            self.presence.draining = True
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.presence.stop()))

    async def stop(self) -> None:
        """Deregister first (routers stop sending), then stop the legs' transfers and the engine."""
        for task in (getattr(self, "_watchdog", None), getattr(self, "_stalls", None)):
            if task is not None:
                task.cancel()
        if self.presence:
            await self.presence.stop()
        for leg in self.legs.values():
            await leg.stop()
        self.engine.shutdown()
