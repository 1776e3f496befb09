"""Engine bookkeeping: refusals (before any forward), leases of held states, capacity, KV events and
what is published as cached. The model runs only where a test needs real cache contents."""
from __future__ import annotations

import pytest

from shared.errors import InvalidRequest, InvalidTokenIds, PromptTooLong, RequestTooLarge
from shared.sampling_params import SamplingParams
from tests.engine.core.helpers import GREEDY, assert_clean, make_llm, no_forward, prompt_ids, tokens


@pytest.fixture(scope="module")
def serving(tiny_dir):
    """One engine for every refusal: each must leave it clean and still serving."""
    return make_llm(tiny_dir)


def test_held_state_lease_expires_and_abort_releases(tiny_dir):
    llm = make_llm(tiny_dir, export_lease_s=30.0)
    llm.engine.add_request("a", prompt_ids(10, 50), GREEDY, export_state=True)
    llm.engine.add_request("b", prompt_ids(12, 51), GREEDY, export_state=True)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert set(llm.engine.held) == {"a", "b"}
    llm.engine.check_integrity()
    assert llm.engine.expire_leases(now=0.0) == []
    llm.engine.abort("a")
    import time
    assert llm.engine.expire_leases(now=time.monotonic() + 31) == ["b"]
    assert_clean(llm)


def test_imported_state_from_a_different_identity_is_refused(tiny_dir):
    a, b = make_llm(tiny_dir), make_llm(tiny_dir, dtype="bfloat16")
    a.engine.add_request("p", prompt_ids(9, 60), GREEDY, export_state=True)
    while a.engine.has_unfinished():
        a.engine.step()
    state = a.engine.export_state("p")
    a.engine.release_export("p")
    with no_forward(b), pytest.raises(ValueError, match="dtype 'float32' does not match this engine's 'bfloat16'"):
        b.engine.add_request("d", state.prompt_token_ids, GREEDY, imported=state)
    assert_clean(a)
    assert_clean(b)


@pytest.mark.parametrize("prompt, params, error", [
    ([1] * 5000, GREEDY, PromptTooLong),
    ([1, 2, 99999], GREEDY, InvalidTokenIds),
    ([], GREEDY, InvalidRequest),
    ([1, 2, 3], SamplingParams(temperature=-1.0), InvalidRequest),
    ([1, 2, 3], SamplingParams(max_tokens=5000), InvalidRequest),
])
def test_bad_requests_raise_typed_errors_and_leave_nothing(serving, prompt, params, error):
    with no_forward(serving), pytest.raises(error):
        serving.engine.add_request(None, prompt, params)
    assert_clean(serving)
    assert tokens(serving.generate([prompt_ids(5, 1)], GREEDY))      # still serving


def test_request_that_can_never_fit_is_refused(tiny_dir):
    llm = make_llm(tiny_dir, max_num_seqs=1, num_snapshot_slots=0, cache_memory_bytes=12800 + 6 * 768)
    with no_forward(llm), pytest.raises(RequestTooLarge, match="the cache holds at most 20 tokens"):
        llm.engine.add_request(None, prompt_ids(10, 1), SamplingParams(max_tokens=20))
    assert_clean(llm)


def test_capacity_is_reported_from_the_memory_budget(tiny_dir):
    llm = make_llm(tiny_dir, max_num_seqs=2, num_snapshot_slots=2, cache_memory_bytes=4 * 12800 + 50 * 768)
    assert llm.engine.capacity_tokens == 49 * 4
    with pytest.raises(AssertionError, match="the model ran"), no_forward(llm):   # the guard the refusals rely on
        llm.generate([prompt_ids(5, 1)], GREEDY)


def test_kv_events_replay_to_the_pool_contents(tiny_dir):
    """Stored/removed events, replayed in order, give exactly the hashes the pool holds."""
    from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    llm = make_llm(tiny_dir, max_num_seqs=2, num_snapshot_slots=2, cache_memory_bytes=4 * 12800 + 20 * 768)
    held: set[int] = set()

    def replay():
        for event in llm.engine.cache.drain_events():
            if isinstance(event, BlockStored):
                assert event.block_size == 4 and len(event.token_ids) == 4 * len(event.block_hashes)
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    for seed in range(6):                                   # enough to force evictions
        llm.generate([prompt_ids(23, 200 + seed)], GREEDY)
        replay()
        assert held == set(llm.engine.cache.pool.hash_to_block)
    assert llm.engine.cache.reset_prefix_cache()
    replay()
    assert held == set() == set(llm.engine.cache.pool.hash_to_block)


def test_only_resumable_prefixes_are_published(tiny_dir):
    """Pages past the last KDA snapshot, and imported prompts, are never announced as cached."""
    llm = make_llm(tiny_dir, snapshot_interval_blocks=100)          # snapshots only at prompt ends
    p = prompt_ids(23, 300)                                          # ends: blocks 5 (20 tokens)
    llm.generate([p], GREEDY)
    published = set(llm.engine.cache.pool.hash_to_block)
    from shared.hashing import block_hashes
    chain = block_hashes(p, 4, llm.engine.hash_root)
    assert published == set(chain[:5])
    llm.engine.add_request("p", prompt_ids(30, 301), GREEDY, export_state=True)
    while llm.engine.has_unfinished():
        llm.engine.step()
    state = llm.engine.export_state("p")
    llm.engine.release_export("p")
    other = make_llm(tiny_dir)
    other.engine.add_request("d", state.prompt_token_ids, GREEDY, imported=state)
    while other.engine.has_unfinished():
        other.engine.step()
    assert not other.engine.cache.pool.hash_to_block and not other.engine.cache.drain_events()
    assert_clean(other)
