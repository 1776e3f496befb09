"""Turns a SchedulerOutput into one flattened forward over the shared paged cache.

It owns the cache tensors; the scheduler hands it requests and token counts only. Before the
forward it applies the step's state moves (snapshot -> working slot copies, imported states);
after it, it returns the logits of the sequences that sample this step (every row of a speculative
verification) and, when a draft reads them, the captured target features of every token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.cache_manager import CacheConfig
from engine.core.request import Request
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.core.state_export import ExportedState, StateIdentity, StateMismatch
from engine.host_threads import ForwardThreads, ForwardThreadSetter
from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration


@dataclass
class RunnerOutput:
    logits: torch.Tensor                    # [rows, V]: 1 row per sampling seq, 1+drafts per verifying seq
    features: torch.Tensor | None           # [tokens, target_hidden * len(capture_layers)], flat token order
    token_offsets: list[int]                # first flat token of each scheduled seq
    # seq index in `out.seqs` -> (first prompt position p, logits [k, V] scoring prompt tokens p+1..p+k),
    # for requests that want prompt logprobs (the last prompt position's logits are its sampling row)
    prompt_logits: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


class StateTarget(Protocol):
    """What `import_state` reads and sets of a request: a `Request`, or the stand-in a tensor-parallel
    worker rank builds from rank 0's broadcast."""

    blocks: list[int]
    kda_slot: int | None
    draft_context_ready: bool

    @property
    def num_prompt_tokens(self) -> int: ...


class ModelRunner:
    def __init__(self, model: KimiK3ForConditionalGeneration, cache_config: CacheConfig, identity: StateIdentity,
                 capture_layers: tuple[int, ...] = (), proposer=None) -> None:
        """proposer: the DSpark proposer whose draft context rows travel with exported states."""
        self.proposer = proposer
        self.model = model
        self.text_config = model.config.text_config
        self.device = next(model.parameters()).device
        self.dtype = next(model.language_model.parameters()).dtype
        self.identity = identity
        self.capture_layers = capture_layers
        self.spec_slots_per_seq = cache_config.spec_slots_per_seq
        self.spec_slot_base = cache_config.num_working_slots + cache_config.num_snapshot_slots
        num_slots = self.spec_slot_base + cache_config.num_working_slots * cache_config.spec_slots_per_seq
        self.cache_config = cache_config
        self.cache = self._allocate_cache(cache_config, num_slots)
        # small CPU forwards on one intra-op thread (engine/host_threads.py); devices keep theirs
        self.forward_threads = (ForwardThreadSetter(ForwardThreads.from_env(self.text_config.hidden_size))
                                if self.device.type == "cpu" else None)
        self.decode_graphs = None          # engine/graphs: padded (graph-replayed) decode steps
        self.block_size = cache_config.block_size

    def _allocate_cache(self, cache_config: CacheConfig, num_slots: int) -> HybridCacheTensors:
        return HybridCacheTensors.allocate(self.text_config, cache_config.num_blocks, num_slots,
                                           cache_config.block_size, self.dtype, self.device)

    # ---- state moves ----------------------------------------------------------------------------
    def spec_slots(self, working_slot: int, count: int) -> tuple[int, ...]:
        """The per-position KDA slots of a working slot (fixed, so nothing can leak or be shared)."""
        base = self.spec_slot_base + working_slot * self.spec_slots_per_seq
        return tuple(range(base, base + count))

    def rollback_kda(self, working_slot: int, num_consumed: int) -> None:
        """After verifying, keep the state after the first `num_consumed` tokens of the block."""
        self.copy_kda_state(self.spec_slots(working_slot, num_consumed)[-1], working_slot)

    def copy_kda_state(self, src: int, dst: int) -> None:
        for layer in self.text_config.kda_layer_ids:
            self.cache.kda_conv[layer][dst] = self.cache.kda_conv[layer][src]
            self.cache.kda_recurrent[layer][dst] = self.cache.kda_recurrent[layer][src]

    def _page_index(self, req: StateTarget, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi, device=self.device)
        table = torch.tensor(req.blocks, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def export_state(self, req: Request) -> dict[str, dict[int, torch.Tensor]]:
        """Copies of req's MLA latents for its prompt tokens and its KDA state, on the CPU."""
        index = self._page_index(req, 0, req.num_prompt_tokens)
        slot = req.kda_slot
        parts = {
            "mla": {i: p.view(-1, p.shape[-1])[index].cpu() for i, p in self.cache.mla_pages.items()},
            "kda_conv": {i: c[slot].cpu().clone() for i, c in self.cache.kda_conv.items()},
            "kda_recurrent": {i: r[slot].cpu().clone() for i, r in self.cache.kda_recurrent.items()},
        }
        if self.proposer is not None:
            parts["draft"] = self.proposer.export_rows(req.blocks, req.num_prompt_tokens)
        return parts

    def import_state(self, req: StateTarget, state: ExportedState) -> None:
        """Write an exported state into req's pages and working slot (shapes checked, nothing partial)."""
        self.identity.check_compatible(state.identity)
        self._check_import_shapes(state, req.num_prompt_tokens)
        index = self._page_index(req, 0, req.num_prompt_tokens)
        for i, pages in self.cache.mla_pages.items():
            pages.view(-1, pages.shape[-1])[index] = state.mla[i].to(self.device, pages.dtype)
        for i in self.text_config.kda_layer_ids:
            self.cache.kda_conv[i][req.kda_slot] = state.kda_conv[i].to(self.device)
            self.cache.kda_recurrent[i][req.kda_slot] = state.kda_recurrent[i].to(self.device)
        if self.proposer is not None:
            # Same draft on both sides -> its prompt context rows travel; else this request decodes unspeculated.
            same = state.extra.get("draft_id") == self.proposer.draft_id and bool(state.draft)
            req.draft_context_ready = same and self.proposer.import_rows(req.blocks, state.draft)

    def _check_import_shapes(self, state: ExportedState, num_tokens: int) -> None:
        expect: dict[tuple[str, int], tuple[int, ...]] = {
            ("mla", i): (num_tokens, self.text_config.mla_cache_dim) for i in self.cache.mla_pages}
        expect |= {("kda_conv", i): tuple(c.shape[1:]) for i, c in self.cache.kda_conv.items()}
        expect |= {("kda_recurrent", i): tuple(r.shape[1:]) for i, r in self.cache.kda_recurrent.items()}
        for (kind, layer), shape in expect.items():
            tensor = getattr(state, kind).get(layer)
            if tensor is None or tuple(tensor.shape) != shape:
                got = None if tensor is None else list(tensor.shape)
                raise StateMismatch(f"imported {kind}.{layer} has shape {got}, expected {list(shape)}")

    # ---- forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the step; logits (fp32) in `out.seqs` order, see RunnerOutput."""
        ids: list[int] = []
        slices: list[SequenceSlice] = []
        logits_rows: list[int] = []
        mm_embeds: list[torch.Tensor] = []
        mm_pos: list[int] = []
        offsets: list[int] = []
        prompt_rows: dict[int, tuple[int, list[int]]] = {}
        flat = 0
        for index, s in enumerate(out.seqs):
            self._prepare(s)
            lo = s.num_computed_before
            real = s.num_new_tokens - len(s.draft_token_ids)
            ids.extend(s.req.token_at(p) for p in range(lo, lo + real))
            ids.extend(s.draft_token_ids)
            spec = self.spec_slots(s.req.slot, len(s.draft_token_ids)) if s.verifies else ()
            slices.append(SequenceSlice(s.num_new_tokens, lo, s.req.slot,
                                        torch.tensor(s.req.blocks, device=self.device),
                                        reset_kda_state=lo == 0, snapshots=s.snapshots, spec_slots=spec))
            self._gather_images(s.req, lo, lo + real, flat, mm_embeds, mm_pos)
            offsets.append(flat)
            scored_hi = min(lo + real, s.req.num_prompt_tokens - 1)
            if s.req.wants_prompt_logprobs and lo < scored_hi:
                prompt_rows[index] = (lo, list(range(flat, flat + scored_hi - lo)))
            flat += s.num_new_tokens
            if s.verifies:
                logits_rows.extend(range(flat - s.num_new_tokens, flat))
            elif s.samples:
                logits_rows.append(flat - 1)
        num_sampling = len(logits_rows)
        extra = [row for _, rows in prompt_rows.values() for row in rows]
        batch = ForwardBatch(slices, self.cache,
                             torch.tensor(logits_rows + extra, dtype=torch.long, device=self.device),
                             torch.cat(mm_embeds) if mm_embeds else None,
                             torch.tensor(mm_pos, device=self.device) if mm_pos else None,
                             capture_layers=self.capture_layers)
        logits = self.run_model(torch.tensor(ids, device=self.device), batch)
        features = torch.cat(batch.captured, dim=-1) if batch.captured else None
        prompt_logits, at = {}, num_sampling
        for index, (start, rows) in prompt_rows.items():
            prompt_logits[index] = (start, logits[at:at + len(rows)])
            at += len(rows)
        return RunnerOutput(logits[:num_sampling], features, offsets, prompt_logits)

    def run_model(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The forward itself (a tensor-parallel runner broadcasts its inputs to the other ranks first)."""
        if self.forward_threads is not None:
            self.forward_threads.before_forward(input_ids.numel())
        if self.decode_graphs is not None:
            return self.decode_graphs.forward(self.model, input_ids, batch)
        return self.model(input_ids, batch)

    def _prepare(self, s: ScheduledSeq) -> None:
        if s.import_state:
            if s.req.imported is None:
                raise RuntimeError(f"request {s.req.request_id} is scheduled to import a state it does not hold")
            self.import_state(s.req, s.req.imported)
        elif s.resume_from_slot is not None:
            self.copy_kda_state(s.resume_from_slot, s.req.slot)

    def _gather_images(self, req: Request, lo: int, hi: int, flat: int, embeds: list, positions: list) -> None:
        for image in req.images:
            a, b = max(lo, image.span.start), min(hi, image.span.start + image.span.length)
            if a < b:
                embeds.append(image.embeds[a - image.span.start: b - image.span.start].to(self.device, self.dtype))
                positions.extend(range(flat + a - lo, flat + b - lo))
