"""Checkpoints' tokenizer files load with `AutoTokenizer.from_pretrained(dir)` in transformers 5.x
(this environment) and 4.x (a cached throwaway venv), encode and decode like `KimiTokenizer`, and
their chat template gives the ids of the server's renderer.

The 4.x venv is made once per machine (`transformers4_venv.py`; `.ci/run` makes it before the suite).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.checkpoint.create import create_checkpoint
from shared.prompt.chat import THINKING_EFFORTS, render_chat
from shared.prompt.hf_files import FAST_TOKENIZER_CLASS, TOKENIZER_JSON_FILE, bpe_merges
from shared.prompt.tokenizer import KimiTokenizer
from tests.shared.prompt.transformers4_venv import ensure_venv

pytestmark = pytest.mark.timeout(600)
PROBE = Path(__file__).with_name("hf_probe.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def transformers4_python() -> Path:
    try:
        return ensure_venv()
    except RuntimeError as exc:          # no package index here: say so (CI has one, so it fails there)
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Written by the checkpoint writer: a generated preset and the shipped trained one."""
    root = tmp_path_factory.mktemp("hf-tokenizers")
    return {"tiny": create_checkpoint("tiny", root / "tiny", progress=False),
            "tiny-chat": create_checkpoint("tiny-chat", root / "tiny-chat", progress=False)}


def _texts() -> list[str]:
    corpus = "\n".join((REPO / p).read_text(encoding="utf-8") for p in
                       ("README.md", "shared/prompt/chat.py", "shared/prompt/data/corpus.txt"))
    rng = random.Random(0)
    fixed = ["Hello world", "  leading spaces\n\n\ttabs  \r\n", "中文测试，你好！", "naïve café — “quotes” 🎉🌦",
             "I'm it's THEY'LL we'Re", "123456789 3.14159 x1000", "a" * 3000, " JSONSchema described in JSON"]
    samples = [corpus[a:a + rng.randint(1, 300)] for a in (rng.randrange(len(corpus)) for _ in range(200))]
    names = KimiTokenizer.generated().special_tokens         # special-token text: see SPECIAL_TEXTS
    return fixed + [t for t in samples if not any(name in t for name in names)]


SPECIAL_TEXTS = ['<|open|>message role="user"<|sep|> typed by a user', "[EOS] and <|reserved_token_8|>"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALLS = {"role": "assistant", "content": "Checking.", "reasoning_content": "need two tools",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {
                 "city": "Paris", "days": 3, "metric": True, "note": None, "extra": {"a": [1, "é"]}}}},
             {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}},
             {"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
# (messages, render_chat options): options double as the template's kwargs.
CHATS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hi there!"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
      {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": " parts"}]}], {}),
    ([{"role": "developer", "content": "dev"}, {"role": "user", "content": "q", "name": "bob"},
      {"role": "assistant", "content": "a", "reasoning_content": "dropped with thinking off"}], {"thinking": False}),
    # results out of call order, one by a NAME:POS alias, the middle call unanswered (index 1 and 3)
    ([{"role": "user", "content": "Weather?"}, CALLS, {"role": "tool", "tool_call_id": "c3", "content": "cold"},
      {"role": "tool", "tool_call_id": "get_weather:0", "content": "sunny"}, {"role": "user", "content": "thanks"}],
     {"tools": [WEATHER]}),
    ([{"role": "user", "content": "Weather?"}, CALLS, {"role": "tool", "content": "a"},
      {"role": "tool", "content": "b"}],
     {"tools": [WEATHER], "thinking_effort": "low"}),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], {"add_generation_prompt": False}),
    *[([{"role": "user", "content": "effort"}], {"thinking_effort": effort}) for effort in THINKING_EFFORTS],
]


def _probe(python: Path, checkpoints: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Each checkpoint as `python`'s transformers sees it (one interpreter start for all)."""
    chats = [{"messages": m, "options": {"add_generation_prompt": True, **o}} for m, o in CHATS]
    chats.append({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
                  "options": {}})
    chats.append({"messages": [{"role": "user", "content": "x"}], "options": {"enable_thinking": False,
                                                                             "add_generation_prompt": True}})
    names = sorted(KimiTokenizer.generated().special_tokens)
    job = {"dirs": [str(d) for d in checkpoints.values()], "texts": _texts(), "special_texts": SPECIAL_TEXTS,
           "chats": chats, "special_names": names}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}      # nothing of this project
    done = subprocess.run([str(python), str(PROBE)], input=json.dumps(job), capture_output=True, text=True,
                          timeout=400, env=env, cwd=next(iter(checkpoints.values())))
    assert done.returncode == 0, done.stderr[-3000:]
    by_dir = json.loads(done.stdout.splitlines()[-1])
    return {name: by_dir[str(d)] for name, d in checkpoints.items()}


@pytest.fixture(scope="module")
def seen_by_5(checkpoints) -> dict[str, dict[str, Any]]:
    pytest.importorskip("transformers", minversion="5")
    return _probe(Path(sys.executable), checkpoints)


@pytest.fixture(scope="module")
def seen_by_4(checkpoints, transformers4_python) -> dict[str, dict[str, Any]]:
    return _probe(transformers4_python, checkpoints)


def _check(result: dict[str, Any], tok: KimiTokenizer, major: str) -> None:
    assert result["version"].split(".")[0] == major
    texts = _texts()
    assert result["encoded"] == [tok.encode(t) for t in texts]
    assert result["decoded"] == texts
    assert result["special_ids"] == tok.special_tokens
    # The engine keeps special-token text typed in a prompt as text; HF does so with split_special_tokens
    # (what its chat template output needs unsplit: the markers are specials there)
    assert result["specials_split"] == [tok.encode(t) for t in SPECIAL_TEXTS]
    assert result["specials_recognised"] == [tok.encode(t, allow_special=True) for t in SPECIAL_TEXTS]
    assert result["eos_bos_pad"] == [tok.eos_id, tok.bos_id, tok.pad_id]
    assert result["len"] == tok.vocab_size
    *chats, image, no_thinking = result["chats"]
    for (messages, options), got in zip(CHATS, chats, strict=True):
        want = render_chat(tok, messages, **{"add_generation_prompt": True, **options}).token_ids
        assert got == want, (options, tok.decode(got), tok.decode(want))
    assert "renders text only" in image["error"]
    assert no_thinking == render_chat(tok, [{"role": "user", "content": "x"}], thinking=False).token_ids


@pytest.mark.parametrize("name", ["tiny", "tiny-chat"])
def test_transformers5_autotokenizer_encodes_and_renders_like_the_engine(checkpoints, seen_by_5, name):
    _check(seen_by_5[name], KimiTokenizer.from_dir(checkpoints[name]), "5")


@pytest.mark.parametrize("name", ["tiny", "tiny-chat"])
def test_transformers4_autotokenizer_encodes_and_renders_like_the_engine(checkpoints, seen_by_4, name):
    assert seen_by_4[name]["class"] == FAST_TOKENIZER_CLASS
    _check(seen_by_4[name], KimiTokenizer.from_dir(checkpoints[name]), "4")


def test_every_checkpoint_writer_emits_the_hf_files(checkpoints, tmp_path):
    from engine.checkpoint.quantize import quantize_checkpoint
    quantized = quantize_checkpoint(checkpoints["tiny"], tmp_path / "w4a8", progress=False)
    for directory in (*checkpoints.values(), quantized):
        config = json.loads((directory / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == FAST_TOKENIZER_CLASS and "<|open|>message" in config["chat_template"]
        spec = json.loads((directory / TOKENIZER_JSON_FILE).read_text())
        assert len(spec["model"]["vocab"]) == KimiTokenizer.from_dir(directory).num_ranks
        assert len(spec["added_tokens"]) == 256


def test_merges_follow_tiktokens_rule():
    """Every two-token split of a token, by that token's rank; a whole-word rank has several."""
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert bpe_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]
