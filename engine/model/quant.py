"""ModelSlim W4A8 checkpoints on Ascend: int4 packing, reference W8A8/W4A8 linears, checkpoint transforms.

On-disk layout (msModelSlim ``ascendv1_saver``, read by vLLM-Ascend ``--quantization ascend``;
docs/model.md, W4A8 and W8A8). A quantized linear ``P`` is stored as exactly these tensors:

* ``W8A8_DYNAMIC``: ``P.weight`` int8 ``[out, in]``; ``P.weight_scale`` and ``P.weight_offset`` fp32
  ``[out, 1]`` (offset is all zeros: symmetric). No ``input_scale``/``input_offset``/``deq_scale``/
  ``quant_bias``: those belong to the *static* ``W8A8`` type; dynamic activations are quantized per token
  at run time.
* ``W4A8_DYNAMIC``: ``P.weight`` int8 ``[out // 2, in]``, two int4 per byte along the OUTPUT dim (low
  nibble = even row, high nibble = odd row); ``weight_scale``/``weight_offset`` fp32 ``[out, 1]``;
  ``P.scale_bias`` fp32 ``[out, 1]`` for gate/up (``w1``/``w3``) and ``[out, 16]`` for down (``w2``).
  ``scale_bias`` is the NPU int4 kernel's correction term, ``8 * sum_k(q[n, k] * scale[n])`` (down: one
  partial sum per 1/16 of the input dim so each of up to 16 TP ranks takes its columns). The reference
  matmul here uses the signed int4 values directly and does not need it; it is written for the kernel.

``quant_model_description.json`` maps every tensor name to its type plus ModelSlim's global keys; it and
the policy of which tensor gets which type live in ``engine.model.quant_description``.

Numerics of the reference forward: activations -> int8 per token (scale = absmax / 127, fp32); the
int8 x int8 (or int8 x int4) product is computed EXACTLY (see ``_exact_int_matmul``) into int32, then
``acc * token_scale * channel_scale`` in fp32, cast to the input dtype -- the order of
``npu_quant_matmul``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from engine.model.choices import W4A8_LOW_NIBBLE_IS_EVEN_ROW
from engine.model.quant_description import (
    FLOAT,
    W4A8_DYNAMIC,
    W8A8_DYNAMIC,
    QuantDescription,
    _split_name,
    describe,
    quant_type_for,
)

# Down-type W4A8 scale_bias is pre-split into 16 input chunks (vLLM-Ascend: [out, 16 // tp], tp <= 16).
SCALE_BIAS_SPLITS = 16
_ROW_PARALLEL_NAMES = ("w2", "down_proj", "o_proj")

INT8_QMAX = 127
INT4_QMIN, INT4_QMAX = -8, 7
# fp32 holds every integer of magnitude <= 2**24; an int8 x int8 product is at most 2**14.
_EXACT_FP32_CHUNK = 2 ** 24 // 2 ** 14
_INT32_SAFE_K = 2 ** 31 // 2 ** 14


# ----------------------------------------------------------------------------------------------
# int4 packing
# ----------------------------------------------------------------------------------------------

def _check_int8_2d(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.int8 or t.dim() != 2:
        raise ValueError(f"{what} must be a 2-D int8 tensor, got {t.dtype} with shape {tuple(t.shape)}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values `[out, in]` into int8 `[out // 2, in]` along the output dim (ModelSlim layout).

    Byte `[i, k]` holds row `2i` in its low nibble and row `2i + 1` in its high nibble, two's complement.
    """
    _check_int8_2d(q, "pack_int4 input")
    if q.shape[0] % 2:
        raise ValueError(f"pack_int4 needs an even number of output rows, got {q.shape[0]}")
    if q.numel() and (int(q.min()) < INT4_QMIN or int(q.max()) > INT4_QMAX):
        raise ValueError(f"pack_int4 values must lie in [{INT4_QMIN}, {INT4_QMAX}], "
                         f"got [{int(q.min())}, {int(q.max())}]")
    nibbles = q.to(torch.int16) & 0xF
    even, odd = nibbles[0::2], nibbles[1::2]
    low, high = (even, odd) if W4A8_LOW_NIBBLE_IS_EVEN_ROW else (odd, even)
    return (low | (high << 4)).to(torch.uint8).view(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Exact inverse of `pack_int4`: int8 `[out // 2, in]` -> int8 `[out, in]` with values in [-8, 7]."""
    _check_int8_2d(packed, "unpack_int4 input")
    byte = packed.view(torch.uint8).to(torch.int16)
    low, high = byte & 0xF, byte >> 4
    low, high = (low ^ 8) - 8, (high ^ 8) - 8          # sign-extend a 4-bit two's complement nibble
    even, odd = (low, high) if W4A8_LOW_NIBBLE_IS_EVEN_ROW else (high, low)
    return torch.stack((even, odd), dim=1).reshape(2 * packed.shape[0], packed.shape[1]).to(torch.int8)


# ----------------------------------------------------------------------------------------------
# quantizers
# ----------------------------------------------------------------------------------------------

def _symmetric_per_row(w: torch.Tensor, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest with scale = absmax / qmax per row (fp32). All-zero rows get scale 0, q 0."""
    w = w.float()
    scale = w.abs().amax(dim=-1, keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe).clamp(qmin, qmax).to(torch.int8)
    return q, scale


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected a 2-D float weight [out, in], got {w.dtype} {tuple(w.shape)}")


def quantize_int4_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int4: (q int8 [out, in] in [-7, 7], scale fp32 [out, 1], offset zeros)."""
    _check_weight(w)
    q, scale = _symmetric_per_row(w, INT4_QMIN, INT4_QMAX)
    return q, scale, torch.zeros_like(scale)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [out, in], scale fp32 [out, 1], offset zeros)."""
    _check_weight(w)
    q, scale = _symmetric_per_row(w, -INT8_QMAX, INT8_QMAX)
    return q, scale, torch.zeros_like(scale)


def dynamic_quant_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 like `npu_dynamic_quant`: (x_q int8 like x, scale fp32 [..., 1]).

    scale = absmax(token) / 127 in fp32, x_q = round(x / scale) (ties to even). A zero token gets scale 0.
    """
    if not x.is_floating_point():
        raise ValueError(f"dynamic_quant_per_token_int8 expects a float tensor, got {x.dtype}")
    return _symmetric_per_row(x, -INT8_QMAX, INT8_QMAX)


def w4a8_scale_bias(q: torch.Tensor, scale: torch.Tensor, columns: int) -> torch.Tensor:
    """msModelSlim's `scale_bias` = 8 * sum_k q[n, k] * scale[n], over `columns` equal input chunks.

    Returns fp32 `[out, columns]`. Only the NPU kernel uses it; the reference forward does not.
    """
    out, inp = q.shape
    if inp % columns:
        raise ValueError(f"scale_bias needs in_features ({inp}) divisible by its {columns} columns")
    deq = q.double() * scale.double()
    return (8.0 * deq.reshape(out, columns, inp // columns).sum(-1)).float()


def scale_bias_columns(module_path: str) -> int:
    """16 for down-type (row-parallel) linears (`w2`, `down_proj`, `o_proj`), else 1 (msModelSlim rule)."""
    return SCALE_BIAS_SPLITS if module_path.rsplit(".", 1)[-1] in _ROW_PARALLEL_NAMES else 1


# ----------------------------------------------------------------------------------------------
# reference quantized linears
# ----------------------------------------------------------------------------------------------

def _exact_int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b.T` for int8-valued `a` [T, K], `b` [N, K] with no rounding at all -> int32 [T, N].

    Device-agnostic (no integer GEMM needed): fp32 GEMMs over K-chunks of 1024, where every partial sum
    is an integer of magnitude <= 1024 * 2**14 = 2**24 and therefore exact in fp32 (also under TF32/HF32
    or bf16 inputs: |values| <= 128 fit those mantissas); the chunk results are then added in int32,
    exact while K < 2**17.
    """
    k = a.shape[-1]
    if k >= _INT32_SAFE_K:
        raise ValueError(f"in_features {k} too large for exact int32 accumulation (< {_INT32_SAFE_K})")
    af, bf = a.float(), b.float()
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32, device=a.device)
    for start in range(0, k, _EXACT_FP32_CHUNK):
        stop = start + _EXACT_FP32_CHUNK
        acc += (af[:, start:stop] @ bf[:, start:stop].T).to(torch.int32)
    return acc


def _quantized_linear(x: torch.Tensor, q_weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Per-token int8 activations x per-channel integer weights, dequantized as the NPU does."""
    lead = x.shape[:-1]
    x_q, x_scale = dynamic_quant_per_token_int8(x.reshape(-1, x.shape[-1]))
    acc = _exact_int_matmul(x_q, q_weight)
    out = acc.float() * x_scale * weight_scale.float().reshape(1, -1)
    return out.to(x.dtype).reshape(*lead, q_weight.shape[0])


class _DynamicLinearBase(nn.Module):
    """Shared plumbing: checkpoint-named parameters, symmetric-offset check on load, dequantization."""

    quant_type: str = ""
    weight: nn.Parameter                  # the packed integer weight, registered by each subclass

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None,
                 params_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.params_dtype = params_dtype  # dtype of the float Linear this replaces
        self.register_parameter("bias", None)
        self.weight_scale = self._param((out_features, 1), torch.float32, device)
        self.weight_offset = self._param((out_features, 1), torch.float32, device)
        self.register_load_state_dict_post_hook(_require_zero_offset)

    @staticmethod
    def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
        return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)

    def int_weight(self) -> torch.Tensor:
        """The integer weight `[out, in]` (int8 dtype, int4 values for W4A8)."""
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`q * scale` as `[out, in]` in `dtype` (default: the replaced Linear's dtype)."""
        w = self.int_weight().float() * self.weight_scale.float()
        return w.to(dtype or self.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _quantized_linear(x, self.int_weight(), self.weight_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quant_type}"


def _require_zero_offset(module: _DynamicLinearBase, _incompatible: Any) -> None:
    """Both dynamic schemes are symmetric; the NPU path ignores weight_offset, so it must be zero."""
    offset = module.weight_offset
    if offset.device.type != "meta" and torch.any(offset != 0):
        raise ValueError(f"{module.quant_type} checkpoint has a non-zero weight_offset; only symmetric "
                         "(zero-offset) weights are supported")


class W8A8DynamicLinear(_DynamicLinearBase):
    """ModelSlim `W8A8_DYNAMIC` linear: int8 weight `[out, in]`, fp32 `weight_scale`/`weight_offset` `[out, 1]`."""

    quant_type = W8A8_DYNAMIC

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None,
                 params_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(in_features, out_features, device, params_dtype)
        self.weight = self._param((out_features, in_features), torch.int8, device)

    def int_weight(self) -> torch.Tensor:
        return self.weight


class W4A8DynamicLinear(_DynamicLinearBase):
    """ModelSlim `W4A8_DYNAMIC` linear: packed int8 `[out // 2, in]`, fp32 scales, `scale_bias` `[out, cols]`."""

    quant_type = W4A8_DYNAMIC

    def __init__(self, in_features: int, out_features: int, scale_bias_cols: int = 1,
                 device: torch.device | str | None = None, params_dtype: torch.dtype = torch.bfloat16) -> None:
        if out_features % 2:
            raise ValueError(f"W4A8 packs two output rows per byte; out_features={out_features} is odd")
        if in_features % scale_bias_cols:
            raise ValueError(f"W4A8 scale_bias splits in_features={in_features} into {scale_bias_cols} chunks")
        super().__init__(in_features, out_features, device, params_dtype)
        self.weight = self._param((out_features // 2, in_features), torch.int8, device)
        self.scale_bias = self._param((out_features, scale_bias_cols), torch.float32, device)

    def int_weight(self) -> torch.Tensor:
        return unpack_int4(self.weight)


# ----------------------------------------------------------------------------------------------
# model and checkpoint transforms
# ----------------------------------------------------------------------------------------------

def _quantized_linear_for(name: str, linear: nn.Linear, qtype: str) -> nn.Module:
    if linear.bias is not None:
        raise ValueError(f"{name}: quantized linears with a bias are not supported")
    kwargs = dict(device=linear.weight.device, params_dtype=linear.weight.dtype)
    if qtype == W8A8_DYNAMIC:
        return W8A8DynamicLinear(linear.in_features, linear.out_features, **kwargs)
    return W4A8DynamicLinear(linear.in_features, linear.out_features, scale_bias_columns(name), **kwargs)


def apply_quant_description(model: nn.Module, desc: QuantDescription) -> None:
    """Swap every `nn.Linear` whose `<path>.weight` is quantized for the matching reference module.

    Module paths must equal checkpoint names, so `model.load_state_dict(quantized_checkpoint)` fits after.
    Linears absent from the description stay float.
    """
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        qtype = desc.weight_type(name)
        if qtype == FLOAT:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _quantized_linear_for(name, linear, qtype))


def _quantize_tensor(name: str, w: torch.Tensor, qtype: str) -> dict[str, torch.Tensor]:
    prefix, _ = _split_name(name)
    if not (w.dim() == 2 and w.is_floating_point()):
        raise ValueError(f"{name}: {qtype} needs a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    if qtype == W8A8_DYNAMIC:
        q, scale, offset = quantize_int8_per_channel(w)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale, f"{prefix}.weight_offset": offset}
    q, scale, offset = quantize_int4_per_channel(w)
    return {f"{prefix}.weight": pack_int4(q), f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_offset": offset,
            f"{prefix}.scale_bias": w4a8_scale_bias(q, scale, scale_bias_columns(prefix))}


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], QuantDescription]:
    """bf16/fp32 checkpoint -> ModelSlim-layout W4A8 checkpoint and its description (policy: `quant_type_for`).

    FLOAT tensors are passed through as the same tensor objects. MXFP4 inputs must be dequantized first.
    """
    out: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for name, tensor in state_dict.items():
        if name.endswith(".weight_packed"):
            raise ValueError(f"{name}: packed (MXFP4) weights must be dequantized to bf16 before quantizing")
        qtype = quant_type_for(name)
        produced = {name: tensor} if qtype == FLOAT else _quantize_tensor(name, tensor, qtype)
        for key, value in produced.items():
            if key in out:
                raise ValueError(f"tensor name collision while quantizing: {key!r}")
            out[key] = value
            types[key] = qtype
    return out, describe(types)
