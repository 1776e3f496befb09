"""`kimi-pd checkpoint train`: train the `tiny-chat` Kimi-K3 on the synthetic chat corpus, on CPU.

Deterministic from `seed`: the vocabulary, the initial weights (`init_weights`), the corpus stream
(`random.Random(seed)`) and the optimiser all derive from it, torch runs on a fixed thread count with
deterministic algorithms, and the run length is a step count (never wall time). Loss is taken on the
answer turn only. Writes a full checkpoint (config, safetensors, tokenizer, generation config), the
loss curve as `loss.png` and `train_log.json` (losses, timings, machine load).
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.checkpoint.create import generation_config, write_safetensors
from engine.checkpoint.init import init_weights
from engine.checkpoint.layout import CONFIG_FILE, GENERATION_CONFIG_FILE, keeps_fp32
from engine.model.kimi_k3 import KimiK3ForConditionalGeneration
from engine.presets import tiny_chat_config
from engine.training.corpus import Example, Mix, build_tokenizer, sample_example
from engine.training.dense_forward import dense_logits
from shared.model_config import ModelConfig
from shared.net import free_port as _free_port
from shared.prompt.hf_files import save_tokenizer
from shared.prompt.tokenizer import KimiTokenizer

log = logging.getLogger(__name__)

# tool_answer (2 % held-out with 0.5) and reverse get more; 500-step ablations (13:26 UTC) with
# tool_answer 1.0 lowered its held-out answer loss 1.57/1.15 -> 1.32/0.96 (thinking off/on).
DEFAULT_FAMILY_WEIGHTS = {"add": 1.2, "sub": 1.2, "multi_turn": 1.2, "reverse": 1.2, "sort": 0.9,
                          "tool_call": 0.6, "tool_answer": 0.9}
# Fewer `thinking_effort` system messages and re-sent history reasoning than the renderer's variety
# would suggest: both are prompt tokens (no loss) that clients rarely send; the saved tokens buy answers.
DEFAULT_MIX = Mix(effort=0.2, history_reasoning=0.3)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 2800
    tokens_per_step: int = 3072      # padded tokens per batch (examples are bucketed by length)
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 60
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    hidden_size: int = 128
    num_layers: int = 4
    # 1-based layer numbers with KDA, the rest gated NoPE MLA. KDA, MLA, KDA, MLA: a second KDA layer
    # (position from its conv and decay, above the first MLA) lowered the 400-step answer loss 1.01 ->
    # 0.89 for +14 % step time; KDA on 1-3 (0.98) and hidden 192 (1.01), run with a different
    # vocabulary so only roughly comparable, were no better (400-step ablations, 10:20 UTC).
    kda_layers: tuple[int, ...] = (1, 3)
    # With the factorised intra-chunk form (kda_dense.py, at most 16) 16 is ~5 % faster than 8 per step;
    # the form cut a KDA layer's forward + backward 2.5x (150 -> 60 ms CPU at 1.5k tokens, 12:55 UTC).
    kda_chunk_size: int = 16
    # One intra-op thread: on the shared 2-core machine (load 8-10) two OpenMP threads spin against
    # each other and a step is 10-20x slower (measured 07:23 UTC: 2.2 s vs 20-40 s per step).
    threads: int = 1
    workers: int = 2                 # data-parallel processes (one per core), gradients all-reduced
    pool_batches: int = 16           # batches drawn together, so length bucketing has choice
    save_every: int = 0              # also write `step-N/` checkpoints every N steps (0: only the final one)
    family_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FAMILY_WEIGHTS))
    mix: Mix = DEFAULT_MIX


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_batch(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs [B, T], targets [B, T] and a loss mask on the answer tokens' targets."""
    t = max(len(e.token_ids) for e in examples) - 1
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), t), dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.token_ids) - 1
        ids[i, :n] = torch.tensor(e.token_ids[:-1])
        targets[i, :n] = torch.tensor(e.token_ids[1:])
        mask[i, e.num_prompt_tokens - 1:n] = True
    return ids, targets, mask


class BatchStream:
    """Deterministic batches: draw a pool of examples, sort by length, cut into token-budget batches."""

    def __init__(self, tok: KimiTokenizer, cfg: TrainConfig, rng: random.Random) -> None:
        self.tok, self.cfg, self.rng = tok, cfg, rng
        self.queue: list[list[Example]] = []

    def next(self) -> list[Example]:
        if not self.queue:
            self._refill()
        return self.queue.pop()

    def _refill(self) -> None:
        budget = self.cfg.tokens_per_step
        approx = max(1, budget // 160)
        pool = sorted((sample_example(self.tok, self.rng, self.cfg.family_weights, self.cfg.mix)
                       for _ in range(approx * self.cfg.pool_batches)), key=lambda e: len(e.token_ids))
        batches: list[list[Example]] = []
        current: list[Example] = []
        for e in pool:
            longest = max([len(e.token_ids), *(len(x.token_ids) for x in current)])
            if current and longest * (len(current) + 1) > budget:
                batches.append(current)
                current = []
            current.append(e)
        if current:
            batches.append(current)
        self.rng.shuffle(batches)
        self.queue = batches


def masked_loss(model: KimiK3ForConditionalGeneration, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                chunk: int) -> torch.Tensor:
    ids, targets, mask = batch
    return F.cross_entropy(dense_logits(model, ids, chunk, positions=mask), targets[mask])


def new_model(tok: KimiTokenizer, cfg: TrainConfig) -> KimiK3ForConditionalGeneration:
    config = ModelConfig.from_dict(tiny_chat_config(tok.num_ranks, cfg.hidden_size, cfg.num_layers,
                                                      tuple(cfg.kda_layers)))
    model = KimiK3ForConditionalGeneration(config)
    init_weights(model, cfg.seed)
    return model


def setup_determinism(cfg: TrainConfig) -> None:
    torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(True)       # KDA's intra-chunk decays underflow; denormal maths is ~10x slower
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def train(cfg: TrainConfig, out: str | Path | None, progress: bool = True) -> dict:
    """Train from scratch; writes the checkpoint to `out` (None: nothing written). Returns the log.

    With `cfg.workers` > 1 the step's batch is split over that many processes (one core each: on
    this CPU one process per core beats intra-op threads, which spin against each other), whose
    gradients are averaged with a gloo all-reduce before every optimiser step; the ranks start from
    the same weights and draw disjoint example streams, so the run is as deterministic as with one.
    """
    if cfg.workers <= 1:
        return _train_rank(0, cfg, out, progress, None)
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, cfg, out, progress, results), daemon=True)
             for rank in range(cfg.workers)]
    for proc in procs:
        proc.start()
    try:
        result = results.get()
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
    if isinstance(result, BaseException):
        raise result
    return result


def _rank_main(rank: int, port: int, cfg: TrainConfig, out: str | Path | None, progress: bool, results) -> None:
    import torch.distributed as dist
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.workers)
    try:
        result = _train_rank(rank, cfg, out, progress and rank == 0, dist)
        if rank == 0:
            results.put(result)
    except BaseException as exc:     # the parent re-raises it
        results.put(RuntimeError(f"training rank {rank} failed: {exc!r}"))
        raise
    finally:
        dist.destroy_process_group()


def _train_rank(rank: int, cfg: TrainConfig, out: str | Path | None, progress: bool, dist) -> dict:
    setup_determinism(cfg)
    started, cpu_started = time.monotonic(), time.process_time()
    load_before = os.getloadavg()[0]
    tok = build_tokenizer(cfg.seed)
    model = new_model(tok, cfg)
    model.train()
    params = [p for p in model.language_model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    workers = max(1, cfg.workers)
    rank_cfg = replace(cfg, tokens_per_step=cfg.tokens_per_step // workers)
    stream = BatchStream(tok, rank_cfg, random.Random(cfg.seed if workers == 1 else f"{cfg.seed}:{rank}"))
    losses: list[float] = []
    bar = tqdm(range(cfg.steps), desc="training tiny-chat", unit="step", disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = masked_loss(model, make_batch(stream.next(), tok.pad_id), cfg.kda_chunk_size)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss_value = loss.detach()
        if dist is not None:
            loss_value = _average_gradients(params, loss_value, dist, workers)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(loss_value.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.4f}")
        if (rank == 0 and out is not None and cfg.save_every and (step + 1) % cfg.save_every == 0
                and step + 1 < cfg.steps):
            save_checkpoint(model, tok, Path(out) / f"step-{step + 1}")
    elapsed = time.monotonic() - started
    result = {"config": asdict(cfg), "losses": losses, "seconds": elapsed, "steps_per_s": cfg.steps / elapsed,
              # this process's CPU time: on 2 quiet cores (one per worker) the wall time is about this
              "cpu_seconds": time.process_time() - cpu_started,
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "num_params": sum(p.numel() for p in params), "vocab_size": tok.vocab_size}
    if out is not None and rank == 0:
        save_checkpoint(model.eval(), tok, Path(out))
        Path(out, "train_log.json").write_text(json.dumps(result))
        plot_losses(losses, Path(out) / "loss.png")
    return result


def _average_gradients(params: Sequence[torch.Tensor], loss: torch.Tensor, dist, workers: int) -> torch.Tensor:
    """Mean of every rank's gradients (one flat all-reduce) and of their losses."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1)])
    dist.all_reduce(flat)
    flat /= workers
    offset = 0
    for p, g in zip(params, grads, strict=False):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).clone()
        offset += n
    return flat[-1]


def save_checkpoint(model: KimiK3ForConditionalGeneration, tok: KimiTokenizer, out: Path) -> None:
    """The HF checkpoint layout, as `kimi-pd checkpoint create` writes it (fp32 weights)."""
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
    tensors = {name: (t if keeps_fp32(name) else t.float()).detach().contiguous()
               for name, t in model.state_dict().items()}
    write_safetensors(out, tensors, 32 << 20, progress=False)
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config(config), indent=2))
    save_tokenizer(tok, out)


def plot_losses(losses: list[float], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    window = 20
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
              for i in range(len(losses))]
    ax.plot(losses, alpha=0.3, label="step")
    ax.plot(smooth, label=f"mean of {window}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("answer-token loss")
    ax.set_title("tiny-chat training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
