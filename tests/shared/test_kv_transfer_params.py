"""`KVTransferParams`' JSON edge: from_dict / to_dict give what a field-by-field reading of the
dataclass gives (the field names are computed once at import), unmodelled keys kept as received."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from shared.kv_transfer_params import KVTransferParams


def reference_to_dict(p: KVTransferParams) -> dict[str, Any]:
    known = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "extra"}
    return {**{k: v for k, v in known.items() if v is not None}, **p.extra}


CASES = [
    {},
    {"do_remote_decode": True},
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
     "remote_port": 7, "remote_block_ids": [1, 2], "remote_num_tokens": 5, "transport": "tcp"},
    {"do_remote_prefill": True, "remote_host": None, "tp_size": 2, "remote_port": 9, "x": {"y": 1}},
    {"interface_version": 3, "state_bytes": 10, "remote_blocks_expiry_time": 1.5, "extra": "a key named extra"},
]


@pytest.mark.parametrize("raw", CASES)
def test_round_trip_matches_the_field_by_field_reading(raw):
    p = KVTransferParams.from_dict(raw)
    names = {f.name for f in dataclasses.fields(KVTransferParams)} - {"extra"}
    assert p.extra == {k: v for k, v in raw.items() if k not in names}
    assert all(getattr(p, k) == v for k, v in raw.items() if k in names)
    assert p.to_dict() == reference_to_dict(p)
    assert list(p.to_dict()) == list(reference_to_dict(p))              # same key order on the wire
    assert KVTransferParams.from_dict(p.to_dict()) == p
