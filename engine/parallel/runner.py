"""The model runner of a tensor-parallel engine: rank 0 drives, every other rank replays.

Everything that touches the model or the cache goes through a command rank 0 broadcasts before doing
it itself, so all ranks run the same forwards (and so the same collectives) in the same order:

    ("forward", input_ids, slices, logits_indices, mm_embeds, mm_positions)
    ("copy_kda", src_slot, dst_slot)                      # resume from a snapshot, speculative rollback
    ("import", blocks, kda_slot, num_tokens, state)       # TP=1 layout; each rank keeps its heads
    ("export", blocks, kda_slot, num_tokens)              # each rank's heads gathered on rank 0
    ("stop",)
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from engine.core.cache_manager import CacheConfig
from engine.core.model_runner import ModelRunner
from engine.core.state_export import ExportedState, StateMismatch
from engine.model.forward_batch import ForwardBatch, HybridCacheTensors
from engine.parallel.comm import TPGroup
from engine.parallel.state_layout import gather_kda, split_kda
from engine.spec_decode.parallel import apply_draft_command

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _ImportTarget:
    """A worker rank's stand-in for the request rank 0 imports a state into (`StateTarget`)."""

    blocks: list[int]
    kda_slot: int | None
    num_prompt_tokens: int
    draft_context_ready: bool = True


class ShardedRunner(ModelRunner):
    """A ModelRunner whose KDA state holds this rank's heads (MLA pages are replicated)."""

    def __init__(self, model, cache_config: CacheConfig, identity, group: TPGroup, proposer=None) -> None:
        self.group = group
        super().__init__(model, cache_config, identity, proposer.capture_layers if proposer else (), proposer)

    def _allocate_cache(self, cache_config: CacheConfig, num_slots: int) -> HybridCacheTensors:
        lac = self.text_config.linear_attn_config
        local_lac = dataclasses.replace(lac, num_heads=lac.num_heads // self.group.world_size)
        local = dataclasses.replace(self.text_config, linear_attn_config=local_lac)
        return HybridCacheTensors.allocate(local, cache_config.num_blocks, num_slots, cache_config.block_size,
                                           self.dtype, self.device)

    def local_state(self, state: ExportedState) -> ExportedState:
        """This rank's share of a TP=1-layout state (raises StateMismatch on a malformed one)."""
        world = self.group.world_size
        for kind, store, dim in (("kda_conv", self.cache.kda_conv, -1), ("kda_recurrent", self.cache.kda_recurrent, 0)):
            for layer, local in store.items():
                full = list(local.shape[1:])
                full[dim] *= world
                got = getattr(state, kind).get(layer)
                if got is None or list(got.shape) != full:
                    shape = None if got is None else list(got.shape)
                    raise StateMismatch(f"imported {kind}.{layer} has shape {shape}, expected {full}")
        try:
            conv, rec = split_kda(state.kda_conv, state.kda_recurrent, self.group.rank, self.group.world_size)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise StateMismatch(f"imported KDA state does not split over {self.group.world_size} ranks: {exc}") from exc
        return dataclasses.replace(state, kda_conv=conv, kda_recurrent=rec)

    def _local_kda(self, slot: int) -> tuple[dict, dict]:
        return ({i: c[slot].cpu().clone() for i, c in self.cache.kda_conv.items()},
                {i: r[slot].cpu().clone() for i, r in self.cache.kda_recurrent.items()})

    # ---- replaying a command (followers; rank 0 runs the same code after broadcasting) ------------
    def apply(self, command: tuple) -> bool:
        """Run one command; False on stop."""
        kind, args = command[0], command[1:]
        if kind == "forward":
            ids, slices, logits_indices, mm_embeds, mm_positions = args
            with torch.inference_mode():
                ModelRunner.run_model(self, ids.to(self.device), ForwardBatch(
                    slices, self.cache, logits_indices, mm_embeds, mm_positions))
        elif kind == "copy_kda":
            ModelRunner.copy_kda_state(self, *args)
        elif kind == "import":
            blocks, slot, num_tokens, state = args
            req = _ImportTarget(blocks=blocks, kda_slot=slot, num_prompt_tokens=num_tokens)
            ModelRunner.import_state(self, req, self.local_state(state))
        elif kind == "export":
            self.group.gather(self._local_kda(args[1]))
        elif kind.startswith("draft_"):           # DSpark's draft, sharded over the same ranks
            apply_draft_command(self, kind, args)
        elif kind == "stop":
            return False
        else:
            raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
        return True


class TPModelRunner(ShardedRunner):
    """Rank 0's runner: broadcasts each command, then runs it as rank 0's share."""

    def run_model(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        self.group.broadcast(("forward", input_ids.cpu(), batch.slices, batch.logits_indices,
                              batch.mm_embeds, batch.mm_positions))
        return super().run_model(input_ids, batch)

    def copy_kda_state(self, src: int, dst: int) -> None:
        self.group.broadcast(("copy_kda", src, dst))
        super().copy_kda_state(src, dst)

    def import_state(self, req, state: ExportedState) -> None:
        self.identity.check_compatible(state.identity)
        local = self.local_state(state)
        self._check_import_shapes(local, req.num_prompt_tokens)      # refuse before any rank writes
        self.group.broadcast(("import", list(req.blocks), req.kda_slot, req.num_prompt_tokens, state))
        super().import_state(req, local)

    def export_state(self, req) -> dict[str, dict[int, torch.Tensor]]:
        self.group.broadcast(("export", list(req.blocks), req.kda_slot, req.num_prompt_tokens))
        parts = super().export_state(req)
        shards = self.group.gather(self._local_kda(req.kda_slot))
        if shards is None:                 # only rank 0 (which runs the engine) exports; gather gives it all
            raise RuntimeError("export_state runs on rank 0 only")
        parts["kda_conv"], parts["kda_recurrent"] = gather_kda(shards)
        return parts

    def stop(self) -> None:
        self.group.broadcast(("stop",))
