"""benchmarks/decode_ops_ab.py: both settings are timed in one engine, and "off" really leaves the C ops."""
from __future__ import annotations

import json

import pytest

from benchmarks import decode_ops_ab
from engine.model import decode_ops


@pytest.mark.skipif(decode_ops.decode_ops() is None, reason="the decode ops' library does not load here")
def test_a_tiny_run_times_both_settings_and_off_calls_no_c(tmp_path, monkeypatch):
    calls = {"on": 0, "off": 0}
    real_usable = decode_ops.usable

    def counting(*tensors):
        ops = real_usable(*tensors)
        calls["on" if decode_ops._switched_on else "off"] += ops is not None
        return ops

    monkeypatch.setattr(decode_ops, "usable", counting)
    out = tmp_path / "ab.json"
    result = decode_ops_ab.main(["--preset", "tiny", "--checkpoint", str(tmp_path / "tiny"), "--batch-sizes", "2",
                                 "--rounds", "2", "--steps", "2", "--warm-steps", "1", "--prompt-tokens", "8",
                                 "--out", str(out)])
    assert json.loads(out.read_text()) == result
    (run,) = result["runs"]
    assert run["batch"] == 2 and len(run["ms_on"]) == len(run["ms_off"]) == 2
    assert run["off_over_on"] == pytest.approx(run["median_ms_off"] / run["median_ms_on"])
    assert calls["on"] > 0 and calls["off"] == 0
    assert decode_ops._switched_on                       # left on for whatever runs next


@pytest.mark.skipif(decode_ops.decode_ops() is None, reason="the decode ops' library does not load here")
def test_the_layers_switch_times_the_whole_layer_calls_only(tmp_path, monkeypatch):
    seen = []
    real = decode_ops.set_layers_enabled
    monkeypatch.setitem(decode_ops_ab.SWITCHES, "layers", lambda on: seen.append(on) or real(on))
    monkeypatch.setattr(decode_ops, "set_enabled", lambda on: pytest.fail("the per-operator switch was touched"))
    out = tmp_path / "ab.json"
    result = decode_ops_ab.main(["--preset", "tiny", "--checkpoint", str(tmp_path / "tiny"), "--batch-sizes", "1",
                                 "--rounds", "2", "--steps", "1", "--warm-steps", "1", "--prompt-tokens", "8",
                                 "--switch", "layers", "--out", str(out)])
    assert result["switch"] == "layers" and json.loads(out.read_text()) == result
    assert seen.count(False) == 3 and seen[-1] is True and decode_ops._layers_on
