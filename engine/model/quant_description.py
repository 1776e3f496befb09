"""ModelSlim's ``quant_model_description.json`` and the policy of which tensor is written as which type.

The file maps every tensor name to its quant type plus the global keys ``version``, ``model_quant_type``,
``group_size`` (0 = per channel), ``metadata``, ``optional``. Kept apart from ``engine.model.quant`` (the
int4/int8 numerics and the reference linears) because it is pure bookkeeping on names: it needs no tensor.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model.choices import W4A8_GROUP_SIZE

MODELSLIM_CONFIG_FILENAME = "quant_model_description.json"

FLOAT = "FLOAT"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W4A8_DYNAMIC = "W4A8_DYNAMIC"
SUPPORTED_TYPES = (FLOAT, W8A8_DYNAMIC, W4A8_DYNAMIC)
QUANTIZED_TYPES = (W8A8_DYNAMIC, W4A8_DYNAMIC)

# Tensors a quantized linear owns, by type (suffixes after the module path).
_COMPANIONS: dict[str, tuple[str, ...]] = {
    W8A8_DYNAMIC: ("weight", "weight_scale", "weight_offset"),
    W4A8_DYNAMIC: ("weight", "weight_scale", "weight_offset", "scale_bias"),
}
# msModelSlim's `model_quant_type`: the highest-priority type written; W4A8_DYNAMIC is deliberately
# not in its priority list, so a W4A8 + W8A8_DYNAMIC checkpoint reports W8A8_DYNAMIC.
_MODEL_TYPE_PRIORITY = (FLOAT, W8A8_DYNAMIC)
DESCRIPTION_VERSION = "1.0.0"
_GLOBAL_KEYS = ("version", "model_quant_type", "group_size", "metadata", "optional")
_UNSUPPORTED_GLOBAL_KEYS = ("fa_quant_type", "kv_quant_type", "kv_cache_type")


# ----------------------------------------------------------------------------------------------
# writing policy
# ----------------------------------------------------------------------------------------------

_LAYER = r"^(?:language_model\.)?model\.layers\.\d+\."
# The msModelSlim Kimi-K3 W4A8 recipe (lab_practice/kimi_k3/kimi_k3_w4a8.yaml); its counts reproduce the
# published Eco-Tech/Kimi-K3-w4a8 distribution exactly. KDA f_a/f_b/b/g/o and MLA kv_b/g/o stay FLOAT.
QUANT_POLICY: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(_LAYER + p), t) for p, t in (
    (r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$", W4A8_DYNAMIC),
    (r"self_attn\.(?:q_proj|k_proj|v_proj)\.weight$", W8A8_DYNAMIC),                    # KDA
    (r"self_attn\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa)\.weight$", W8A8_DYNAMIC),   # MLA
    (r"mlp\.(?:gate_proj|up_proj|down_proj)\.weight$", W8A8_DYNAMIC),                  # layer-0 dense MLP
    (r"block_sparse_moe\.shared_experts\.(?:gate_proj|up_proj|down_proj)\.weight$", W8A8_DYNAMIC),
    (r"block_sparse_moe\.routed_expert_(?:up|down)_proj\.weight$", W8A8_DYNAMIC),     # latent projections
))


def quant_type_for(name: str) -> str:
    """Quant type to write for the float checkpoint tensor `name`; anything not in the policy is FLOAT."""
    for pattern, qtype in QUANT_POLICY:
        if pattern.match(name):
            return qtype
    return FLOAT


# ----------------------------------------------------------------------------------------------
# quant_model_description.json
# ----------------------------------------------------------------------------------------------

_FUSED_GROUPS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(.*\.experts)\.\d+\.w[123]\.weight$"), r"\1"),                       # one FusedMoE
    (re.compile(r"^(.*)\.(?:gate_proj|up_proj)\.weight$"), r"\1.gate_up_proj"),
    (re.compile(r"^(.*)\.(?:q_a_proj|kv_a_proj_with_mqa)\.weight$"), r"\1.fused_qkv_a_proj"),
)


def _fused_group(weight_name: str) -> str | None:
    """The serving-side fused layer a `.weight` loads into (vLLM-Ascend requires one type per layer)."""
    for pattern, repl in _FUSED_GROUPS:
        if pattern.match(weight_name):
            return pattern.sub(repl, weight_name)
    return None


def _split_name(name: str) -> tuple[str, str]:
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix


@dataclass
class QuantDescription:
    """`quant_model_description.json`: tensor name -> quant type, plus ModelSlim's global keys.

    Unknown non-string global keys are kept in `extra` and written back unchanged.
    """

    tensor_types: dict[str, str]
    version: str = DESCRIPTION_VERSION
    model_quant_type: str = FLOAT
    group_size: int = W4A8_GROUP_SIZE
    metadata: dict[str, Any] = field(default_factory=dict)
    optional: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # --- parsing / writing -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> QuantDescription:
        for key in _UNSUPPORTED_GLOBAL_KEYS:
            if key in raw:
                raise ValueError(f"description key {key!r}={raw[key]!r}: attention / KV-cache quantization "
                                 "is not supported (W4A8/W8A8_DYNAMIC linears only)")
        tensors: dict[str, str] = {}
        extra: dict[str, Any] = {}
        for key, value in raw.items():
            if key in _GLOBAL_KEYS:
                continue
            if isinstance(value, str):
                tensors[key] = value
            else:
                extra[key] = value
        return cls(tensor_types=tensors, version=str(raw.get("version", DESCRIPTION_VERSION)),
                   model_quant_type=str(raw.get("model_quant_type", FLOAT)),
                   group_size=raw.get("group_size", W4A8_GROUP_SIZE), metadata=dict(raw.get("metadata", {})),
                   optional=dict(raw.get("optional", {})), extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.tensor_types)
        out.update(self.extra)
        out.update(version=self.version, model_quant_type=self.model_quant_type, metadata=self.metadata,
                   group_size=self.group_size, optional=self.optional)
        return out

    @classmethod
    def read(cls, path: str | Path) -> QuantDescription:
        """Read from the JSON file or from a checkpoint directory holding it."""
        path = Path(path)
        if path.is_dir():
            path = path / MODELSLIM_CONFIG_FILENAME
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def write(self, path: str | Path) -> Path:
        """Write to the JSON file, or into a directory as `quant_model_description.json`."""
        path = Path(path)
        if path.is_dir():
            path = path / MODELSLIM_CONFIG_FILENAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    # --- queries ----------------------------------------------------------------------------
    def weight_type(self, module_path: str) -> str:
        """Type of `<module_path>.weight` (`weight_packed` accepted as vLLM-Ascend does); FLOAT if absent."""
        for suffix in ("weight", "weight_packed"):
            qtype = self.tensor_types.get(f"{module_path}.{suffix}")
            if qtype is not None:
                return qtype
        return FLOAT

    def fused_type(self, module_paths: Iterable[str]) -> str:
        """The single type shared by the shards of one fused layer; raises naming the disagreeing shards."""
        types = {p: self.weight_type(p) for p in module_paths}
        if len(set(types.values())) > 1:
            detail = ", ".join(f"{p}.weight={t}" for p, t in types.items())
            raise ValueError(f"fused shards disagree on quant type: {detail}")
        return next(iter(types.values()), FLOAT)

    # --- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        if self.group_size != W4A8_GROUP_SIZE:
            raise ValueError(f"group_size={self.group_size!r}: only per-channel quantization "
                             f"(group_size {W4A8_GROUP_SIZE}) is supported")
        for name, qtype in self.tensor_types.items():
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(f"tensor {name!r} has unsupported quant type {qtype!r} "
                                 f"(supported: {', '.join(SUPPORTED_TYPES)})")
        self._validate_companions()
        self._validate_fused_groups()

    def _validate_companions(self) -> None:
        """Every quantized linear has exactly its scheme's tensors, all tagged with the same type."""
        for name, qtype in self.tensor_types.items():
            if qtype == FLOAT:
                continue
            prefix, suffix = _split_name(name)
            if suffix not in _COMPANIONS[qtype]:
                raise ValueError(f"tensor {name!r}: {qtype} has no tensor named {suffix!r} "
                                 f"(expected {', '.join(_COMPANIONS[qtype])})")
            for companion in _COMPANIONS[qtype]:
                other = f"{prefix}.{companion}"
                if self.tensor_types.get(other) != qtype:
                    raise ValueError(f"tensor {name!r} is {qtype} but {other!r} is "
                                     f"{self.tensor_types.get(other, 'missing')}")

    def _validate_fused_groups(self) -> None:
        seen: dict[str, tuple[str, str]] = {}
        for name, qtype in self.tensor_types.items():
            group = _fused_group(name)
            if group is None:
                continue
            first = seen.setdefault(group, (name, qtype))
            if first[1] != qtype:
                raise ValueError(f"fused layer {group!r} mixes quant types: "
                                 f"{first[0]}={first[1]} but {name}={qtype}")


def _model_quant_type(types: Iterable[str]) -> str:
    used = set(types)
    return max((t for t in _MODEL_TYPE_PRIORITY if t in used), key=_MODEL_TYPE_PRIORITY.index, default=FLOAT)


def describe(tensor_types: Mapping[str, str]) -> QuantDescription:
    """The description of a checkpoint whose tensors have these types (global keys derived from them)."""
    return QuantDescription(tensor_types=dict(tensor_types), model_quant_type=_model_quant_type(tensor_types.values()))
