"""Run one sequence through the model with a private cache: the simplest correct driver.

Used by `kimi-pd generate` and by model-level tests; the serving engine drives the same forward
with a shared paged cache instead.
"""
from __future__ import annotations

import torch

from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration


class SequenceRunner:
    def __init__(self, model: KimiK3ForConditionalGeneration, max_tokens: int, block_size: int = 16) -> None:
        cfg = model.config.text_config
        dtype = next(model.language_model.parameters()).dtype
        device = next(model.parameters()).device
        num_blocks = -(-max_tokens // block_size)
        self.model, self.max_tokens = model, max_tokens
        self.cache = HybridCacheTensors.allocate(cfg, num_blocks, 1, block_size, dtype, device)
        self.block_table = torch.arange(num_blocks, device=device)
        self.num_tokens = 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int] | torch.Tensor, mm_embeds: torch.Tensor | None = None,
             mm_positions: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Append tokens; returns logits [t, V] (or [1, V] with last_only). mm_positions index `token_ids`."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.block_table.device)
        t = ids.numel()
        if self.num_tokens + t > self.max_tokens:
            raise ValueError(f"sequence of {self.num_tokens + t} tokens exceeds this runner's {self.max_tokens}")
        piece = SequenceSlice(num_new_tokens=t, num_cached_tokens=self.num_tokens, kda_slot=0,
                              block_table=self.block_table, reset_kda_state=self.num_tokens == 0)
        logits_indices = torch.tensor([t - 1], device=ids.device) if last_only else None
        batch = ForwardBatch([piece], self.cache, logits_indices, mm_embeds, mm_positions)
        logits = self.model(ids, batch)
        self.num_tokens += t
        return logits
