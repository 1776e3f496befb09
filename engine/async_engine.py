"""AsyncEngine: the LLMEngine on its own thread, for asyncio services.

All engine state is touched by one thread only. Callers submit commands (add, abort, export,
release) that the engine thread runs between steps; outputs flow back to per-request asyncio
queues. A consumer that stops iterating (client gone, task cancelled) aborts its request, so no
request keeps running or holding cache for nobody. If a step raises, the engine is marked dead and
every open stream ends with EngineDead instead of hanging.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.inputs import EngineInput
from engine.core.outputs import RequestOutput
from engine.core.state_export import ExportedState
from engine.structured_output import GrammarBudget
from shared.errors import EngineDead, InvalidRequest
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput

log = logging.getLogger(__name__)
_DONE = object()
IDLE_POLL_S = 0.05          # how long the engine thread waits for a command when it has nothing to run


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 grammar_budget: GrammarBudget | None = None) -> None:
        if engine is None:
            if config is None:
                raise ValueError("AsyncEngine needs an EngineConfig or an LLMEngine")
            engine = LLMEngine(config)
        self.engine = engine
        self.grammar_budget = grammar_budget or GrammarBudget()
        # one compile at a time, beside the engine thread: a costly grammar delays other grammars, not steps
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._shutting_down = False               # shutdown() was called: a death that is no failure
        self._dead: BaseException | None = None
        self._stalled = False
        self._busy_since: float | None = None              # monotonic start of the command or step now running
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: EngineInput | list[int], params: SamplingParams,
                       export_state: bool = False,
                       imported: ExportedState | None = None,
                       group: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Yield this request's outputs as steps produce them; the last one has `finished=True`."""
        if params.structured_output is not None:
            await self.prepare_grammar(params.structured_output)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        try:
            await self.call(lambda: self.engine.add_request(request_id, prompt, params, export_state, imported, group))
        except BaseException as exc:
            self._streams.pop(request_id, None)
            if isinstance(exc, asyncio.CancelledError):
                self.abort_nowait(request_id)       # the add may still run on the engine thread: undo it
            raise
        finished = False
        try:
            while True:
                item = await outputs.get()
                if item is _DONE:
                    raise EngineDead(f"engine stopped: {self._dead!r}" if self._dead else "engine stopped")
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort_nowait(request_id)

    async def prepare_grammar(self, spec: StructuredOutput) -> None:
        """Compile `spec` into the engine's grammar cache off the engine thread, within the budget: a spec
        over the size limit, or not compiled in time, is an InvalidRequest (400). A compile that had started
        when time ran out runs on and is cached, so the same spec sent again is served."""
        self.grammar_budget.check_size(spec)
        grammars = self.engine.grammars
        if grammars.is_cached(spec):
            return
        future = self._grammar_pool.submit(grammars.compiled, spec)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), self.grammar_budget.compile_timeout_s)
        except TimeoutError:
            raise InvalidRequest(f"structured_outputs: the {spec.kind} did not compile within "
                                 f"{self.grammar_budget.compile_timeout_s:g} s (this server's limit); "
                                 "simplify it", param="structured_outputs") from None

    async def abort(self, request_id: str) -> None:
        await self.call(lambda: self.engine.abort(request_id))

    def abort_nowait(self, request_id: str) -> None:
        """Abort from any context (e.g. a generator being closed); runs on the engine thread."""
        if self._dead is None:
            self._commands.put((lambda: self.engine.abort(request_id), concurrent.futures.Future()))

    async def export_state(self, request_id: str) -> ExportedState:
        return await self.call(lambda: self.engine.export_state(request_id))

    async def release_export(self, request_id: str, reason: str = "released") -> bool:
        return await self.call(lambda: self.engine.release_export(request_id, reason))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps; its exception is raised here."""
        if self._dead is not None or self._stop.is_set():
            raise EngineDead()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    def stats(self) -> dict[str, Any]:
        """A racy but safe snapshot for health and load reports (reads only counters: never waits on the
        engine thread, so a stuck engine still reports, with `busy_s` saying for how long)."""
        e = self.engine
        return {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting), "held": len(e.held),
                "cache_usage": e.cache.usage, "capacity_tokens": e.capacity_tokens,
                "preemptions": e.scheduler.num_preemptions, "dead": self._dead is not None,
                "busy_s": self.busy_s()}

    def busy_s(self) -> float:
        """How long the engine thread has been inside its current command or step (0 when it waits)."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def mark_dead(self, exc: BaseException) -> None:
        """Fail the engine from outside (e.g. one of its ranks exited): streams end, calls raise EngineDead."""
        if self._dead is None:
            self._die(exc)
            self._stop.set()
            self._commands.put((lambda: None, concurrent.futures.Future()))

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def failed(self) -> bool:
        """Dead, and not because it was shut down: a step raised or `mark_dead` was called."""
        return self._dead is not None and not self._shutting_down

    def shutdown(self, timeout: float = 10.0) -> None:
        self._shutting_down = True
        self._stop.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        self._thread.join(timeout)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.engine.close()

    # ---- engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._iteration()
        except BaseException as exc:                           # noqa: BLE001 - the engine must not hang streams
            log.exception("engine thread failed; failing every open request")
            self._die(exc)
            return
        self._die(None)

    def _iteration(self) -> None:
        """Commands, then one step. Blocks (no busy-spin) while nothing can be scheduled."""
        self._run_commands(block=not self.engine.has_unfinished() or self._stalled)
        self.engine.expire_leases()
        if self._stop.is_set() or not self.engine.has_unfinished():
            return
        self._busy_since = time.monotonic()
        try:
            outputs = self.engine.step()
        finally:
            self._busy_since = None
        # waiting work that cannot be admitted (held states, full cache): wait for a command or a lease
        self._stalled = not outputs and not self.engine.scheduler.running
        for out in outputs:
            self._publish(out.request_id, out)

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_one(fn, future)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_one(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():          # the caller gave up before we got to it
            return
        self._busy_since = time.monotonic()
        try:
            result = fn()
        except BaseException as exc:                           # noqa: BLE001 - delivered to the caller
            future.set_exception(exc)
            return
        finally:
            self._busy_since = None
        future.set_result(result)
        if isinstance(result, RequestOutput) and result.finished:  # an abort's final output
            self._publish(result.request_id, result)

    def _publish(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            with contextlib.suppress(RuntimeError):            # the loop is closed: nobody listens
                loop.call_soon_threadsafe(q.put_nowait, item)

    def _die(self, exc: BaseException | None) -> None:
        self._dead = exc if exc is not None else EngineDead("shut down")
        for request_id in list(self._streams):
            self._publish(request_id, _DONE)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if not future.done():
                future.set_exception(EngineDead())
