"""What crosses kv_transfer: a request's exported hybrid state, and the model identity peers compare.

Tensors travel as their raw bytes in the tensor's own dtype (bfloat16 included), viewed as flat
uint8: no per-element Python work, and a round trip is bit-exact by construction.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import msgpack
import torch

from kv_transfer.errors import CorruptFrame

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
        torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class ModelIdentity:
    """What two pools must agree on before any state crosses between them."""

    config_hash: str
    dtype: str
    layer_schedule: str
    block_size: int

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def mismatch(self, sender: ModelIdentity) -> str | None:
        """Describe the first field where this (receiver) identity differs from `sender`'s."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(sender, f.name)
            if mine != theirs:
                return f"model identity mismatch on {f.name}: receiver has {mine!r}, sender has {theirs!r}"
        return None

    @classmethod
    def from_wire(cls, raw: object) -> ModelIdentity:
        """Parse a peer's identity; anything malformed is a `CorruptFrame`."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if not isinstance(raw, dict) or set(raw) != set(fields) or not all(
            isinstance(raw[name], int if kind == "int" else str) for name, kind in fields.items()
        ):
            raise CorruptFrame("malformed model identity in handshake")
        return cls(**raw)


@dataclass
class TransferPayload:
    """One request's exported state.

    `meta` must be msgpack-able (prompt token ids, first token, logprob, ...). `tensors` keeps its
    insertion order across a transfer; names are free-form (`mla.3`, `kda_conv.0`, ...). Once
    published, the sender may read the tensors until `on_free` runs: do not modify them before.
    """

    request_id: str
    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of a manifest."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype].itemsize

    def to_wire(self) -> list[object]:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, raw: object) -> TensorSpec:
        """Parse and bound-check one manifest entry (known dtype, non-negative int dims)."""
        if not (isinstance(raw, (list, tuple)) and len(raw) == 3):
            raise CorruptFrame("malformed tensor spec")
        name, dtype, shape = raw
        ok = isinstance(name, str) and dtype in _DTYPES and isinstance(shape, (list, tuple))
        if not ok or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptFrame(f"malformed tensor spec for {name!r}")
        return cls(name, dtype, tuple(shape))

    def empty(self, device: str | torch.device = "cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=_DTYPES[self.dtype], device=device)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise TypeError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
    return TensorSpec(name, dtype, tuple(tensor.shape))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no copy)."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return flat_bytes(tensor).numpy().data.cast("B")


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a contiguous CPU tensor (copies only when it is not one already)."""
    return tensor.detach().to("cpu").contiguous()


def pack_meta(meta: dict) -> bytes:
    """Encode meta once at publish time, so a non-msgpack-able meta fails there, not mid-pull."""
    return msgpack.packb(meta, use_bin_type=True)
