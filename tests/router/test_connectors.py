"""Each P/D protocol's contract with the request path (router/connectors.py): what it puts on the
prefill leg (`prepare`), what it needs before one is sent (`ready`), what it takes from the answer
(`adopt`) and what the decode leg carries (`decode_params`)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import pytest

from router.connectors import bootstrap_addr, connector, mooncake_decode_params
from router.registry import WorkerRegistry
from router.request.trace import Trace
from router.settings import RouterSettings
from router.transport.upstream import UpstreamError
from shared.kv_transfer_params import KVTransferParams
from tests.router.fake_session import KTP

P = "http://10.0.0.7:8100"
ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-p",
          "remote_request_id": "cmpl-p-0", "remote_block_ids": [3], "remote_host": "10.0.0.7", "remote_port": 5600}


@dataclass
class Lookup:
    """router.connectors.BootstrapLookup over a mock bootstrap server that counts its /query calls."""

    answer: object
    engines: dict[str, str] = field(default_factory=dict)
    bootstrap_port: int = 8998
    connect_timeout_s: float = 1.0
    queries: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        def handle(request: httpx.Request) -> httpx.Response:
            self.queries.append(str(request.url))
            return httpx.Response(200, json=self.answer)
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))


def worker():
    settings = RouterSettings(model=None, static_prefill=(P,))
    return next(iter(WorkerRegistry(settings, None).states()))


def adopted(name: str, answer: object, lookup: Lookup | None = None) -> Trace:
    kind, trace = connector(name), Trace("r1", "chat")
    kind.adopt(trace, worker(), answer, kind.prepare("r1"), lookup or Lookup(None))
    return trace


def test_our_workers_answer_our_params_and_the_decode_carries_them():
    kind = connector("kimi-pd")
    assert kind.prepare("r1").params == KVTransferParams.prefill_request().to_dict() and not kind.vllm
    trace = adopted("kimi-pd", KTP)
    assert trace.kv_transfer_params == KVTransferParams.from_dict(KTP) and trace.decode_params is None
    assert kind.decode_params(trace) == KVTransferParams.from_dict(KTP).to_dict()
    assert kind.decode_params(Trace("r2", "chat")) is None                 # decode-only: nothing to carry


@pytest.mark.parametrize("name", ["kimi-pd", "nixl", "mooncake-ascend"])
def test_a_protocol_that_promises_an_answer_falls_back_without_one(name):
    for answer in (None, {}, "text"):
        with pytest.raises(UpstreamError) as info:
            adopted(name, answer)
        assert info.value.reason == "no_kv_transfer_params" and info.value.status == 502
        assert info.value.health_outcome is None                           # not held against the worker


@pytest.mark.parametrize("name", ["nixl", "NixlConnector", "mooncake-ascend"])
def test_vllm_answers_are_forwarded_exactly(name):
    kind = connector(name)
    assert kind.vllm and kind.prepare("r1").params == {"do_remote_decode": True, "do_remote_prefill": False}
    trace = adopted(name, ANSWER)
    assert kind.decode_params(trace) == ANSWER and trace.kv_transfer_params is not None


@pytest.mark.parametrize("name", ["example", "SharedStorageConnector", "lmcache", "LMCacheConnectorV1"])
def test_storage_connectors_take_nothing_and_the_decode_finds_the_kv(name):
    trace = adopted(name, None)
    assert connector(name).decode_params(trace) is None and trace.kv_transfer_params is None


def test_mooncake_makes_the_transfer_id_and_asks_the_bootstrap_once():
    kind, lookup = connector("MooncakeConnector"), Lookup({"1": {"engine_id": "b"}, "0": {"engine_id": "eng-0"}})
    plan = kind.prepare("r1")
    assert plan.params == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": plan.transfer_id}
    assert plan.transfer_id != kind.prepare("r1").transfer_id

    async def twice():
        await kind.ready(worker(), lookup)
        await kind.ready(worker(), lookup)
    asyncio.run(twice())
    assert lookup.queries == ["http://10.0.0.7:8998/query"] and lookup.engines == {P: "eng-0"}
    trace = Trace("r1", "chat")
    kind.adopt(trace, worker(), None, plan, lookup)
    assert kind.decode_params(trace) == mooncake_decode_params(plan.transfer_id, "eng-0", "http://10.0.0.7:8998")
    assert trace.kv_transfer_params is None            # nothing of ours to release or to count as adopted


def test_mooncake_without_an_engine_id_is_not_ready():
    with pytest.raises(UpstreamError) as info:
        asyncio.run(connector("mooncake").ready(worker(), Lookup({})))
    assert info.value.reason == "no_engine_id"


def test_an_ipv6_prefill_bootstrap_address_is_bracketed():
    settings = RouterSettings(model=None, static_prefill=("http://[::1]:8100",))
    state = next(iter(WorkerRegistry(settings, None).states()))
    assert bootstrap_addr(state, Lookup(None, bootstrap_port=9)) == "http://[::1]:9"
