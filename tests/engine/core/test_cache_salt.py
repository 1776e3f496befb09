"""vLLM's cache_salt: only requests with the same salt share prefix-cache blocks; the router's
placement hashes are the engine's."""
from __future__ import annotations

from engine import SamplingParams
from shared.hashing import block_hashes, salted_root
from tests.engine.core.helpers import make_llm, prompt_ids


def test_only_equal_salts_share_cached_blocks(tiny_dir):
    llm = make_llm(tiny_dir)
    prompt = prompt_ids(40, seed=9)

    def cached(salt):
        params = SamplingParams(temperature=0, max_tokens=2, cache_salt=salt)
        return llm.generate(prompt, params)[0]

    first = cached("tenant-a")
    assert first.num_cached_tokens == 0
    assert cached("tenant-b").num_cached_tokens == 0          # another tenant: no hit
    assert cached(None).num_cached_tokens == 0                # unsalted: no hit either
    again = cached("tenant-a")
    assert again.num_cached_tokens > 0 and again.output.token_ids == first.output.token_ids
    req_hashes = block_hashes(prompt, 4, salted_root(llm.engine.hash_root, "tenant-a"))
    assert req_hashes != block_hashes(prompt, 4, llm.engine.hash_root)
    assert salted_root(7, None) == 7 and salted_root(7, "a") != salted_root(7, "b")
