"""DSpark through the router with P/D: speculating decode == plain offline greedy, token for token;
spec metrics on the decode worker; a bad --speculative-config stops a worker at start-up."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from engine import SamplingParams
from engine.spec_decode.checkpoint import create_draft_checkpoint
from tests.e2e.fleet import Fleet, metric

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 20
PROMPTS = ["The lighthouse keeper walked along the shore", "Once upon a time in a small village"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, e2e_model):
    tmp = tmp_path_factory.mktemp("spec")
    draft = create_draft_checkpoint(e2e_model, tmp / "draft7", block=7, seed=3)
    config = json.dumps({"method": "dspark", "model": str(draft), "num_speculative_tokens": 7})
    with Fleet(tmp, e2e_model) as f:
        flags = ("--speculative-config", config)
        yield f.static_pd(flags, flags)


def test_router_pd_with_speculation_equals_plain_offline(fleet, offline):
    for prompt in PROMPTS:
        body = {"model": "kimi-k3", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        got = httpx.post(fleet.r.url + "/v1/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        assert got.headers["x-kimi-pd-decision"] == "prefill-decode"
        expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert got.json()["choices"][0]["text"] == expected[0].output.text
        assert got.json()["usage"]["completion_tokens"] == MAX_TOKENS
    drafts = metric(fleet.d.url, "kimi_pd_worker_spec_decode_num_drafts_total")
    assert drafts > 0
    assert metric(fleet.d.url, "kimi_pd_worker_spec_decode_num_draft_tokens_total") >= drafts
    assert metric(fleet.d.url, "kimi_pd_worker_spec_decode_acceptance_length_count") == drafts
    assert metric(fleet.d.url, "kimi_pd_worker_spec_decode_verify_seconds_count") > 0
    assert metric(fleet.d.url, "kimi_pd_worker_spec_decode_draft_seconds_count") > 0
    assert metric(fleet.p.url, "kimi_pd_worker_held") == 0
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        ours = metric(fleet.d.url, f"kimi_pd_worker_spec_decode_{name}_total")   # vLLM's names carry the same counts
        assert metric(fleet.d.url, f"vllm:spec_decode_{name}_total", model_name="kimi-k3", engine="0") == ours
    decode_tokens = metric(fleet.d.url, "kimi_pd_worker_generation_tokens_total")
    assert metric(fleet.d.url, "vllm:generation_tokens_total", model_name="kimi-k3") == decode_tokens
    assert metric(fleet.d.url, "vllm:request_success_total", finished_reason="length") == len(PROMPTS)
    assert metric(fleet.d.url, "vllm:external_prefix_cache_hits_total") > 0     # the pulled prefill states


# configs refused when the flags are parsed, before any engine or file is touched
UNPARSABLE = [
    ('{"method": "dspark", "model": "/nowhere", "k": 7}', "unknown field"),
    ('{"method": "medusa", "model": "/nowhere"}', "only 'dspark'"),
    ("{not json", "not valid JSON"),
]


def test_bad_speculative_config_is_a_startup_error(e2e_model):
    """A worker process whose --speculative-config names no draft checkpoint exits 2 and says why (one child
    process: each costs an interpreter and a torch import; the unparsable configs are refused in-process below,
    on the path this process takes first)."""
    config, message = '{"method": "dspark", "model": "/nowhere"}', "no draft config.json"
    cmd = [sys.executable, "-m", "kimi_pd", "decode", "--model", str(e2e_model), "--speculative-config", config]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KIMI_PD_TRANSFER_SECRET": "x" * 32})
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr


@pytest.mark.parametrize("config, message", UNPARSABLE)
def test_unparsable_speculative_config_is_refused_before_the_engine_starts(e2e_model, monkeypatch, config, message):
    """What the worker's start-up does first with its flags (`settings_from_args`, before any engine):
    each bad config is a ValueError naming the fault, which `kimi-pd` turns into exit status 2."""
    from kimi_pd.cli import build_parser
    from worker.cli import settings_from_args
    monkeypatch.setenv("KIMI_PD_TRANSFER_SECRET", "x" * 32)
    args = build_parser().parse_args(["decode", "--model", str(e2e_model), "--speculative-config", config])
    with pytest.raises(ValueError, match=re.escape(message)):
        settings_from_args(args, str(e2e_model))


def test_streamed_speculative_answer_concatenates_to_the_whole(fleet):
    from tests.e2e.test_equivalence import stream_text
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    whole = httpx.post(fleet.r.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    text, events = stream_text(fleet.r.url + "/v1/chat/completions", body)
    assert text == (whole.get("reasoning_content") or "") + (whole.get("content") or "")
    assert events[-1]["choices"][0]["finish_reason"] == "length"


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_router_pd_constrained_requests_speculate_and_equal_offline(fleet, offline):
    """Structured output and bad words / logit bias through P/D with a speculating
    decode worker: the same tokens as offline plain greedy, and the decode worker drafted for them."""
    pytest.importorskip("xgrammar")
    import jsonschema

    from shared.structured_output import StructuredOutput
    drafts_before = metric(fleet.d.url, "kimi_pd_worker_spec_decode_num_drafts_total")
    free = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    banned = free[0].output.token_ids[1]
    schema = StructuredOutput("json", json.dumps(SCHEMA))
    cases = [({"structured_outputs": {"json": SCHEMA}, "max_tokens": 40},
              SamplingParams(temperature=0.0, max_tokens=40, structured_output=schema)),
             ({"logit_bias": {str(banned): -100}, "bad_words": ["the"], "max_tokens": MAX_TOKENS, "ignore_eos": True},
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={banned: -100.0},
                             bad_words=["the"]))]
    for extra, params in cases:
        body = {"model": "kimi-k3", "prompt": PROMPTS[0], "temperature": 0, **extra}
        got = httpx.post(fleet.r.url + "/v1/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        assert got.headers["x-kimi-pd-decision"] == "prefill-decode"
        want = offline.generate(PROMPTS[0], params)[0].output
        assert got.json()["choices"][0]["text"] == want.text
        assert want.token_ids != free[0].output.token_ids
    other = httpx.post(fleet.r.url + "/v1/completions", timeout=60, json={
        "model": "kimi-k3", "prompt": PROMPTS[1], "temperature": 0, "max_tokens": 40,
        "structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(other.json()["choices"][0]["text"]), SCHEMA)       # still valid for its schema
    assert metric(fleet.d.url, "kimi_pd_worker_spec_decode_num_drafts_total") > drafts_before


def test_router_pd_forced_tool_call_speculates_and_equals_offline(fleet, offline):
    pytest.importorskip("xgrammar")
    from shared.openai.convert import shape_chat_message
    from shared.prompt.tool_grammar import forced_tool_call_grammar
    from shared.structured_output import StructuredOutput
    drafts_before = metric(fleet.d.url, "kimi_pd_worker_spec_decode_num_drafts_total")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": "kimi-k3", "messages": messages, "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": 120, "temperature": 0}
    got = httpx.post(fleet.r.url + "/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    grammar = forced_tool_call_grammar([WEATHER], thinking=True)
    params = SamplingParams(temperature=0.0, max_tokens=120, skip_special_tokens=False,
                            structured_output=StructuredOutput("xtml", grammar))
    text = offline.chat(messages, params, tools=[WEATHER])[0].output.text
    expected = shape_chat_message(text, thinking=True, tools_requested=True).tool_calls
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [(c.function.name, json.loads(c.function.arguments)) for c in expected]
    assert metric(fleet.d.url, "kimi_pd_worker_spec_decode_num_drafts_total") > drafts_before
