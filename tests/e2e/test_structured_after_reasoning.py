"""Structured output through router + P + D on the shipped tiny-chat, thinking on (the default) and
off, with the official `openai` client's `.parse()` and with streams, the decode worker speculating
with DSpark: the answer is the grammar's, the reasoning arrives in `reasoning_content`, and each
answer equals the offline engine's."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from engine import SamplingParams
from shared.structured_output import StructuredOutput
from tests.e2e.fleet import Fleet, offline_llm

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(300)
ASK = [{"role": "user", "content": "What is 347 + 586?"}]
DSPARK = json.dumps({"method": "dspark", "model": "tiny-chat-dspark"})


class Answer(BaseModel):
    answer: int = Field(ge=0, le=9999)       # bounded: the tiny model may write digits forever


@pytest.fixture(scope="module")
def model_dir():
    from engine.presets import shipped_checkpoint
    return shipped_checkpoint("tiny-chat")


@pytest.fixture(scope="module")
def client(tmp_path_factory, model_dir):
    with Fleet(tmp_path_factory.mktemp("after-reasoning"), model_dir) as fleet:
        fleet.static_pd(decode_flags=("--speculative-config", DSPARK))
        yield openai.OpenAI(base_url=fleet.r.url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir):
    return offline_llm(model_dir)


def _offline_answer(offline, spec: StructuredOutput, thinking: bool) -> str:
    params = SamplingParams(temperature=0, max_tokens=100, structured_output=spec, skip_special_tokens=False)
    from shared.openai.convert import shape_chat_message
    text = offline.chat(ASK, params, thinking=thinking)[0].output.text
    return shape_chat_message(text, thinking=thinking, tools_requested=False).content


@pytest.mark.parametrize("thinking", [True, False])
def test_parse_answers_with_thinking_on_and_off(client, offline, thinking):
    extra = {} if thinking else {"reasoning_effort": "none"}
    got = client.beta.chat.completions.parse(model="kimi-k3", messages=ASK, response_format=Answer, max_tokens=100,
                                             temperature=0, **extra)
    message = got.choices[0].message
    assert isinstance(message.parsed, Answer) and got.choices[0].finish_reason == "stop"
    schema = json.dumps(Answer.model_json_schema() | {"additionalProperties": False})
    assert message.content == _offline_answer(offline, StructuredOutput("json", schema, after_reasoning=thinking),
                                              thinking)
    reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
    assert bool(reasoning) == thinking


@pytest.mark.parametrize("stream", [False, True])
def test_every_form_answers_with_thinking_on(client, offline, stream):
    cases = [({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "", after_reasoning=True)),
             ({"extra_body": {"structured_outputs": {"regex": "[0-9]{3}"}}},
              StructuredOutput("regex", "[0-9]{3}", after_reasoning=True)),
             ({"extra_body": {"structured_outputs": {"choice": ["933", "nine"]}}},
              StructuredOutput("choice", json.dumps(["933", "nine"]), after_reasoning=True))]
    for fields, spec in cases:
        kwargs = dict(model="kimi-k3", messages=ASK, max_tokens=100, temperature=0, **fields)
        if stream:
            chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            content, reasoning = message.content, (message.model_extra or {}).get("reasoning_content")
        assert content and content == _offline_answer(offline, spec, True), fields
        assert reasoning
