"""AsyncEngine: streamed outputs equal the offline ones; abort and disconnect free everything."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.core.engine import EngineConfig, LLMEngine
from engine.structured_output import GrammarBudget
from shared.errors import EngineDead, InvalidRequest
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutput
from tests.engine.core.helpers import SETTINGS, assert_clean, make_llm, prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)




@pytest.fixture()
def async_engine(tiny_dir):
    eng = AsyncEngine(EngineConfig(model=str(tiny_dir), **SETTINGS))
    yield eng
    eng.shutdown()


class _Wrapped:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine


async def collect(engine: AsyncEngine, rid: str, prompt, params=GREEDY):
    return [out async for out in engine.generate(rid, prompt, params)]


def test_concurrent_streams_equal_offline(async_engine, tiny_dir):
    prompts = [prompt_ids(n, n) for n in (4, 11, 19)]
    expected = [o.output.token_ids for o in make_llm(tiny_dir).generate(prompts, GREEDY)]

    async def main():
        return await asyncio.gather(*(collect(async_engine, f"r{i}", p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    for outs, want in zip(results, expected, strict=False):
        assert outs[-1].finished and outs[-1].output.token_ids == want
        assert [t for o in outs for t in o.new_token_ids] == want            # one delta per step, in order
        assert "".join(o.new_text for o in outs) == outs[-1].output.text
    assert_clean(_Wrapped(async_engine.engine))


def test_consumer_that_stops_early_aborts_its_request(async_engine):
    async def main():
        stream = async_engine.generate("early", prompt_ids(9, 1), SamplingParams(temperature=0.0, max_tokens=50,
                                                                                  ignore_eos=True))
        async for out in stream:
            if len(out.output.token_ids) == 3:
                break
        await stream.aclose()
        await async_engine.call(lambda: None)          # let the abort run on the engine thread
        return await async_engine.call(lambda: dict(async_engine.engine.requests))

    assert asyncio.run(main()) == {}
    assert_clean(_Wrapped(async_engine.engine))


def test_explicit_abort_ends_the_stream(async_engine):
    async def main():
        outs = []
        async for out in async_engine.generate("ab", prompt_ids(7, 2), SamplingParams(temperature=0.0, max_tokens=200,
                                                                                       ignore_eos=True)):
            outs.append(out)
            if len(outs) == 2:
                await async_engine.abort("ab")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].output.finish_reason == "abort"
    assert_clean(_Wrapped(async_engine.engine))


def test_bad_request_raises_to_the_caller_and_engine_keeps_serving(async_engine):
    async def main():
        with pytest.raises(InvalidRequest):
            await collect(async_engine, "bad", [1, 2, 10**6])
        return await collect(async_engine, "good", prompt_ids(5, 3))

    assert asyncio.run(main())[-1].finished
    assert_clean(_Wrapped(async_engine.engine))


def test_engine_failure_ends_streams_with_engine_dead(async_engine):
    def boom():
        raise RuntimeError("device lost")

    async def main():
        stream = async_engine.generate("x", prompt_ids(5, 4), SamplingParams(temperature=0.0, max_tokens=500,
                                                                              ignore_eos=True))
        first = await stream.__anext__()
        async_engine.engine.step = boom                 # the next step fails
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass
        return first

    assert asyncio.run(main()).output.token_ids
    assert async_engine.is_dead


def test_caller_cancelled_while_its_command_is_queued_leaves_the_engine_alive(async_engine):
    """A client that leaves while its add_request waits behind a long step must not kill the engine."""
    import time

    async def main():
        slow = asyncio.ensure_future(async_engine.call(lambda: time.sleep(0.4)))
        await asyncio.sleep(0.05)
        stream = async_engine.generate("cancelled", prompt_ids(6, 9), GREEDY)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.gather(slow, first, return_exceptions=True)
        await asyncio.sleep(0.5)
        outs = await asyncio.wait_for(collect(async_engine, "after", prompt_ids(5, 10)), 20)
        return outs, await async_engine.call(lambda: dict(async_engine.engine.requests))

    outs, live = asyncio.run(main())
    assert outs[-1].finished and not async_engine.is_dead
    assert live == {}                                    # the cancelled add was undone, nothing orphaned
    assert_clean(_Wrapped(async_engine.engine))


def test_engine_thread_does_not_spin_while_nothing_can_be_admitted(tiny_dir):
    import resource
    eng = AsyncEngine(EngineConfig(model=str(tiny_dir), **{**SETTINGS, "max_num_seqs": 1}))
    try:
        async def main():
            held = [o async for o in eng.generate("held", prompt_ids(5, 11), GREEDY, export_state=True)]
            stream = eng.generate("blocked", prompt_ids(5, 12), GREEDY)
            task = asyncio.ensure_future(stream.__anext__())
            before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
            await asyncio.sleep(1.0)
            spent = resource.getrusage(resource.RUSAGE_SELF).ru_utime - before
            await eng.release_export("held")
            first = await asyncio.wait_for(task, 20)          # admitted once the slot is free
            await stream.aclose()
            return held, spent, first
        held, spent, first = asyncio.run(main())
        assert held[-1].finished and first.output.token_ids
        assert spent < 0.5, f"engine thread burned {spent:.2f} CPU s in 1 s while stalled"
    finally:
        eng.shutdown()


def _big_schema(properties: int) -> StructuredOutput:
    """A JSON schema that takes xgrammar seconds to compile (~56 bytes a property)."""
    props = {f"p{i}": {"type": "string", "enum": [f"v{i}a", f"v{i}b"]} for i in range(properties)}
    return StructuredOutput("json", json.dumps({"type": "object", "properties": props}))


def test_a_grammar_over_the_size_budget_is_refused_before_the_engine_sees_it(tiny_dir):
    eng = AsyncEngine(EngineConfig(model=str(tiny_dir), **SETTINGS), grammar_budget=GrammarBudget(max_spec_bytes=64))
    try:
        spec = StructuredOutput("regex", "(" + "|".join(f"w{i}" for i in range(40)) + ")")
        params = SamplingParams(temperature=0.0, max_tokens=4, structured_output=spec)
        with pytest.raises(InvalidRequest, match=r"is \d+ bytes, over this server's limit of 64 bytes") as err:
            asyncio.run(collect(eng, "big", prompt_ids(5, 1), params))
        assert err.value.param == "structured_outputs"
        assert not eng.engine.grammars.is_cached(spec)                   # never compiled
        assert asyncio.run(collect(eng, "after", prompt_ids(5, 2)))[-1].finished
        assert_clean(_Wrapped(eng.engine))
    finally:
        eng.shutdown()


def test_a_slow_grammar_neither_stalls_other_requests_nor_hangs_its_own(tiny_dir):
    """While a costly schema compiles, another request runs to the end; the costly one gets a 400 when its
    time is up, and its compile finishes in the background, so sending it again is served from the cache."""
    spec = _big_schema(1500)
    budget = GrammarBudget(max_spec_bytes=len(spec.value), compile_timeout_s=0.05)
    eng = AsyncEngine(EngineConfig(model=str(tiny_dir), **SETTINGS), grammar_budget=budget)
    slow = SamplingParams(temperature=0.0, max_tokens=3, structured_output=spec)
    try:
        async def main():
            costly = asyncio.ensure_future(collect(eng, "costly", prompt_ids(5, 3), slow))
            plain = await asyncio.wait_for(collect(eng, "plain", prompt_ids(9, 4)), 20)
            compiled_while_plain_ran = eng.engine.grammars.is_cached(spec)
            with pytest.raises(InvalidRequest, match=r"did not compile within 0.05 s") as err:
                await costly
            return plain, compiled_while_plain_ran, err.value.param

        plain, compiled_early, param = asyncio.run(main())
        assert plain[-1].finished and len(plain[-1].output.token_ids) == GREEDY.max_tokens
        assert param == "structured_outputs"
        assert not compiled_early                  # the plain request did not wait for the compile to end
        deadline = time.monotonic() + 60
        while not eng.engine.grammars.is_cached(spec) and time.monotonic() < deadline:
            time.sleep(0.1)
        again = asyncio.run(collect(eng, "again", prompt_ids(5, 3), slow))    # from the cache: no timeout
        assert again[-1].finished and again[-1].output.text.startswith("{")
        assert_clean(_Wrapped(eng.engine))
    finally:
        eng.shutdown()
