"""Run `kimi-pd bench` as a user would (a subprocess) and read back what it saved."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from PIL import Image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests", "total_cached_tokens", "cached_token_ratio", "cold_requests",
                "prefix_hit_requests", "median_ttft_cold_ms", "median_ttft_prefix_hit_ms", "date", "backend",
                "model_id", "num_prompts", "request_rate", "max_concurrency"]
LATENCY_KEYS = [f"{stat}_{name}_ms"
                for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]


def run_bench(url: str, tokenizer: Path, result_dir: Path, *args: str,
              timeout_s: float = 180) -> tuple[dict, list[Path]]:
    cmd = [sys.executable, "-m", "kimi_pd", "bench", "--url", url, "--tokenizer", str(tokenizer), "--save-result",
           "--result-dir", str(result_dir), "--result-filename", "run.json", "--disable-tqdm", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"kimi-pd bench exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads((result_dir / "run.json").read_text())
    return result, sorted(result_dir.glob("run.*.png"))


def assert_valid_pngs(paths: list[Path]) -> None:
    assert [p.name for p in paths] == ["run.latency_cdf.png", "run.throughput.png", "run.ttft_vs_prompt.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            assert img.format == "PNG" and img.width >= 400 and img.height >= 300
            assert sum(1 for n in img.convert("L").histogram() if n) > 8, f"{path.name} is blank"
