"""`kimi-pd checkpoint train-draft`: distil a DSpark draft from its target (docs/dspark.md, Training a draft).

Data is the target's own behaviour: prompts (the task families the target was trained on when
`engine.training` is present, else the shipped tokenizer corpus) are answered greedily by the target
through the serving engine; one forward per sequence captures the target features at the draft's
`target_layer_ids`. Training then mirrors serving exactly: for an anchor position a (a token the
target emitted), context rows come from the features of positions < a, the query block
`[x_a, MASK x (N-1)]` sits at a..a+N-1 and block position k must predict the target's greedy token
x_{a+k+1}; the Markov head is teacher-forced with prev = x_{a+k} (what serving sees when the drafts
before it are accepted). The confidence head learns P(draft == target). `block_logits` is the dense
batched form of the proposer's forward (same parameters, same maths; a test checks they agree).
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.forward_batch import ForwardBatch, HybridCacheTensors, SequenceSlice
from engine.spec_decode.checkpoint import config_for, save_draft
from engine.spec_decode.draft_model import (
    DraftGQA,
    DraftLayer,
    DraftMLA,
    DSparkDraftModel,
    apply_rope,
    apply_rope_neox,
    draft_model_for,
    rope_cos_sin,
)
from shared.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftTrainConfig:
    block: int = 7
    num_layers: int = 2
    attention: str = "mla"                  # "gqa": the Qwen3-style draft (docs/dspark.md)
    num_sequences: int = 384
    max_new_tokens: int = 160
    steps: int = 1000
    batch_sequences: int = 8
    anchors_per_sequence: int = 12
    lr: float = 2e-3
    weight_decay: float = 0.01
    position_decay: float = 0.9             # loss weight of block position k: decay**k
    seed: int = 0
    # One intra-op thread: these tensors are small, and on a shared 2-core machine two OpenMP threads
    # spin against each other (measured here: log_softmax of a [3, 6] tensor 2.8 ms vs 1.4 us).
    threads: int = 1


# ---- data --------------------------------------------------------------------------------------

def training_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Prompts the target answers: its training task families when available, else corpus lines."""
    rng = random.Random(f"draft-prompts:{seed}")
    try:
        from engine.training.corpus import sample_example
        from engine.training.tasks import FAMILIES
        weights = {f: 1.0 for f in FAMILIES}
        out = []
        for _ in range(n):
            ex = sample_example(tokenizer, rng, weights)
            out.append(ex.token_ids[: ex.num_prompt_tokens])
        return out
    except ImportError:
        from shared.prompt.bpe_train import DEFAULT_CORPUS
        corpus = DEFAULT_CORPUS.read_text().split()
        out = []
        for _ in range(n):
            start = rng.randrange(0, max(1, len(corpus) - 40))
            out.append(tokenizer.encode(" ".join(corpus[start: start + rng.randint(8, 30)])))
        return out


@torch.no_grad()
def target_features(model, token_ids: list[int], layers: tuple[int, ...], block_size: int = 16) -> torch.Tensor:
    """One forward of the target over a whole sequence -> features [T, hidden * len(layers)]."""
    cfg = model.config.text_config
    t = len(token_ids)
    blocks = -(-t // block_size) + 1
    cache = HybridCacheTensors.allocate(cfg, blocks, 1, block_size, next(model.parameters()).dtype)
    piece = SequenceSlice(t, 0, 0, torch.arange(blocks), reset_kda_state=True)
    batch = ForwardBatch([piece], cache, torch.tensor([t - 1]), capture_layers=layers)
    model(torch.tensor(token_ids), batch)
    return torch.cat(batch.captured, dim=-1).float()


@dataclass
class Sequence:
    token_ids: torch.Tensor          # [T] prompt + the target's greedy answer
    num_prompt: int
    features: torch.Tensor           # [T, F]


def build_dataset(target_dir: str | Path, cfg: DraftTrainConfig, layers: tuple[int, ...],
                  prompts: list[list[int]] | None = None) -> list[Sequence]:
    from engine import LLM, SamplingParams
    llm = LLM(str(target_dir), max_num_seqs=16, max_num_batched_tokens=4096, cache_memory_bytes=512 << 20,
              enable_prefix_caching=False)
    prompts = prompts or training_prompts(llm.tokenizer, cfg.num_sequences, cfg.seed)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens))
    data = []
    for prompt, out in zip(prompts, outs, strict=False):
        ids = prompt + out.output.token_ids
        if len(out.output.token_ids) < 2:
            continue
        data.append(Sequence(torch.tensor(ids), len(prompt), target_features(llm.engine.model, ids, layers)))
    return data


# ---- the dense training forward ------------------------------------------------------------------

def _attention(attn: DraftMLA, x: torch.Tensor, q_pos: torch.Tensor, ctx_rows: torch.Tensor,
               allowed: torch.Tensor) -> torch.Tensor:
    """x [B, Q, D] queries at q_pos [B, Q]; ctx_rows [B, T, kv+rope]; allowed [B, Q, T+Q] -> [B, Q, D]."""
    b, q_len, _ = x.shape
    nh = attn.num_heads
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(b, q_len, nh, attn.nope + attn.rope)
    q_nope, q_pe = q.split([attn.nope, attn.rope], dim=-1)
    cos, sin = rope_cos_sin(q_pos.reshape(-1), attn.rope, attn.theta)
    q_pe = apply_rope(q_pe.reshape(b * q_len, nh, attn.rope), cos, sin).view(b, q_len, nh, attn.rope)
    own = attn.cache_rows(x.reshape(b * q_len, -1), cos, sin).view(b, q_len, -1)
    kv = torch.cat([ctx_rows, own], dim=1)                                           # [B, T+Q, kv+rope]
    c, k_pe = kv.split([attn.kv_lora, attn.rope], dim=-1)
    w = attn.kv_b_proj.weight.view(nh, attn.nope + attn.v_dim, attn.kv_lora)
    k_nope = torch.einsum("bsc,hnc->bhsn", c, w[:, : attn.nope])
    v = torch.einsum("bsc,hvc->bhsv", c, w[:, attn.nope:])
    scores = (torch.einsum("bqhn,bhsn->bhqs", q_nope, k_nope)
              + torch.einsum("bqhr,bsr->bhqs", q_pe, k_pe)) * attn.scale
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    out = torch.einsum("bhqs,bhsv->bqhv", probs, v).reshape(b, q_len, nh * attn.v_dim)
    return attn.o_proj(out)


def _gqa_attention(attn: DraftGQA, x: torch.Tensor, q_pos: torch.Tensor, ctx_rows: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
    """`_attention` for the GQA draft: ctx_rows [B, T, 2*kv_heads*head_dim] (K then V)."""
    b, q_len, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    cos, sin = rope_cos_sin(q_pos.reshape(-1), hd, attn.theta)
    q = apply_rope_neox(attn.q_norm(attn.q_proj(x).view(b * q_len, nh, hd)), cos, sin).view(b, q_len, nh, hd)
    own = attn.cache_rows(x.reshape(b * q_len, -1), cos, sin).view(b, q_len, -1)
    k, v = torch.cat([ctx_rows, own], dim=1).split(nkv * hd, dim=-1)              # [B, T+Q, nkv*hd] each
    k = k.view(b, -1, nkv, hd).repeat_interleave(attn.group, dim=2)
    v = v.view(b, -1, nkv, hd).repeat_interleave(attn.group, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q, k) * attn.scale
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    return attn.o_proj(torch.einsum("bhqs,bshd->bqhd", probs, v).reshape(b, q_len, nh * hd))


def block_logits(draft: DSparkDraftModel, embed, lm_head, features: torch.Tensor, valid: torch.Tensor,
                 token_ids: torch.Tensor, anchors: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Base draft logits [B, M, n, V] and hidden [B, M, n, D] for query blocks at `anchors` [B, M].

    features [B, T, F] (rows past a sequence's length are padding), valid [B, T], token_ids [B, T].
    Block m of row b attends the context rows of positions < anchors[b, m] and its own n rows.
    """
    cfg = draft.cfg
    b, t = token_ids.shape
    m = anchors.shape[1]
    context = draft.context_states(features)
    cos_c, sin_c = rope_cos_sin(torch.arange(t).repeat(b), draft.rope_dim, cfg.rope_theta)
    offsets = torch.arange(n)
    q_pos = (anchors[:, :, None] + offsets).reshape(b, m * n)
    ids = torch.full((b, m, n), cfg.mask_token_id, dtype=torch.long)
    ids[:, :, 0] = token_ids.gather(1, anchors)
    ctx_allowed = (torch.arange(t)[None, None, :] < anchors.repeat_interleave(n, dim=1)[:, :, None]) & valid[:, None]
    block_of = torch.arange(m).repeat_interleave(n)
    own_allowed = (block_of[:, None] == block_of[None, :]).expand(b, m * n, m * n)
    allowed = torch.cat([ctx_allowed, own_allowed], dim=-1)
    h, residual = embed(ids.view(b, m * n)), None
    for layer in typing.cast("Iterable[DraftLayer]", draft.layers):       # an nn.ModuleList of DraftLayer
        rows = layer.self_attn.cache_rows(context.reshape(b * t, -1), cos_c, sin_c).view(b, t, -1)
        residual = h if residual is None else h + residual
        attn, x = layer.self_attn, layer.input_layernorm(residual)
        a = (_gqa_attention(attn, x, q_pos, rows, allowed) if isinstance(attn, DraftGQA)
             else _attention(attn, x, q_pos, rows, allowed))
        residual = a + residual
        h = layer.mlp(layer.post_attention_layernorm(residual))
    hidden = draft.output_norm(h + residual)
    base = lm_head(hidden).float() * cfg.logit_scale
    return base.view(b, m, n, -1), hidden.view(b, m, n, -1)


def _batch(data: list[Sequence], rng: random.Random, cfg: DraftTrainConfig, n: int):
    seqs = rng.sample(data, min(cfg.batch_sequences, len(data)))
    t = max(s.token_ids.numel() for s in seqs)
    f = seqs[0].features.shape[1]
    feats, ids, valid = torch.zeros(len(seqs), t, f), torch.zeros(len(seqs), t, dtype=torch.long), \
        torch.zeros(len(seqs), t, dtype=torch.bool)
    picked: list[list[int]] = []
    for i, s in enumerate(seqs):
        length = s.token_ids.numel()
        feats[i, :length], ids[i, :length], valid[i, :length] = s.features, s.token_ids, True
        # anchors are tokens the target emitted (serving drafts after each one), with >= 1 label after
        choices = list(range(s.num_prompt, length - 1))
        picked.append([rng.choice(choices) for _ in range(cfg.anchors_per_sequence)])
    anchors = torch.tensor(picked)
    label_pos = anchors[:, :, None] + 1 + torch.arange(n)                            # [B, M, n]
    lengths = valid.sum(1)
    label_ok = label_pos < lengths[:, None, None]
    labels = ids.gather(1, label_pos.clamp(max=t - 1).view(len(seqs), -1)).view_as(label_pos)
    prev = ids.gather(1, (label_pos - 1).clamp(max=t - 1).view(len(seqs), -1)).view_as(label_pos)
    return feats, valid, ids, anchors, labels, prev, label_ok


def _draft_loss(draft: DSparkDraftModel, lm, batch: tuple, weights: torch.Tensor):
    """One batch's training loss (position-weighted CE, plus the confidence head's BCE when it has one), with the
    top-1 hits and the valid mask the step's accuracy is counted on; kept apart so the loop reads as a loop."""
    feats, valid, ids, anchors, labels, prev, ok = batch
    draft_cfg = draft.cfg
    base, hidden = block_logits(draft, lm.model.embed_tokens, lm.lm_head, feats, valid, ids, anchors, len(weights))
    e = draft.markov_head.markov_w1(prev)
    logits = base + draft.markov_head.markov_w2(e).float() * draft_cfg.logit_scale
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    w = weights * ok
    loss = (ce * w).sum() / w.sum()
    hit = (logits.argmax(-1) == labels) & ok
    conf = draft.confidence(hidden.flatten(0, 2), e.flatten(0, 2)) if draft_cfg.enable_confidence_head else None
    if conf is not None:
        bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), hit.flatten().float(), reduction="none")
        loss = loss + 0.1 * (bce * ok.flatten()).sum() / ok.sum()
    return loss, hit, ok


def train_draft(target_dir: str | Path, out: str | Path, cfg: DraftTrainConfig = DraftTrainConfig(),
                progress: bool = True, data: list[Sequence] | None = None) -> dict:
    """Distil a draft for `target_dir` into `out`; returns the training log (also written as train_log.json)."""
    from engine.checkpoint.init import init_weights
    from engine.checkpoint.loader import load_checkpoint
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    target_cfg = ModelConfig.from_file(Path(target_dir) / "config.json")
    draft_cfg = config_for(target_cfg, cfg.block, cfg.num_layers, cfg.seed, cfg.attention)
    started = time.monotonic()
    data = data if data is not None else build_dataset(target_dir, cfg, draft_cfg.target_layer_ids)
    data_s = time.monotonic() - started
    target = load_checkpoint(target_dir)
    lm = target.language_model
    for p in target.parameters():
        p.requires_grad_(False)
    draft = draft_model_for(draft_cfg)
    init_weights(draft, cfg.seed)
    draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    n = cfg.block
    weights = cfg.position_decay ** torch.arange(n, dtype=torch.float32)
    losses, accs = [], []
    pos_hits, pos_total = torch.zeros(n), torch.zeros(n)
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        loss, hit, ok = _draft_loss(draft, lm, _batch(data, rng, cfg, n), weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step >= cfg.steps - 100:
            pos_hits += hit.sum((0, 1)).float()
            pos_total += ok.sum((0, 1)).float()
        accs.append(float(hit.sum() / ok.sum()))
        if progress and (step % 100 == 0 or step == cfg.steps - 1):
            log.warning("train-draft step %d/%d loss %.3f top-1 %.3f", step, cfg.steps, losses[-1], accs[-1])
    draft.eval()
    result = {"steps": cfg.steps, "sequences": len(data), "data_seconds": round(data_s, 1),
              "train_seconds": round(time.monotonic() - started - data_s, 1),
              "final_loss": sum(losses[-50:]) / len(losses[-50:]), "final_top1": sum(accs[-50:]) / len(accs[-50:]),
              "final_top1_per_position": [round(float(h / max(t, 1)), 3)
                                          for h, t in zip(pos_hits, pos_total, strict=True)],
              "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}}
    path = save_draft(draft, draft_cfg, out, f"trained-seed{cfg.seed}")
    (path / "train_log.json").write_text(json.dumps({**result, "losses": losses[::10]}, indent=1))
    return result
