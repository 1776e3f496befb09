"""A real tiny-model export crossing each transport bit-exactly, and the disaggregation path without
HTTP: export on engine A -> tcp -> import on engine B -> decode == one engine, token for token."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.state_export import ExportedState
from kv_transfer.interface import KVTransferParams, make_receiver, make_sender
from kv_transfer.payload import ModelIdentity, TransferPayload
from prefill_worker.handoff import to_payload
from shared.sampling_params import SamplingParams
from tests.kv_transfer.helpers import FreeLog, assert_same, config, eventually, metrics, serving

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = [(37 * i + 11) % 1000 for i in range(29)]




def engine(tiny_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_dir), block_size=4, kda_chunk_size=8, cache_memory_bytes=4 << 20))


def run_to_end(eng: LLMEngine):
    final = None
    while eng.has_unfinished():
        final = [o for o in eng.step() if o.finished] or final
    return final


def real_export(tiny_dir: Path) -> tuple[LLMEngine, ExportedState]:
    eng = engine(tiny_dir)
    eng.add_request("p", PROMPT, GREEDY, export_state=True)
    run_to_end(eng)
    return eng, eng.export_state("p")


def identity_of(eng: LLMEngine) -> ModelIdentity:
    i = eng.identity
    return ModelIdentity(i.config_hash, i.dtype, i.layer_schedule, i.block_size)


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
def test_real_export_round_trip_is_bit_exact(tiny_dir, transport):
    if transport == "mooncake":
        pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda")
    eng, state = real_export(tiny_dir)
    payload = to_payload(state)
    cfg = config(transport=transport, identity=identity_of(eng))

    async def main():
        log = FreeLog()
        async with serving(make_sender(cfg, metrics())) as sender:
            params = sender.publish(payload, None, log)
            receiver = make_receiver(cfg, metrics())
            await receiver.start()
            try:
                got = await receiver.pull(KVTransferParams.from_dict(params.to_dict()))
                assert await receiver.release(params)
            finally:
                await receiver.stop()
            await eventually(lambda: sender.held_count() == 0)
        assert log.calls == [("p", "released")]
        return got

    got = asyncio.run(main())
    assert_same(payload, got)
    assert ExportedState.from_parts(got.meta, got.tensors).first_token_id == state.first_token_id


def test_export_tcp_import_continue_equals_one_engine(tiny_dir):
    single = engine(tiny_dir)
    single.add_request("s", PROMPT, GREEDY)
    expected = run_to_end(single)[0].output

    prefill, decode = engine(tiny_dir), engine(tiny_dir)
    prefill.add_request("p", PROMPT, GREEDY, export_state=True)
    run_to_end(prefill)
    cfg = config(transport="tcp", identity=identity_of(prefill))

    async def main():
        freed = []
        async with serving(make_sender(cfg, metrics())) as sender:
            def on_free(rid, reason):
                freed.append(reason)
                prefill.release_export(rid, reason)
            params = sender.publish(to_payload(prefill.export_state("p")), None, on_free)
            receiver = make_receiver(cfg, metrics())
            await receiver.start()
            try:
                got = await receiver.pull(params)
                await receiver.release(params)
            finally:
                await receiver.stop()
            await eventually(lambda: sender.held_count() == 0)
        return got, freed

    payload, freed = asyncio.run(main())
    assert freed == ["released"] and not prefill.held
    prefill.check_integrity()
    decode.add_request("d", PROMPT, GREEDY, imported=ExportedState.from_parts(payload.meta, payload.tensors))
    got = run_to_end(decode)[0].output
    assert got.token_ids == expected.token_ids
    decode.check_integrity()
    assert not decode.requests


def _rank_main(rank: int, port: int, export_file: str, identity: dict, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        cfg = config(transport="torch-dist", identity=ModelIdentity(**identity))
        saved = torch.load(export_file)
        payload = TransferPayload("p", saved["meta"], saved["tensors"])
        results.put((rank, asyncio.run(asyncio.wait_for((_send if rank == 0 else _pull)(cfg, payload, results), 40))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


async def _send(cfg, payload, results) -> str:
    log = FreeLog()
    async with serving(make_sender(cfg, metrics())) as sender:
        results.put(("params", sender.publish(payload, None, log).to_dict()))
        await eventually(lambda: sender.held_count() == 0, timeout_s=30)
    return "released" if log.calls == [("p", "released")] else repr(log.calls)


async def _pull(cfg, payload, results) -> str:
    raw = None
    while raw is None:
        item = await asyncio.to_thread(results.get, True, 30)
        if item[0] == "params":
            raw = item[1]
        else:
            results.put(item)
            await asyncio.sleep(0.05)
    receiver = make_receiver(cfg, metrics())
    await receiver.start()
    params = KVTransferParams.from_dict(raw)
    got = await receiver.pull(params)
    await receiver.release(params)
    assert_same(payload, got)
    return "pulled"


def test_real_export_over_torch_dist_is_bit_exact(tiny_dir, tmp_path):
    eng, state = real_export(tiny_dir)
    meta, tensors = state.to_parts()
    export_file = tmp_path / "export.pt"
    torch.save({"meta": meta, "tensors": tensors}, export_file)
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ident = vars(identity_of(eng)).copy() if hasattr(identity_of(eng), "__dict__") else identity_of(eng).to_dict()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(export_file), ident, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        outcome = {}
        while len(outcome) < 2:
            key, value = results.get(timeout=60)
            if key == "params":
                results.put((key, value))
                continue
            outcome[key] = value
        assert outcome == {0: "released", 1: "pulled"}, outcome
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
