"""`kimi-pd checkpoint create` + `kimi-pd generate` through the real console entry point."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from PIL import Image


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_pd", *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd)


def test_create_then_generate_json_is_deterministic(tmp_path):
    ckpt = tmp_path / "tiny"
    created = run_cli("checkpoint", "create", "--preset", "tiny", "--out", str(ckpt), "--quiet")
    assert created.returncode == 0, created.stderr
    image = tmp_path / "img.png"
    Image.fromarray((np.arange(40 * 50 * 3) % 255).astype(np.uint8).reshape(40, 50, 3)).save(image)
    args = ("generate", "--model", str(ckpt), "--prompt", "Hello, Kimi", "--max-tokens", "6", "--json")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out == json.loads(second.stdout)
    assert len(out["token_ids"]) == len(out["logprobs"]) <= 6
    assert all(lp <= 0 for lp in out["logprobs"])
    with_image = run_cli(*args, "--image", str(image))
    assert with_image.returncode == 0, with_image.stderr
    img_out = json.loads(with_image.stdout)
    assert len(img_out["prompt_token_ids"]) > len(out["prompt_token_ids"])
    plain = run_cli("generate", "--model", str(ckpt), "--prompt", "Hello", "--max-tokens", "3")
    assert plain.returncode == 0, plain.stderr


def test_generate_errors_are_clear(tmp_path):
    missing = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert missing.returncode == 2 and "no config.json" in missing.stderr
    bad = run_cli("checkpoint", "create", "--preset", "huge", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
