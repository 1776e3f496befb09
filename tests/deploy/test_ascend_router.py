"""deploy/ascend/router.sh as it would run: the router started with exactly the command line the script
prints under DRY_RUN=1, in front of protocol stubs of vLLM-Ascend's MooncakeConnectorV1 ranks
(tests/router/ascend_stub.py). The P/D handoff happens, the prefill rank's parameters reach the decode
rank verbatim, and no kimi-pd internal endpoint or admin token ever reaches a rank, also when a decode
leg fails. Without the script's `--kv-connector` the router refuses to start, naming the flag. The
printed `kimi-pd` is run as `python -m kimi_pd` (the same entry point) so the router is this tree's."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kimi_pd.up import KIMI_PD
from shared.net import free_port
from tests.deploy.helpers import ASCEND, ROOT, run, tool
from tests.router.ascend_stub import AscendRank, sequence_text
from tests.router.fake_vllm import Servers

ADMIN = "ascend-admin-token-not-for-ranks"
MODEL_DIR = ROOT / "engine" / "presets_data" / "tiny-chat"      # config.json + tokenizer, as a K3 checkpoint has
PROMPT = "Summarise the history of the transfer engine in one line. " * 40


def router_argv(prefill: list[AscendRank], decode: list[AscendRank], port: int, **extra: str) -> list[str]:
    """What `DRY_RUN=1 router.sh` prints for these ranks (and `extra` environment), NUL-separated."""
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "PREFILL_URLS": " ".join(r.url for r in prefill),
           "DECODE_URLS": " ".join(r.url for r in decode), "ROUTER_MODEL_DIR": str(MODEL_DIR),
           "ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": str(port), "KIMI_PD_ADMIN_TOKEN": ADMIN, **extra}
    proc = run([tool("bash"), str(ASCEND / "router.sh")], env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    argv = proc.stdout.decode().split("\0")[:-1]
    assert argv[0] == "kimi-pd" and ADMIN not in argv
    return argv[1:]


def start_router(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "KIMI_PD_ADMIN_TOKEN": ADMIN, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        return subprocess.Popen([*KIMI_PD, *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"router exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"router not ready:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def ranks():
    prefill = [AscendRank(f"p{i}", "kv_producer", eos_first=True) for i in range(2)]
    decode = [AscendRank(f"d{i}", "kv_consumer") for i in range(2)]
    with Servers(*prefill, *decode):
        yield prefill, decode


@pytest.fixture(scope="module")
def router(ranks, tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("ascend") / "router.log"
    proc = start_router(router_argv(*ranks, port), log)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def nothing_internal_reached(ranks) -> None:
    for rank in (*ranks[0], *ranks[1]):
        assert not [c["path"] for c in rank.calls if c["path"].startswith("/internal/")], rank.name
        assert not [c for c in rank.calls if ADMIN in str(c["headers"])], f"{rank.name} saw the admin token"
        assert not [c for c in rank.posts() if "kimi_pd_resume" in (c["body"] or {})], rank.name


def test_router_sh_hands_off_through_mooncake_connector_v1_verbatim(ranks, router):
    prefill, decode = ranks
    chat = {"model": "kimi-k3", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
    for stream in (False, True):
        before = sum(len(r.issued) for r in prefill)
        resp = httpx.post(router + "/v1/chat/completions", json={**chat, "stream": stream}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
        text = resp.text if stream else resp.json()["choices"][0]["message"]["content"]
        assert sequence_text(5).strip().split()[0] in text and "recomputed" not in resp.text
        assert sum(len(r.issued) for r in prefill) == before + 1, "every prefill leg answered its parameters"
    for p in prefill:
        for call in p.posts():
            body = call["body"]
            assert body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
            assert (body["max_tokens"], body["min_tokens"], body["stream"]) == (1, 1, False)
    issued = [params for p in prefill for params in p.issued]
    pulled = [params for d in decode for params in d.pulled]
    assert sorted(map(str, pulled)) == sorted(map(str, issued)), "the decode ranks got the prefill's answers verbatim"
    assert not any(d.computed_locally for d in decode)
    nothing_internal_reached(ranks)


def test_a_failed_decode_leg_reaches_no_internal_endpoint_and_is_a_real_error(ranks, router):
    prefill, decode = ranks
    for d in decode:
        d.fail = 1
    resp = httpx.post(router + "/v1/completions", timeout=30,
                      json={"model": "kimi-k3", "prompt": PROMPT, "max_tokens": 4})
    for d in decode:
        d.fail = 0
    assert resp.status_code == 500 and resp.json()["error"]["message"], resp.text    # never an empty 200
    legs = [d.posts()[-1]["body"] for d in decode]      # one failed leg on each decode rank
    assert sorted("kv_transfer_params" in leg for leg in legs) == [False, True], \
        "a failed decode is asked again decode-only elsewhere, never with the stale parameters"
    time.sleep(0.5)                                    # the router's release would be a background task
    nothing_internal_reached(ranks)


def test_without_the_connector_the_router_refuses_stock_vllm_ranks(ranks, tmp_path):
    argv = router_argv(*ranks, free_port())
    at = argv.index("--kv-connector")
    del argv[at:at + 2]                                # the router.sh this issue found
    log = tmp_path / "router.log"
    proc = start_router(argv, log)
    try:
        assert proc.wait(60) != 0
    finally:
        stop(proc)
    out = log.read_text()
    assert "answer as stock vLLM" in out and "--kv-connector" in out and "mooncake-ascend" in out, out[-3000:]
    assert ADMIN not in out
    nothing_internal_reached(ranks)



def test_router_sh_with_a_kv_pool_serves_through_the_ranks(ranks, tmp_path):
    """`ROUTER_KV_POOL_BLOCKS` (the tutorial's prefill-side KV pool) reaches the router as its pool flags, and
    the router serves P/D through the ranks with the pool counted in placement."""
    argv = router_argv(*ranks, port := free_port(), ROUTER_KV_POOL_BLOCKS="4096", ROUTER_KV_POOL_LOAD_COST="0.05")
    at = argv.index("--kv-pool-blocks")
    assert argv[at:at + 4] == ["--kv-pool-blocks", "4096", "--kv-pool-load-cost", "0.05"]
    assert "--kv-pool-blocks" not in router_argv(*ranks, port), "no pool unless asked for"
    log = tmp_path / "router.log"
    proc = start_router(argv, log)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
        chat = {"model": "kimi-k3", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
        for _ in range(3):
            resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=30)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        pooled = [ln for ln in metrics.splitlines() if ln.startswith("kimi_pd_router_placement_kv_pool_blocks ")]
        assert pooled and float(pooled[0].split()[1]) > 0, "the prompt's blocks are in the router's view of the pool"
    finally:
        stop(proc)
    nothing_internal_reached(ranks)
