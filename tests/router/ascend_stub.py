"""A protocol stub of one vLLM-Ascend API server whose engine runs MooncakeConnectorV1 (kv_producer or
kv_consumer), for router tests without an NPU: it reads and writes request and response bodies as
vLLM-Ascend does (vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py, read for this stub),
and records every call (method, path, headers, body).

What it copies from the connector's scheduler side:

- a prefill (`do_remote_decode`) answers `kv_transfer_params` only when it finished LENGTH_CAPPED: a
  first token that is the end token finishes it "stopped" and the answer carries `null` (so a proxy
  that does not set `min_tokens: 1` loses the handoff when `eos_first` is set here); the parameters are
  the connector's: `do_remote_prefill`, `remote_block_ids` (a list per KV cache group),
  `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`, `remote_pcp_size`,
  `remote_dcp_size`, `remote_ptp_size`, `last_token_id`, `remote_multi_nodes_meta_mapping`,
  `num_prompt_blocks`, `remote_block_size`;
- a decode (`do_remote_prefill`) pulls only with `remote_block_ids` and all of `remote_engine_id`,
  `remote_host`, `remote_port`, `remote_request_id`, else it computes the prompt itself (recorded);
- vLLM-Ascend's recompute scheduler: a decode short of KV memory ends the request with
  `finish_reason: "stop"`, `stop_reason: "recomputed"` and no new token (`recomputes` times here, after
  `recompute_after` tokens), and expects the proxy to run it again through a prefill.

Generation is a fixed word sequence continued from where the context ends (a chat's final assistant
message with `continue_final_message`, or a completion prompt ending with the sequence), so a re-run
request answers exactly the rest: equivalence tests compare a recomputed answer with an undisturbed one.
The API server honours `X-data-parallel-rank` as vLLM does (`dp_size` ranks; another rank: 400).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.router.fake_vllm import METRICS, record_calls

WORDS = tuple(f"w{i}" for i in range(7))
TOKEN_BASE = 1000                            # token id of WORDS[i] is TOKEN_BASE + i
PULL_FIELDS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")


def word(i: int) -> str:
    return WORDS[i % len(WORDS)] + " "


def sequence_text(n: int, start: int = 0) -> str:
    return "".join(word(i) for i in range(start, start + n))


def done_in_text(text: str) -> int:
    """How many words of the sequence `text` ends with (the context's answer so far)."""
    for k in range(len(text.split()), 0, -1):
        if text.endswith(sequence_text(k)):
            return k
    return 0


def done_in_ids(ids: list[int]) -> int:
    for k in range(len(ids), 0, -1):
        if ids[-k:] == [TOKEN_BASE + i % len(WORDS) for i in range(k)]:
            return k
    return 0


@dataclass
class AscendRank:
    """One vLLM-Ascend API server: `role` is its kv_role ("kv_producer" prefill, "kv_consumer" decode)."""

    name: str
    role: str
    tokens: int = 8                          # answer length when max_tokens does not cap it
    eos_first: bool = False                  # the first sampled token is the end token (min_tokens bans it)
    recompute_after: int = 2                 # tokens a decode streams before a recomputed end
    recomputes: int = 0                      # how many requests still end "recomputed"
    dp_size: int = 1                         # data-parallel ranks behind this API server
    engine_id: str = ""
    calls: list[dict] = field(default_factory=list)
    issued: list[dict] = field(default_factory=list)      # kv_transfer_params a prefill answered
    pulled: list[dict] = field(default_factory=list)      # kv_transfer_params a decode pulled with
    computed_locally: int = 0                # decode legs that carried no usable parameters
    fail: int = 0                            # the next `fail` completions answer 500 (an engine error)
    cut: int = 0                             # the next `cut` streamed P/D decode legs die after `recompute_after`
    port: int = 0
    _ids: Any = field(default_factory=itertools.count)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def posts(self, path: str | None = None) -> list[dict]:
        return [c for c in self.calls if c["method"] == "POST" and (path is None or c["path"] == path)]

    def app(self) -> FastAPI:
        app = FastAPI()

        record_calls(app, self.calls)

        app.add_api_route("/health", lambda: Response(status_code=200), methods=["GET"])   # vLLM: empty 200
        app.add_api_route("/version", lambda: {"version": "0.32.0+ascend-stub"}, methods=["GET"])
        app.add_api_route("/metrics", lambda: PlainTextResponse(METRICS.format(running=0, waiting=0, usage=0.1)),
                          methods=["GET"])

        async def chat(request: Request) -> Response:
            return await self.serve(request, True)

        async def completions(request: Request) -> Response:
            return await self.serve(request, False)
        app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
        app.add_api_route("/v1/completions", completions, methods=["POST"])
        return app

    # ---- one request ----------------------------------------------------------------------------
    async def serve(self, request: Request, chat: bool) -> Response:
        body = await request.json()
        if self.fail > 0:
            self.fail -= 1
            return JSONResponse({"error": {"message": "EngineCore encountered an issue", "type":
                                           "InternalServerError", "param": None, "code": 500}}, status_code=500)
        rank = request.headers.get("x-data-parallel-rank")
        if rank is not None and not (rank.isdigit() and int(rank) < self.dp_size):
            return JSONResponse({"error": {"message": f"data_parallel_rank {rank} is out of range", "type":
                                           "BadRequestError", "param": None, "code": 400}}, status_code=400)
        ktp = body.get("kv_transfer_params") or {}
        start, prompt_tokens = self._context(body, chat)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or self.tokens
        n, finish, params = min(limit, self.tokens - start), "length", None
        stop_reason: str | None = None
        if ktp.get("do_remote_decode"):
            n, finish, params = self._prefill(body, prompt_tokens, n)
        elif ktp.get("do_remote_prefill"):
            self._decode(ktp)
        if n and self.role == "kv_consumer" and self.recomputes > 0 and n > self.recompute_after:
            self.recomputes -= 1
            n, finish, stop_reason = self.recompute_after, "stop", "recomputed"
        elif start + n >= self.tokens and n < limit:
            finish = "stop"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{next(self._ids)}"
        if body.get("stream") and ktp.get("do_remote_prefill") and self.cut > 0:
            self.cut -= 1
            return StreamingResponse(self._dies(rid, body, chat, start), media_type="text/event-stream")
        if body.get("stream"):
            return StreamingResponse(self._chunks(rid, body, chat, start, n, finish, stop_reason, prompt_tokens),
                                     media_type="text/event-stream")
        text = sequence_text(n, start)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
        choice.update({"message": {"role": "assistant", "content": text, "reasoning_content": None}} if chat
                      else {"text": text})
        if body.get("return_token_ids"):
            choice["token_ids"] = [TOKEN_BASE + (start + i) % len(WORDS) for i in range(n)]
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": 1,
                             "model": body.get("model"), "choices": [choice],
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                       "total_tokens": prompt_tokens + n, "prompt_tokens_details": None},
                             "kv_transfer_params": params})

    def _context(self, body: dict, chat: bool) -> tuple[int, int]:
        """(words of the answer already in the context, prompt tokens)."""
        if chat:
            messages = body.get("messages") or []
            text = " ".join(str(m.get("content") or "") for m in messages)
            last = messages[-1] if messages else {}
            done = done_in_text(str(last.get("content") or "")) if (
                last.get("role") == "assistant" and body.get("continue_final_message")) else 0
            return done, len(text.split())
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return done_in_ids(prompt), len(prompt)
        return done_in_text(str(prompt)), len(str(prompt).split())

    def _prefill(self, body: dict, prompt_tokens: int, n: int) -> tuple[int, str, dict | None]:
        """The producer's one token and `request_finished`'s answer (None unless LENGTH_CAPPED)."""
        if self.eos_first and (body.get("min_tokens") or 0) < 1:
            return 0, "stop", None
        rid = f"{self.name}-req-{next(self._ids)}"
        blocks = -(-prompt_tokens // 128)
        params = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_block_ids": [list(range(10, 10 + blocks))], "remote_engine_id": self.engine_id or self.name,
                  "remote_request_id": rid, "remote_host": "127.0.0.1", "remote_port": 36000,
                  "remote_pcp_size": 1, "remote_dcp_size": 1, "remote_ptp_size": 16, "last_token_id": TOKEN_BASE,
                  "remote_multi_nodes_meta_mapping": {}, "num_prompt_blocks": blocks, "remote_block_size": 128}
        self.issued.append(params)
        return min(n, 1), "length", params

    def _decode(self, ktp: dict) -> None:
        if ktp.get("remote_block_ids") and all(k in ktp for k in PULL_FIELDS):
            self.pulled.append(ktp)
        else:
            self.computed_locally += 1

    async def _chunks(self, rid: str, body: dict, chat: bool, start: int, n: int, finish: str,
                      stop_reason: str | None, prompt_tokens: int):
        def event(choice: dict, **extra: Any) -> bytes:
            obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
                   "model": body.get("model"), "choices": [choice] if choice else [], **extra}
            return f"data: {json.dumps(obj)}\n\n".encode()

        def choice(text: str, i: int | None, end: bool) -> dict:
            c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish if end else None,
                                 "stop_reason": stop_reason if end else None}
            c.update({"delta": {"content": text} if text or not end else {}} if chat else {"text": text})
            if body.get("return_token_ids"):
                c["token_ids"] = [] if i is None else [TOKEN_BASE + i % len(WORDS)]
            return c
        if chat:
            yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        for i in range(start, start + n):
            yield event(choice(word(i), i, False))
        yield event(choice("", None, True))
        if (body.get("stream_options") or {}).get("include_usage"):
            yield event({}, usage={"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                   "total_tokens": prompt_tokens + n})
        yield b"data: [DONE]\n\n"

    async def _dies(self, rid: str, body: dict, chat: bool, start: int):
        """A stream whose rank dies after `recompute_after` tokens: no end, no [DONE], the connection cut."""
        async for chunk in self._chunks(rid, body, chat, start, self.recompute_after, "length", None, 0):
            if b'"finish_reason": "length"' in chunk:
                raise ConnectionResetError("the rank died")
            yield chunk
