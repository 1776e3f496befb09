"""The router process never loads torch or the engine: it tokenises and renders prompts with
`shared.prompt` and speaks to workers over HTTP. Checked in a fresh interpreter (other tests' imports
would otherwise be in sys.modules), through real requests: a P/D chat and a streamed completion."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from engine.checkpoint.create import create_checkpoint
    return create_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), progress=False)


def test_router_serves_requests_without_torch_or_engine(model_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.architecture.router_child", str(model_dir)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    status, decision, content = report["chat"]
    assert (status, decision) == (200, "prefill-decode") and content
    assert report["stream"] == [200, True]
    assert report["heavy"] == []
