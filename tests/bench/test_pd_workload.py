"""benchmarks/pd_vs_colocated.py's workload: Poisson short chats plus simultaneous bursts of long
prompts, identical for every fleet (seeded)."""
from __future__ import annotations

import pytest

from benchmarks.pd_vs_colocated import parse_args, workload


def test_workload_has_steady_short_chats_and_long_bursts(pool):
    args = parse_args(["--duration", "20", "--short-rate", "4", "--burst-every", "5", "--burst-size", "3",
                       "--long-len", "300", "--short-len", "40"])
    reqs = workload(pool, args)
    assert reqs == workload(pool, args), "seeded: every fleet gets the same requests"
    short = [r for r in reqs if r.request_id.startswith("short")]
    long = [r for r in reqs if r.request_id.startswith("long")]
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert len(short) == pytest.approx(80, rel=0.3) and all(0 <= r.arrival_s < 20 for r in short)
    assert all(30 <= r.prompt_len <= 50 and r.expected_output_len >= 24 for r in short)
    assert sorted({r.arrival_s for r in long}) == [2.5, 7.5, 12.5, 17.5]
    assert len(long) == 12 and all(r.prompt_len == 300 for r in long)
    tok = pool.tokenizer
    assert all(len(tok.encode(r.prompt)) == r.prompt_len for r in reqs[:10])
