"""The OpenAI surface vLLM users and evaluation harnesses rely on, through the router with P/D,
with the official `openai` client: equal to the offline `LLM` (greedy, and seeded sampling), streamed
and not. Prompt logprobs (echo, prompt_logprobs, max_tokens=0), n / best_of / lists of prompts,
the tokenizer endpoints and the model cards."""
from __future__ import annotations

import math

import httpx
import openai
import pytest

from engine import SamplingParams
from tests.e2e.fleet import metric
from tests.engine.core.helpers import bannable_word

pytestmark = pytest.mark.timeout(300)
TOL = 1e-4
PROMPTS = ["The lighthouse keeper counted the boats", "Rain fell on the quiet town", "A b c d e f g"]


@pytest.fixture(scope="module")
def fleet(pd_fleet):
    # the router may fetch image URLs from loopback (the test's HTTP server); the workers may not, so an
    # image URL answered through P/D proves the router forwarded the image itself
    return pd_fleet


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet.r.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, abs_tol=TOL))


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_equal_offline_prompt_logprobs(fleet, client, offline, stream):
    """lm-eval's loglikelihood request: echo + logprobs=1 + max_tokens=1, a batch of token prompts."""
    prompts = [offline.tokenizer.encode(p) for p in PROMPTS]
    expected = offline.generate(prompts, _greedy(max_tokens=1, logprobs=1, prompt_logprobs=1))
    if stream:
        chunks = list(client.completions.create(model="kimi-k3", prompt=prompts, max_tokens=1, temperature=0,
                                                logprobs=1, echo=True, stream=True))
        by_index: dict[int, list] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                by_index.setdefault(choice.index, []).append(choice)
        texts = {i: "".join(c.text for c in cs) for i, cs in by_index.items()}
        token_logprobs = {i: [lp for c in cs if c.logprobs for lp in c.logprobs.token_logprobs]
                          for i, cs in by_index.items()}
    else:
        got = client.completions.create(model="kimi-k3", prompt=prompts, max_tokens=1, temperature=0,
                                        logprobs=1, echo=True)
        texts = {c.index: c.text for c in got.choices}
        token_logprobs = {c.index: c.logprobs.token_logprobs for c in got.choices}
        for c in sorted(got.choices, key=lambda c: c.index):
            top = c.logprobs.top_logprobs
            assert top[0] is None and all(len(t) in (1, 2) for t in top[1:])
    assert sorted(texts) == [0, 1, 2]
    for i, (ids, out) in enumerate(zip(prompts, expected, strict=False)):
        assert texts[i] == PROMPTS[i] + out.output.text
        want = [None] + [e.logprob for e in out.prompt_logprobs[1:]] + out.output.logprobs
        assert len(token_logprobs[i]) == len(ids) + 1
        assert all(_close(a, b) for a, b in zip(token_logprobs[i], want, strict=False)), (token_logprobs[i], want)


def test_max_tokens_zero_with_echo_scores_the_prompt_only(fleet, offline):
    ids = offline.tokenizer.encode(PROMPTS[0])
    body = {"model": "kimi-k3", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    got = httpx.post(fleet.r.url + "/v1/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.headers["x-kimi-pd-decision"] == "prefill-decode"
    choice = got.json()["choices"][0]
    expected = offline.generate(ids, _greedy(max_tokens=0, prompt_logprobs=0))[0]
    assert choice["text"] == PROMPTS[0] and choice["finish_reason"] == "length"
    assert got.json()["usage"]["completion_tokens"] == 0
    want = [None] + [e.logprob for e in expected.prompt_logprobs[1:]]
    assert all(_close(a, b) for a, b in zip(choice["logprobs"]["token_logprobs"], want, strict=True))
    refused = httpx.post(fleet.r.url + "/v1/completions", json={**body, "echo": False}, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_on_chat_and_completions(fleet, offline, stream):
    messages = [{"role": "user", "content": "Name three colours."}]
    rendered = offline.render(messages, thinking=True)
    expected = offline.generate(rendered, _greedy(max_tokens=3, ignore_eos=True, prompt_logprobs=2))[0]
    body = {"model": "kimi-k3", "messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "prompt_logprobs": 2, "stream": stream}
    if stream:
        with httpx.stream("POST", fleet.r.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            events = [httpx.Response(200, content=line[6:]).json() for line in resp.iter_lines()
                      if line.startswith("data: {")]
        scores = next(e["prompt_logprobs"] for e in events if e.get("prompt_logprobs"))
    else:
        got = httpx.post(fleet.r.url + "/v1/chat/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        scores = got.json()["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(rendered.prompt_token_ids)
    for entry, want, token in zip(scores[1:], expected.prompt_logprobs[1:], rendered.prompt_token_ids[1:],
                                  strict=False):
        assert _close(entry[str(token)]["logprob"], want.logprob) and entry[str(token)]["rank"] == want.rank
        assert {int(k) for k in entry} == {token, *(i for i, _ in want.top)}
    completion = httpx.post(fleet.r.url + "/v1/completions", timeout=60, json={
        "model": "kimi-k3", "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}).json()
    ref = offline.generate(PROMPTS[1], _greedy(max_tokens=2, prompt_logprobs=0))[0]
    pl = completion["choices"][0]["prompt_logprobs"]
    assert [None if e is None else _only(e)[0] for e in pl] == [None] + [e.token_id for e in ref.prompt_logprobs[1:]]


def _only(entry: dict) -> tuple[int, dict]:
    assert len(entry) == 1
    key, value = next(iter(entry.items()))
    return int(key), value


@pytest.mark.parametrize("stream", [False, True])
def test_n_and_prompt_lists_equal_offline(client, offline, stream):
    params = SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=6, ignore_eos=True)
    expected = offline.generate(PROMPTS[:2], params)
    kwargs = dict(model="kimi-k3", prompt=PROMPTS[:2], n=2, temperature=0.9, seed=7, max_tokens=6,
                  extra_body={"ignore_eos": True})
    if stream:
        texts: dict[int, str] = {}
        for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens == 24
    else:
        got = client.completions.create(**kwargs)
        texts = {c.index: c.text for c in got.choices}
        assert got.usage.completion_tokens == 24
    assert texts == {i * 2 + j: expected[i].outputs[j].text for i in range(2) for j in range(2)}
    assert texts[0] != texts[1]                             # the two sequences really sample apart


@pytest.mark.parametrize("stream", [False, True])
def test_n_sequences_prefill_the_prompt_once_through_pd(fleet, client, offline, stream):
    """The router fans n=4 out as four P/D requests; the prefill worker computes the prompt's
    blocks once (the other three wait for that prefill and hit its blocks), and the answers equal
    the offline n=4."""
    prompt = offline.tokenizer.encode("One prompt, four sequences: " * 6)[:41] if not stream else \
        offline.tokenizer.encode("Another prompt for four streamed sequences. " * 5)[:41]
    params = SamplingParams(temperature=0.9, seed=21, n=4, max_tokens=4, ignore_eos=True)
    expected = [o.text for o in offline.generate(prompt, params)[0].outputs]
    before = {m: metric(fleet.p.url, f"kimi_pd_worker_{m}")
              for m in ("prompt_tokens_total", "cached_prompt_tokens_total")}
    kwargs = dict(model="kimi-k3", prompt=prompt, n=4, temperature=0.9, seed=21, max_tokens=4,
                  extra_body={"ignore_eos": True})
    if stream:
        texts: dict[int, str] = {}
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    else:
        texts = {c.index: c.text for c in client.completions.create(**kwargs).choices}
    assert texts == dict(enumerate(expected))
    prompt_tokens = metric(fleet.p.url, "kimi_pd_worker_prompt_tokens_total") - before["prompt_tokens_total"]
    cached = metric(fleet.p.url, "kimi_pd_worker_cached_prompt_tokens_total") - before["cached_prompt_tokens_total"]
    assert prompt_tokens == 4 * len(prompt)
    block = 4                                                 # the fleet's --block-size
    assert cached == 3 * (len(prompt) // block * block), (prompt_tokens, cached)   # 41 tokens: 40 hit, 1 computed


def test_chat_n_and_best_of(client, offline):
    messages = [{"role": "user", "content": "Say something."}]
    expected = offline.chat(messages, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True,
                                                     skip_special_tokens=False))   # chat keeps K3's markers
    got = client.chat.completions.create(model="kimi-k3", messages=messages, n=3, temperature=1.0, seed=3,
                                         max_tokens=5, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [(c.message.reasoning_content or "") + (c.message.content or "") for c in got.choices] == \
        [o.text for o in expected[0].outputs]
    greedy = offline.generate(PROMPTS[2], _greedy(max_tokens=4, ignore_eos=True))[0].output.text
    best = client.completions.create(model="kimi-k3", prompt=PROMPTS[2], best_of=3, n=1, temperature=0,
                                     max_tokens=4, extra_body={"ignore_eos": True})
    assert [c.text for c in best.choices] == [greedy] and best.choices[0].logprobs is None


def test_tokenizer_endpoints_and_model_cards(fleet, offline):
    for url in (fleet.r.url, fleet.d.url):
        tok = httpx.post(url + "/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}).json()
        ids = offline.tokenizer.encode(PROMPTS[0])
        assert tok["tokens"] == ids and tok["count"] == len(ids) and "".join(tok["token_strs"]) == PROMPTS[0]
        messages = [{"role": "user", "content": "hi"}]
        chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
        assert chat["tokens"] == offline.render(messages, thinking=True).prompt_token_ids
        assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPTS[0]}
        info = httpx.get(url + "/tokenizer_info").json()
        assert info["eos_token"] == offline.tokenizer.eos_token and info["model_max_length"] > 0
        assert info["chat_template"] == offline.tokenizer.chat_template         # the checkpoint's Jinja twin
        bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        cards = httpx.get(url + "/v1/models").json()["data"]
        assert cards[0]["max_model_len"] == offline.engine.max_model_len and cards[0]["root"]
        assert httpx.get(url + "/v1/models/kimi-k3").json()["id"] == "kimi-k3"
        assert httpx.get(url + "/v1/models/other").status_code == 404


def test_no_prefill_state_left_held(fleet):
    assert metric(fleet.p.url, "kimi_pd_kv_held_leases") == 0


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": PROMPTS[0]}),
])
def test_continuous_usage_stats_count_tokens_on_every_chunk(fleet, endpoint, body):
    body = {"model": "kimi-k3", **body, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", fleet.r.url + endpoint, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [httpx.Response(200, content=line[6:]).json() for line in resp.iter_lines()
                  if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events if e.get("choices")]
    assert counts == sorted(counts) and counts[-1] == 5 and all(e.get("usage") for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("field, value", [("include_reasoning", False), ("add_generation_prompt", False),
                                          ("thinking_token_budget", 64)])
def test_fields_this_server_cannot_honour_are_refused_by_name(fleet, field, value):
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], field: value}
    resp = httpx.post(fleet.r.url + "/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_allowed_token_ids_bad_words_equal_offline(client, offline, stream):
    ids = offline.tokenizer.encode(PROMPTS[0])
    free = offline.generate(ids, _greedy(max_tokens=6, ignore_eos=True))[0]
    word = bannable_word(offline.tokenizer, free.output.token_ids)
    cases = [({"logit_bias": {str(free.output.token_ids[0]): -100}}, {"logit_bias": {free.output.token_ids[0]: -100}}),
             ({"allowed_token_ids": [5, 17, 300]}, {"allowed_token_ids": [5, 17, 300]}),
             ({"bad_words": [word]}, {"bad_words": [word]})]
    for body_fields, params in cases:
        expected = offline.generate(ids, _greedy(max_tokens=6, ignore_eos=True, **params))[0].output.text
        logit_bias = body_fields.pop("logit_bias", None)
        kwargs = dict(model="kimi-k3", prompt=PROMPTS[0], max_tokens=6, temperature=0, logit_bias=logit_bias,
                      extra_body={"ignore_eos": True, **body_fields})
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        assert text == expected, body_fields or logit_bias
        assert text != free.output.text


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_equals_offline_and_validates(client, offline, stream):
    pytest.importorskip("xgrammar")
    import json

    import jsonschema

    from shared.structured_output import StructuredOutput
    messages = [{"role": "user", "content": "Give me JSON."}]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
         StructuredOutput("json", json.dumps(SCHEMA))),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "")),
        ({"extra_body": {"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}},
         StructuredOutput("regex", "[a-c]{3}-[0-9]{2}")),
        ({"extra_body": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}},
         StructuredOutput("choice", json.dumps(["yes", "no", "maybe"]))),
    ]
    for fields, spec in cases:
        params = SamplingParams(temperature=0, max_tokens=40, structured_output=spec, skip_special_tokens=False)
        expected = offline.chat(messages, params, thinking=False)[0].output.text
        kwargs = dict(model="kimi-k3", messages=messages, max_tokens=40, temperature=0, reasoning_effort="none",
                      **fields)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                stream=True, **kwargs) if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        assert text == expected, fields
        if spec.kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
    got = client.completions.create(model="kimi-k3", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                    extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(got.choices[0].text), SCHEMA)
    assert got.choices[0].finish_reason == "stop"


def test_bad_structured_outputs_are_400s(fleet):
    for extra in ({"structured_outputs": {"regex": "([a-"}}, {"structured_outputs": {"regex": "a", "choice": ["b"]}},
                  {"response_format": {"type": "xml"}}):
        resp = httpx.post(fleet.r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, **extra}, timeout=20)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"].split(".")[0] in ("structured_outputs", "response_format")


def test_a_grammar_over_the_workers_budget_is_a_400_and_harms_nothing(fleet, client):
    """A 100 KB regex (the default limit is 64 KiB): refused by name before any engine compiles it."""
    huge = "(" + "|".join(f"word{i}" for i in range(12_000)) + ")"
    resp = httpx.post(fleet.r.url + "/v1/completions", timeout=20,
                      json={"prompt": "x", "max_tokens": 3, "structured_outputs": {"regex": huge}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "structured_outputs" and "over this server's limit of 65536 bytes" in error["message"]
    done = client.completions.create(model="kimi-k3", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert done.choices[0].finish_reason == "length"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
_FORCED_OFFLINE: dict[tuple[str, float, str | None], str] = {}     # the offline text, shared by both stream forms


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_always_parse_and_equal_offline(client, offline, stream):
    pytest.importorskip("xgrammar")
    import json

    from shared.openai.convert import shape_chat_message
    from shared.prompt.tool_grammar import forced_tool_call_grammar
    from shared.structured_output import StructuredOutput
    tools = [WEATHER, CLOCK]
    asks = ["What is the weather in Paris?", "Time please.", "Hello!"]
    for ask, choice, temperature in [(asks[0], "required", 0.0), (asks[1], "required", 1.0),
                                     (asks[2], {"type": "function", "function": {"name": "get_weather"}}, 0.0)]:
        messages = [{"role": "user", "content": ask}]
        name = None if choice == "required" else choice["function"]["name"]
        grammar = forced_tool_call_grammar(tools, thinking=True, name=name)
        params = SamplingParams(temperature=temperature, seed=11, max_tokens=120, skip_special_tokens=False,
                                structured_output=StructuredOutput("xtml", grammar))
        key = (ask, temperature, name)
        if key not in _FORCED_OFFLINE:
            _FORCED_OFFLINE[key] = offline.chat(messages, params, tools=tools)[0].output.text
        expected = shape_chat_message(_FORCED_OFFLINE[key], thinking=True, tools_requested=True).tool_calls
        kwargs = dict(model="kimi-k3", messages=messages, tools=tools, tool_choice=choice, max_tokens=120,
                      temperature=temperature, seed=11)
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    for d in c.delta.tool_calls or []:
                        call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                        call["name"] += (d.function.name or "") if d.function else ""
                        call["arguments"] += (d.function.arguments or "") if d.function else ""
            got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
        else:
            message = client.chat.completions.create(**kwargs).choices[0]
            finish = message.finish_reason
            got = [(c.function.name, json.loads(c.function.arguments)) for c in message.message.tool_calls]
        assert got and finish == "tool_calls"
        assert got == [(c.function.name, json.loads(c.function.arguments)) for c in expected]
        if name:
            assert {n for n, _ in got} == {name}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("effort", ["none", "max"])                 # content (thinking off) and reasoning
def test_chat_skip_special_tokens_default_strips_them_and_false_keeps_them(client, offline, stream, effort):
    """vLLM strips special tokens from chat text by default. The tiny random model emits many (its
    reserved tokens), so the stripped and the kept answers differ, each equal to the offline one."""
    from shared.openai.convert import shape_chat_message
    from shared.openai.shaping import SpecialTokenStrip
    messages = [{"role": "user", "content": "Say something."}]
    thinking = effort != "none"
    text = offline.chat(messages, _greedy(max_tokens=16, ignore_eos=True, skip_special_tokens=False),
                        thinking=thinking)[0].output.text
    strip = SpecialTokenStrip(offline.tokenizer.special_tokens)
    answers = {}
    for skip in (None, True, False):        # None: the field unset (vLLM's default, true)
        extra = {"ignore_eos": True, "reasoning_effort": effort,
                 **({} if skip is None else {"skip_special_tokens": skip})}
        kwargs = dict(model="kimi-k3", messages=messages, max_tokens=16, temperature=0, extra_body=extra)
        if stream:
            deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            got = ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                   "".join(d.content or "" for d in deltas))
        else:
            m = client.chat.completions.create(**kwargs).choices[0].message
            got = (getattr(m, "reasoning_content", None) or "", m.content or "")
        want = shape_chat_message(text, thinking=thinking, tools_requested=False,
                                  strip=strip if skip is not False else None)
        assert got == (want.reasoning_content or "", want.content or ""), skip
        answers[skip] = got
    assert answers[None] == answers[True] != answers[False]
    names = offline.tokenizer.special_tokens
    assert any(name in "".join(answers[False]) for name in names)
    assert not any(name in "".join(answers[True]) for name in names)


def test_cache_salt_isolates_prefix_hits_through_the_router(fleet):
    prompt = "A long shared system prompt that several tenants send " * 4

    def cached(salt):
        body = {"model": "kimi-k3", "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
        resp = httpx.post(fleet.r.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("t1") == 0
    assert cached("t2") == 0
    assert cached("t1") > 0


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_032_output_fields_are_honoured_through_pd(fleet, offline, stream):
    """return_tokens_as_token_ids, return_prompt_text and repetition_detection, as vLLM 0.32 answers them."""
    messages = [{"role": "user", "content": "Hello there"}]          # greedy: one token twice, at 26 and 27
    detect = {"max_pattern_size": 1, "min_count": 2}
    expected = offline.chat(messages, _greedy(max_tokens=60, ignore_eos=True, skip_special_tokens=False,
                                              repetition_detection=(1, 0, 2)), thinking=True)[0].output
    assert expected.finish_reason == "repetition" and len(expected.token_ids) < 60    # the rule fires here
    body = {"model": "kimi-k3", "messages": messages, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "return_prompt_text": True, "repetition_detection": detect, "stream": stream}
    if stream:
        with httpx.stream("POST", fleet.r.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            events = [httpx.Response(200, content=line[6:]).json() for line in resp.iter_lines()
                      if line.startswith("data: {")]
        prompt_texts = [e["prompt_text"] for e in events if e.get("prompt_text")]
        choices = [c for e in events for c in e["choices"]]
        ids = [t for c in choices for t in c.get("token_ids") or []]
        tokens = [e["token"] for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
        finish = [c for c in choices if c.get("finish_reason")][-1]
    else:
        got = httpx.post(fleet.r.url + "/v1/chat/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        prompt_texts, finish = [got.json()["prompt_text"]], got.json()["choices"][0]
        ids, tokens = finish["token_ids"], [e["token"] for e in finish["logprobs"]["content"]]
    assert prompt_texts == [offline.tokenizer.decode(offline.render(messages, thinking=True).prompt_token_ids)]
    assert ids == expected.token_ids and tokens == [f"token_id:{i}" for i in ids]
    assert (finish["finish_reason"], finish["stop_reason"]) == ("repetition", "repetition_detected")


def test_an_image_url_answers_as_its_data_url_through_pd(fleet):
    """The router fetches an http image once and forwards it inlined: the answer equals the same
    image sent as a data: URL; the decode worker, which may not fetch from loopback, refuses the URL."""
    import base64
    import io
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import numpy as np
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buffer, "PNG")
    png = buffer.getvalue()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:          # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        def ask(url: str, target: str = fleet.r.url) -> httpx.Response:
            parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]
            return httpx.post(target + "/v1/chat/completions", timeout=60, json={
                "model": "kimi-k3", "messages": [{"role": "user", "content": parts}], "max_tokens": 8,
                "temperature": 0, "return_token_ids": True})
        by_url = ask(f"http://127.0.0.1:{httpd.server_port}/cat.png")
        by_data = ask("data:image/png;base64," + base64.b64encode(png).decode())
        assert by_url.status_code == by_data.status_code == 200, by_url.text
        assert by_url.json()["choices"][0]["token_ids"] == by_data.json()["choices"][0]["token_ids"]
        assert by_url.json()["usage"]["prompt_tokens"] == by_data.json()["usage"]["prompt_tokens"]
        direct = ask(f"http://127.0.0.1:{httpd.server_port}/cat.png", fleet.d.url)
        assert direct.status_code == 400 and "not a public address" in direct.json()["error"]["message"]
    finally:
        httpd.shutdown()
