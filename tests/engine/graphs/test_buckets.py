"""Bucket ladder, bucket choice and the --compilation-config schema (pure policy, no device)."""
from __future__ import annotations

import pytest

from engine.graphs.buckets import bucket_for, capture_sizes
from engine.graphs.config import CompilationConfig


def test_default_ladder_is_vllms_cut_at_max_num_seqs():
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(20) == (1, 2, 4, 8, 16)
    assert capture_sizes(3) == (1, 2)
    assert capture_sizes(64, max_size=24) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(8, configured=(3, 6, 12)) == (3, 6)
    assert capture_sizes(2, configured=(4, 8)) == (2,)          # nothing fits: one bucket of the max


def test_bucket_is_the_smallest_holding_the_batch():
    sizes = (1, 2, 4, 8)
    assert [bucket_for(b, sizes) for b in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


def test_compilation_config_parses_vllm_json_and_refuses_the_rest():
    cfg = CompilationConfig.parse('{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 1, 2]}')
    assert cfg.cudagraph_mode == "FULL_DECODE_ONLY" and cfg.cudagraph_capture_sizes == (1, 2, 4)
    assert cfg.wants_graphs(enforce_eager=False) and not cfg.wants_graphs(enforce_eager=True)
    assert not CompilationConfig.parse(None).wants_graphs(False)
    for bad, match in [("{", "not valid JSON"), ('{"cudagraph_mode": "PIECEWISE"}', "not supported"),
                       ('{"level": 3}', "unsupported keys"), ('{"cudagraph_capture_sizes": [0]}', "positive"),
                       ("[1]", "JSON object")]:
        with pytest.raises(ValueError, match=match):
            CompilationConfig.parse(bad)
