"""Latent MoE with a biased sigmoid router and shared experts (docs/model.md, Latent MoE)."""
from __future__ import annotations

import ctypes
import itertools
import typing

import torch
from torch import nn

from engine.model import decode_ops, rowdot
from engine.model.fused import EXPERT_GEMMS_ATTR, FUSED_ATTR, fuse_linears, fused_gemm_max_rows, project
from engine.model.gemm import Linear, grouped_kernel, linear, panel_weight, row_major_weights, rowdot_now
from engine.model.layers import RMSNorm, SiTUMLP, cast, situ, upcast
from shared.model_config import TextConfig


def route(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, renormalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router, noaux_tc: the bias only picks experts, weights come from the unbiased scores.

    logits: [T, E] fp32. Returns (weights [T, k] fp32, expert ids [T, k] int64). Float32 inference runs
    it in one C call (engine/model/decode_ops.py; the same choice, weights equal to rounding).
    """
    if top_k <= logits.shape[-1] and logits.dim() == 2:
        ops = decode_ops.usable(logits, correction_bias)
        if ops is not None and correction_bias.is_contiguous():
            return ops.route(logits, correction_bias, top_k, renormalize, scaling)
    scores = torch.sigmoid(upcast(logits))
    ids = torch.topk(scores + upcast(correction_bias), top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return (weights if scaling == 1.0 else weights * scaling), ids     # x * 1.0 is x: skip the call


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return upcast(x) @ upcast(self.weight).t()


class Expert(nn.Module):
    """One routed expert at the latent width: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, width: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = Linear(width, intermediate, bias=False)
        self.w3 = Linear(width, intermediate, bias=False)
        self.w2 = Linear(intermediate, width, bias=False)


class LatentMoE(nn.Module):
    """Route on the full-width input, run experts at the latent width, norm, project back, add shared."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d, latent = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.top_k, self.renormalize = cfg.num_experts_per_token, cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.beta, self.linear_beta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
        self.gate = Router(d, cfg.num_experts)
        self.experts = nn.ModuleList(Expert(latent, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.routed_expert_down_proj = Linear(d, latent, bias=False)
        self.routed_expert_up_proj = Linear(latent, d, bias=False)
        self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.shared_experts = (SiTUMLP(d, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                       self.beta, self.linear_beta) if cfg.num_shared_experts else None)
        # Expert parallelism (engine/parallel/shard.py): this rank's experts and the sum over ranks.
        self.expert_range: tuple[int, int] | None = None
        self.reduce_routed = None
        # Data parallelism: the routed tokens of every DP rank meet here (engine/parallel/dp_comm.py).
        self.expert_parallel = None

    def forward(self, x: torch.Tensor, static: bool = False) -> torch.Tensor:
        """static: capture-safe (no host reads of the routing): every local expert runs on every token
        and a dense routing-weight mask keeps the chosen ones (decode graphs; same sums as dispatch)."""
        if not static and (y := self._rows_in_c(x)) is not None:
            return y
        linears = self._input_linears()
        outs = project(self, x, linears, (1,) * len(linears))
        logits = outs.pop(0) if linears[0] is self.gate else self.gate.logits(x)
        h = outs.pop(0)
        weights, ids = route(logits, self.gate.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)
        if self.expert_parallel is not None:
            y = self.expert_parallel.routed(self, h, weights, ids)
        else:
            y = self._routed_dense(h, weights, ids) if static else self._routed_dispatch(h, weights, ids)
        if self.reduce_routed is not None:
            y = self.reduce_routed(y)
        y = cast(y, x.dtype)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        y = self.routed_expert_up_proj(y)
        return y + self.shared_experts.down(*outs) if self.shared_experts is not None else y

    def _rows_in_c(self, x: torch.Tensor) -> torch.Tensor | None:
        """This layer on a decode step's few tokens in one C call (`decode_ops.c`'s `moe_rows`), where every
        linear of the Python path would run on the rowdot kernels: the same products and operators in the
        same order, so bitwise that path's result (tests/engine/model/test_decode_layers.py). None where it
        does not apply."""
        ops = decode_ops.layer_usable(x)
        if ops is None or not rowdot_now(x):
            return None
        plan = self._rows_plan()
        rows, kernel = x.shape[0], rowdot.kernel()
        if plan is None or rows > plan.max_rows or kernel is None:
            return None
        panels = [0, 0, 0]
        if rows > rowdot.row_major_max_rows():
            panels = [panel_weight(w, kernel).data_ptr() if w is not None else 0 for w in plan.dense]
        y = torch.empty(rows, plan.hidden, dtype=torch.float32)
        scratch = torch.empty(plan.scratch_floats(rows), dtype=torch.float32)
        ints = torch.empty(plan.scratch_longs(rows), dtype=torch.int64)
        missing = torch.empty(len(plan.w13s), dtype=torch.int64)
        x = x.contiguous()
        while True:
            lacking = ops.moe_rows(rows, *plan.sizes, rowdot.row_major_max_rows(), x.data_ptr(), plan.w_in_ptr,
                                   panels[0], *plan.routing, panels[1], plan.down_ptr, panels[2], *plan.betas,
                                   scratch.data_ptr(), ints.data_ptr(), missing.data_ptr(), y.data_ptr())
            if not lacking:
                return y
            for e in missing[:lacking].tolist():          # experts meeting two rows for the first time
                plan.add_panels(e, panel_weight(plan.w13s[e], kernel), panel_weight(plan.w2s[e], kernel))

    def _rows_plan(self) -> _RowsPlan | None:
        """The constant arguments of `_rows_in_c`, made again when the fusing, the parallel layout or the
        fused input weight changes (None kept where it cannot run)."""
        fused, gemms = self.__dict__.get(FUSED_ATTR), self.__dict__.get(EXPERT_GEMMS_ATTR)
        w_in = fused.groups[0].weight if fused is not None and fused.groups else None
        version = None if w_in is None else (w_in.data_ptr(), -1 if w_in.is_inference() else w_in._version)
        key = (id(fused), id(gemms), self.expert_range, id(self.expert_parallel), id(self.reduce_routed), version)
        held = self.__dict__.get("_rows_plan_held")
        if held is None or held[0] != key:
            held = self.__dict__["_rows_plan_held"] = (key, _rows_plan(self, fused, gemms))
        return held[1]

    def _input_linears(self) -> tuple[nn.Module, ...]:
        """Every projection of the layer input x: the router (when it computes in x's dtype: its fp32
        weight beside bf16 linears keeps its own fp32 GEMM), the latent down projection and the shared
        experts' gate/up."""
        down = self.routed_expert_down_proj
        joins = isinstance(down, nn.Linear) and self.gate.weight.dtype == down.weight.dtype
        shared = (self.shared_experts.gate_proj, self.shared_experts.up_proj) if self.shared_experts else ()
        return ((self.gate,) if joins else ()) + (down,) + shared

    def fuse_linears(self) -> None:
        """The layer input's projections as one GEMM per weight kind and every local expert's w1/w3 as one
        (engine/model/fused.py); after any sharding."""
        linears = self._input_linears()
        fuse_linears(self, linears, (1,) * len(linears))
        gemms: list | None = []
        for e in self._local_experts():
            expert = self._expert_at(e)
            fused = fuse_linears(expert, (expert.w1, expert.w3), (1, 1))
            w13 = expert.__dict__[FUSED_ATTR].groups[0] if fused else None
            if gemms is not None and isinstance(w13, Linear) and isinstance(expert.w2, Linear):
                gemms.append((w13.weight, expert.w1.weight, expert.w3.weight, expert.w2.weight,
                              fused_gemm_max_rows(w13.weight)))
            else:
                gemms = None
        # float experts: the dispatch loop calls their GEMMs directly (no module calls per expert)
        self.__dict__[EXPERT_GEMMS_ATTR] = gemms

    def _expert_at(self, e: int) -> Expert:
        """Local expert `e`: `experts` is an nn.ModuleList of Expert (another rank's slots hold empty
        modules after expert-parallel sharding, and only local indices are asked for)."""
        return typing.cast(Expert, self.experts[e])

    def _local_experts(self) -> range:
        lo, hi = self.expert_range if self.expert_range is not None else (0, len(self.experts))
        return range(lo, hi)

    def _gate_up(self, e: int, he: torch.Tensor) -> list[torch.Tensor]:
        expert = self._expert_at(e)
        return project(expert, he, (expert.w1, expert.w3), (1, 1))

    def _expert(self, e: int, he: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(e, he)
        return self._expert_at(e).w2(situ(gate, up, self.beta, self.linear_beta))

    def _routed_dispatch(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each chosen expert on its tokens only (the chosen set is read on the host, once)."""
        gemms = self.__dict__.get(EXPERT_GEMMS_ATTR)
        if h.shape[0] == 1 and gemms is not None:
            return self._one_token(h, weights, ids, gemms)
        return self._sorted_dispatch(h, weights, ids)

    def _sorted_dispatch(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Any number of tokens.

        The (token, slot) pairs are sorted by expert, so every expert takes one contiguous run of
        gathered rows; SiTU runs once over all experts' gate/up rows, and one accumulating scatter adds
        each token's contributions in ascending expert order (the order of an expert-by-expert loop).
        """
        y = torch.zeros(h.shape, dtype=upcast(h).dtype, device=h.device)
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        local = self._local_experts()
        first = sum(counts[: local.start])
        order = order[first: first + sum(counts[local.start: local.stop])]
        if not order.numel():
            return y
        tok = order // top_k
        rows = h[tok]
        gemms = self.__dict__.get(EXPERT_GEMMS_ATTR)
        out = (self._float_experts(rows, counts, local, gemms) if gemms is not None
               else self._any_experts(rows, counts, local))
        # index_put_ rather than index_add_: the latter costs ~30 ms a call on this CPU build of torch.
        y.index_put_((tok,), upcast(out) * weights.reshape(-1)[order, None], accumulate=True)
        return y

    def _one_token(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gemms: list) -> torch.Tensor:
        """`_routed_dispatch` for one token (batch-1 decode) with fused float experts, in ~half the ops.

        The same arithmetic in the same order: each chosen local expert's w1|w3 on the token, one
        SiTU over their rows, each w2, weighted, summed in ascending expert order (what the
        accumulating scatter of the general path adds up), so the result is bitwise the same.
        """
        local = self._local_experts()
        chosen = sorted((e, slot) for slot, e in enumerate(ids[0].tolist()) if e in local)
        if not chosen:
            return torch.zeros(h.shape, dtype=upcast(h).dtype, device=h.device)
        row = h.contiguous()
        w13s = [gemms[e - local.start][0] for e, _ in chosen]
        w2s = [gemms[e - local.start][3] for e, _ in chosen]
        kernel = grouped_kernel(row, w13s + w2s)
        gate_up = kernel.same_row(row, w13s) if kernel is not None else _cat([linear(row, w) for w in w13s])
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        act = situ(gate, up, self.beta, self.linear_beta)
        out = (kernel.grouped(act.contiguous(), w2s, [1] * len(w2s)) if kernel is not None
               else _cat([linear(a, w2) for a, w2 in zip(act.split(1), w2s, strict=True)]))
        # a sum over rows adds them in order, bitwise as the scatter does (test_decode_fast_paths)
        return (upcast(out) * weights[0, [slot for _, slot in chosen]].unsqueeze(1)).sum(0, keepdim=True)

    def _any_experts(self, rows: torch.Tensor, counts: list[int], local: range) -> torch.Tensor:
        """Expert outputs of `rows` (grouped by expert, `counts[e]` each) through the expert modules."""
        gates, ups, runs, pos = [], [], [], 0
        for e in local:
            n = counts[e]
            if n:
                gate, up = self._gate_up(e, rows[pos: pos + n])
                gates.append(gate)
                ups.append(up)
                runs.append((e, pos, pos + n))
                pos += n
        act = situ(_cat(gates), _cat(ups), self.beta, self.linear_beta)
        return _cat([self._expert_at(e).w2(act[lo:hi]) for e, lo, hi in runs])

    def _float_experts(self, rows: torch.Tensor, counts: list[int], local: range, gemms: list) -> torch.Tensor:
        """`_any_experts` for fused float experts, calling their GEMMs directly: the same products
        (w1|w3 fused up to `fused_gemm_max_rows` rows, as `FusedProjections` does) and the same SiTU."""
        sizes = [counts[e] for e in local]
        gemms = gemms[:len(sizes)]             # gemms[i] is local expert local.start + i
        used = [g for g, n in zip(gemms, sizes, strict=True) if n]
        kernel = grouped_kernel(rows, [g[0] for g in used] + [g[3] for g in used])
        if kernel is not None:           # the groups `linear` runs on the row-major kernel, in one call
            return self._float_experts_grouped(kernel, rows.contiguous(), sizes, gemms)
        parts, runs, pos = [], [], 0
        for n, expert in zip(sizes, gemms, strict=True):
            if n:
                parts.append(_fused_gate_up(rows[pos: pos + n], expert))
                runs.append((expert[3], pos, pos + n))
                pos += n
        gate_up = _cat(parts)
        inter = gate_up.shape[-1] // 2
        act = situ(gate_up[:, :inter], gate_up[:, inter:], self.beta, self.linear_beta)
        return _cat([linear(act[lo:hi], w2) for w2, lo, hi in runs])

    def _float_experts_grouped(self, kernel, rows: torch.Tensor, sizes: list[int], gemms: list) -> torch.Tensor:
        """`_float_experts` with every expert of the rows `linear` runs on the row-major kernel in one kernel
        call per weight kind; an expert with more rows takes `linear` as there (bitwise the same products)."""
        most = rowdot.row_major_max_rows()
        gate_up = kernel.grouped(rows, [g[0] for g in gemms], sizes, most)
        bounds = list(itertools.accumulate(sizes, initial=0))
        big = [(i, bounds[i], bounds[i + 1]) for i, n in enumerate(sizes) if n > most]
        for i, lo, hi in big:
            gate_up[lo:hi] = _fused_gate_up(rows[lo:hi], gemms[i])
        inter = gate_up.shape[-1] // 2
        act = situ(gate_up[:, :inter], gate_up[:, inter:], self.beta, self.linear_beta).contiguous()
        out = kernel.grouped(act, [g[3] for g in gemms], sizes, most)
        for i, lo, hi in big:
            out[lo:hi] = linear(act[lo:hi], gemms[i][3])
        return out

    def _routed_dense(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, weighted by a dense [T, E] routing matrix (zero where not chosen)."""
        dense = torch.zeros(h.shape[0], len(self.experts), dtype=weights.dtype, device=h.device)
        dense.scatter_(1, ids, weights)
        y = torch.zeros(h.shape, dtype=upcast(h).dtype, device=h.device)
        for e in self._local_experts():
            w = dense[:, e, None]
            # where, not a product: an unchosen expert's output never reaches the sum, whatever its value
            y = y + torch.where(w != 0, upcast(self._expert(e, h)) * w, 0.0)
        return y


class _RowsPlan:
    """`moe_rows`' constant arguments for one fused layer, and the expert panel copies it has met (kept
    here too, so a pointer handed to C never outlives its copy)."""

    def __init__(self, moe: LatentMoE, w_in: torch.Tensor, w13s: list[torch.Tensor], w2s: list[torch.Tensor],
                 up: torch.Tensor, down: torch.Tensor | None, width: int, max_rows: int) -> None:
        norm, bias = moe.routed_expert_norm, moe.gate.e_score_correction_bias
        experts, latent, inter = len(w13s), up.shape[1], w2s[0].shape[1]
        self.hidden, self.max_rows, self.w13s, self.w2s = w_in.shape[1], max_rows, w13s, w2s
        self.dense = (w_in, up, down)                    # their panel copies are looked up per call
        self.sizes = (self.hidden, experts, latent, width, inter, moe.top_k)
        array = ctypes.c_long * experts
        self._w13, self._w2 = array(*(w.data_ptr() for w in w13s)), array(*(w.data_ptr() for w in w2s))
        self._w13_panels, self._w2_panels = array(), array()
        self._panels: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.w_in_ptr = w_in.data_ptr()
        experts_at = tuple(ctypes.addressof(a) for a in (self._w13, self._w2, self._w13_panels, self._w2_panels))
        self.routing = (bias.data_ptr(), int(moe.renormalize), moe.scaling, *experts_at,
                        norm.weight.data_ptr() if norm is not None else None, norm.eps if norm is not None else 0.0,
                        up.data_ptr())
        self.down_ptr = down.data_ptr() if down is not None else None
        self.betas = (moe.beta, moe.linear_beta if moe.linear_beta is not None else 0.0)
        self._keep = (w_in, up, down, bias, norm.weight if norm is not None else None)

    def add_panels(self, e: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self._panels[e] = (w13, w2)
        self._w13_panels[e], self._w2_panels[e] = w13.data_ptr(), w2.data_ptr()

    def scratch_floats(self, rows: int) -> int:
        d, experts, latent, width, inter, k = self.sizes
        return (rows * (experts + latent + 2 * width) + rows * k * (3 * inter + 2 * latent + 1) + 2 * rows * latent
                + rows * width + rows * d)

    def scratch_longs(self, rows: int) -> int:
        return 2 * rows * self.sizes[5] + self.sizes[1]


def _rows_plan(moe: LatentMoE, fused, gemms: list | None) -> _RowsPlan | None:
    """`moe_rows`' plan for `moe` fused as `fused`/`gemms`, or None where the C call does not reproduce the
    Python path: expert or data parallel, unfused, quantized or small (non-rowdot) linears, no joined router."""
    experts = len(moe.experts)
    if (fused is None or gemms is None or moe.expert_parallel is not None or moe.reduce_routed is not None
            or moe.expert_range is not None or len(gemms) != experts or not 1 <= moe.top_k <= experts):
        return None
    linears = moe._input_linears()
    shared = moe.shared_experts
    if (linears[0] is not moe.gate or len(fused.groups) != 1 or not isinstance(fused.groups[0], Linear)
            or fused._split_sizes is None or len(linears) != (4 if shared is not None else 2)):
        return None
    w_in = fused.groups[0].weight
    latent = moe.routed_expert_down_proj.weight.shape[0]
    width = shared.gate_proj.weight.shape[0] if shared is not None else 0
    if fused._split_sizes != ([experts, latent, width, width] if shared is not None else [experts, latent]):
        return None
    up, norm = moe.routed_expert_up_proj, moe.routed_expert_norm
    down = shared.down_proj if shared is not None else None
    w13s, w2s = [g[0] for g in gemms], [g[3] for g in gemms]
    big = [w_in, up.weight, *w13s, *w2s] + ([down.weight] if down is not None else [])
    if (not isinstance(up, Linear) or (down is not None and not isinstance(down, Linear))
            or not row_major_weights(big) or moe.beta <= 0 or (moe.linear_beta is not None and moe.linear_beta <= 0)):
        return None
    small = [moe.gate.e_score_correction_bias] + ([norm.weight] if norm is not None else [])
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in small):
        return None
    # the fused GEMMs run as one up to these rows (`fused_gemm_max_rows`), as the C call does
    max_rows = min(fused._max_rows, *(g[4] for g in gemms), rowdot.linear_max_rows())
    return _RowsPlan(moe, w_in, w13s, w2s, up.weight, down.weight if down is not None else None, width, max_rows)


def _fused_gate_up(rows: torch.Tensor, expert: tuple) -> torch.Tensor:
    """One fused float expert's w1|w3 on its rows: one GEMM up to the rows it beats its members at
    (`fused_gemm_max_rows`), w1 and w3 apart above."""
    w13, w1, w3, _, max_rows = expert
    return linear(rows, w13) if rows.shape[0] <= max_rows else torch.cat([linear(rows, w1), linear(rows, w3)], dim=-1)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
