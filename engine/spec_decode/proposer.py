"""DSpark proposer: owns the draft model and its paged context cache; writes context, drafts blocks.

The draft cache is one page tensor per draft layer, `[num_blocks, block_size, kv_lora+rope]`, indexed
by the TARGET's block tables: a request's draft rows live in the same blocks as its target latents, so
allocation, freeing, preemption and prefix sharing need no bookkeeping of their own. Only verified
tokens are written (`write_context`); the query block's own rows are kept in a scratch tensor for the
one forward that needs them, so nothing past the verified length is ever stored.

Context writes are deferred and applied in order, in one batched projection, before anything reads the
pages (a draft forward, an export, an import) or once `FLUSH_TOKENS` have queued: while speculation is
off (adaptive K = 0) the per-step write would otherwise cost a few percent of a plain step. An engine
step queues its rows as one `ContextRows` (its features tensor as the forward returned it, when every
row is kept), so an off step costs a list of slots and no tensor operation. In-order application
leaves the pages exactly as immediate writes would, even when a block is freed and reused in between
(its new owner's rows are queued after the stale ones).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from engine.spec_decode.checkpoint import draft_identity, load_draft
from engine.spec_decode.config import AnyDraftConfig, SpeculativeConfig
from engine.spec_decode.verify import sample_draft

log = logging.getLogger(__name__)
FLUSH_TOKENS = 512                    # queued context tokens that force a write


@dataclass
class DraftRequest:
    """One request to draft for: its block table, verified length, anchor token and sampling."""

    blocks: list[int]
    num_verified: int                 # tokens 0..num_verified-1 have context rows
    anchor: int                       # the last sampled token, at position num_verified
    num_drafts: int                   # <= num_speculative_tokens; the block is the batch's largest
    temperature: float                # 0: greedy
    seed: int


@dataclass(frozen=True)
class ContextRows:
    """Verified tokens whose draft context is to be written: cache slot and position of each feature row."""

    slots: list[int]                  # by the block tables as they were when the rows were verified
    positions: list[int]
    features: torch.Tensor            # [len(slots), target_hidden * L]

    @classmethod
    def of(cls, items: list[tuple[list[int], int, torch.Tensor]], block_size: int) -> ContextRows | None:
        """(blocks, first position, features) per request -> one ContextRows (None when no row)."""
        items = [it for it in items if it[2].shape[0]]
        if not items:
            return None
        features = items[0][2] if len(items) == 1 else torch.cat([f for _, _, f in items])
        starts = itertools.accumulate((f.shape[0] for _, _, f in items), initial=0)
        return cls.of_step([(b, pos, start, f.shape[0]) for (b, pos, f), start in zip(items, starts, strict=False)],
                           features, block_size)

    @classmethod
    def of_step(cls, kept: list[tuple[list[int], int, int, int]], features: torch.Tensor,
                block_size: int) -> ContextRows:
        """An engine step's kept tokens: (blocks, first position, first feature row, rows) per request.
        When they are all of `features` in order (a decode step without verification) the tensor is
        taken as it is: no slice or copy per request."""
        slots: list[int] = []
        positions: list[int] = []
        whole, row = True, 0
        for blocks, pos, offset, n in kept:
            slots += [blocks[p // block_size] * block_size + p % block_size for p in range(pos, pos + n)]
            positions += range(pos, pos + n)
            whole, row = whole and offset == row, row + n
        if whole and row == features.shape[0]:
            return cls(slots, positions, features)
        return cls(slots, positions, torch.cat([features[offset: offset + n] for _, _, offset, n in kept]))


@dataclass
class DraftBlock:
    token_ids: list[int]
    logits: torch.Tensor | None       # [n, V] pre-temperature, when the draft sampled (probabilistic)
    confidence: list[float] | None


class DSparkProposer:
    def __init__(self, spec: SpeculativeConfig, target_model, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        text = target_model.config.text_config
        self.model, self.cfg = load_draft(spec.model, text, dtype, device)
        self.draft_id = draft_identity(spec.model)
        made_for = self.cfg.extra.get("kimi_pd_target")
        if made_for and made_for != target_model.config.identity_hash():
            log.warning("draft %s was made for another target (%s, this is %s): outputs stay exact, "
                        "acceptance will be low", spec.model, made_for, target_model.config.identity_hash())
        self.spec = spec
        assert spec.num_speculative_tokens is not None, "resolve the config against its draft first"
        self.num_spec: int = spec.num_speculative_tokens
        self.block_size = block_size
        self.device, self.dtype = device, dtype
        lm = target_model.language_model
        self.embed_tokens, self.lm_head = lm.model.embed_tokens, lm.lm_head
        self.head_dtype = getattr(lm.lm_head, "inner", lm.lm_head).weight.dtype   # a TP head wraps its shard
        self.pages = {j: torch.zeros(num_blocks, block_size, self.cfg.cache_dim, dtype=dtype, device=device)
                      for j in range(self.cfg.num_hidden_layers)}
        self._queued: list[ContextRows] = []
        self._queued_tokens = 0

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    @staticmethod
    def bytes_per_block(cfg: AnyDraftConfig, block_size: int, dtype_bytes: int) -> int:
        return cfg.num_hidden_layers * block_size * cfg.cache_dim * dtype_bytes

    def _index(self, blocks: list[int], lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi, device=self.device)
        table = torch.tensor(blocks, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # ---- context ---------------------------------------------------------------------------
    def write_context(self, items: list[tuple[list[int], int, torch.Tensor]]) -> None:
        """items: (blocks, first position, features [t, target_hidden*L]) of verified tokens; queued (module doc)."""
        if (rows := ContextRows.of(items, self.block_size)) is not None:
            self.write_rows(rows)

    def write_rows(self, rows: ContextRows) -> None:
        """Queue one step's verified rows (module doc); written at the next read or past FLUSH_TOKENS."""
        self._queued.append(rows)
        self._queued_tokens += len(rows.slots)
        if self._queued_tokens >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        """Write every queued context row (before anything reads or overwrites the pages)."""
        queued, self._queued, self._queued_tokens = self._queued, [], 0
        if queued:
            self._write_context(queued)

    @torch.inference_mode()
    def _write_context(self, queued: list[ContextRows]) -> None:
        feats = queued[0].features if len(queued) == 1 else torch.cat([q.features for q in queued])
        positions = torch.tensor([p for q in queued for p in q.positions], device=self.device)
        rows = self.model.context_kv(feats, positions)                      # [layers, T, dim]
        index = torch.tensor([slot for q in queued for slot in q.slots], device=self.device)
        if len(queued) > 1 and index.unique().numel() < index.numel():    # a slot written twice: the last wins
            order = torch.arange(index.numel(), device=index.device)
            last = torch.full((int(index.max()) + 1,), -1, dtype=torch.long, device=index.device)
            keep = last.scatter_reduce(0, index, order, "amax")[index] == order
            index, rows = index[keep], rows[:, keep]
        for j, pages in self.pages.items():
            pages.view(-1, pages.shape[-1])[index] = rows[j].to(pages.dtype)

    def export_rows(self, blocks: list[int], num_tokens: int) -> dict[int, torch.Tensor]:
        self.flush()
        index = self._index(blocks, 0, num_tokens)
        return {j: p.view(-1, p.shape[-1])[index].cpu() for j, p in self.pages.items()}

    def import_rows(self, blocks: list[int], rows: dict[int, torch.Tensor]) -> bool:
        """Write exported context rows; False (nothing written) if they do not fit this draft."""
        n = next(iter(rows.values())).shape[0] if rows else 0
        if set(rows) != set(self.pages) or any(tuple(r.shape) != (n, self.cfg.cache_dim) for r in rows.values()):
            return False
        self.flush()
        index = self._index(blocks, 0, n)
        for j, pages in self.pages.items():
            pages.view(-1, pages.shape[-1])[index] = rows[j].to(pages.device, pages.dtype)
        return True

    # ---- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def block_logits(self, reqs: list[DraftRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft forward over every request's `[anchor, MASK x (N-1)]`: ids [R, n], final hidden
        [R*n, D], base logits [R, n, V], n = the largest num_drafts (an adaptive K drafts a shorter block).
        Every tensor-parallel rank runs this part (its collectives)."""
        self.flush()
        n, cfg = max(r.num_drafts for r in reqs), self.cfg
        ids = torch.full((len(reqs), n), cfg.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = torch.tensor([r.anchor for r in reqs], device=self.device)
        positions = torch.cat([torch.arange(r.num_verified, r.num_verified + n, device=self.device) for r in reqs])
        contexts = [[pages.view(-1, pages.shape[-1])[self._index(r.blocks, 0, r.num_verified)] for r in reqs]
                    for pages in self.pages.values()]
        embeds = self.embed_tokens(ids.view(-1)).to(self.dtype)
        hidden = self.model.block_hidden(embeds, positions, contexts, n)               # [R*n, D]
        base = (self.lm_head(hidden.to(self.head_dtype)).float() * cfg.logit_scale).view(len(reqs), n, -1)
        return ids, hidden, base

    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest]) -> list[DraftBlock]:
        """One parallel forward over every request's `[anchor, MASK x (N-1)]`, then the Markov loop."""
        if not reqs:
            return []
        cfg = self.cfg
        ids, hidden, base = self.block_logits(reqs)
        n = ids.shape[1]
        top = self.spec.dspark_draft_topk or cfg.dspark_draft_topk
        prev = ids[:, 0]
        tokens = torch.empty(len(reqs), n, dtype=torch.long)
        keep_logits = self.spec.draft_sample_method == "probabilistic"
        logits_out = torch.empty(len(reqs), n, base.shape[-1]) if keep_logits else None
        embeds_e = []
        for i in range(n):
            e, bias = self.model.markov_bias(prev)
            embeds_e.append(e)
            if top:
                values, index = base[:, i].topk(top, dim=-1)
                logits = torch.full_like(base[:, i], float("-inf")).scatter(1, index, values + bias.gather(1, index))
            else:
                logits = base[:, i] + bias
            picked = logits.argmax(dim=-1)
            if logits_out is not None:
                logits_out[:, i] = logits.cpu()
                for r, req in enumerate(reqs):
                    if req.temperature > 0:
                        picked[r] = sample_draft(logits[r], req.temperature, req.seed, req.num_verified + i + 1)
            tokens[:, i] = picked.cpu()
            prev = picked
        conf = self.model.confidence(hidden.view(len(reqs), n, -1).flatten(0, 1),
                                     torch.stack(embeds_e, dim=1).flatten(0, 1))
        conf_l = conf.view(len(reqs), n).tolist() if conf is not None else None
        out = []
        for r, req in enumerate(reqs):
            k = req.num_drafts
            out.append(DraftBlock(tokens[r, :k].tolist(),
                                  logits_out[r, :k] if logits_out is not None and req.temperature > 0 else None,
                                  conf_l[r][:k] if conf_l else None))
        return out
