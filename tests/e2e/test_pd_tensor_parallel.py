"""P and D at different TP sizes through the router: a TP=2 prefill worker feeding a TP=1 decode
worker, and a TP=1 prefill feeding a TP=2 decode, each give the offline (colocated, TP=1) engine's
greedy tokens, token for token.

The state crosses kv_transfer in the TP=1 layout: the TP=2 prefill gathers its ranks' KDA heads on
export, the TP=2 decode splits them on import (`engine/parallel/state_layout.py`); MLA latents are
replicated. Every worker (and its follower rank) is stopped when the fleet closes, also on failure.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.e2e.fleet import Fleet, complete_ids, greedy_reference, metric, pd_routers

pytestmark = pytest.mark.timeout(420)
MAX_TOKENS = 8
# token-id prompts crossing pages (block 4) and KDA chunks (8); one repeats a prefix of another
PROMPTS = [np.random.default_rng(s).integers(0, 1024, n).tolist() for s, n in [(11, 37), (12, 45)]]
PROMPTS.append(PROMPTS[1][:24] + [3, 1, 4, 1, 5, 9, 2, 6])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, e2e_model):
    with Fleet(tmp_path_factory.mktemp("pd-tp"), e2e_model) as f:
        f.p2 = f.worker("prefill", "p-tp2", "--tensor-parallel-size", "2", "--enable-expert-parallel")
        strict = ("--kv-load-failure-policy", "fail")      # a state that does not import is a 503, not a recompute
        f.d1 = f.worker("decode", "d-tp1", *strict)
        f.p1 = f.worker("prefill", "p-tp1")
        f.d2 = f.worker("decode", "d-tp2", "--tensor-parallel-size", "2", *strict)
        for proc in (f.p2, f.d1, f.p1, f.d2):
            f.wait(proc, timeout_s=240)
        f.wide_prefill, f.wide_decode = pd_routers(f, {"r-p2-d1": (f.p2, f.d1), "r-p1-d2": (f.p1, f.d2)})
        yield f


@pytest.fixture(scope="module")
def colocated(e2e_model) -> list[list[int]]:
    return greedy_reference(e2e_model, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("pair", ["tp2-prefill-tp1-decode", "tp1-prefill-tp2-decode"])
def test_pd_across_tp_sizes_equals_colocated(fleet, colocated, pair):
    router, prefill, decode = ((fleet.wide_prefill, fleet.p2, fleet.d1) if pair.startswith("tp2")
                               else (fleet.wide_decode, fleet.p1, fleet.d2))
    for prompt, expected in zip(PROMPTS, colocated, strict=False):
        got = complete_ids(router.url, prompt, MAX_TOKENS)
        assert got.status_code == 200, got.text
        assert got.headers["x-kimi-pd-decision"] == "prefill-decode"
        assert got.headers["x-kimi-pd-prefill-worker"] == prefill.url
        assert got.headers["x-kimi-pd-decode-worker"] == decode.url
        assert got.json()["choices"][0]["token_ids"] == expected
    # every state was pulled and imported (no recompute) and none is left held on the prefill worker
    assert metric(decode.url, "kimi_pd_kv_pull_failures_total") == 0
    assert metric(decode.url, "kimi_pd_kv_transfers_total", direction="recv") >= len(PROMPTS)
    assert metric(prefill.url, "kimi_pd_kv_held_leases") == 0
    assert metric(prefill.url, "kimi_pd_worker_held") == 0


def follower_pids(parent: int) -> list[int]:
    """Pids of `engine.parallel.follower` processes whose parent is `parent` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"engine.parallel.follower" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_tp2_workers_run_one_follower_rank_each(fleet):
    """A TP=2 worker is two processes (rank 0 serves, rank 1 is its child); a TP=1 worker is one."""
    assert len(follower_pids(fleet.p2.popen.pid)) == 1
    assert len(follower_pids(fleet.d2.popen.pid)) == 1
    assert follower_pids(fleet.d1.popen.pid) == []
