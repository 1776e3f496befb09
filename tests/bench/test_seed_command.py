"""`kimi-pd bench` takes `vllm bench serve`'s command line as written: the seed's argument list
(tests/bench/seed_bench_command.sh, unedited) against a stub server on the seed's port 8000, and counts
stream events as vLLM's client does (the chat role chunk and the finish chunk are events)."""
from __future__ import annotations

import json
import os
import random
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_pd.bench.client import CHAT, COMPLETIONS, RequestSettings, SSEMessages, payload
from kimi_pd.bench.datasets import SampleRequest
from tests.e2e.fleet import Fleet

pytestmark = pytest.mark.timeout(240)
SEED = Path(__file__).with_name("seed_bench_command.sh")
OUTPUT_LEN = 128


def seed_argv() -> list[str]:
    """The seed's command as a shell would split it (placeholders left as `$NAME` for the environment)."""
    text = "\n".join(line for line in SEED.read_text().splitlines() if not line.lstrip().startswith("#"))
    return shlex.split(text.replace("\\\n", " "))


def _free_loopback_8000() -> str:
    """A 127.x.y.z address whose port 8000 is free, so the seed's `:8000` stays as written."""
    rng = random.Random()
    for _ in range(50):
        ip = f"127.{rng.randrange(1, 255)}.{rng.randrange(0, 255)}.{rng.randrange(1, 255)}"
        with socket.socket() as s:
            try:
                s.bind((ip, 8000))
            except OSError:
                continue
        return ip
    pytest.skip("no loopback address with a free port 8000")


@pytest.fixture(scope="module")
def seed_server(tmp_path_factory, bench_model):
    ip = _free_loopback_8000()
    with Fleet(tmp_path_factory.mktemp("seed-stub"), bench_model) as fleet:
        cmd = [sys.executable, "-m", "tests.stub_worker", "--host", ip, "--port", "8000", "--tokens", str(OUTPUT_LEN)]
        proc = fleet._spawn("seed-stub", cmd, 8000)
        proc.url = f"http://{ip}:8000"
        fleet.wait(proc)
        yield ip


def test_the_seed_command_runs_as_written(seed_server, bench_model, tmp_path, monkeypatch):
    argv = seed_argv()
    assert argv[:3] == ["vllm", "bench", "serve"]
    monkeypatch.setenv("NODE0_IP", seed_server)
    monkeypatch.setenv("TOKENIZER_PATH", str(bench_model))
    args = [os.path.expandvars(a) for a in argv[3:]]               # as the shell expands the quoted "$NAME"s
    proc = subprocess.run([sys.executable, "-m", "kimi_pd", "bench", *args, "--disable-tqdm"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "temperature: not sent" in proc.stderr
    saved = list((tmp_path / "benchmark-results").glob("*.json"))
    assert len(saved) == 1, saved
    result = json.loads(saved[0].read_text())
    assert (result["completed"], result["failed"]) == (100, 0)
    assert result["total_output_tokens"] == 100 * OUTPUT_LEN
    assert result["total_input_tokens"] == 100 * 1024       # the stub counts the words of the text part
    assert result["backend"] == CHAT and result["model_id"] == "kimi-k3" and result["max_concurrency"] == 4


def test_chat_events_are_counted_as_vllm_counts_them(seed_server, bench_model, tmp_path):
    """Role chunk + one chunk per token + the finish chunk: ITL samples = tokens + 1 per request."""
    cmd = [sys.executable, "-m", "kimi_pd", "bench", "--base-url", f"http://{seed_server}:8000", "--backend",
           "openai-chat", "--endpoint", "/v1/chat/completions", "--model", "kimi-k3", "--tokenizer", str(bench_model),
           "--num-prompts", "3", "--input-len", "8", "--output-len", "5", "--save-result", "--save-detailed",
           "--result-dir", str(tmp_path), "--result-filename", "r.json", "--no-plots", "--disable-tqdm",
           "--num-warmups", "2", "--temperature", "0", "--header", "x-extra=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert [len(itl) for itl in result["itls"]] == [5 + 1] * 3
    assert result["output_lens"] == [5] * 3 and result["input_lens"] == [8] * 3
    assert "temperature: not sent" not in proc.stderr


def test_request_bodies_are_vllms():
    req = SampleRequest("a b c", 3, 7, "random-4")
    chat = payload(RequestSettings("u", CHAT, "kimi-k3"), req)
    assert chat == {"model": "kimi-k3", "messages": [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}],
                    "max_completion_tokens": 7, "stream": True, "stream_options": {"include_usage": True}}
    text = payload(RequestSettings("u", COMPLETIONS, "kimi-k3", ignore_eos=True, temperature=0.5,
                                   extra_body=(("top_p", 0.9),)), req)
    assert text == {"model": "kimi-k3", "prompt": "a b c", "repetition_penalty": 1.0, "max_tokens": 7,
                    "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "temperature": 0.5, "top_p": 0.9}


def test_sse_messages_split_at_blank_lines_across_reads():
    m = SSEMessages()
    assert m.feed('data: {"a"') == []
    assert m.feed(': 1}\n\ndata: [DO') == ['data: {"a": 1}']
    assert m.feed("NE]\n\n") == ["data: [DONE]"]
    assert m.feed("data: x") == [] and m.rest() == ["data: x"]


def test_the_seed_flags_parse_to_vllms_meaning(bench_model):
    """Every flag of the seed parses; a Kimi tokenizer mode is accepted, a foreign one refused."""
    from kimi_pd.bench.cli import _apply_vllm_defaults, _request_settings
    from kimi_pd.cli import build_parser
    argv = [a.replace("$NODE0_IP", "10.0.0.1").replace("$TOKENIZER_PATH", str(bench_model)) for a in seed_argv()[3:]]
    args = build_parser().parse_args(["bench", *argv])
    _apply_vllm_defaults(args)
    request, model_id, tokenizer = _request_settings(args)
    assert (request.url, request.backend, request.model, model_id) == (
        "http://10.0.0.1:8000/v1/chat/completions", CHAT, "kimi-k3", "kimi-k3")
    assert tokenizer == str(bench_model) and request.ignore_eos and request.temperature is None
    assert request.extra_body == () and args.max_concurrency == 4 and args.request_rate == float("inf")
    args.tokenizer_mode = "mistral"
    with pytest.raises(ValueError, match="--tokenizer-mode 'mistral'"):
        _apply_vllm_defaults(args)
