"""`kimi-pd checkpoint create` + `kimi-pd generate`: `generate` once through the real entry point
(`python -m kimi_pd`, a child process), everything else through the same `main` in this process (no
interpreter start and torch import each time, seconds apiece on two cores); the two must answer alike."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from kimi_pd.cli import main


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_pd", *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`kimi-pd ARGS` in this process: (exit status, stdout, stderr); argparse's exits become a status."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_create_then_generate_json_is_deterministic(tmp_path, capsys):
    ckpt = tmp_path / "tiny"
    code, _, err = run_main(capsys, "checkpoint", "create", "--preset", "tiny", "--out", str(ckpt), "--quiet")
    assert code == 0, err
    image = tmp_path / "img.png"
    Image.fromarray((np.arange(40 * 50 * 3) % 255).astype(np.uint8).reshape(40, 50, 3)).save(image)
    args = ("generate", "--model", str(ckpt), "--prompt", "Hello, Kimi", "--max-tokens", "6", "--json")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    code, second, err = run_main(capsys, *args)
    assert code == 0, err
    out = json.loads(first.stdout)
    assert out == json.loads(second)                    # another process, the same answer
    assert len(out["token_ids"]) == len(out["logprobs"]) <= 6
    assert all(lp <= 0 for lp in out["logprobs"])
    code, with_image, err = run_main(capsys, *args, "--image", str(image))
    assert code == 0, err
    assert len(json.loads(with_image)["prompt_token_ids"]) > len(out["prompt_token_ids"])
    code, _, err = run_main(capsys, "generate", "--model", str(ckpt), "--prompt", "Hello", "--max-tokens", "3")
    assert code == 0, err


def test_generate_errors_are_clear(tmp_path, capsys):
    code, _, err = run_main(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert code == 2 and "no config.json" in err
    code, _, err = run_main(capsys, "checkpoint", "create", "--preset", "huge", "--out", str(tmp_path / "x"))
    assert code == 2 and "invalid choice" in err
