"""A streamed completion sends one SSE event per engine step that produced tokens, as vLLM does, even when
the step's text is held back (a split UTF-8 character): clients (vLLM's benchmark among them) time tokens
by events, so riding on the next event would read as a burst."""
from __future__ import annotations

import asyncio
import json

from engine.core.outputs import CompletionOutput, RequestOutput
from shared.openai.requests import CompletionRequest
from worker.responses import completion_stream
from worker.role import LegResult


def _step(new: list[int], so_far: list[int], text: str, finished: bool = False) -> RequestOutput:
    out = CompletionOutput(0, text, list(so_far), [], [], finish_reason="length" if finished else None)
    return RequestOutput("r", [1, 2], [out], finished, new_text=text, new_token_ids=list(new))


def test_every_step_with_tokens_is_its_own_event():
    steps = [_step([7], [7], "a"), _step([8], [7, 8], ""), _step([9], [7, 8, 9], "é"),
             _step([10], [7, 8, 9, 10], "b", finished=True)]

    async def outputs():
        for s in steps:
            yield s

    async def collect() -> list[dict]:
        req = CompletionRequest(model="kimi-k3", prompt="x", stream=True, return_token_ids=True)
        events = [e async for e in completion_stream(req, "kimi-k3", outputs(), LegResult("r"), None)]  # type: ignore[arg-type]
        return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]

    choices = [c["choices"][0] for c in asyncio.run(collect())]
    assert [c["token_ids"] for c in choices] == [[7], [8], [9], [10]]
    assert "".join(c["text"] for c in choices) == "aéb" and choices[1]["text"] == ""
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
