"""A stand-in for a stock vLLM OpenAI server, for router unit tests that must run without vLLM:
records every call (path, headers, body), answers chat/completions in vLLM's shapes with the
`kv_transfer_params` its test chooses, serves a vLLM-style /metrics page and, optionally, a
Mooncake bootstrap server's `/query`. Runs on 127.0.0.1 on a free port in a thread.

The protocol assertions stay in the tests; what vLLM really does is checked by tests/interop."""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} 640.0
vllm:prefix_cache_queries_created{{engine="0",model_name="m"}} 1.7e+09
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} 320.0
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} 96.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="32",engine="0",num_gpu_blocks="100"}} 1.0
"""



def record_calls(app: FastAPI, calls: list[dict]) -> None:
    """Append every request the app gets (method, path, headers, JSON body) to `calls` before serving it:
    what the fakes' tests read to see what the router sent."""
    @app.middleware("http")
    async def record(request: Request, call_next):
        body = await request.body()
        calls.append({"method": request.method, "path": request.url.path, "headers": dict(request.headers),
                      "body": json.loads(body) if body else None})
        return await call_next(request)

@dataclass
class FakeVllm:
    name: str
    answer_params: Any = None                 # what a prefill (do_remote_decode) answer carries
    running: int = 0
    waiting: int = 0
    usage: float = 0.25
    engine_id: str | None = None              # serve a Mooncake bootstrap /query naming this engine
    calls: list[dict] = field(default_factory=list)
    port: int = 0
    refuse: bool = False                      # answer completions with vLLM's 400 (a client's bad request)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def posts(self) -> list[dict]:
        return [c for c in self.calls if c["method"] == "POST"]

    def app(self) -> FastAPI:
        app = FastAPI()

        record_calls(app, self.calls)

        @app.get("/health")
        async def health():
            return PlainTextResponse("")

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(METRICS.format(running=self.running, waiting=self.waiting, usage=self.usage))

        @app.get("/query")
        async def query():
            if self.engine_id is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return {"0": {"engine_id": self.engine_id, "worker_addr": {"0": {"0": "127.0.0.1:1"}}}}

        async def complete(request: Request, chat: bool):
            body = await request.json()
            if self.refuse:
                return JSONResponse({"error": {"message": "bad", "type": "BadRequestError", "param": None,
                                               "code": 400}}, status_code=400)
            ktp = body.get("kv_transfer_params") or {}
            params = self.answer_params if ktp.get("do_remote_decode") else None
            text = f"{self.name}-says-hi"
            if body.get("stream"):
                def events():
                    delta = {"delta": {"content": text}} if chat else {"text": text}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [{'index': 0, **delta}]})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(events(), media_type="text/event-stream")
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            return {"id": "x", "object": "chat.completion" if chat else "text_completion", "model": body.get("model"),
                    "choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                    "kv_transfer_params": params}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await complete(request, True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await complete(request, False)

        @app.post("/internal/kv/release")
        async def release(request: Request):
            return {"released": True}

        return app


class Servers:
    """Runs FakeVllm apps on free loopback ports; stops them all on exit."""

    def __init__(self, *fakes: FakeVllm) -> None:
        self.fakes, self.servers = fakes, []

    def __enter__(self) -> Servers:
        for fake in self.fakes:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            fake.port = sock.getsockname()[1]
            server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", access_log=False))
            threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
            self.servers.append(server)
        deadline = time.monotonic() + 20
        while not all(s.started for s in self.servers):
            if time.monotonic() > deadline:
                raise TimeoutError("fake vLLM servers did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.should_exit = True
