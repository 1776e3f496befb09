"""A throwaway venv with transformers 4.x, for checking that checkpoints' tokenizer files load there.

Made once per machine under ~/.cache/kimi-pd (or $KIMI_PD_CACHE_DIR) with `--system-site-packages`,
so only transformers 4, its huggingface-hub and tokenizers are installed into it; a marker file
names the requirement it holds. `.ci/run` makes it before the suite (`python3 -m
tests.shared.prompt.transformers4_venv`), so the install is not part of the suite's time; the test
fixture makes it when missing.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TRANSFORMERS4 = "transformers>=4.45,<5"


def cache_dir() -> Path:
    if os.environ.get("KIMI_PD_CACHE_DIR"):
        return Path(os.environ["KIMI_PD_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kimi-pd"


def ensure_venv(timeout_s: float = 900) -> Path:
    """The venv's python, made if missing; raises RuntimeError when pip cannot install."""
    venv = cache_dir() / "venv-transformers4"
    python, marker = venv / "bin" / "python", venv / ".kimi-pd-ready"
    if marker.is_file() and marker.read_text() == TRANSFORMERS4 and python.exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", TRANSFORMERS4],
                         capture_output=True, text=True, timeout=timeout_s)
    if pip.returncode != 0:
        raise RuntimeError(f"could not install {TRANSFORMERS4} into {venv}: {pip.stderr[-2000:]}")
    marker.write_text(TRANSFORMERS4)
    return python


if __name__ == "__main__":
    print(ensure_venv())
