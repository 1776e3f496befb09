"""Our router cut short after one stage of its request path: what each stage costs per request.

Run by benchmarks/router_overhead.py (`--stages`) as `python -m benchmarks.router_stages --stage S
<kimi_pd args>`: the same `kimi-pd router` and flags as the whole router, whose chat route answers a
fixed completion at the end of stage S instead of going on. The stages, in request order:

- `front`: the HTTP server takes the request and reads its body; nothing else runs;
- `validated`: + the API key check, strict JSON parse and the request's pydantic validation;
- `prepared`: + the model and sampling checks, chat rendering and tokenising (the cut is an exception
  the app answers, which costs a few µs more than a return);
- `admitted`: + the trace and admission;
- `placed`: + placement (prefix hashes, the index, filters, scorers, the ledger), the P/D decision
  and, in prefill-decode mode, the prefill leg and its lease;
- the whole router (router_overhead's `router` target): + the decode leg, its relay and the answer.

Why: issue 30 asks the router to match sglang-router's CPU per request on two cores; the whole
router's figure alone does not say which stages a faster router must change. Measured in the same
run, one stage's CPU minus the one before is what that stage costs, and any single stage (or the
front alone) above sglang-router's whole figure rules out matching it by trimming the others.

The cut is made by replacing one function at a stage boundary (below). The router's `--workers N`
processes are spawned interpreters that import this module again as `__mp_main__`, so the cut is
applied at import, from `KIMI_PD_BENCH_STAGE`, in every process. Benchmarks only: never for serving.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

STAGES = ("front", "validated", "prepared", "admitted", "placed")
STAGE_ENV = "KIMI_PD_BENCH_STAGE"
# a non-streamed answer the size of the stub worker's (16 tokens), so writing it costs what writing that does
ANSWER = (b'{"id":"chatcmpl-stage","object":"chat.completion","created":0,"model":"kimi-k3","choices":[{"index":0,'
          b'"message":{"role":"assistant","content":"tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok"},'
          b'"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":686,"completion_tokens":16,'
          b'"total_tokens":702}}')


class StageEnd(Exception):
    """Raised where the `prepared` stage ends (no function ends there to replace); the app answers it."""


def answer() -> Any:
    from starlette.responses import Response
    return Response(ANSWER, media_type="application/json")


def legs_served(stage: str, mode: str) -> tuple[tuple[str, str], ...]:
    """The (stub, leg kind) legs a request cut after `stage` still makes: only `placed` in
    prefill-decode mode sends one (its prefill leg)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
    return (("prefill", "prefill"),) if stage == "placed" and mode == "prefill-decode" else ()


def cut(stage: str) -> None:
    """Make this process's router answer `ANSWER` at the end of `stage` (before its app is built)."""
    import router.app as app
    from router.orchestrator import Orchestrator

    async def front(request: Any) -> Any:
        await app.read_body(request, request.app.state.settings.max_request_bytes)
        return answer()

    async def validated(request: Any, req: Any, one: Callable[[Any], Any]) -> Any:
        return answer()

    def trace_after_prepare(*args: Any, **kwargs: Any) -> Any:
        raise StageEnd

    build_app = app.create_app

    def answering_app(*args: Any, **kwargs: Any) -> Any:
        built = build_app(*args, **kwargs)

        async def answered(request: Any, exc: Exception) -> Any:
            return answer()
        built.add_exception_handler(StageEnd, answered)
        return built

    async def admitted(self: Orchestrator, trace: Any, req: Any, prepared: Any) -> Any:
        return answer()

    async def placed(self: Orchestrator, trace: Any, req: Any, decode: Any, route: Any) -> Any:
        return answer()

    if stage == "front":
        app._chat = app._completions = front
    elif stage == "validated":
        app._one_or_fanned_out = validated
    elif stage == "prepared":
        # the request's Trace is built right after its prompt is prepared
        app.Trace = trace_after_prepare                         # type: ignore[misc,assignment]
        app.create_app = answering_app
    elif stage == "admitted":
        Orchestrator.handle = admitted                          # type: ignore[method-assign]
    elif stage == "placed":
        Orchestrator._call_decode = placed                      # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--stage":
        print(f"usage: python -m benchmarks.router_stages --stage {{{','.join(STAGES)}}} <kimi_pd args>",
              file=sys.stderr)
        return 2
    stage = argv[1]
    os.environ[STAGE_ENV] = stage                 # the router's spawned processes read it when they import us
    cut(stage)
    from kimi_pd.cli import main as kimi_pd
    return kimi_pd(argv[2:])


if os.environ.get(STAGE_ENV) and __name__ == "__mp_main__":      # a spawned router process
    cut(os.environ[STAGE_ENV])

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
