"""Turns a SchedulerOutput into one flattened forward over the shared paged cache.

It owns the cache tensors; the scheduler hands it requests and token counts only. Before the
forward it applies the step's state moves (snapshot -> working slot copies, imported states);
after it, it returns the logits of the sequences that sample this step.
"""
from __future__ import annotations

import torch

from engine.core.cache_manager import CacheConfig
from engine.core.request import Request
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.core.state_export import ExportedState, StateIdentity, StateMismatch
from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration


class ModelRunner:
    def __init__(self, model: KimiK3ForConditionalGeneration, cache_config: CacheConfig, identity: StateIdentity) -> None:
        self.model = model
        self.text_config = model.config.text_config
        self.device = next(model.parameters()).device
        self.dtype = next(model.language_model.parameters()).dtype
        self.identity = identity
        num_slots = cache_config.num_working_slots + cache_config.num_snapshot_slots
        self.cache = HybridCacheTensors.allocate(self.text_config, cache_config.num_blocks, num_slots,
                                                 cache_config.block_size, self.dtype, self.device)
        self.block_size = cache_config.block_size

    # ---- state moves ----------------------------------------------------------------------------
    def copy_kda_state(self, src: int, dst: int) -> None:
        for layer in self.text_config.kda_layer_ids:
            self.cache.kda_conv[layer][dst] = self.cache.kda_conv[layer][src]
            self.cache.kda_recurrent[layer][dst] = self.cache.kda_recurrent[layer][src]

    def _page_index(self, req: Request, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi, device=self.device)
        table = torch.tensor(req.blocks, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def export_state(self, req: Request) -> dict[str, dict[int, torch.Tensor]]:
        """Copies of req's MLA latents for its prompt tokens and its KDA state, on the CPU."""
        index = self._page_index(req, 0, req.num_prompt_tokens)
        slot = req.kda_slot
        return {
            "mla": {i: p.view(-1, p.shape[-1])[index].cpu() for i, p in self.cache.mla_pages.items()},
            "kda_conv": {i: c[slot].cpu().clone() for i, c in self.cache.kda_conv.items()},
            "kda_recurrent": {i: r[slot].cpu().clone() for i, r in self.cache.kda_recurrent.items()},
        }

    def import_state(self, req: Request, state: ExportedState) -> None:
        """Write an exported state into req's pages and working slot (shapes checked, nothing partial)."""
        self.identity.check_compatible(state.identity)
        self._check_import_shapes(state, req.num_prompt_tokens)
        index = self._page_index(req, 0, req.num_prompt_tokens)
        for i, pages in self.cache.mla_pages.items():
            pages.view(-1, pages.shape[-1])[index] = state.mla[i].to(self.device, pages.dtype)
        for i in self.text_config.kda_layer_ids:
            self.cache.kda_conv[i][req.kda_slot] = state.kda_conv[i].to(self.device)
            self.cache.kda_recurrent[i][req.kda_slot] = state.kda_recurrent[i].to(self.device)

    def _check_import_shapes(self, state: ExportedState, num_tokens: int) -> None:
        expect = {("mla", i): (num_tokens, self.text_config.mla_cache_dim) for i in self.cache.mla_pages}
        expect |= {("kda_conv", i): tuple(c.shape[1:]) for i, c in self.cache.kda_conv.items()}
        expect |= {("kda_recurrent", i): tuple(r.shape[1:]) for i, r in self.cache.kda_recurrent.items()}
        for (kind, layer), shape in expect.items():
            tensor = getattr(state, kind).get(layer)
            if tensor is None or tuple(tensor.shape) != shape:
                got = None if tensor is None else list(tensor.shape)
                raise StateMismatch(f"imported {kind}.{layer} has shape {got}, expected {list(shape)}")

    # ---- forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step; returns logits [num sampling seqs, vocab] in `out.seqs` order (fp32)."""
        return self.execute_with_prompt_logits(out)[0]

    @torch.inference_mode()
    def execute_with_prompt_logits(self, out: SchedulerOutput) -> tuple[torch.Tensor, dict[int, tuple[int, torch.Tensor]]]:
        """`execute`, plus, for each seq (by index in `out.seqs`) whose request wants prompt logprobs,
        `(first position, logits [k, vocab])`: the logits at prompt positions p..p+k-1 of this chunk,
        which score prompt tokens p+1..p+k (the last prompt position's logits are its sampling row)."""
        ids, slices, logits_rows, mm_embeds, mm_pos = [], [], [], [], []
        prompt_rows: dict[int, tuple[int, list[int]]] = {}
        flat = 0
        for index, s in enumerate(out.seqs):
            self._prepare(s)
            lo, hi = s.num_computed_before, s.num_computed_before + s.num_new_tokens
            ids.extend(s.req.token_at(p) for p in range(lo, hi))
            slices.append(SequenceSlice(s.num_new_tokens, lo, s.req.kda_slot,
                                        torch.tensor(s.req.blocks, device=self.device),
                                        reset_kda_state=lo == 0, snapshots=s.snapshots))
            self._gather_images(s.req, lo, hi, flat, mm_embeds, mm_pos)
            scored_hi = min(hi, s.req.num_prompt_tokens - 1)
            if s.req.wants_prompt_logprobs and lo < scored_hi:
                prompt_rows[index] = (lo, list(range(flat, flat + scored_hi - lo)))
            flat += s.num_new_tokens
            if s.samples:
                logits_rows.append(flat - 1)
        num_sampling = len(logits_rows)
        extra = [row for _, rows in prompt_rows.values() for row in rows]
        batch = ForwardBatch(slices, self.cache, torch.tensor(logits_rows + extra, dtype=torch.long, device=self.device),
                             torch.cat(mm_embeds) if mm_embeds else None,
                             torch.tensor(mm_pos, device=self.device) if mm_pos else None)
        logits = self.model(torch.tensor(ids, device=self.device), batch)
        prompt_logits, at = {}, num_sampling
        for index, (start, rows) in prompt_rows.items():
            prompt_logits[index] = (start, logits[at:at + len(rows)])
            at += len(rows)
        return logits[:num_sampling], prompt_logits

    def _prepare(self, s: ScheduledSeq) -> None:
        if s.import_state:
            self.import_state(s.req, s.req.imported)
        elif s.resume_from_slot is not None:
            self.copy_kda_state(s.resume_from_slot, s.req.kda_slot)

    def _gather_images(self, req: Request, lo: int, hi: int, flat: int, embeds: list, positions: list) -> None:
        for image in req.images:
            a, b = max(lo, image.span.start), min(hi, image.span.start + image.span.length)
            if a < b:
                embeds.append(image.embeds[a - image.span.start: b - image.span.start].to(self.device, self.dtype))
                positions.extend(range(flat + a - lo, flat + b - lo))
