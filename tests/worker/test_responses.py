"""Worker response shaping of vLLM's per-request output options, in process: `parallel_tool_calls: false`
keeps the first call only (whole and streamed, as vLLM filters them), `return_prompt_text` and
`return_tokens_as_token_ids` as vLLM 0.32 shapes them."""
from __future__ import annotations

import asyncio
import json

from engine.core.outputs import CompletionOutput, RequestOutput
from shared.openai.requests import ChatCompletionRequest
from shared.prompt.prepare import PreparedPrompt
from shared.prompt.tokenizer import KimiTokenizer
from worker import responses
from worker.role import LegResult

TOK = KimiTokenizer.generated()
CALLS = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
         '<|open|>call tool="a" index="1"<|sep|><|close|>call<|sep|><|open|>call tool="b" index="2"<|sep|>'
         '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "ab"]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                                 **fields})


def _output(text: str, ids: list[int]) -> RequestOutput:
    out = CompletionOutput(0, text, ids, [-0.5] * len(ids), [None] * len(ids), "stop", None)
    return RequestOutput("r", [1, 2, 3], [out], True, new_text=text, new_token_ids=ids)


def _names(calls) -> list[str]:
    return [c.function.name for c in calls or []]


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed():
    prepared = PreparedPrompt([1, 2, 3], thinking=True, tools_requested=True)
    ids = TOK.encode_prompt(CALLS)
    for flag, want in ((None, ["a", "b"]), (True, ["a", "b"]), (False, ["a"])):
        req = _request(**({} if flag is None else {"parallel_tool_calls": flag}))
        whole = responses.chat_completion(req, "m", prepared, _output(CALLS, ids), LegResult("r"), TOK)
        assert _names(whole.choices[0].message.tool_calls) == want

        async def outputs():
            yield _output(CALLS, ids)

        chunks = asyncio.run(_collect(responses.chat_stream(req, "m", prepared, outputs(), LegResult("r"), TOK)))
        streamed = [c["function"]["name"] for e in chunks for ch in e["choices"]
                    for c in ch["delta"].get("tool_calls") or []]
        assert streamed == want


def test_prompt_text_and_tokens_as_token_ids():
    prepared = PreparedPrompt(TOK.encode_prompt("<|open|>message<|sep|>hi"), thinking=False)
    ids = TOK.encode("ok")
    req = _request(logprobs=True, return_prompt_text=True, return_tokens_as_token_ids=True, tools=None)
    whole = responses.chat_completion(req, "m", prepared, _output("ok", ids), LegResult("r"), TOK)
    body = whole.model_dump(mode="json", exclude_none=True)
    assert body["prompt_text"] == "<|open|>message<|sep|>hi"
    assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]
    plain = responses.chat_completion(_request(logprobs=True, tools=None), "m", prepared, _output("ok", ids),
                                      LegResult("r"), TOK).model_dump(mode="json", exclude_none=True)
    assert "prompt_text" not in plain and plain["choices"][0]["logprobs"]["content"][0]["token"] == TOK.decode(ids[:1])


async def _collect(stream) -> list[dict]:
    return [json.loads(chunk[6:]) async for chunk in stream if chunk.startswith(b"data: {")]
