"""kimi-pd's router in front of stock vLLM 0.32 (CPU) prefill and decode instances with NixlConnector.

Two prefill instances and one decode instance, all on 127.0.0.1; the router knows them as static
workers (`--kv-connector nixl`). Greedy answers through the router's P/D must equal one vLLM
instance's, and the decode instance must have loaded the prompt's KV (its external-prefix-cache
counters), not recomputed it.
"""
from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.interop.vllm_fleet import ADMIN, SERVED, VllmFleet, metric

pytestmark = pytest.mark.timeout(2400)          # first module: may build the venv (minutes) + start 3 vLLMs
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
_WORD_TEXT = ("router worker prefill decode cache block token transfer state prompt answer question number the a of "
              "to and in is it that was for on are with as be at by this had not but from or have an they")
WORDS = _WORD_TEXT.split()
AUTH = {"authorization": f"Bearer {ADMIN}"}


def sentence(seed: int, n: int) -> str:
    """n words drawn from a generator seeded by `seed`: different seeds give different prompts (the
    old `(seed * 31 + ...) % 40` repeated every 40 seeds, so the affinity test's prefixes were already
    cached on both instances by earlier tests and their holders were a coin toss)."""
    rng = random.Random(f"sentence-{seed}")
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def fleet(vllm_python, tiny_llama, tmp_path_factory):
    with VllmFleet(tmp_path_factory.mktemp("nixl"), vllm_python, tiny_llama) as f:
        for name in ("p1", "p2", "d"):
            f.start_vllm(name, NIXL)
        started = time.monotonic()
        f.wait_all()
        print(f"3 vLLM instances ready in {time.monotonic() - started:.0f} s")
        f.warm_nixl(["p1", "p2"], "d")
        f.start_router("nixl", ["p1", "p2"], ["d"])
        yield f


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    resp = httpx.post(url + path, json=body, timeout=120, **kw)
    assert resp.status_code == 200, resp.text
    return resp


def streamed_text(url: str, path: str, body: dict) -> tuple[str, dict]:
    parts, headers = [], {}
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        headers = dict(resp.headers)
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts), headers


def answer(resp: httpx.Response) -> str:
    choice = resp.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def routed_answer(router: str, path: str, body: dict, stream: bool) -> tuple[str, dict]:
    """The answer text and response headers of one request through the router, streamed or whole."""
    if stream:
        return streamed_text(router, path, body)
    resp = post(router, path, body)
    return answer(resp), dict(resp.headers)


def requests_for(seed: int) -> list[tuple[str, dict]]:
    chat = {"model": SERVED, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "system", "content": sentence(seed, 40)},
                         {"role": "user", "content": sentence(seed + 1, 60)}]}
    completion = {"model": SERVED, "temperature": 0, "max_tokens": 24, "prompt": sentence(seed + 2, 100)}
    return [("/v1/chat/completions", chat), ("/v1/completions", completion)]


def test_all_listeners_are_on_loopback(fleet):
    out = subprocess.run(["ss", "-Hltnup"], capture_output=True, text=True, check=True).stdout
    pids = set().union(*(fleet.pids(n) for n in ("p1", "p2", "d", "router")))
    mine = [line for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]
    assert len(mine) >= 4, out                           # at least every HTTP server
    for line in mine:
        local = line.split()[4]
        assert local.startswith(("127.0.0.1:", "[::1]:")), f"a listener off loopback: {line}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_answers_equal_one_vllm_instance(fleet, stream):
    """Chat and completions, greedy: router P/D == the same request to one vLLM instance by itself."""
    router, single = fleet.urls["router"], fleet.urls["p2"]
    hits_before = metric(fleet.urls["d"], "vllm:external_prefix_cache_hits_total")
    for path, body in requests_for(100 + 10 * stream):
        expected = answer(post(single, path, body))
        got, headers = routed_answer(router, path, body, stream)
        assert headers["x-kimi-pd-decision"] == "prefill-decode", headers
        assert headers["x-kimi-pd-decode-worker"] == fleet.urls["d"]
        assert got == expected and got, (path, got, expected)
    loaded = metric(fleet.urls["d"], "vllm:external_prefix_cache_hits_total") - hits_before
    assert loaded >= 2 * 32, f"the decode instance loaded {loaded} prompt tokens through NIXL"


def test_aliases_and_models(fleet):
    router = fleet.urls["router"]
    names = [m["id"] for m in httpx.get(router + "/v1/models", timeout=60).json()["data"]]
    assert names == [SERVED, "tiny"]
    path, body = requests_for(300)[1]
    expected = answer(post(fleet.urls["p2"], path, body))
    assert answer(post(router, path, {**body, "model": "tiny"})) == expected   # the alias reaches vLLM as its name
    bad = httpx.post(router + path, json={**body, "model": "nope"}, timeout=120)
    assert bad.status_code == 404 and bad.json()["error"]["message"]


def workers_view(router: str) -> dict[str, dict]:
    listed = httpx.get(router + "/admin/workers", headers=AUTH, timeout=120).json()["workers"]
    return {w["worker_id"]: w for w in listed}


def wait_for_load(router: str, worker: str, check, timeout_s: float = 120) -> dict:
    deadline, seen = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        seen = workers_view(router)[worker]
        if seen["load"] and check(seen["load"]["running"] + seen["load"]["waiting"]):
            return seen
        time.sleep(0.2)
    raise AssertionError(f"the router never saw the load it waited for on {worker}: {seen}")


def pool_view(router: str, workers) -> dict[str, dict]:
    keys = ("healthy", "circuit", "inflight", "active_requests", "backlog_s", "tokens_per_s", "cached_blocks", "load")
    return {u: {k: w.get(k) for k in keys} for u, w in workers_view(router).items() if u in workers}


def explain(router: str, prompt: str, wanted: str, got: str, view: dict) -> str:
    """What the router saw just before a placement the test did not expect, and its failure counters."""
    counters = [line for line in httpx.get(router + "/metrics", timeout=60).text.splitlines()
                if not line.startswith("#") and any(k in line for k in ("retries", "failures", "fallbacks"))]
    return json.dumps({"prompt": prompt[:40], "wanted": wanted, "got": got, "view": view, "counters": counters},
                      indent=1)


def wait_for_idle_pool(router: str, workers, timeout_s: float = 60, idle: bool = True) -> None:
    """Every one of `workers` healthy, its circuit closed and (with `idle`) no load, as the router
    sees it. A starved host makes workers miss health probes: this runner's VM was seen descheduled
    for 10-16 s at a time (no log line from the router or the vLLM API servers; all three workers
    marked unhealthy at once, healthy again seconds later), and a placement made meanwhile avoids
    the unhealthy holder, as it should; the affinity tests are about placement among healthy workers."""
    deadline, view = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        view = workers_view(router)
        if all(view[w]["healthy"] and view[w]["circuit"] == "closed" and (not idle or (
                not view[w]["inflight"] and view[w]["load"]
                and view[w]["load"]["running"] + view[w]["load"]["waiting"] == 0)) for w in workers):
            return
        time.sleep(0.2)
    raise AssertionError(f"the pool never looked {'idle' if idle else 'healthy'} to the router: "
                         f"{[view.get(w) for w in workers]}")


@contextlib.contextmanager
def busy(url: str, requests: int = 14):
    """Long requests sent to one vLLM instance directly (the router never sees them), unstreamed and
    each outlasting the test that uses it (~1,900 tokens: tens of seconds even on a quiet machine); a
    hog whose request ends sends the next one, and leaving closes every connection (vLLM aborts a
    request whose client is gone).

    Streamed hogs cost vLLM's API server an event per token: with 14 of them its /metrics page took
    10-30 s to come, so the load the router read was that old. Short hogs (480 tokens, sent again as
    they ended) came in waves: requests batched together and of one length end together, and one
    scrape per wave saw the instance idle (measured: 14 running, then 0), and a placement went to it."""
    stop = threading.Event()
    host, port = url.removeprefix("http://").split(":")

    def hog(i: int) -> None:
        body = json.dumps({"model": SERVED, "prompt": sentence(i, 6), "max_tokens": 1900 - 37 * i,
                           "ignore_eos": True}).encode()
        request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body
        if stop.wait(0.2 * i):
            return
        while not stop.is_set():
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(request)
                conn.settimeout(0.2)
                while not stop.is_set():
                    try:
                        if not conn.recv(65536):
                            break                            # answered (connection: close): send the next
                    except TimeoutError:
                        pass

    threads = [threading.Thread(target=hog, args=(i,), daemon=True) for i in range(requests)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def prefill_of(router: str, prompt: str) -> str:
    body = {"model": SERVED, "temperature": 0, "max_tokens": 2, "prompt": prompt}
    resp = post(router, "/v1/completions", body)
    assert resp.headers["x-kimi-pd-decision"] == "prefill-decode"
    return resp.headers["x-kimi-pd-prefill-worker"]


def test_load_from_vllm_metrics_reaches_the_scorer(fleet):
    """Requests the router never saw (sent to one prefill instance directly) show up as its load,
    read from its /metrics, and placement moves a prefix that instance holds to the other one."""
    router = fleet.urls["router"]
    prefix = sentence(700, 120)
    holder = prefill_of(router, prefix)
    with busy(holder):
        seen = wait_for_load(router, holder, lambda n: n >= 12)
        assert seen["load"]["extra"]["source"] == "vllm-metrics" and seen["active_requests"] >= 12, seen
        view = pool_view(router, {fleet.urls["p1"], fleet.urls["p2"]})
        got = prefill_of(router, prefix + " " + sentence(1, 6))
        assert got != holder, ("placement ignored the load it read: "
                               + explain(router, prefix, "not " + holder, got, view))
    wait_for_load(router, holder, lambda n: n == 0)      # and the load it read falls back when vLLM's does


def test_two_prefill_instances_get_prefix_affinity(fleet):
    """Prefixes first placed on either prefill instance (the second gets some while the first is
    busy) stay there: continuations go to their holder, whose own prefix-cache hits rise."""
    router, names = fleet.urls["router"], {fleet.urls["p1"]: "p1", fleet.urls["p2"]: "p2"}
    idle = [sentence(500 + g, 120) for g in range(3)]
    moved = [sentence(600 + g, 120) for g in range(3)]
    holders = {p: prefill_of(router, p) for p in idle}
    first = holders[idle[-1]]
    with busy(first):
        wait_for_load(router, first, lambda n: n >= 12)
        for p in moved:
            wait_for_idle_pool(router, names, idle=False)
            wait_for_load(router, first, lambda n: n >= 12)      # as the router sees it now
            view = pool_view(router, names)
            holders[p] = prefill_of(router, p)
            assert holders[p] != first, explain(router, p, "not " + first, holders[p], view)   # the other one
    wait_for_idle_pool(router, names)
    hits = {n: metric(u, "vllm:prefix_cache_hits_total") for u, n in names.items()}
    for k in range(2):
        for prefix, holder in holders.items():
            wait_for_idle_pool(router, names)
            view = pool_view(router, names)
            got = prefill_of(router, f"{prefix} {sentence(900 + k, 8)}")
            assert got == holder, explain(router, prefix, holder, got, view)
    for url, name in names.items():
        held = sum(1 for h in holders.values() if h == url)
        gained = metric(url, "vllm:prefix_cache_hits_total") - hits[name]
        assert gained >= held * 2 * 96, f"{name} hit its prefix cache for only {gained} tokens"


def test_router_metrics_for_vllm_workers(fleet):
    text = httpx.get(fleet.urls["router"] + "/metrics", timeout=60).text
    assert 'kimi_pd_router_prefill_fallbacks_total{reason="no_kv_transfer_params"}' not in text
    ready = httpx.get(fleet.urls["router"] + "/ready", timeout=60).json()
    assert ready == {"ready": True, "workers": {"prefill": 2, "decode": 1, "both": 0}, "store": "none"}
