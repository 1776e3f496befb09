"""What the router knows about a stream it relays, so that a decode worker's death costs no answer.

Decode legs are asked for `return_token_ids`: each chunk carries the ids of the tokens whose text it
delivers. `RelayedStream` parses each complete SSE event, records those ids (the tokens the client
has seen), the response id and whether a finish reason passed, and forwards the event as it came
unless the client must see it changed: without the ids unless the client asked for them, under the
first worker's response id, and without the role chunk of a continuation. When the worker dies,
`continuation_body` is the request for another decode worker: the same request plus `kimi_pd_resume`
(delivered tokens and the seeded generator's offset), which that worker prefills (its prefix cache
holds most of the prompt) and continues from - greedy, token for token what the first worker would
have produced.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.openai.ids import is_safe_request_id
from shared.openai.sse import SSE_DONE, SSEEvent, SSEParser


@dataclass
class RelayedStream:
    keep_token_ids: bool                       # the client asked for return_token_ids itself
    token_ids: list[int] = field(default_factory=list)
    response_id: str | None = None
    created: int | None = None
    finished: bool = False                     # a finish_reason was relayed
    done: bool = False                         # [DONE] was relayed
    errors: int = 0                            # in-band error events relayed
    continuation: bool = False                 # the current upstream is a migrated continuation
    untracked: bool = False                    # content was delivered without token ids (a worker that
                                               # ignores return_token_ids): such a stream cannot be resumed
    # vLLM-Ascend's recompute hand-back (router/request/recompute.py): the upstream ended "recomputed"
    # (that end and the rest of its stream are not relayed); what was delivered, to run the rest again
    recomputed: bool = False
    keep_text: bool = False                    # keep `text`/`reasoning` (stock vLLM: what a re-run is told)
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    content_events: int = 0                    # choices that delivered content (tokens, where ids are missing)
    earlier_tokens: int = 0                    # delivered before the current re-run (its usage is corrected)
    reruns: int = 0
    _parser: SSEParser = field(default_factory=SSEParser)

    def restart(self) -> None:
        """A new upstream (a continuation) begins: its bytes start a fresh SSE stream."""
        self._parser, self.continuation = SSEParser(), True

    @property
    def delivered(self) -> int:
        """Tokens the client has (counted by content events where a worker sends no token ids)."""
        return self.content_events if self.untracked else len(self.token_ids)

    def rerun(self) -> None:
        """The request runs again after a recomputed hand-back: a fresh upstream that continues this stream."""
        self.restart()
        self.done = self.recomputed = False
        self.earlier_tokens = self.delivered

    def feed(self, chunk: bytes) -> bytes:
        """The client's bytes for this upstream chunk (complete events only; a partial one waits).

        The common chunk (whole one-line `data:` events) is read without building SSEEvents, and
        forwarded as it came when the relay changes none of its events."""
        datas = self._parser.whole_data(chunk)
        if datas is None:
            return b"".join(self._event(e) for e in self._parser.feed(chunk))
        outs = [self._data_event(d) for d in datas]
        if all(out is None for out in outs):
            return chunk
        return b"".join(b"data: " + d + b"\n\n" if out is None else out for d, out in zip(datas, outs, strict=False))

    def _data_event(self, data: bytes) -> bytes | None:
        """One event's data bytes: the client's bytes for it, or None to forward it unchanged."""
        if data == b"[DONE]":
            self.done = True
            return b"" if self.recomputed else None
        if b'"error"' in data:                         # the cheap test first: one event per token
            event = SSEEvent(data.decode("utf-8", errors="replace"))
            if event.is_error:
                self.errors += 1
                return _frame(event)
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError:                 # not JSON, or not UTF-8: as the line parser frames it
            return _frame(SSEEvent(data.decode("utf-8", errors="replace")))
        if not isinstance(body, dict):
            return None
        changed, role_only = self._track(body)
        if self.recomputed:
            return b""                                 # the hand-back: the re-run goes on where this ended
        if self.continuation and role_only:
            return b""                                 # the client already has the role chunk
        usage = body.get("usage")
        if self.earlier_tokens and isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            usage["completion_tokens"] += self.earlier_tokens      # a re-run's prompt held the delivered tokens
            if isinstance(usage.get("prompt_tokens"), int):
                usage["prompt_tokens"] = max(usage["prompt_tokens"] - self.earlier_tokens, 0)
            changed = True
        if self.response_id is None:
            self.response_id, self.created = body.get("id"), body.get("created")
        elif "id" in body and (body["id"] != self.response_id or body.get("created") != self.created):
            body["id"], body["created"] = self.response_id, self.created
            changed = True
        return b"data: " + orjson.dumps(body) + b"\n\n" if changed else None

    def _event(self, event: SSEEvent) -> bytes:
        """An event the line parser read (any framing): fields and errors pass as they are."""
        if event.is_done:
            self.done = True
            return b"" if self.recomputed else SSE_DONE
        if event.event is not None or event.is_error:
            self.errors += 1
            return _frame(event)
        out = self._data_event(event.data.encode())
        return _frame(event) if out is None else out

    def _track(self, body: dict[str, Any]) -> tuple[bool, bool]:
        """Record the chunk's token ids and finish, strip the ids unless the client asked for them:
        (whether the body changed, whether it is a role-only chunk)."""
        listed = body.get("choices")
        choices: list[Any] = listed if isinstance(listed, list) else []
        role_only = changed = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("stop_reason") == "recomputed":
                self.recomputed = True                 # no token: vLLM-Ascend gives the request back
                continue
            ids = choice.get("token_ids") if self.keep_token_ids else choice.pop("token_ids", None)
            if isinstance(ids, list):
                self.token_ids += [t for t in ids if isinstance(t, int)]
            elif _has_content(choice):
                self.untracked = True
            changed = changed or (not self.keep_token_ids and ids is not None)
            if choice.get("finish_reason"):
                self.finished = True
            delta = choice.get("delta")
            if self.keep_text:
                self._keep_delivered(choice, delta if isinstance(delta, dict) else {})
            role_only = role_only or (isinstance(delta, dict) and "role" in delta and not delta.get("content")
                                      and len(choices) == 1 and not choice.get("finish_reason"))
        return changed, role_only

    def _keep_delivered(self, choice: dict[str, Any], delta: dict[str, Any]) -> None:
        text = choice.get("text") or delta.get("content")
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(text, str) and text:
            self.text.append(text)
        if isinstance(reasoning, str) and reasoning:
            self.reasoning.append(reasoning)
        if _has_content(choice):
            self.content_events += 1

    @property
    def resumable(self) -> bool:
        """Whether another worker can continue exactly where the client is (nothing finished, nothing
        delivered that the router cannot name in tokens)."""
        return not self.finished and not self.untracked

    @property
    def seed_offset(self) -> int:
        """Generator draws a fresh engine must skip to continue a seeded stream: one per delivered token,
        whichever worker sampled it. On one engine token k is sampled with the seed's k-th draw; a P/D
        leg's first token took the prefill worker's first draw, but the worker that continues starts its
        generator from the seed, so it skips that draw too."""
        return len(self.token_ids)


def continuation_body(body: dict[str, Any], stream: RelayedStream) -> dict[str, Any]:
    """The decode-only request that continues `stream` on another worker."""
    out = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "kimi_pd_resume")}
    out.update(stream=True, return_token_ids=True)
    if stream.token_ids:
        resume = {"token_ids": list(stream.token_ids), "seed_offset": stream.seed_offset}
        if is_safe_request_id(stream.response_id):
            resume["response_id"] = stream.response_id
        out["kimi_pd_resume"] = resume
    return out


def _has_content(choice: dict[str, Any]) -> bool:
    given = choice.get("delta")
    delta: dict[str, Any] = given if isinstance(given, dict) else {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def _frame(event: SSEEvent) -> bytes:
    head = f"event: {event.event}\n" if event.event else ""
    return (head + "".join(f"data: {line}\n" for line in event.data.split("\n")) + "\n").encode()
