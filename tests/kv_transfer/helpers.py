"""Shared fixtures-as-functions for the kv_transfer tests: configs, a realistic payload, checks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kv_transfer.interface import KVSender, TransferConfig
from kv_transfer.metrics import TransferMetrics, get_metrics
from kv_transfer.payload import ModelIdentity, TransferPayload, flat_bytes

IDENTITY = ModelIdentity(config_hash="c0ffee", dtype="bfloat16", layer_schedule="KKKM" * 2, block_size=64)
SECRET = b"test-secret-0123456789abcdef"


def config(**overrides: Any) -> TransferConfig:
    """Loopback config with short timeouts, so a hang fails fast instead of hanging the suite."""
    base = dict(identity=IDENTITY, secret=SECRET, host="127.0.0.1", port=0, read_timeout_s=5.0,
                connect_timeout_s=2.0, transfer_timeout_s=20.0, lease_s=30.0, sweep_interval_s=0.05,
                chunk_bytes=1 << 20, streams=3)
    base.update(overrides)
    return TransferConfig(**base)


def metrics() -> TransferMetrics:
    return get_metrics(CollectorRegistry())


def hybrid_payload(request_id: str = "req-1", tokens: int = 2048, seed: int = 0) -> TransferPayload:
    """A Kimi-K3-shaped export, scaled down: MLA latents [tokens, 576] bf16 (2.25 MiB each), KDA
    recurrent [4, 128, 128] fp32 and conv [3, 3*4*128] bf16 states, plus odd shapes. Raw random
    bits (NaNs included), so only a bit-exact transfer compares equal."""
    g = torch.Generator().manual_seed(seed)

    def bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)

    tensors: dict[str, torch.Tensor] = {}
    for layer in (3, 7):
        tensors[f"mla.{layer}"] = bits((tokens, 576), torch.bfloat16)
    for layer in range(3):
        tensors[f"kda_recurrent.{layer}"] = bits((4, 128, 128), torch.float32)
        tensors[f"kda_conv.{layer}"] = bits((3, 3 * 4 * 128), torch.bfloat16)
    tensors["first_token"] = torch.tensor(4711, dtype=torch.int64)
    tensors["mask"] = torch.rand(37, generator=g) > 0.5
    tensors["empty"] = torch.empty(0, 576, dtype=torch.bfloat16)
    meta = {"prompt_token_ids": list(range(tokens)), "first_token": 4711, "logprob": -0.125,
            "block_ids": list(range(tokens // 64))}
    return TransferPayload(request_id, meta, tensors)


def assert_same(sent: TransferPayload, got: TransferPayload) -> None:
    """Same request, meta, tensor names in order, dtypes, shapes and every byte."""
    assert got.request_id == sent.request_id
    assert got.meta == sent.meta
    assert list(got.tensors) == list(sent.tensors)
    for name, want in sent.tensors.items():
        have = got.tensors[name]
        assert (have.dtype, have.shape) == (want.dtype, want.shape), name
        assert torch.equal(flat_bytes(have.contiguous()), flat_bytes(want.contiguous())), name


class FreeLog:
    """An `on_free` callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request_id: str, reason: str) -> None:
        self.calls.append((request_id, reason))


def run(coro: Awaitable[Any], timeout_s: float = 30.0) -> Any:
    """Run a coroutine on a fresh loop, bounded in time."""
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout_s)
    return asyncio.run(bounded())


async def eventually(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until `cond()` holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def open_sockets() -> int:
    """Sockets this process holds open (pipes and files are not counted)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):           # the listing's own fd is gone by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


@contextlib.asynccontextmanager
async def serving(sender: KVSender) -> AsyncIterator[KVSender]:
    """Start `sender`, and stop it however the block ends."""
    await sender.start()
    try:
        yield sender
    finally:
        await sender.stop()


class Clock:
    """A settable clock for lease tests."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def with_identity(**changes: Any) -> ModelIdentity:
    return dataclasses.replace(IDENTITY, **changes)


def sample(m: TransferMetrics, name: str, **labels: str) -> float:
    """Current value of one metric sample in `m`'s registry (0 if absent)."""
    return m.registry.get_sample_value(name, labels) or 0.0
