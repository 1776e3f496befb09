"""`--speculative-config` (vLLM's `SpeculativeConfig` field names and defaults) and the `k3_dspark` draft config.

Both parse once into frozen dataclasses; every problem is a `SpecConfigError` naming the field, so a
worker refuses to start with a clear message instead of failing at the first request.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.json_flag import json_object

log = logging.getLogger(__name__)


class SpecConfigError(ValueError):
    """A speculative config or draft checkpoint config that cannot run here."""


# Trained drafts shipped as package data, next to the trained targets they were distilled from.
SHIPPED_DRAFTS_DIR = Path(__file__).parents[1] / "presets_data"
SHIPPED_DRAFTS = ("tiny-chat-dspark", "tiny-chat-dspark-gqa")    # MLA and GQA, distilled from the shipped tiny-chat


def shipped_draft(name: str) -> Path:
    """Directory of a shipped trained draft (FileNotFoundError if the install lacks it)."""
    if name not in SHIPPED_DRAFTS:
        raise ValueError(f"unknown shipped draft {name!r}; choose one of {list(SHIPPED_DRAFTS)}")
    path = SHIPPED_DRAFTS_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the {name} draft is not installed at {path} (package data missing)")
    return path


# vLLM SpeculativeConfig fields this build implements, with vLLM's defaults.
_DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
_REJECTION_METHODS = ("standard",)
# vLLM fields accepted only at their neutral value (they name features other methods or hardware use).
_NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "tensor_parallel_size": (None, 1), "quantization": (None,), "revision": (None,), "code_revision": (None,),
    "kv_cache_dtype": (None, "auto"), "attention_backend": (None,), "moe_backend": (None,),
    "disable_padded_drafter_batch": (False, True), "enable_adaptive_verification": (False,),
    "parallel_drafting": (False, True),
    "synthetic_acceptance_rates": (None,), "synthetic_acceptance_length": (None,),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """What a worker speculates with. `num_speculative_tokens` None = the draft's block size."""

    method: str
    model: str
    num_speculative_tokens: int | None = None
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    dspark_draft_topk: int | None = None
    enforce_eager: bool | None = None
    # K per step, at most num_speculative_tokens (docs/dspark.md#adaptive-speculation): vLLM's fixed
    # schedule [[first batch, last batch, K], ...] when given; else, when adaptive, from measured costs
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    adaptive_num_speculative_tokens: bool = False      # off by default until a quiet-host run shows it never loses
    adaptive_costs: dict[str, Any] | None = field(default=None, compare=False)     # override of the measured costs
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """JSON text or a dict (the CLI flag / LLM kwarg) -> config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return cls.from_dict(json_object(value, "--speculative-config", SpecConfigError))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        where = "--speculative-config"
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(d) - names - set(_NEUTRAL_FIELDS))
        if unknown:
            raise SpecConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(names | set(_NEUTRAL_FIELDS))}")
        for key, allowed in _NEUTRAL_FIELDS.items():
            if key in d and d[key] not in allowed:
                raise SpecConfigError(f"{where}.{key}={d[key]!r} is not supported by this build "
                                      f"(accepted: {', '.join(map(repr, allowed))})")
        if d.get("method") != "dspark":
            raise SpecConfigError(f"{where}.method: only 'dspark' is implemented, got {d.get('method')!r}")
        if not isinstance(d.get("model"), str) or not d["model"]:
            raise SpecConfigError(f"{where}.model: the draft checkpoint directory is required")
        for key in ("num_speculative_tokens", "draft_tensor_parallel_size", "max_model_len", "dspark_draft_topk"):
            v = d.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise SpecConfigError(f"{where}.{key}: expected an integer >= 1, got {v!r}")
        if d.get("draft_sample_method", "greedy") not in _DRAFT_SAMPLE_METHODS:
            raise SpecConfigError(f"{where}.draft_sample_method: one of {_DRAFT_SAMPLE_METHODS}, "
                                  f"got {d['draft_sample_method']!r}")
        if d.get("rejection_sample_method", "standard") not in _REJECTION_METHODS:
            raise SpecConfigError(f"{where}.rejection_sample_method: only 'standard' is implemented, "
                                  f"got {d['rejection_sample_method']!r}")
        if d.get("enforce_eager") not in (None, True, False):
            raise SpecConfigError(f"{where}.enforce_eager: expected a boolean")
        known = {k: v for k, v in d.items() if k in names}
        _check_dynamic(known)
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    def num_drafts_for_batch(self, batch: int) -> int | None:
        """K from vLLM's `num_speculative_tokens_per_batch_size` (None: no schedule; 0 outside its ranges)."""
        if self.num_speculative_tokens_per_batch_size is None:
            return None
        return next((k for lo, hi, k in self.num_speculative_tokens_per_batch_size if lo <= batch <= hi), 0)

    def check_draft_tp(self, target_tp: int) -> None:
        """vLLM's rule: the draft's TP is 1 or the target's. Here the draft always runs on the target's ranks,
        sharded like it (its embedding and LM head ARE the target's vocabulary-parallel ones)."""
        draft_tp = self.draft_tensor_parallel_size
        if draft_tp not in (None, 1, target_tp):
            raise SpecConfigError(f"--speculative-config.draft_tensor_parallel_size={draft_tp} cannot be other than "
                                  f"1 or the target's --tensor-parallel-size ({target_tp})")
        if draft_tp == 1 and target_tp > 1:
            log.warning("--speculative-config.draft_tensor_parallel_size=1: the draft runs sharded over the "
                        "target's %d ranks here (it shares their vocabulary-parallel embedding and LM head)",
                        target_tp)

    def with_model_path(self) -> SpeculativeConfig:
        """`model` as a directory: a path as given, or the name of a shipped draft preset (`tiny-chat-dspark`)."""
        if Path(self.model).exists():
            return self
        if self.model in SHIPPED_DRAFTS:
            return dataclasses.replace(self, model=str(shipped_draft(self.model)))
        return self                         # DraftConfig.from_dir names the missing directory

    def resolve(self, draft: AnyDraftConfig, target_max_model_len: int) -> SpeculativeConfig:
        """Fill the draft-dependent defaults and check consistency with the draft and the target."""
        n = self.num_speculative_tokens or draft.block_size
        if n > draft.block_size:
            raise SpecConfigError(f"--speculative-config.num_speculative_tokens={n} exceeds the draft's block size "
                                  f"{draft.block_size} ({self.model})")
        if any(k > n for _, _, k in self.num_speculative_tokens_per_batch_size or ()):
            raise SpecConfigError(f"--speculative-config.num_speculative_tokens_per_batch_size: a K above "
                                  f"num_speculative_tokens ({n})")
        max_len = self.max_model_len or target_max_model_len
        if max_len > target_max_model_len:
            raise SpecConfigError(f"--speculative-config.max_model_len={max_len} exceeds the target's "
                                  f"max_model_len {target_max_model_len}")
        if self.dspark_draft_topk is not None and self.dspark_draft_topk > draft.vocab_size:
            raise SpecConfigError("--speculative-config.dspark_draft_topk exceeds the vocabulary")
        return dataclasses.replace(self, num_speculative_tokens=n, max_model_len=max_len)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["num_speculative_tokens_per_batch_size"] is not None:
            d["num_speculative_tokens_per_batch_size"] = [list(t) for t in d["num_speculative_tokens_per_batch_size"]]
        return {**{k: v for k, v in d.items() if k != "extra"}, **self.extra}


def _check_dynamic(known: dict[str, Any]) -> None:
    """Validate (and normalise in place) the adaptive-K fields."""
    where = "--speculative-config"
    if known.get("adaptive_num_speculative_tokens") not in (None, True, False):
        raise SpecConfigError(f"{where}.adaptive_num_speculative_tokens: expected a boolean")
    schedule = known.get("num_speculative_tokens_per_batch_size")
    if schedule is not None:
        ok = isinstance(schedule, list | tuple) and all(
            isinstance(t, list | tuple) and len(t) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in t) and 1 <= t[0] <= t[1] and t[2] >= 0
            for t in schedule)
        if not ok or not schedule:
            raise SpecConfigError(f"{where}.num_speculative_tokens_per_batch_size: a list of [first batch size, "
                                  f"last batch size, K] (inclusive, K >= 0), got {schedule!r}")
        known["num_speculative_tokens_per_batch_size"] = tuple(tuple(t) for t in schedule)
    costs = known.get("adaptive_costs")
    if costs is not None:
        from engine.spec_decode.adaptive import StepCosts
        try:
            StepCosts.from_dict(costs if isinstance(costs, dict) else {})
        except ValueError as exc:
            raise SpecConfigError(f"{where}.{exc}") from exc


_MASK_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
_MUST_BE_FALSE = ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor")


@dataclass(frozen=True)
class DraftConfig:
    """`config.json` of a `k3_dspark` draft (docs/dspark.md 3.1). Keys we do not model are kept in `extra`."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    target_hidden_size: int
    markov_rank: int
    mask_token_id: int
    block_size: int
    model_type: str = "k3_dspark"
    architectures: tuple[str, ...] = ("K3DSparkModel",)
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    rope_type: str = "default"
    draft_vocab_size: int | None = None
    logit_scale: float = 1.0
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    sample_from_anchor: bool = True
    dspark_draft_topk: int | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "draft config") -> DraftConfig:
        if d.get("model_type") != "k3_dspark":
            raise SpecConfigError(f"{where}.model_type: expected 'k3_dspark', got {d.get('model_type')!r}")
        d = dict(d)
        rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        d.setdefault("rope_theta", rope.get("rope_theta", 50000.0))
        d.setdefault("rope_type", rope.get("rope_type", "default"))
        if "block_size" not in d and "dspark_block_size" in d:
            d["block_size"] = d.pop("dspark_block_size")
        dflash = d.get("dflash_config") or {}
        if "mask_token_id" in dflash:
            d["mask_token_id"] = dflash["mask_token_id"]
        for key in _MASK_TOKEN_KEYS:                      # vLLM's lookup order
            if d.get(key) is not None:
                d["mask_token_id"] = d[key]
                break
        for key in _MUST_BE_FALSE:
            if d.get(key):
                raise SpecConfigError(f"{where}.{key}: MLA DSpark requires false")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        known = {k: v for k, v in d.items() if k in fields}
        extra = {k: v for k, v in d.items() if k not in fields}
        for name, f in fields.items():
            if name not in known and f.default is dataclasses.MISSING:
                raise SpecConfigError(f"{where}: missing required key '{name}'")
        known["target_layer_ids"] = tuple(known["target_layer_ids"])
        known["architectures"] = tuple(known.get("architectures", cls.architectures))
        cfg = cls(**known, extra=extra)
        cfg.validate(where)
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> DraftConfig:
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError as exc:
            raise SpecConfigError(f"{file}: no draft config.json") from exc
        except json.JSONDecodeError as exc:
            raise SpecConfigError(f"{file}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, str(file))

    def validate(self, where: str) -> None:
        if not self.target_layer_ids or self.num_target_layers != len(self.target_layer_ids):
            raise SpecConfigError(f"{where}: target_layer_ids must be non-empty and num_target_layers == its length")
        if (self.draft_vocab_size or self.vocab_size) != self.vocab_size:
            raise SpecConfigError(f"{where}.draft_vocab_size must equal vocab_size (embedding and LM head are shared)")
        if self.hidden_act not in ("silu", "situ"):
            raise SpecConfigError(f"{where}.hidden_act: 'silu' or 'situ', got {self.hidden_act!r}")
        if self.rope_type != "default":
            raise SpecConfigError(f"{where}.rope_type: only 'default' RoPE is implemented, got {self.rope_type!r}")
        if not self.sample_from_anchor:
            raise SpecConfigError(f"{where}.sample_from_anchor: only the anchor-as-first layout (true) is implemented")
        if self.qk_rope_head_dim % 2:
            raise SpecConfigError(f"{where}.qk_rope_head_dim must be even")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise SpecConfigError(f"{where}.mask_token_id {self.mask_token_id} is outside the vocabulary")
        if self.block_size < 1 or self.num_hidden_layers < 1 or self.markov_rank < 1:
            raise SpecConfigError(f"{where}: block_size, num_hidden_layers and markov_rank must be >= 1")

    def check_target(self, target) -> None:
        """The draft must read the target it was made for (TextConfig)."""
        check_fits(self, target)

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def attention(self) -> str:
        return "mla"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        d["target_layer_ids"] = list(d["target_layer_ids"])
        d["architectures"] = list(d["architectures"])
        d["rope_parameters"] = {"rope_type": d["rope_type"], "rope_theta": d["rope_theta"]}
        d["draft_vocab_size"] = d["draft_vocab_size"] or d["vocab_size"]
        for key in _MUST_BE_FALSE:
            d[key] = False
        return {**d, **extra}

    def identity_hash(self) -> str:
        return identity_hash(self.to_dict())


def identity_hash(config: dict[str, Any]) -> str:
    import hashlib
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_fits(cfg: DraftConfig | GQADraftConfig, target) -> None:
    """A draft (either attention) must read the target it was made for (TextConfig)."""
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target {target.vocab_size}")
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target {target.hidden_size} (shared embedding)")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target {target.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside 0..{target.num_hidden_layers - 1}")
    if problems:
        raise SpecConfigError("draft does not fit the target: " + "; ".join(problems))


def _first(d: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` set in d or in its `dflash_config` (where DFlash-family drafts keep them)."""
    for source in (d.get("dflash_config") or {}, d):
        for key in keys:
            if source.get(key) is not None:
                return source[key]
    return None


@dataclass(frozen=True)
class GQADraftConfig:
    """`config.json` of the GQA (Qwen3-style, RadixArk's) DSpark draft: `model_type: "qwen3"`,
    `architectures: ["DSparkDraftModel"]`, taps and MASK id in `dflash_config` (docs/dspark.md)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    mask_token_id: int
    block_size: int
    target_hidden_size: int = 0                   # 0: hidden_size (vLLM's fallback)
    model_type: str = "qwen3"
    architectures: tuple[str, ...] = ("DSparkDraftModel",)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_type: str = "default"
    attention_bias: bool = False
    draft_vocab_size: int | None = None
    logit_scale: float = 1.0
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    dspark_draft_topk: int | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "draft config") -> GQADraftConfig:
        d = dict(d)
        rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        d.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        d["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        d["target_layer_ids"] = _first(d, "target_layer_ids", "dspark_target_layer_ids")
        d["block_size"] = _first(d, "block_size", "dspark_block_size")
        d["mask_token_id"] = _first(d, *_MASK_TOKEN_KEYS)
        d["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        known = {k: v for k, v in d.items() if k in fields and v is not None}
        for name, f in fields.items():
            if name not in known and f.default is dataclasses.MISSING:
                raise SpecConfigError(f"{where}: missing required key '{name}'")
        known["target_layer_ids"] = tuple(known["target_layer_ids"])
        known["architectures"] = tuple(known.get("architectures", cls.architectures))
        known["target_hidden_size"] = known.get("target_hidden_size") or known["hidden_size"]
        if known.get("draft_vocab_size") == known["vocab_size"]:
            known["draft_vocab_size"] = None                      # the full vocabulary, as written by to_dict
        consumed = {"dspark_target_layer_ids", "dspark_block_size", *_MASK_TOKEN_KEYS}
        cfg = cls(**known, extra={k: v for k, v in d.items() if k not in fields and k not in consumed})
        cfg.validate(where)
        return cfg

    def validate(self, where: str) -> None:
        checks = {"num_attention_heads must be a multiple of num_key_value_heads":
                  self.num_attention_heads % self.num_key_value_heads == 0,
                  "head_dim must be even": self.head_dim % 2 == 0,
                  "hidden_act: only 'silu' is implemented": self.hidden_act == "silu",
                  f"rope: only 'default' RoPE is implemented, got {self.rope_type!r}": self.rope_type == "default",
                  "attention_bias: only false is implemented": not self.attention_bias,
                  "draft_vocab_size must equal vocab_size (embedding and LM head are shared)":
                  (self.draft_vocab_size or self.vocab_size) == self.vocab_size,
                  "target_layer_ids must be non-empty": bool(self.target_layer_ids),
                  f"mask_token_id {self.mask_token_id} is outside the vocabulary":
                  0 <= self.mask_token_id < self.vocab_size,
                  "block_size, num_hidden_layers and markov_rank must be >= 1":
                  min(self.block_size, self.num_hidden_layers, self.markov_rank) >= 1}
        bad = [what for what, ok in checks.items() if not ok]
        if bad:
            raise SpecConfigError(f"{where}: {bad[0]}")

    def check_target(self, target) -> None:
        check_fits(self, target)

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def cache_dim(self) -> int:
        """One cache row: K (normed, rotated) then V of every KV head."""
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def attention(self) -> str:
        return "gqa"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        dflash = {**extra.pop("dflash_config", {}), "target_layer_ids": list(d.pop("target_layer_ids")),
                  "mask_token_id": d.pop("mask_token_id")}
        d["architectures"] = list(d["architectures"])
        d["rope_parameters"] = {"rope_type": d.pop("rope_type"), "rope_theta": d["rope_theta"]}
        d["draft_vocab_size"] = d["draft_vocab_size"] or d["vocab_size"]
        return {**d, "dflash_config": dflash, **extra}

    def identity_hash(self) -> str:
        return identity_hash(self.to_dict())


AnyDraftConfig = DraftConfig | GQADraftConfig
GQA_ARCHITECTURES = ("DSparkDraftModel", "Qwen3DSparkModel")


def read_draft_config(path: str | Path) -> AnyDraftConfig:
    """A draft's `config.json`: the MLA `k3_dspark` layout or the GQA `qwen3` DSpark one."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise SpecConfigError(f"{file}: no draft config.json") from exc
    except json.JSONDecodeError as exc:
        raise SpecConfigError(f"{file}: not valid JSON ({exc})") from exc
    if raw.get("model_type") == "qwen3" and set(raw.get("architectures") or ()) & set(GQA_ARCHITECTURES):
        return GQADraftConfig.from_dict(raw, str(file))
    if raw.get("model_type") != "k3_dspark":
        raise SpecConfigError(f"{file}.model_type: expected 'k3_dspark' (MLA draft) or 'qwen3' with architectures "
                              f"{list(GQA_ARCHITECTURES)} (GQA draft), got {raw.get('model_type')!r}")
    return DraftConfig.from_dict(raw, str(file))
