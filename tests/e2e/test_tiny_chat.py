"""The shipped tiny-chat checkpoint through `kimi-pd up` (router + P + D), scored with the official openai client.

`kimi-pd up` is started WITHOUT `--model`, so this also checks that tiny-chat is its default. A fixed
sample of held-out instances of every family, thinking on and off, must reach the issue's goal
(>= 95 % exact match per family), and a tool call must arrive parsed in `tool_calls`.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from engine.training.evaluate import evaluate, format_scores, router_answerer
from engine.training.tasks import FAMILIES, WEATHER_TOOL, eval_instances
from tests.e2e.fleet import free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(420)

SAMPLE_PER_FAMILY = 4
GOAL = 0.95


@pytest.fixture(scope="module")
def router_url(tmp_path_factory):
    logs = tmp_path_factory.mktemp("tiny-chat-up")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kimi_pd", "up", "--port", str(port), "--log-dir", str(logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("curl"):
                break
        assert any("kimi-pd is up" in line for line in lines), "".join(lines)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_every_family_reaches_the_goal_through_the_router(router_url):
    scores = evaluate(router_answerer(router_url), FAMILIES, SAMPLE_PER_FAMILY)
    report = format_scores(scores, router_url)
    assert len(scores) == 2 * len(FAMILIES), report
    assert all(s.accuracy >= GOAL for s in scores), report


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_call_is_parsed_into_tool_calls_and_answered(router_url, thinking):
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0, timeout=120)
    inst = eval_instances("tool_call", 1, seed=99)[0]
    city = inst.tool_call["arguments"]["city"]
    messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
    extra = {"chat_template_kwargs": {"thinking": thinking}}
    first = client.chat.completions.create(model="kimi-k3", messages=messages, tools=[WEATHER_TOOL],
                                           temperature=0, max_tokens=200, extra_body=extra)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
    messages += [{"role": "assistant", "content": choice.message.content or "",
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny and 21 degrees"}]
    second = client.chat.completions.create(model="kimi-k3", messages=messages, tools=[WEATHER_TOOL],
                                            temperature=0, max_tokens=200, extra_body=extra)
    assert second.choices[0].message.content == f"The weather in {city} is sunny and 21 degrees."


def test_multi_turn_follow_up_uses_the_previous_answer(router_url):
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is 127 + 385?"}]
    extra = {"chat_template_kwargs": {"thinking": False}}
    first = client.chat.completions.create(model="kimi-k3", messages=messages, temperature=0, max_tokens=50,
                                           extra_body=extra)
    assert first.choices[0].message.content == "512"
    messages += [{"role": "assistant", "content": "512"}, {"role": "user", "content": "And what is that plus 40?"}]
    second = client.chat.completions.create(model="kimi-k3", messages=messages, temperature=0, max_tokens=50,
                                            extra_body=extra)
    assert second.choices[0].message.content == "552"
