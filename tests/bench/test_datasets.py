"""Workloads: prompts encode to exactly the requested lengths; shared prefixes are shared tokens."""
from __future__ import annotations

import json

import pytest

from kimi_pd.bench.datasets import sample_mooncake, sample_random, sample_sharegpt

MOONCAKE_FILE = "/work/shared/data/mooncake/conversation_trace.jsonl"


def test_random_prompts_have_the_requested_token_lengths(pool):
    reqs = sample_random(pool, 20, input_len=100, output_len=7, range_ratio=0.5, prefix_len=24, seed=3)
    tok = pool.tokenizer
    lens = [len(tok.encode(r.prompt)) for r in reqs]
    assert lens == [r.prompt_len for r in reqs]
    assert all(24 + 50 <= n <= 24 + 150 for n in lens) and len(set(lens)) > 5
    assert all(3 <= r.expected_output_len <= 11 for r in reqs)   # floor(3.5) .. ceil(10.5)
    prefixes = {tuple(tok.encode(r.prompt)[:24]) for r in reqs}
    assert len(prefixes) == 1, "every prompt starts with the same prefix tokens"
    assert len({tuple(tok.encode(r.prompt)[24:30]) for r in reqs}) == 20, "the rest differs"


def test_random_is_seeded(pool):
    a = sample_random(pool, 5, 40, 4, 0.3, seed=1)
    assert a == sample_random(pool, 5, 40, 4, 0.3, seed=1) and a != sample_random(pool, 5, 40, 4, 0.3, seed=2)
    assert [r.prompt_len for r in a] != [40] * 5 and [r.prompt_len for r in sample_random(pool, 3, 40, 4)] == [40] * 3


@pytest.mark.parametrize("kwargs", [dict(input_len=0, output_len=4), dict(input_len=8, output_len=0),
                                    dict(input_len=8, output_len=4, range_ratio=1.0)])
def test_random_rejects_impossible_lengths(pool, kwargs):
    with pytest.raises(ValueError):
        sample_random(pool, 2, **kwargs)


def write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_mooncake_equal_hash_ids_give_equal_token_prefixes(pool, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 250, "input_length": 1100, "output_length": 9, "hash_ids": [0, 1, 3]},
        {"timestamp": 900, "input_length": 600, "output_length": 2, "hash_ids": [4, 5]},
    ])
    reqs = sample_mooncake(pool, trace, None, block_tokens=32, slowdown=2.0)
    tok = pool.tokenizer
    ids = [tok.encode(r.prompt) for r in reqs]
    # lengths scale by 32/512 and stay inside the blocks the hash ids cover
    assert [len(i) for i in ids] == [r.prompt_len for r in reqs] == [94, 69, 38]
    assert ids[0][:64] == ids[1][:64], "hash ids 0, 1 shared"
    assert ids[0][64:69] != ids[1][64:69], "block 2 != block 3"
    assert ids[2][:32] != ids[0][:32]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.8]
    assert [r.expected_output_len for r in reqs] == [5, 9, 2]


def test_mooncake_reads_the_shipped_trace(pool):
    reqs = sample_mooncake(pool, MOONCAKE_FILE, 50, block_tokens=8, output_len=3)
    assert len(reqs) == 50 and all(r.expected_output_len == 3 for r in reqs)
    first = [pool.tokenizer.encode(r.prompt)[:8] for r in reqs[:6]]
    assert all(f == first[0] for f in first), "the trace's first requests share hash id 0"


def test_mooncake_rejects_malformed_records(pool, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        sample_mooncake(pool, bad, None)


def test_sharegpt_uses_first_turns_and_filters(pool, tmp_path):
    text = " the cat sat on the mat and then it ran to the door"
    data = [{"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": text * 2}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": text}]},   # too short
            {"conversations": [{"from": "human", "value": text}]},                                  # one turn
            {"conversations": [{"from": "human", "value": text * 3}, {"from": "gpt", "value": text}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    tok = pool.tokenizer
    reqs = sample_sharegpt(pool, path, 10, seed=0)
    assert sorted(r.prompt for r in reqs) == sorted([text, text * 3])
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt))
        assert r.expected_output_len == len(tok.encode(text * 2 if r.prompt == text else text))
    assert all(r.expected_output_len == 6 for r in sample_sharegpt(pool, path, 10, output_len=6))
