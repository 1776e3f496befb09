"""Tensor and expert parallelism over `torch.distributed`, in the style of gpt-fast.

One process per rank. Every rank loads the whole checkpoint and keeps its shard (`shard.py`): MLA and
KDA by heads, dense FFNs by columns/rows, routed experts by expert (EP) or by their intermediate dim
(TP), the LM head and the embedding by vocabulary. Rank 0 runs the engine (scheduler, sampler,
detokenizer); the others run `follower.py`'s loop, replaying every runner command rank 0 broadcasts
(`runner.py`). An exported state always has the TP=1 layout (KDA heads gathered on export, split on
import, `state_layout.py`), so prefill and decode may run at different TP sizes.

Data parallelism (`dp_*.py`): D such engines, each with its own scheduler, batch and cache, whose
routed experts spread over all D x TP ranks; a front in the serving process places requests on them
and steps them together (docs/parallelism.md).
"""
