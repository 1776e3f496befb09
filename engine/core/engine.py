"""LLMEngine: requests in, one scheduled forward per `step()`, outputs out. Single-threaded.

It ties the scheduler (who runs), the cache manager (where state lives), the model runner (the
forward), the sampler and the detokenizer. Disaggregation hooks: a request added with
`export_state=True` stops after its first token and is HELD (pages and KDA slot kept) until
`release_export`, an abort, or its lease expiring; `export_state()` copies its state out. A request
added with `imported=` state starts with its prompt already computed and its first token known.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.checkpoint.loader import load_checkpoint
from engine.core.cache_manager import HybridCacheManager, budget_cache
from engine.core.inputs import EngineInput, Resume, checked_max_model_len, encode_images, validate_tokens
from engine.core.model_runner import ModelRunner, RunnerOutput
from engine.core.outputs import CompletionOutput, PromptLogprob, RequestOutput
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import SCHEDULING_POLICIES, Scheduler, SchedulerConfig, SchedulerOutput
from engine.core.state_export import ExportedState, StateIdentity
from engine.dtypes import TORCH_DTYPE_NAMES, torch_dtype
from engine.graphs.config import CompilationConfig
from engine.graphs.decode import setup_decode_graphs
from engine.model.kda import KDAOptions
from engine.model.kimi_k3 import ModelOptions
from engine.parallel.dp_config import DataParallelSettings
from engine.sampler import SamplingState, sample
from engine.spec_decode.config import AnyDraftConfig, SpeculativeConfig, read_draft_config
from engine.spec_decode.proposer import ContextRows, DSparkProposer
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.step import SpecDecodeStep
from engine.spec_decode.verify import VerifyResult
from engine.structured_output import GrammarCompiler
from engine.token_constraints import bad_words_token_ids
from shared.errors import InvalidRequest, InvalidTokenIds, RequestTooLarge
from shared.hashing import block_hashes, root_hash, salted_root
from shared.prompt.detokenizer import IncrementalDetokenizer
from shared.prompt.tokenizer import KimiTokenizer
from shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig(DataParallelSettings):     # + the --data-parallel-* fields (keyword-only)
    model: str
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    request_share: float = 0.5             # of max_num_seqs one request's fan-out holds while others wait
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    block_size: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    cache_memory_bytes: int = 256 << 20
    num_snapshot_slots: int | None = None
    snapshot_interval_blocks: int = 4
    kda_chunk_size: int = 64
    export_lease_s: float | None = 60.0    # None: held until released (a transfer layer owns the lease)
    seed: int = 0
    model_id: str | None = None          # names the prefix-hash chain; defaults to the config hash
    speculative_config: SpeculativeConfig | dict | str | None = None   # vLLM's --speculative-config (DSpark)
    tensor_parallel_size: int = 1          # ranks (processes) sharing the model (engine/parallel/)
    enable_expert_parallel: bool = False   # routed experts split whole across those ranks
    compilation_config: dict | str | None = None   # vLLM's --compilation-config: {"cudagraph_mode": ...}
    enforce_eager: bool = False            # never capture graphs
    # ranks on several hosts (vLLM's --master-addr/--master-port/--nnodes/--node-rank; engine/parallel/launch.py)
    master_addr: str = "127.0.0.1"
    master_port: int = 0                   # 0: any free port (one host only)
    nnodes: int = 1
    node_rank: int = 0
    scheduling_policy: str = "fcfs"        # vLLM's --scheduling-policy: fcfs | priority (lower value first)
    tokenizer: str | None = None           # vLLM's --tokenizer: tokenizer files' directory (default: model)

    def validate(self) -> None:
        checks = {"max_num_seqs": self.max_num_seqs >= 1, "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
                  "block_size": self.block_size >= 1, "kda_chunk_size": self.kda_chunk_size >= 1,
                  "snapshot_interval_blocks": self.snapshot_interval_blocks >= 1,
                  "dtype": self.dtype in TORCH_DTYPE_NAMES, "request_share": 0 < self.request_share <= 1,
                  "export_lease_s": self.export_lease_s is None or self.export_lease_s > 0,
                  "tensor_parallel_size": self.tensor_parallel_size >= 1,
                  "scheduling_policy": self.scheduling_policy in SCHEDULING_POLICIES,
                  "data_parallel_size": self.data_parallel_size >= 1}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid engine settings: {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}")


@dataclass
class StepBatch:
    """One step's requests after the forward: who samples (and from which logits row), whose drafts
    were verified, and the draft context of the tokens kept."""

    sampling: list[Request] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    verified: list[tuple[Request, VerifyResult]] = field(default_factory=list)
    context: ContextRows | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, parallel=None) -> None:    # parallel: a DP rank's handle (dp_rank.py)
        config.validate()
        self.config = config
        options = ModelOptions(kda=KDAOptions(chunk_size=config.kda_chunk_size))
        CompilationConfig.parse(config.compilation_config)        # a bad --compilation-config stops start-up here
        from engine.parallel.launch import tensor_parallel  # TP > 1: starts ranks 1..N-1 (None at TP=1)
        self.tp = parallel if parallel is not None else tensor_parallel(config)
        self.model = self.tp.model if self.tp else load_checkpoint(config.model, torch_dtype(config.dtype),
                                                                    config.device, options)
        self.model.fuse_linears()       # one GEMM per shared input (TP ranks fused their shards already)
        self.tokenizer = KimiTokenizer.from_dir(config.tokenizer or config.model)
        text = self.model.config.text_config
        self.max_model_len = checked_max_model_len(config.max_model_len, text.max_position_embeddings)
        dtype_bytes = torch.finfo(torch_dtype(config.dtype)).bits // 8
        self.spec, draft_cfg = self._speculative_config(text)
        num_spec = (self.spec.num_speculative_tokens or 0) if self.spec else 0       # resolved: never None
        self.cache_config = budget_cache(text, config.cache_memory_bytes, config.block_size, config.max_num_seqs,
                                         config.num_snapshot_slots if config.num_snapshot_slots is not None
                                         else 2 * config.max_num_seqs, dtype_bytes,
                                         config.enable_prefix_caching, config.snapshot_interval_blocks, num_spec,
                                         DSparkProposer.bytes_per_block(draft_cfg, config.block_size, dtype_bytes)
                                         if draft_cfg else 0)
        self.cache = HybridCacheManager(self.cache_config)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy, config.request_share), self.cache)
        config_hash = self.model.config.identity_hash()
        schedule = "".join("K" if text.is_kda_layer(i) else "M" for i in range(text.num_hidden_layers))
        self.identity = StateIdentity(config_hash, config.dtype, schedule, config.block_size)
        self.proposer = self._proposer(config) if self.spec else None
        self.spec_stats = SpecDecodeStats(num_spec) if self.spec else None
        self.runner = (self.tp.make_runner(self.cache_config, self.identity, self.proposer) if self.tp else
                       ModelRunner(self.model, self.cache_config, self.identity,
                                   self.proposer.capture_layers if self.proposer else (), self.proposer))
        setup_decode_graphs(self.runner, self.model, config.device, config.max_num_seqs,
                            CompilationConfig.parse(config.compilation_config), config.enforce_eager)
        self.hash_root = root_hash(config.model_id or config_hash)
        self.eos_token_ids = {self.tokenizer.eos_id}
        self.speculation = (SpecDecodeStep(self.spec, self.proposer, self.spec_stats, self.runner, self.cache,
                                           self.eos_token_ids, self.max_model_len)
                            if self.spec and self.proposer and self.spec_stats else None)
        self.grammars = GrammarCompiler(self.tokenizer, text.vocab_size)   # compiles on first use
        self.requests: dict[str, Request] = {}
        self.held: dict[str, float] = {}                       # request id -> lease expiry (monotonic)
        self._pending_outputs: list[RequestOutput] = []        # produced outside a step (imported first tokens)
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        log.info("engine ready: %d MLA pages x %d tokens (%d tokens), %d+%d KDA slots",
                 self.cache_config.num_blocks, config.block_size, self.capacity_tokens,
                 self.cache_config.num_working_slots, self.cache_config.num_snapshot_slots)

    def _speculative_config(self, text) -> tuple[SpeculativeConfig | None, AnyDraftConfig | None]:
        """`--speculative-config` resolved against its draft and this target (None: no speculation)."""
        spec = SpeculativeConfig.parse(self.config.speculative_config)
        if spec is None:
            return None, None
        spec = spec.with_model_path()
        spec.check_draft_tp(self.config.tensor_parallel_size)
        draft_cfg = read_draft_config(spec.model)
        draft_cfg.check_target(text)
        return spec.resolve(draft_cfg, self.max_model_len), draft_cfg

    def _proposer(self, config: EngineConfig) -> DSparkProposer:
        """The draft on this process; with tensor parallelism, rank 0's share of a draft sharded like the target."""
        assert self.spec is not None
        args = (self.spec, self.model, self.cache_config.num_blocks, config.block_size, torch_dtype(config.dtype),
                torch.device(config.device))
        if self.tp is None or self.tp.group.world_size == 1:      # a DP rank at TP 1 drafts alone
            return DSparkProposer(*args)
        from engine.spec_decode.parallel import TPProposer
        return TPProposer(*args, group=self.tp.group)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent; a TP=1 engine holds no processes)."""
        if self.tp is not None:
            self.tp.close()

    @property
    def capacity_tokens(self) -> int:
        return self.cache_config.capacity_tokens

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: EngineInput | list[int], params: SamplingParams,
                    export_state: bool = False, imported: ExportedState | None = None, group: str | None = None) -> str:
        """Validate and queue (`group`: the fan-out sharing one share of the batch). Raises InvalidRequest."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        inputs = prompt if isinstance(prompt, EngineInput) else EngineInput(list(prompt))
        params.validate(self.model.config.text_config.vocab_size)
        if params.n != 1:
            raise InvalidRequest("the engine runs one sequence per request (LLM and the servers fan n out)",
                                 param="n")
        validate_tokens(inputs.prompt_token_ids, self.model.config.text_config.vocab_size, self.max_model_len)
        max_tokens = self._resolve_max_tokens(len(inputs.prompt_token_ids), params)
        if imported is not None:
            self._check_import(inputs.prompt_token_ids, imported)
        req = Request(request_id, list(inputs.prompt_token_ids), params, export_state=export_state, imported=imported,
                      priority=params.priority, group=group)
        if req.wants_prompt_logprobs:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        req.max_tokens = min(1, max_tokens) if export_state else max_tokens
        req.images = [] if imported else encode_images(self.model, inputs.images, len(req.prompt_token_ids),
                                                        self.tokenizer.media_pad_id, req.prompt_token_ids)
        req.block_hashes = block_hashes(req.prompt_token_ids, self.config.block_size,
                                        salted_root(self.hash_root, params.cache_salt),
                                        [img.span for img in req.images])
        req.sampling_seed = (params.seed if params.seed is not None
                             else int(torch.randint(0, 2**62, (1,), generator=self._seed_source)))
        req.generator = torch.Generator().manual_seed(req.sampling_seed % 2**64)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, params, self.eos_token_ids)
        if inputs.resume is not None:
            self._resume(req, inputs.resume, vocab_size=self.model.config.text_config.vocab_size)
        req.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer.encode)
        if params.structured_output is not None:
            req.grammar = self.grammars.matcher(params.structured_output, accepted=req.output_token_ids)
        self.requests[request_id] = req
        if imported is not None:
            self._pending_outputs.append(self._adopt_first_token(req, imported))
        if not req.is_finished:
            self.scheduler.add(req)
        return request_id

    def _resume(self, req: Request, resume: Resume, vocab_size: int) -> None:
        """Adopt already delivered tokens as outputs: the detokenizer and `text` are primed with them
        (their text is not emitted again) and the generator skips the draws that produced them."""
        ids = list(resume.token_ids)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidTokenIds(bad, vocab_size, param="resume.token_ids")
        if not ids or len(ids) >= req.max_tokens or req.num_prompt_tokens + len(ids) >= self.max_model_len:
            raise InvalidRequest(f"resume needs 1..{req.max_tokens - 1} tokens that leave room to generate",
                                 param="resume.token_ids")
        if not 0 <= resume.seed_offset <= len(ids):
            raise InvalidRequest("resume.seed_offset must be in 0..len(token_ids)", param="resume.seed_offset")
        for token in ids:
            step = req.detokenizer.add(token)
            if step.stopped is not None:
                raise InvalidRequest("the resumed tokens already end the request", param="resume.token_ids")
            req.text += step.new_text
        req.output_token_ids = ids
        req.output_logprobs = [0.0] * len(ids)          # not known here; only new tokens' logprobs are reported
        req.output_top_logprobs = [None] * len(ids)
        if not req.params.is_greedy:
            noise = torch.empty(self.model.config.text_config.vocab_size)
            for _ in range(resume.seed_offset):       # one row of exponential noise per sampled token
                noise.exponential_(generator=req.generator)

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                                 f"maximum context length of {self.max_model_len}", param="max_tokens")
        if prompt_len + max_tokens > self.capacity_tokens:
            raise RequestTooLarge(prompt_len + max_tokens, self.capacity_tokens)
        return max_tokens

    def _check_import(self, prompt_token_ids: list[int], state: ExportedState) -> None:
        if list(state.prompt_token_ids) != list(prompt_token_ids):
            raise InvalidRequest("imported state was computed for a different prompt")
        self.identity.check_compatible(state.identity)

    def _adopt_first_token(self, req: Request, state: ExportedState) -> RequestOutput:
        """The prefill worker's first token (and prompt logprobs) become this request's own."""
        req.num_cached_tokens = state.num_cached_tokens
        if req.wants_prompt_logprobs:
            raw = state.extra.get("prompt_logprobs")
            if raw is None:
                raise InvalidRequest("imported state carries no prompt logprobs", param="prompt_logprobs")
            req.prompt_logprobs = [None if e is None else PromptLogprob.from_wire(e) for e in raw]
        if req.max_tokens == 0:
            self._finish(req, "length", None)
            return self._output(req, "", [])
        if not req.params.is_greedy:
            # the prefill worker drew this token's noise from the same seed: skip that draw, so a
            # seeded request samples the same tokens disaggregated as on one engine
            torch.empty(self.model.config.text_config.vocab_size).exponential_(generator=req.generator)
        return self._append_tokens(req, [state.first_token_id], [state.first_logprob], [state.first_top_logprobs])

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free what it holds. Unknown ids return None."""
        req = self.requests.get(request_id)
        if req is None or (req.is_finished and request_id not in self.held):
            return None
        if req.status == RequestStatus.HELD:
            self.release_export(request_id, reason="abort")
            return None
        self._finish(req, "abort", None)
        return self._output(req, "", [])

    # ---- export / release -----------------------------------------------------------------------
    def export_state(self, request_id: str) -> ExportedState:
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.HELD:
            raise KeyError(f"no held state for request {request_id!r}")
        parts = self.runner.export_state(req)
        top = req.output_top_logprobs[0] if req.output_top_logprobs else None
        extra: dict[str, Any] = {"draft_id": self.proposer.draft_id} if self.proposer else {}
        if req.prompt_logprobs is not None:       # they travel with the state to the decode worker
            extra["prompt_logprobs"] = [None if e is None else e.to_wire() for e in req.prompt_logprobs]
        first_token = req.output_token_ids[0] if req.output_token_ids else -1     # -1: max_tokens=0
        first_logprob = req.output_logprobs[0] if req.output_logprobs else 0.0
        return ExportedState(request_id, list(req.prompt_token_ids), first_token, first_logprob,
                             self.identity, num_cached_tokens=req.num_cached_tokens, first_top_logprobs=top,
                             extra=extra, **parts)

    def release_export(self, request_id: str, reason: str = "released") -> bool:
        """Free a held prefill state. True if something was held (frees exactly once)."""
        if self.held.pop(request_id, None) is None:
            return False
        req = self.requests.pop(request_id)
        self.cache.free(req)
        req.status = RequestStatus.FINISHED
        log.debug("released held state of %s (%s)", request_id, reason)
        return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        expired = [rid for rid, expiry in self.held.items() if expiry <= now]
        for rid in expired:
            self.release_export(rid, reason="expired")
        return expired

    # ---- stepping -------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        """One forward for the scheduled requests; returns every output produced since the last step:
        schedule, execute, account (computed tokens, verified drafts), sample, propose."""
        pending, self._pending_outputs = self._pending_outputs, []
        self.expire_leases()
        out = self.scheduler.schedule()
        if not out.seqs:
            return pending
        started = time.perf_counter()
        result = self.runner.execute(out)
        batch = self._account(out, result)
        if self.speculation is not None:           # before commit publishes blocks or a finish frees them
            self.speculation.write_context(batch.context)
        for s in out.seqs:
            self.cache.commit(s.req)
        pending += self._finish_scored_only(batch)
        outputs = self._sample(batch, result.logits)
        verify_s = time.perf_counter() - started if batch.verified else None
        outputs += [self._append_tokens(req, c.token_ids, c.logprobs, c.top_logprobs) for req, c in batch.verified]
        if self.speculation is not None:
            self.speculation.propose(batch.sampling + [r for r, _ in batch.verified], verify_s, started)
        return pending + outputs

    def _account(self, out: SchedulerOutput, result: RunnerOutput) -> StepBatch:
        """What the forward computed, per request: prompt logprobs, computed tokens, verified drafts,
        the rows to sample from, and the draft context of the tokens kept."""
        for index, (start, chunk_logits) in result.prompt_logits.items():
            record_prompt_logprobs(out.seqs[index].req, start, chunk_logits)
        batch, row = StepBatch(), 0
        kept: list[tuple[list[int], int, int, int]] = []         # (blocks, first position, feature row, rows)
        for s, offset in zip(out.seqs, result.token_offsets, strict=False):
            req = s.req
            req.first_scheduled_time = req.first_scheduled_time or time.monotonic()
            if s.verifies:
                assert self.speculation is not None
                n = len(s.draft_token_ids)
                checked = self.speculation.verify(s, result.logits[row: row + n + 1])
                row += n + 1
                consumed = checked.num_consumed
                batch.verified.append((req, checked))
            else:
                req.num_computed_tokens += s.num_new_tokens
                consumed = s.num_new_tokens
                if s.samples:
                    batch.sampling.append(req)
                    batch.sample_rows.append(row)
                    row += 1
            if result.features is not None and consumed:
                kept.append((req.blocks, s.num_computed_before, offset, consumed))
        if result.features is not None and kept:
            batch.context = ContextRows.of_step(kept, result.features, self.config.block_size)
        return batch

    def _finish_scored_only(self, batch: StepBatch) -> list[RequestOutput]:
        """max_tokens=0 (prompt scoring): the prompt is computed, nothing is generated; they leave the batch."""
        keep = [i for i, r in enumerate(batch.sampling) if r.max_tokens > 0]
        if len(keep) == len(batch.sampling):
            return []
        scored = [r for r in batch.sampling if r.max_tokens == 0]
        batch.sampling, batch.sample_rows = [batch.sampling[i] for i in keep], [batch.sample_rows[i] for i in keep]
        outputs = []
        for req in scored:
            if req.export_state:
                self._hold(req, "length", None)
            else:
                self._finish(req, "length", None)
            outputs.append(self._output(req, "", []))
        return outputs

    def _sample(self, batch: StepBatch, logits: torch.Tensor) -> list[RequestOutput]:
        """One token for each request whose step reached the end of its known tokens."""
        if not batch.sampling:
            return []
        states = [SamplingState(params=r.params, prompt_token_ids=r.prompt_token_ids,
                                output_token_ids=r.output_token_ids, generator=r.generator,
                                bad_words_token_ids=r.bad_words_token_ids, grammar=r.grammar) for r in batch.sampling]
        sampled = sample(logits[batch.sample_rows], states, self.eos_token_ids)
        return [self._append_tokens(req, [tok], [lp], [top]) for req, tok, lp, top in
                zip(batch.sampling, sampled.token_ids, sampled.logprobs, sampled.top_logprobs, strict=False)]

    # ---- outputs ----------------------------------------------------------------------------------
    def _append_tokens(self, req: Request, tokens: list[int], logprobs: list[float], tops: list) -> RequestOutput:
        """Append tokens in order until one stops the request; one output for all of them."""
        new_text, added = "", []
        for token, logprob, top in zip(tokens, logprobs, tops, strict=False):
            req.output_token_ids.append(token)
            if req.grammar is not None:
                req.grammar.accept(token)
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top)
            added.append(token)
            step = req.detokenizer.add(token)
            piece = step.new_text
            reason, stop = self._stop_check(req, step.stopped)
            if reason is not None:
                piece += req.detokenizer.finish() if reason != "stop_string" else ""
                if req.export_state:
                    self._hold(req, reason, stop)
                else:
                    self._finish(req, reason, stop)
            req.text += piece
            new_text += piece
            if reason is not None:
                break
        return self._output(req, new_text, added)

    def _stop_check(self, req: Request, stopped) -> tuple[str | None, int | str | None]:
        if stopped is not None:                     # vLLM: no stop_reason at the model's own end (eos)
            return ("stop", None if stopped.kind == "eos" else stopped.value)
        if req.grammar is not None and req.grammar.terminated:
            return ("stop", None)                   # the structured output is complete
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return ("length", None)
        return ("repetition", "repetition_detected") if req.params.repeats(req.output_token_ids) else (None, None)

    def _finish(self, req: Request, reason: str, stop) -> None:
        self.scheduler.remove(req)
        self.cache.free(req)
        req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED, reason, stop
        self.requests.pop(req.request_id, None)

    def _hold(self, req: Request, reason: str, stop) -> None:
        self.scheduler.remove(req)
        req.status, req.finish_reason, req.stop_reason = RequestStatus.HELD, reason, stop
        lease = self.config.export_lease_s
        self.held[req.request_id] = math.inf if lease is None else time.monotonic() + lease

    def _output(self, req: Request, new_text: str, new_tokens: list[int]) -> RequestOutput:
        finished = req.status in (RequestStatus.FINISHED, RequestStatus.HELD)
        completion = CompletionOutput(0, req.text, list(req.output_token_ids), list(req.output_logprobs),
                                      list(req.output_top_logprobs), req.finish_reason, req.stop_reason)
        queued = None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time
        prompt_done = req.imported is not None or req.num_computed_tokens >= req.num_prompt_tokens
        scored = req.prompt_logprobs if prompt_done else None
        return RequestOutput(req.request_id, req.prompt_token_ids, [completion], finished,
                             req.num_cached_tokens, new_text, new_tokens, queued, scored)

    # ---- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every block and slot is owned by exactly the live requests that reference it."""
        holders = [r for r in self.requests.values() if r.status != RequestStatus.FINISHED]
        self.cache.check_integrity(holders)
        live = set(self.scheduler.running) | set(self.scheduler.waiting)
        for r in self.requests.values():
            if r.status in (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED) and r not in live:
                raise AssertionError(f"request {r.request_id} is {r.status.value} but in no queue")


def record_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
    """Score prompt tokens start+1 .. start+k from the logits at positions start .. start+k-1 (raw,
    as vLLM reports them). A recomputed chunk (after preemption) writes the same values again."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + logits.shape[0]], device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    n = req.params.prompt_logprobs or 0
    chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
    if n:
        top_values, top_ids = logprobs.topk(n, dim=-1)
        tops = list(zip(top_ids.tolist(), top_values.tolist(), strict=False))
    else:
        tops = [([], [])] * len(chosen_l)
    rows = zip(targets.tolist(), chosen_l, ranks_l, tops, strict=False)
    assert req.prompt_logprobs is not None              # sized when the request was added
    for i, (token_id, lp, rank, (ids, values)) in enumerate(rows):
        req.prompt_logprobs[start + 1 + i] = PromptLogprob(token_id, lp, rank, list(zip(ids, values, strict=False)))
