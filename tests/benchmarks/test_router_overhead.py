"""benchmarks/router_overhead.py's arithmetic and checks, on made-up runs: added latency against the
right baseline per mode, ratios to each peer, the goals, the headroom, the leg check; and the wrk
script quoting bodies so Lua reads them back exactly."""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.loadgen import Run, write_script
from benchmarks.router_overhead import (
    check_legs,
    goals,
    headroom,
    served_by_process,
    settled_counts,
    spread,
    stub_counts,
    summarize_mode,
)
from benchmarks.services import ROOT, BenchError, checkout_path
from router.procs.metrics import TableCollector
from router.procs.share import SERVED, ProcessShare
from router.procs.table import SharedTable


def row(rps: float, mean: float, p50: float | None = None, cpu: float | None = None) -> dict:
    out = {"requests": 100, "requests_per_s": rps, "mean_us": mean, "p50_us": p50 or mean, "p99_us": 2 * mean,
           "generator_cpu_us_per_request": 30.0}
    return out if cpu is None else {**out, "cpu_us_per_request": cpu, "rss_mb": 90.0}


def runs(mode_rows: dict[str, dict[str, list[dict]]]) -> dict:
    return {"chat": mode_rows}


def test_decode_only_added_latency_is_against_the_direct_call_of_the_same_round():
    s = summarize_mode("decode-only", runs({
        "1": {"direct": [row(900, 100), row(800, 120), row(850, 110)],
              "router": [row(500, 400, cpu=300), row(400, 420, cpu=310), row(450, 430, cpu=320)],
              "sglang-router": [row(700, 250, cpu=100), row(600, 260, cpu=110), row(650, 240, cpu=90)]},
        "32": {"direct": [row(6000, 5000)], "router": [row(1000, 30000, cpu=280)],
               "sglang-router": [row(2000, 15000, cpu=70)]}}))
    assert s["targets"]["router"]["chat_c1"]["added_latency_us"] == 300      # median of 300, 300, 320
    assert s["targets"]["sglang-router"]["chat_c1"]["added_latency_us"] == 140
    assert "added_latency_us" not in s["targets"]["router"]["chat_c32"]
    r = s["ratios"]["router_vs_sglang-router"]
    assert r["chat_c32_requests_per_s"] == 0.5 and r["chat_c32_cpu_us_per_request"] == 4.0
    g = goals({"decode-only": s})["decode-only"]
    assert g["requests_per_s_c32"] == [1000, 2000] and g["met"] is False
    h = headroom({"decode-only": s})
    assert h == {"decode-only/chat_c32": {"direct_requests_per_s": 6000, "fastest_proxy_requests_per_s": 2000,
                                          "headroom": 3.0, "generator_cpu_us_per_request": 30.0,
                                          # wrk's CPU per request x the rate it drove: the cores it used
                                          "generator_cores": {"direct": 0.18, "router": 0.03, "sglang-router": 0.06}}}


def test_pd_added_latency_is_against_both_legs_done_by_the_client():
    s = summarize_mode("prefill-decode", runs({
        "1": {"direct": [row(900, 100)], "direct_prefill": [row(900, 150)], "router": [row(500, 600, cpu=500)],
              "router_baseline": [row(400, 700, cpu=600)]}}))
    assert s["targets"]["router"]["chat_c1"]["added_latency_us"] == 350
    assert s["ratios"]["router_vs_baseline"]["chat_c1_cpu_us_per_request"] == round(500 / 600, 2)


def test_leg_check_allows_only_the_requests_in_flight_when_wrk_stopped():
    run = Run(requests=100, seconds=1.0, errors={}, mean_us=1.0, p50_us=1, p99_us=1, max_us=1, generator_cpu_s=0.0)
    ok = {("prefill", "prefill"): 100, ("decode", "decode"): 132, ("decode", "local"): 0}
    check_legs("prefill-decode", "router", run, ok, connections=32)                   # 32 in flight at most
    for bad in ({**ok, ("decode", "decode"): 133}, {**ok, ("decode", "local"): 1}, {**ok, ("prefill", "prefill"): 99}):
        with pytest.raises(BenchError):
            check_legs("prefill-decode", "router", run, bad, connections=32)
    check_legs("prefill-decode", "sglang-router", run, {("prefill", "local"): 100, ("decode", "local"): 100}, 32)
    with pytest.raises(BenchError, match="errors"):
        check_legs("decode-only", "router", Run(**{**run.__dict__, "errors": {"status": 3}}),
                   {("decode", "local"): 100}, 32)


def test_wrk_script_quotes_bodies_as_lua_strings(tmp_path):
    bodies = [{"model": "m", "messages": [{"role": "user", "content": 'say "hi" \\ then\nbye'}]}]
    text = write_script(tmp_path / "s.lua", bodies).read_text()
    literal = re.search(r'local bodies = \{(".*")\}', text).group(1)
    # Lua and JSON read these escapes alike: the literal parsed as a JSON string is the body's JSON
    assert json.loads(json.loads(literal)) == bodies[0]


def test_python_floor_forwards_requests_and_answers_unchanged(tmp_path):
    """The floor proxy (benchmarks/python_floor.py) relays a chat request to the fast stub and its answer
    back as the stub wrote it; the stub counts exactly one leg per request."""
    import argparse

    import httpx

    from benchmarks.services import service, stub_worker
    from shared.net import free_port

    stub_port, floor_port = free_port(), free_port()
    stub_args = argparse.Namespace(tokens=4, token_delay_ms=0.0, startup_timeout=60.0)
    stub = f"http://127.0.0.1:{stub_port}"
    floor = f"http://127.0.0.1:{floor_port}"
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    with stub_worker("decode", stub_port, stub_args, tmp_path), \
            service("python-floor", ["-m", "benchmarks.python_floor", "--port", str(floor_port), "--upstream", stub],
                    floor + "/health", tmp_path, 60.0):
        before = httpx.get(stub + "/stats", timeout=5).json()
        with httpx.Client(timeout=5) as http:
            answers = [http.post(floor + "/v1/chat/completions", json=body) for _ in range(3)]
            direct = http.post(stub + "/v1/chat/completions", json=body)
        after = httpx.get(stub + "/stats", timeout=5).json()
    assert [a.status_code for a in answers] == [200, 200, 200]
    strip = ("id", "created")
    assert all({k: v for k, v in a.json().items() if k not in strip} ==
               {k: v for k, v in direct.json().items() if k not in strip} for a in answers)
    assert after["local"] - before["local"] == 4 and after["decode"] == before["decode"]    # 3 relayed + 1 direct


def test_leg_counts_are_read_once_the_previous_runs_stragglers_are_served():
    reads = iter([Counter({("decode", "local"): n}) for n in (100, 130, 140, 140, 150)])
    got = settled_counts({}, read=lambda urls: next(reads), quiet_s=0.0)
    assert got == Counter({("decode", "local"): 140})        # the first two reads alike: settled
    moving = iter(Counter({("decode", "local"): n}) for n in range(10**6))
    start = time.monotonic()
    last = settled_counts({}, read=lambda urls: next(moving), quiet_s=0.001, limit_s=0.02)
    assert time.monotonic() - start < 1.0 and last[("decode", "local")] >= 1    # never settles: gives up, latest read


def test_spread_reads_each_process_count_from_the_routers_own_exposition(tmp_path):
    table = SharedTable.create(str(tmp_path / "table"), 3, threading.Lock())
    shares = [ProcessShare(table, i) for i in range(3)]
    registry = CollectorRegistry()
    registry.register(TableCollector(shares[0]))
    before = served_by_process(generate_latest(registry).decode())
    assert before == {"0": 0.0, "1": 0.0, "2": 0.0}
    for share, n in zip(shares, (10, 30, 20), strict=True):
        for _ in range(n):
            share.served()
    assert table.proc(1, SERVED) == 30
    after = served_by_process(generate_latest(registry).decode())
    assert spread(before, after) == {"process_requests": [10, 30, 20], "process_spread": 1.5}
    assert spread(after, after)["process_spread"] is None          # nothing served: no spread, not a crash


def test_a_baseline_checkout_runs_on_its_own_modules_with_the_hosts_other_paths():
    host = os.pathsep.join(["/tmp/site", str(ROOT), "", str(ROOT / ".")])
    assert checkout_path(Path("/work/base"), host) == os.pathsep.join(["/work/base", "/tmp/site"])
    assert checkout_path(Path("/work/base"), "") == "/work/base"


def test_a_baseline_router_is_given_the_same_process_count_or_refused(tmp_path):
    """A checkout whose router takes --workers defaults to one process per core: the A/B must pass the
    count to both (a baseline run as two processes beside one once read as a 1.5x gain)."""
    from argparse import Namespace

    from benchmarks.services import knows_router_workers, router
    old = tmp_path / "old"
    (old / "router").mkdir(parents=True)
    (old / "router" / "cli.py").write_text('p.add_argument("--port", type=int)\n')
    assert knows_router_workers(ROOT) and not knows_router_workers(old)
    args = Namespace(router_workers=2, startup_timeout=5.0)
    with pytest.raises(BenchError, match="no --workers flag"):
        router(0, 0, "http://p", "http://d", tmp_path, args, tmp_path, tree=old)


def test_stage_costs_are_each_stage_over_the_one_before_and_never_a_peer():
    s = summarize_mode("decode-only", runs({
        "32": {"direct": [row(6000, 5000)], "router": [row(1000, 30000, cpu=500)],
               "router@front": [row(9000, 3000, cpu=50)], "router@validated": [row(8000, 3500, cpu=100)],
               "router@prepared": [row(5000, 6000, cpu=200)], "router@admitted": [row(4000, 7000, cpu=250)],
               "router@placed": [row(2500, 12000, cpu=400)],
               "sglang-router": [row(2000, 15000, cpu=150)]}}))
    stages = s["stages"]["chat_c32"]
    assert [(r["stage"], r["cpu_us_per_request"], r.get("added_us")) for r in stages] == [
        ("front", 50, 50), ("validated", 100, 50), ("prepared", 200, 100), ("admitted", 250, 50),
        ("placed", 400, 150), ("whole", 500, 100), ("reference: sglang-router, whole", 150, None)]
    assert [r.get("share_of_whole") for r in stages[:6]] == [0.1, 0.1, 0.2, 0.1, 0.3, 0.2]
    assert set(s["ratios"]) == {"router_vs_sglang-router"}              # a cut router is not a peer
    assert summarize_mode("decode-only", runs({"32": {"router": [row(1000, 3, cpu=5)]}}))["stages"] == {}


def test_a_cut_router_is_checked_for_the_legs_its_stage_still_sends():
    run = Run(requests=100, seconds=1.0, errors={}, mean_us=1.0, p50_us=1, p99_us=1, max_us=1, generator_cpu_s=0.0)
    check_legs("prefill-decode", "router@placed", run, {("prefill", "prefill"): 100, ("decode", "decode"): 0}, 32)
    check_legs("prefill-decode", "router@admitted", run, {("prefill", "prefill"): 0}, 32)
    with pytest.raises(BenchError):        # a cut that still reached the decode worker would measure the whole path
        check_legs("prefill-decode", "router@placed", run, {("prefill", "prefill"): 100, ("decode", "decode"): 5}, 32)
    with pytest.raises(BenchError):
        check_legs("decode-only", "router@front", run, {("decode", "local"): 1}, 32)


def test_each_cut_answers_where_its_stage_ends_in_every_router_process(tmp_path):
    """Against real stubs: `front` answers even a request validation would refuse, `validated` refuses it
    but answers one for a model nobody serves (the model check comes after), `prepared` refuses both,
    `placed` (in prefill-decode mode, two spawned router processes) sends the prefill leg only. Every
    answer is the cut's fixed completion."""
    import argparse

    import httpx

    from benchmarks.router_overhead import _tiny_checkpoint
    from benchmarks.router_stages import ANSWER
    from benchmarks.services import router, stub_worker
    from shared.net import free_port

    args = argparse.Namespace(tokens=4, token_delay_ms=0.0, startup_timeout=60.0, router_workers=1)
    ports = {"prefill": free_port(), "decode": free_port()}
    stubs = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    model = _tiny_checkpoint(tmp_path)
    good = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hello there"}]}
    bad = {"model": "kimi-k3", "messages": "not a list"}
    unknown_model = {**good, "model": "no-such-model"}

    def served() -> Counter:
        return stub_counts(stubs)

    with stub_worker("prefill", ports["prefill"], args, tmp_path), \
            stub_worker("decode", ports["decode"], args, tmp_path):
        for stage, threshold, workers in (("front", 100000, 1), ("validated", 100000, 1), ("prepared", 100000, 1),
                                          ("placed", 0, 2)):
            port = free_port()
            with router(port, threshold, stubs["prefill"], stubs["decode"], model,
                        argparse.Namespace(**{**vars(args), "router_workers": workers}), tmp_path, name=f"cut-{stage}",
                        entry=("-m", "benchmarks.router_stages", "--stage", stage)):
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                before, answers, processes = served(), [], set()
                while len(answers) < 8 or (len(processes) < workers and len(answers) < 64):
                    answers.append(httpx.post(url, json=good, timeout=10))     # a new connection each: any process
                    processes.add(answers[-1].headers.get("x-kimi-pd-router-process", "").partition(":")[0])
                refused = httpx.post(url, json=bad, timeout=10)
                unknown = httpx.post(url, json=unknown_model, timeout=10)
                legs = served() - before
            assert [a.status_code for a in answers] == [200] * len(answers)
            assert all(a.content == ANSWER for a in answers) and len(processes) == workers, (stage, processes)
            assert refused.status_code == (200 if stage == "front" else 400), stage
            assert unknown.status_code == (200 if stage in ("front", "validated") else 404), stage
            expected = Counter({("prefill", "prefill"): len(answers)}) if stage == "placed" else Counter()
            assert legs == expected, (stage, legs)
