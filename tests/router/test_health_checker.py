"""Active health checks: a probe's timeout is its own setting, not the check interval. A worker that
answers /health late (its host is starved, its engine busy) stays healthy while it answers within the
timeout, however short the interval; one that misses the timeout twice in a row is marked unhealthy,
and one good answer makes it healthy again."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from router import health_checker
from router.registry import WorkerRegistry
from router.settings import RouterSettings

pytestmark = pytest.mark.asyncio


class SlowWorker:
    """A real loopback HTTP server that answers every request after `delay_s` (client timeouts are
    enforced by the network layer, so a mock transport would never time out)."""

    def __init__(self, delay_s: float, dribble_s: float = 0.0, dribbled: str = "") -> None:
        self.delay_s, self.dribble_s, self.url, self._server = delay_s, dribble_s, "", None
        self.dribbled = dribbled            # the path answered in pieces ("": every path)
        self.paths: list[str] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (head := await reader.readuntil(b"\r\n\r\n")):
                self.paths.append(head.split()[1].decode())
                await asyncio.sleep(self.delay_s)
                body = b"ok" * 8
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
                dribble = self.dribble_s if self.dribbled in ("", self.paths[-1]) else 0.0
                for byte in (body if dribble else [body]):               # dribbled: one byte at a time
                    writer.write(bytes([byte]) if dribble else byte)
                    await writer.drain()
                    await asyncio.sleep(dribble)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> SlowWorker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()


async def run_checks(client: httpx.AsyncClient, registry: WorkerRegistry, seconds: float, timeout_s: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(health_checker.run(client, registry, 0.05, stop, None, timeout_s))
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_slow_answer_within_the_timeout_keeps_a_worker_healthy_at_a_short_interval():
    async with SlowWorker(0.3) as worker, httpx.AsyncClient() as client:
        registry = WorkerRegistry(RouterSettings(model=None, static_decode=(worker.url,)), None)
        await run_checks(client, registry, 1.2, timeout_s=1.0)
        assert registry.health.is_healthy(worker.url)


async def test_missed_timeouts_mark_unhealthy_and_one_answer_heals():
    async with SlowWorker(0.3) as worker, httpx.AsyncClient() as client:
        registry = WorkerRegistry(RouterSettings(model=None, static_decode=(worker.url,)), None)
        await run_checks(client, registry, 1.0, timeout_s=0.1)
        assert not registry.health.is_healthy(worker.url)
        worker.delay_s = 0.0
        await run_checks(client, registry, 0.3, timeout_s=0.1)
        assert registry.health.is_healthy(worker.url)


async def test_an_answer_sent_in_slow_pieces_counts_as_missed_and_does_not_hold_the_round():
    """Each piece comes within the timeout (so httpx's per-read timeout never fires) but the whole
    answer takes 16 x 0.15 s: the check gives up at the timeout, and a round with a fast worker in it
    ends about then rather than when the slow page would have."""
    async with SlowWorker(0.0, dribble_s=0.15) as slow, SlowWorker(0.0) as fast, httpx.AsyncClient() as client:
        registry = WorkerRegistry(RouterSettings(model=None, static_decode=(slow.url, fast.url)), None)
        started = asyncio.get_running_loop().time()
        await health_checker.check_once(client, registry, 0.5)
        elapsed = asyncio.get_running_loop().time() - started
        await health_checker.check_once(client, registry, 0.5)
        assert not registry.health.is_healthy(slow.url) and registry.health.is_healthy(fast.url)
        assert elapsed < 1.5, elapsed                       # the slow page alone takes 2.4 s
        slow.dribble_s = 0.0
        await health_checker.check_once(client, registry, 0.5)
        assert registry.health.is_healthy(slow.url)


async def test_a_slow_vllm_metrics_page_is_read_off_the_round_one_read_at_a_time():
    """A stock vLLM worker whose /metrics comes in pieces over 2.4 s: health rounds every 0.05 s go on
    meanwhile (its /health is answered at once), and only one read of its page is under way at a time."""
    async with SlowWorker(0.0, dribble_s=0.15, dribbled="/metrics") as worker, httpx.AsyncClient() as client:
        settings = RouterSettings(model=None, static_decode=(worker.url,), kv_connector="nixl")
        registry = WorkerRegistry(settings, None)
        assert registry.is_vllm(worker.url)
        await run_checks(client, registry, 1.0, timeout_s=0.5)
        assert worker.paths.count("/health") >= 5 and worker.paths.count("/metrics") == 1, worker.paths
        assert registry.health.is_healthy(worker.url)
        assert not registry.load_scrapes         # the checker's exit cancelled its read
