"""The interface's pure parts: params codec, config validation, registry, chunk plan, metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prometheus_client import CollectorRegistry

from kv_transfer.errors import CorruptFrame, LeaseExpired, TransferConfigError, TransferError, error_from_code
from kv_transfer.interface import KVTransferParams, make_receiver, make_sender, transports
from kv_transfer.metrics import get_metrics
from kv_transfer.payload import ModelIdentity, TensorSpec, spec_of
from kv_transfer.tcp import TcpReceiver, TcpSender, chunk_plan
from tests.kv_transfer.helpers import IDENTITY, config, metrics

pytestmark = pytest.mark.timeout(10)
VLLM_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
               "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens",
               "remote_blocks_expiry_time"}


def test_params_carry_vllm_fields_and_ignore_unknown_ones() -> None:
    params = KVTransferParams(do_remote_prefill=True, remote_engine_id="e", remote_request_id="r",
                              remote_host="127.0.0.1", remote_port=5, remote_block_ids=[1, 2],
                              remote_num_tokens=100, remote_blocks_expiry_time=9.5, transport="tcp")
    raw = params.to_dict()
    assert set(raw) >= VLLM_FIELDS
    assert KVTransferParams.from_dict({**raw, "tp_size": 8, "remote_handshake_port": 1}) == params
    prefill_leg = KVTransferParams.from_dict({"do_remote_decode": True, "do_remote_prefill": False})
    assert prefill_leg.do_remote_decode and prefill_leg.remote_host is None


@pytest.mark.parametrize(
    "bad",
    [{"secret": b"short"}, {"secret": "a-str-not-bytes-0123456789"}, {"streams": 0},
     {"chunk_bytes": 1024}, {"read_timeout_s": 0}, {"lease_s": -1}],
)
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(TransferConfigError):
        config(**bad)
    with pytest.raises(TypeError):
        config(no_such_option=1)


def test_secret_never_shows_in_repr() -> None:
    assert "test-secret" not in repr(config())


def test_registry_builds_each_transport_and_refuses_unknown_ones() -> None:
    assert transports() == ["mooncake", "tcp", "torch-dist"]
    assert isinstance(make_sender(config(), metrics()), TcpSender)
    assert isinstance(make_receiver(config(), metrics()), TcpReceiver)
    assert make_sender(config(transport="torch-dist"), metrics()).transport_name == "torch-dist"
    with pytest.raises(TransferConfigError, match="unknown transport 'rdma'"):
        make_sender(config(transport="rdma"))


def test_chunk_plan_covers_every_byte_once_and_balances_streams() -> None:
    specs = [TensorSpec("a", "bfloat16", (1000, 576)), TensorSpec("e", "float32", (0,)),
             TensorSpec("b", "float32", (96, 128, 128)), TensorSpec("c", "bfloat16", (3, 100))]
    plan = chunk_plan(specs, 1 << 20, 3)
    seen: dict[int, list[tuple[int, int]]] = {}
    for share in plan:
        for index, offset, length in share:
            assert 0 < length <= 1 << 20
            seen.setdefault(index, []).append((offset, length))
    for index, spec in enumerate(specs):
        ranges = sorted(seen.get(index, []))
        assert sum(n for _, n in ranges) == spec.nbytes
        assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
    loads = [sum(n for *_, n in share) for share in plan]
    assert max(loads) - min(loads) <= 1 << 20
    assert chunk_plan(specs, 1 << 20, 3) == plan


def test_specs_refuse_malformed_entries() -> None:
    assert TensorSpec.from_wire(["x", "bfloat16", [2, 3]]).nbytes == 12
    for bad in (["x", "complex64", [1]], ["x", "float32", [-1]], ["x", "float32"], "nope",
                ["x", "float32", [1.5]]):
        with pytest.raises(CorruptFrame):
            TensorSpec.from_wire(bad)
    with pytest.raises(TypeError):
        spec_of("z", torch.zeros(2, dtype=torch.complex64))


def test_identity_from_wire_is_validated() -> None:
    assert ModelIdentity.from_wire(IDENTITY.to_dict()) == IDENTITY
    for bad in ({**IDENTITY.to_dict(), "block_size": "64"}, {"config_hash": "x"}, None):
        with pytest.raises(CorruptFrame):
            ModelIdentity.from_wire(bad)
    assert IDENTITY.mismatch(IDENTITY) is None
    other = dataclasses.replace(IDENTITY, layer_schedule="MMMM")
    assert "layer_schedule" in other.mismatch(IDENTITY)


def test_error_codes_round_trip() -> None:
    assert isinstance(error_from_code("lease_expired", "x"), LeaseExpired)
    unknown = error_from_code("from-the-future", "x")
    assert type(unknown) is TransferError
    assert type(error_from_code(None, "x")) is TransferError


def test_metrics_are_shared_per_registry() -> None:
    registry = CollectorRegistry()
    assert get_metrics(registry) is get_metrics(registry)
    assert get_metrics(CollectorRegistry()) is not get_metrics(registry)
    get_metrics(registry).failed("recv", "tcp", "timeout")
    assert registry.get_sample_value("kimi_pd_kv_transfer_failures_total",
                                     {"direction": "recv", "transport": "tcp", "reason": "timeout"}) == 1


def test_data_verification_is_on_by_default_and_never_off_over_tcp() -> None:
    assert config().verify_data is True
    for transport, protocol in (("tcp", "tcp"), ("mooncake", "tcp")):
        with pytest.raises(TransferConfigError, match="refused"):
            config(transport=transport, mooncake_protocol=protocol, verify_data=False)
    with pytest.raises(TransferConfigError, match="bool"):
        config(transport="mooncake", mooncake_protocol="rdma", verify_data=0)   # only an explicit False
    trusted = config(transport="mooncake", mooncake_protocol="rdma", verify_data=False)
    assert trusted.verify_data is False
    assert config(transport="torch-dist", verify_data=False).verify_data is False   # backend checked at start
