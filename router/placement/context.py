"""Building a RoutingContext: hash the prompt once per hash chain, read the prefix index once."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from router.placement.kv_pool import KVPool
from router.placement.prefix_index import PrefixQuery
from router.placement.types import HashKey, RoutingContext, WorkerState
from shared.hashing import ImageSpan, block_hashes, salted_root
from shared.workers import Role


def build_context(request_id: str, token_ids: Sequence[int], workers: Sequence[WorkerState],
                  index: PrefixQuery, *, model: str, role: Role, now: float,
                  images: Sequence[ImageSpan] = (), cache_salt: str | None = None,
                  tail_prefill_s: float | None = None, pool: KVPool | None = None) -> RoutingContext:
    """Context for one request over the workers serving `model`.

    The prompt is hashed once per distinct (hash_root, block_size) among those workers, since
    workers on different chains never share a block hash; each worker's cached prefix is read
    from `index` here, once, so all plugins of this decision see the same numbers.
    """
    serving = [w for w in workers if w.info.model_id == model]
    keys = [HashKey(*chain) for chain in {(w.info.hash_root, w.info.block_size) for w in serving}]
    hashes: dict[tuple[int, int], tuple[int, ...]] = {
        k: tuple(block_hashes(token_ids, k.block_size, salted_root(k.hash_root, cache_salt), images)) for k in keys}
    return context_from_hashes(request_id, len(token_ids), hashes, serving, index, model=model, role=role, now=now,
                               tail_prefill_s=tail_prefill_s, pool=pool)


def context_from_hashes(request_id: str, num_prompt_tokens: int, hashes: Mapping[tuple[int, int], tuple[int, ...]],
                        workers: Sequence[WorkerState], index: PrefixQuery, *, model: str, role: Role,
                        now: float, tail_prefill_s: float | None = None, pool: KVPool | None = None) -> RoutingContext:
    """Context from block hashes already computed (`build_context`, or a trace replay that has
    block ids instead of tokens): reads each serving worker's cached prefix once, and with a KV pool
    the pool's match once per hash chain for the pool's members."""
    cached = {info.worker_id: index.matched_blocks(info.worker_id, hashes.get((info.hash_root, info.block_size), ()))
              for info in (w.info for w in workers) if info.model_id == model}
    pooled: dict[str, int] = {}                      # the pool's match per member (empty without a pool)
    if pool is not None:
        chains = {key: pool.matched_blocks(chain) for key, chain in hashes.items()}
        pooled = {info.worker_id: chains.get((info.hash_root, info.block_size), 0)
                  for info in (w.info for w in workers) if info.model_id == model and pool.member(info.role)}
    # without a pool no block is pooled, so the load cost is never read: the context's own default stands
    load_cost = pool.config.load_cost if pool is not None else RoutingContext.pool_load_cost
    return RoutingContext(request_id=request_id, model=model, role=role, num_prompt_tokens=num_prompt_tokens,
                          prompt_hashes=hashes, cached_blocks=cached, now=now, tail_prefill_s=tail_prefill_s,
                          pooled_blocks=pooled, pool_load_cost=load_cost)
