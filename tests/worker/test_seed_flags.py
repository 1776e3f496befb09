"""The seed's DP4/TP16/EP64 command lines (deploy/ascend/seed.sh, the one copy), as written, through
`kimi-pd serve`'s real parser: every flag is accepted and does what docs/deployment.md says, the ones
without an effect here log one line each, an unknown flag is still an error."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import subprocess
from pathlib import Path

import pytest

from engine.core.inputs import checked_max_model_len
from engine.parallel.dp_config import DPLayout
from engine.presets import shipped_checkpoint
from engine.spec_decode.config import SpecConfigError, SpeculativeConfig
from kimi_pd.cli import build_parser
from worker.cli import checked_settings
from worker.flags import AUTO_TOOL_CHOICE_ERROR, SEED_FLAGS, resolve_model

ROOT = Path(__file__).resolve().parents[2]
SEED_SCRIPT = ROOT / "deploy" / "ascend" / "seed.sh"
TINY_CHAT = shipped_checkpoint("tiny-chat")


@pytest.fixture(scope="module")
def w4a8_dir(tmp_path_factory) -> Path:
    """A ModelSlim checkpoint, what `--quantization ascend` expects (the shipped tiny-chat, quantized)."""
    from engine.checkpoint.quantize import quantize_checkpoint
    return Path(quantize_checkpoint(TINY_CHAT, tmp_path_factory.mktemp("seed") / "w4a8", progress=False))


def seed_argv(node: int, model: Path) -> list[str]:
    """The seed's line for `node`, as deploy/ascend/seed.sh writes it, run on kimi-pd instead of vLLM."""
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "SERVER": "kimi-pd serve", "MODEL_PATH": str(model),
           "DSPARK_DRAFT_PATH": "tiny-chat-dspark", "LOCAL_IP": "127.0.0.1", "NIC_NAME": "lo",
           "DP_MASTER_IP": "127.0.0.1", "NODE_RANK": str(node)}
    proc = subprocess.run(["bash", str(SEED_SCRIPT)], env=env, capture_output=True, timeout=30, check=True)
    return proc.stdout.decode().split("\0")[:-1]


def parse(argv: list[str]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"kimi-pd refuses {argv}: {err.getvalue()}") from exc


def test_the_seed_lines_are_the_issue_s_22_flags_and_the_table_covers_them(w4a8_dir):
    node0, node1 = seed_argv(0, w4a8_dir), seed_argv(1, w4a8_dir)
    assert node0[:3] == ["kimi-pd", "serve", str(w4a8_dir)]
    flags0 = [a for a in node0 if a.startswith("--")]
    assert len(flags0) == len(set(flags0)) == 22
    assert [a for a in node1 if a.startswith("--")] == [*flags0, "--headless", "--data-parallel-start-rank"]
    assert set(flags0) | {"--headless", "--data-parallel-start-rank"} == set(SEED_FLAGS) - {"MODEL_PATH"}


def test_node0_line_as_written_takes_effect_flag_by_flag(w4a8_dir, caplog):
    args = parse(seed_argv(0, w4a8_dir)[1:])
    assert args.command == "serve" and resolve_model(args) == str(w4a8_dir)
    with caplog.at_level(logging.WARNING, logger="worker.cli"):
        settings = checked_settings(args, resolve_model(args))
    engine = settings.engine
    assert (settings.host, settings.port, settings.served_model_name) == ("0.0.0.0", 8000, "kimi-k3")
    assert engine.model == engine.tokenizer == str(w4a8_dir)
    assert (engine.tensor_parallel_size, engine.enable_expert_parallel) == (16, True)
    assert (engine.data_parallel_size, engine.data_parallel_size_local, engine.data_parallel_start_rank,
            engine.data_parallel_address, engine.data_parallel_rpc_port) == (4, 1, 0, "127.0.0.1", 13389)
    assert (engine.max_model_len, engine.max_num_batched_tokens, engine.max_num_seqs) == (133120, 8192, 16)
    assert engine.enable_prefix_caching and settings.enable_auto_tool_choice
    assert (args.tokenizer_mode, args.reasoning_parser, args.tool_call_parser) == ("kimi_k3",) * 3
    spec = SpeculativeConfig.parse(engine.speculative_config)
    assert spec is not None and (spec.method, spec.num_speculative_tokens, spec.draft_tensor_parallel_size,
                                 spec.enforce_eager) == ("dspark", 7, 16, True)
    spec.check_draft_tp(16)                                      # the seed's draft TP = its target TP
    assert DPLayout.of(engine).size == 4                         # DP 4 with --speculative-config: accepted
    with pytest.raises(SpecConfigError, match="cannot be other than 1 or the target's"):
        spec.check_draft_tp(8)
    lines = [r.getMessage() for r in caplog.records]
    for flag in ("--quantization ascend", "--safetensors-load-strategy prefetch", "--gpu-memory-utilization 0.9"):
        assert sum(line.startswith(flag + ":") for line in lines) == 1, (flag, lines)
    # the checkpoint here has 4096 positions: the seed's 133120 is refused at start-up, in vLLM's words
    with pytest.raises(ValueError, match=r"User-specified max_model_len \(133120\) is greater than the derived "
                                         r"max_model_len \(max_position_embeddings=4096"):
        checked_max_model_len(engine.max_model_len, 4096)
    assert checked_max_model_len(None, 4096) == 4096 and checked_max_model_len(2048, 4096) == 2048


def test_headless_node_lines_parse_with_their_rank(w4a8_dir):
    for node in (1, 2, 3):
        args = parse(seed_argv(node, w4a8_dir)[1:])
        assert args.headless and resolve_model(args) == str(w4a8_dir)
        engine = checked_settings(args, resolve_model(args)).engine
        assert (engine.data_parallel_size, engine.data_parallel_size_local, engine.data_parallel_start_rank) == (
            4, 1, node)
        assert DPLayout.of(engine).local_ranks() == list(
            range(16 * node, 16 * node + 16))                    # its 16 TP ranks of DP rank `node`


def test_unknown_flags_and_wrong_values_stay_errors(w4a8_dir):
    argv = seed_argv(0, w4a8_dir)[1:]
    for extra in (["--no-such-flag"], ["--quantization", "fp8"], ["--safetensors-load-strategy", "mmap"],
                  ["--gpu-memory-utilization", "1.5"]):
        with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
            build_parser().parse_args(argv + extra)


def test_quantization_ascend_needs_a_modelslim_checkpoint_and_model_path_must_agree(w4a8_dir):
    args = parse(["serve", str(TINY_CHAT), "--quantization", "ascend"])
    with pytest.raises(ValueError, match="--quantization ascend needs a ModelSlim checkpoint"):
        checked_settings(args, resolve_model(args))
    with pytest.raises(ValueError, match="name different checkpoints"):
        resolve_model(parse(["serve", str(TINY_CHAT), "--model", str(w4a8_dir)]))
    assert resolve_model(parse(["prefill", "--model", str(TINY_CHAT)])) == str(TINY_CHAT)
    assert resolve_model(parse(["decode", str(TINY_CHAT)])) == str(TINY_CHAT)


def test_auto_tool_choice_defaults_vllm_s_for_serve_and_on_for_the_roles():
    assert parse(["serve", "M"]).enable_auto_tool_choice is False
    assert parse(["serve", "M", "--enable-auto-tool-choice"]).enable_auto_tool_choice is True
    for role in ("prefill", "decode", "worker"):
        assert parse([role, "M"]).enable_auto_tool_choice is True
        assert parse([role, "M", "--no-enable-auto-tool-choice"]).enable_auto_tool_choice is False


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_auto_tool_choice_is_gated_as_in_vllm():
    """`kimi-pd serve` without --enable-auto-tool-choice: tools with "auto" (or no tool_choice) are a 400
    in vLLM's words; "none" and a named tool still serve; with the flag, "auto" serves."""
    from fastapi.testclient import TestClient

    from kimi_pd.roles import COMMANDS
    from worker.app import create_app
    from worker.runtime import WorkerRuntime

    def client(*flags: str) -> TestClient:
        args = parse(["serve", str(TINY_CHAT), "--cache-memory", "8MiB", "--max-num-seqs", "2", *flags])
        return TestClient(create_app(WorkerRuntime.build(checked_settings(args, str(TINY_CHAT)), COMMANDS["worker"])))

    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 2,
            "tools": TOOLS}
    with client() as gated:
        for choice in ({}, {"tool_choice": "auto"}):
            r = gated.post("/v1/chat/completions", json={**body, **choice})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == AUTO_TOOL_CHOICE_ERROR
            assert r.json()["error"]["param"] == "tool_choice"
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("none", named):
            assert gated.post("/v1/chat/completions", json={**body, "tool_choice": choice}).status_code == 200
    with client("--enable-auto-tool-choice") as allowed:
        r = allowed.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
        assert r.status_code == 200, r.text
        assert json.loads(r.text)["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")


def test_tokenizer_flag_is_where_the_engine_reads_its_tokenizer(tmp_path):
    """--tokenizer DIR: the engine's tokenizer comes from DIR (a copy serves; a directory without one fails)."""
    import shutil

    from engine.core.engine import EngineConfig, LLMEngine
    copy = tmp_path / "tok"
    shutil.copytree(TINY_CHAT, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.json.gz"))
    engine = LLMEngine(EngineConfig(model=str(TINY_CHAT), tokenizer=str(copy), cache_memory_bytes=4 << 20))
    assert engine.tokenizer.encode("What is 2 + 3?") == LLMEngine(EngineConfig(
        model=str(TINY_CHAT), cache_memory_bytes=4 << 20)).tokenizer.encode("What is 2 + 3?")
    (tmp_path / "empty").mkdir()
    with pytest.raises((FileNotFoundError, ValueError), match="empty"):
        LLMEngine(EngineConfig(model=str(TINY_CHAT), tokenizer=str(tmp_path / "empty"), cache_memory_bytes=4 << 20))
