"""The router in front of stock vLLM workers, without vLLM: each P/D protocol as the connector
sources in vLLM 0.32 define it (router/connectors.py), against recording fakes (tests/router/
fake_vllm.py). What real vLLM does with these bodies is checked by tests/interop."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.connectors import connector, engine_id_from_query, mooncake_decode_params
from router.settings import RouterSettings
from router.vllm_metrics import load_from_vllm_metrics
from shared.openai.surface import SurfaceOptions
from tests.router.fake_vllm import METRICS, FakeVllm, Servers

NIXL_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-p",
               "remote_request_id": "cmpl-p-0", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1",
               "remote_port": 5600, "tp_size": 1}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 4}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json with a chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    out = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello there general kenobi"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                                           "chat_template": template, "model_max_length": 512}))
    return out


def router(model, prefill, decode, **kw) -> TestClient:
    settings = RouterSettings(model=str(model) if model else None, served_model_name="m", block_size=32,
                              static_prefill=tuple(f.url for f in prefill), static_decode=tuple(f.url for f in decode),
                              disagg_threshold_tokens=1, health_check_s=0.2, **kw)
    return TestClient(create_app(settings))


def kv_params(fake: FakeVllm) -> list:
    return [c["body"].get("kv_transfer_params") for c in fake.posts()]


def fallbacks(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('kimi_pd_router_prefill_fallbacks_total{reason="no_kv_transfer_params"}'):
            return float(line.split()[-1])
    return 0.0


def test_nixl_prefill_answer_is_forwarded_unchanged_and_nothing_of_ours_reaches_vllm(hf_dir):
    p, d = FakeVllm("p", answer_params=NIXL_ANSWER), FakeVllm("d")
    with Servers(p, d), router(hf_dir, [p], [d], kv_connector="nixl", admin_token="adm", api_keys=("ck",),
                               worker_api_key=None) as client:
        resp = client.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer ck"})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
        assert kv_params(p) == [{"do_remote_decode": True, "do_remote_prefill": False}]
        assert kv_params(d) == [NIXL_ANSWER]                 # exactly what vLLM's prefill wrote
        # client gone before the decode leg is the case where we would release: never for vLLM
        every = p.calls + d.calls
        assert not [c for c in every if c["path"].startswith("/internal/")]
        assert not [c for c in every if "adm" in c["headers"].get("authorization", "")]
        assert fallbacks(client) == 0


def test_a_missing_answer_is_a_counted_fallback_where_the_connector_promises_one(hf_dir):
    p, d = FakeVllm("p", answer_params=None), FakeVllm("d")
    with Servers(p, d), router(hf_dir, [p], [d], kv_connector="nixl") as client:
        resp = client.post("/v1/completions", json={"model": "m", "prompt": "hello there " * 20, "max_tokens": 4})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "d-says-hi"
        assert resp.headers["x-kimi-pd-decision"] == "decode-only"
        assert kv_params(d) == [None]                        # the decode computes the prompt itself
        assert fallbacks(client) == 1


def test_storage_connectors_expect_no_answer(hf_dir):
    """ExampleConnector answers null by design: the decode loads from the shared store, the request
    stays prefill-decode and no fallback is counted."""
    p, d = FakeVllm("p", answer_params=None), FakeVllm("d")
    with Servers(p, d), router(hf_dir, [p], [d], kv_connector="ExampleConnector") as client:
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode"
        assert kv_params(p) == [{"do_remote_decode": True, "do_remote_prefill": False}]
        assert kv_params(d) == [None] and fallbacks(client) == 0


def test_upstream_mooncake_gets_a_router_made_transfer_id_and_the_prefill_bootstrap(hf_dir):
    p, d = FakeVllm("p", engine_id="engine-of-p"), FakeVllm("d")
    with Servers(p, d), router(hf_dir, [p], [d], kv_connector="mooncake", mooncake_bootstrap_port=p.port) as client:
        for stream in (False, True):
            resp = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode"
    sent_p, sent_d = kv_params(p), kv_params(d)
    assert len(sent_p) == len(sent_d) == 2
    for prefill, decode in zip(sent_p, sent_d, strict=False):
        tid = prefill["transfer_id"]
        assert prefill == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
        assert decode == mooncake_decode_params(tid, "engine-of-p", f"http://127.0.0.1:{p.port}")
    assert sent_p[0]["transfer_id"] != sent_p[1]["transfer_id"]
    assert [c["path"] for c in p.calls if c["path"] == "/query"] == ["/query"]      # asked once, then cached


def test_mooncake_without_a_bootstrap_server_falls_back(hf_dir):
    p, d = FakeVllm("p", engine_id=None), FakeVllm("d")
    with Servers(p, d), router(hf_dir, [p], [d], kv_connector="mooncake", mooncake_bootstrap_port=p.port) as client:
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "decode-only"
        assert kv_params(d) == [None]
        assert p.posts() == []                 # nothing sent to hold blocks for a transfer nobody can make


def test_aliases_are_accepted_and_the_workers_get_their_own_name(hf_dir):
    p, d = FakeVllm("p", answer_params=NIXL_ANSWER), FakeVllm("d")
    with Servers(p, d), router(hf_dir, [p], [d], kv_connector="nixl", served_model_aliases=("alias",)) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m", "alias"]
        assert client.get("/v1/models/alias").status_code == 200
        assert client.post("/v1/chat/completions", json={**CHAT, "model": "alias"}).status_code == 200
        missing = client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        assert missing.status_code == 404 and missing.json()["error"]["type"]
    assert [c["body"]["model"] for c in p.posts() + d.posts()] == ["m", "m"]


def test_vllm_load_from_metrics_reaches_the_registry(hf_dir):
    import time
    p, d = FakeVllm("p", running=3, waiting=2, usage=0.5), FakeVllm("d")
    with Servers(p, d), router(hf_dir, [p], [d], kv_connector="nixl", admin_token="adm") as client:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            workers = {w["worker_id"]: w for w in client.get("/admin/workers",
                                                             headers={"authorization": "Bearer adm"}).json()["workers"]}
            if workers[p.url]["load"]:
                break
            time.sleep(0.1)
        load = workers[p.url]["load"]
        assert (load["running"], load["waiting"], load["cache_usage"]) == (3, 2, 0.5)
        assert load["capacity_tokens"] == 3200 and load["extra"]["prefix_cache_hits"] == 320
        assert workers[p.url]["active_requests"] == 5 and workers[p.url]["kv_connector"] == "nixl"
        assert client.get("/ready").json()["store"] == "none"


def test_metrics_parser_sums_engines_and_refuses_other_pages():
    two = METRICS.format(running=1, waiting=0, usage=0.2) + METRICS.format(running=2, waiting=4, usage=0.4).replace(
        'engine="0"', 'engine="1"').split("# TYPE vllm:cache_config_info")[0].replace("# HELP", "# HELP2")
    report = load_from_vllm_metrics("\n".join(line for line in two.splitlines() if not line.startswith("# ")), 7.0)
    assert (report.running, report.waiting, report.ts) == (3, 4, 7.0)
    assert report.cache_usage == pytest.approx(0.3) and report.extra["prefix_cache_queries"] == 1280
    assert load_from_vllm_metrics("kimi_pd_worker_capacity_tokens 4096\n", 1.0) is None


def test_connector_table():
    """The same facts the flag table held, asked of each connector's behaviour (tests/router/
    test_connectors.py covers the whole prepare / adopt / decode contract)."""
    from router.request.trace import Trace
    from router.transport.upstream import UpstreamError
    with pytest.raises(UpstreamError, match="no kv_transfer_params"):       # nixl promises an answer
        connector("NixlConnector").adopt(Trace("r1", "chat"), None, None, connector("nixl").prepare("r1"), None)
    assert connector("nixl").vllm
    assert not connector("kimi-pd").vllm and connector("kimi-pd").prepare("r1").params["do_remote_decode"]
    moon = connector("MooncakeConnector")
    first, second = moon.prepare("r1"), moon.prepare("r1")
    assert first.transfer_id and first.transfer_id != second.transfer_id
    assert first.params["transfer_id"] == first.transfer_id
    assert connector("nixl").prepare("r1").transfer_id is None
    assert engine_id_from_query({"1": {"engine_id": "b"}, "0": {"engine_id": "a"}}) == "a"
    assert engine_id_from_query({}) is None and engine_id_from_query({"0": {"engine_id": ""}}) is None
    with pytest.raises(ValueError, match="unknown --kv-connector"):
        RouterSettings(model=None, static_decode=("http://127.0.0.1:1",), kv_connector="bogus").validate()


def test_hf_tokenizer_dir_renders_its_chat_template(hf_dir):
    from router.prompt_source import load_prompt_source
    from shared.openai.requests import ChatCompletionRequest, CompletionRequest
    source = load_prompt_source(str(hf_dir))
    assert source.kind == "hf" and source.max_model_len == 512
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hello there"}]})
    assert source.render_chat(req) == "<s>[user] hello there</s>[assistant] "
    ids = source.prepare_chat(req).token_ids
    assert source.decode(ids) == "<s>[user] hello there</s>[assistant] "
    completion = source.prepare_completion(CompletionRequest.model_validate({"prompt": "hello there"}))
    assert source.decode(completion.token_ids) == "hello there"


def test_tokenizer_endpoints_and_text_mode(hf_dir, tmp_path):
    from router.prompt_source import load_prompt_source
    p, d = FakeVllm("p", answer_params=NIXL_ANSWER), FakeVllm("d")
    with Servers(p, d):
        with router(hf_dir, [p], [d], kv_connector="nixl") as client:
            assert client.get("/tokenizer_info").status_code == 404     # vLLM: only with its flag
        with router(hf_dir, [p], [d], kv_connector="nixl",
                    surface=SurfaceOptions(enable_tokenizer_info_endpoint=True)) as client:
            tokens = client.post("/tokenize", json={"prompt": "hello there"}).json()
            assert tokens["count"] == len(tokens["tokens"]) > 0
            assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hello there"}
            info = client.get("/tokenizer_info").json()       # the template itself, as vLLM shows it
            assert info["chat_template"] == json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]
        with router(None, [p], [d], kv_connector="nixl") as client:         # --no-tokenizer
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            refused = client.post("/tokenize", json={"prompt": "x"})
            assert refused.status_code == 400 and "without a tokenizer" in refused.json()["error"]["message"]
    with pytest.raises(ValueError, match="neither a Kimi-K3 checkpoint"):
        load_prompt_source(str(tmp_path))
    text = load_prompt_source(None)
    assert text.encode("héllo") == list("héllo".encode()) and text.decode(text.encode("héllo")) == "héllo"


HISTOGRAMS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0"}} 0.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{engine="0",le="0.3"}} {count}
vllm:request_queue_time_seconds_bucket{{engine="0",le="+Inf"}} {count}
vllm:request_queue_time_seconds_count{{engine="0"}} {count}
vllm:request_queue_time_seconds_sum{{engine="0"}} {total}
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_count{{engine="0"}} {count}
vllm:nixl_xfer_time_seconds_sum{{engine="0"}} {xfer}
"""


def test_vllm_timing_histograms_become_interval_observations():
    from router.vllm_metrics import timing_deltas
    before = load_from_vllm_metrics(HISTOGRAMS.format(count=2, total=0.5, xfer=0.02), 1.0)
    after = load_from_vllm_metrics(HISTOGRAMS.format(count=6, total=1.7, xfer=0.1), 2.0)
    assert before.extra["queue_count"] == 2 and before.extra["transfer_sum"] == pytest.approx(0.02)
    deltas = timing_deltas(before, after)
    assert deltas["queue"][1] == 4 and deltas["queue"][0] == pytest.approx(1.2)
    assert deltas["transfer"][1] == 4 and deltas["transfer"][0] == pytest.approx(0.08)
    assert timing_deltas(None, after) == {}
    assert timing_deltas(after, before) == {}                   # a restarted worker: counters went down


def test_router_flags_for_vllm():
    import argparse

    from router.cli import add_router_args, settings_from_args
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    args = parser.parse_args(["--served-model-name", "llama", "a1", "a2", "--kv-connector", "MooncakeConnector",
                              "--mooncake-bootstrap-port", "9000", "--prefill", "http://127.0.0.1:1",
                              "--decode", "http://127.0.0.1:2", "--kv-events", "http://127.0.0.1:1=tcp://127.0.0.1:3"])
    s = settings_from_args(args, None)
    assert (s.served_model_name, s.served_model_aliases, s.served_model_names) == ("llama", ("a1", "a2"),
                                                                                   ("llama", "a1", "a2"))
    assert s.kv_connector == "MooncakeConnector" and s.mooncake_bootstrap_port == 9000
    assert s.kv_events == (("http://127.0.0.1:1", "tcp://127.0.0.1:3"),) and s.model is None
    s.validate()
    bad = settings_from_args(parser.parse_args(["--decode", "http://127.0.0.1:2", "--kv-events",
                                                "http://127.0.0.1:9=tcp://127.0.0.1:3"]), None)
    with pytest.raises(ValueError, match="not static workers"):
        bad.validate()


def test_cli_refuses_model_and_no_tokenizer_together():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "kimi_pd", "router", "--model", "x", "--no-tokenizer",
                           "--decode", "http://127.0.0.1:2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not both" in proc.stderr


def test_a_workers_400_is_the_clients_error_not_the_fleets(hf_dir):
    """The router's requests counter (and the dashboard's error rate, which reads it) tells a request the
    worker refused (`client_error`) from a failure of the fleet (`error`)."""
    p, d = FakeVllm("p", answer_params=NIXL_ANSWER, refuse=True), FakeVllm("d", refuse=True)
    with Servers(p, d), router(hf_dir, [p], [d], kv_connector="nixl") as client:
        refused = client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 400
        lines = [line for line in client.get("/metrics").text.splitlines()
                 if line.startswith("kimi_pd_router_requests_total{")]
        assert any('outcome="client_error"' in line and line.endswith(" 1.0") for line in lines), lines
        # the error series exist from the start at 0 (router/metrics.py); none may have counted this request
        assert not any('outcome="error"' in line and not line.endswith(" 0.0") for line in lines), lines
