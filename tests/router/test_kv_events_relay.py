"""stock vLLM's ZMQ KV events -> the router's exact prefix index (router/kv_events_relay.py): vLLM's
own block hashes rehashed over our chain from the events' token ids, through a real ZMQ socket."""
from __future__ import annotations

import time

import msgpack
import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.kv_events_relay import Translator, parse_kv_events_flag
from router.placement.prefix_index import PrefixIndex
from router.settings import RouterSettings
from shared.hashing import block_hashes, root_hash
from shared.kv_events import decode_batch
from shared.net import free_port
from tests.router.fake_vllm import FakeVllm, Servers

BS = 4


def vllm_batch(events: list, ts: float = 1.0) -> bytes:
    """What vLLM's msgspec encoder writes: [ts, [tagged arrays...], dp_rank], with vLLM's extra fields."""
    return msgpack.packb([ts, events, 0])


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> list:
    return ["BlockStored", hashes, parent, tokens, BS, None, None, None, None, None, None]


def test_translator_rehashes_chains_and_removes():
    root = root_hash("m")
    tokens = list(range(12))
    ours = block_hashes(tokens, BS, root)
    t, index = Translator(root, BS), PrefixIndex()
    index.apply("w", t.translate(decode_batch(vllm_batch([stored([b"a", b"b"], None, tokens[:8])]))))
    index.apply("w", t.translate(decode_batch(vllm_batch([stored([b"c"], b"b", tokens[8:])]))))
    assert index.matched_blocks("w", ours) == 3
    index.apply("w", t.translate(decode_batch(vllm_batch([["BlockRemoved", [b"b"], None]]))))
    assert index.matched_blocks("w", ours) == 1
    orphan = t.translate(decode_batch(vllm_batch([stored([b"z"], b"unknown", tokens[:4])])))
    assert orphan.events == []                        # its parent was stored before the relay listened
    index.apply("w", t.translate(decode_batch(vllm_batch([["AllBlocksCleared"]]))))
    assert index.matched_blocks("w", ours) == 0 and t.ours == {}


def test_flag_parsing():
    assert parse_kv_events_flag(["http://h:1=tcp://h:2"]) == (("http://h:1", "tcp://h:2"),)
    with pytest.raises(ValueError, match="WORKER_URL=tcp"):
        parse_kv_events_flag(["tcp://h:2"])


def test_events_over_zmq_reach_placement(tmp_path):
    import zmq
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    d1, d2 = FakeVllm("d1"), FakeVllm("d2")
    try:
        with Servers(d1, d2):
            settings = RouterSettings(model=None, served_model_name="m", block_size=BS,
                                      static_decode=(d1.url, d2.url), kv_connector="nixl",
                                      kv_events=((d2.url, f"tcp://127.0.0.1:{port}"),), admin_token="adm")
            with TestClient(create_app(settings)) as client:
                prompt = "abcdefghijklmnopqrstuvwxyz0123456789"
                tokens = list(prompt.encode())[:32]            # text mode: bytes are the tokens
                hashes = [bytes([i]) * 8 for i in range(len(tokens) // BS)]
                relay = client.app.state.kv_events
                deadline = time.monotonic() + 10
                seq = 0
                while relay.batches == 0 and time.monotonic() < deadline:   # SUB joins asynchronously
                    seq += 1
                    pub.send_multipart([b"", seq.to_bytes(8, "big"), vllm_batch([stored(hashes, None, tokens)])])
                    time.sleep(0.1)
                assert relay.batches > 0
                workers = {w["worker_id"]: w for w in client.get(
                    "/admin/workers", headers={"authorization": "Bearer adm"}).json()["workers"]}
                assert workers[d2.url]["cached_blocks"] == len(hashes) and workers[d1.url]["cached_blocks"] == 0
                for _ in range(4):
                    resp = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2})
                    assert resp.headers["x-kimi-pd-decode-worker"] == d2.url
                pub.send_multipart([b"", (seq + 5).to_bytes(8, "big"), vllm_batch([])])      # a gap
                deadline = time.monotonic() + 5
                while relay.gaps == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert relay.gaps == 1
                workers = {w["worker_id"]: w for w in client.get(
                    "/admin/workers", headers={"authorization": "Bearer adm"}).json()["workers"]}
                assert workers[d2.url]["cached_blocks"] == 0
    finally:
        pub.close(linger=0)
        ctx.term()
