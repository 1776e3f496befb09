"""A fan-out through the router: its sub-requests reach the workers under one group id (`x-kimi-pd-group`,
which a worker's scheduler gives one share of its batch), a lone request under none, and a request for more
sequences than `max_sequences_per_request` is a 400 before anything reaches a worker."""
from __future__ import annotations

import httpx
import pytest

from router.app import create_app
from router.settings import RouterSettings
from tests.router.test_front import _serve
from tests.stub_worker import StubSettings
from tests.stub_worker import create_app as stub_app


@pytest.fixture(scope="module")
def router():
    seen: list[str | None] = []
    worker = stub_app(StubSettings(role="both", tokens=2))

    @worker.middleware("http")
    async def record(request, call_next):
        if request.url.path.startswith("/v1/"):
            seen.append(request.headers.get("x-kimi-pd-group"))
        return await call_next(request)

    servers = []
    try:
        worker_url, w = _serve(worker)
        servers.append(w)
        app = create_app(RouterSettings(model=None, static_both=(worker_url,), max_sequences_per_request=6))
        url, r = _serve(app)
        servers.append(r)
        yield url, seen
    finally:
        for server in servers:
            server.should_exit = True


def test_sub_requests_share_one_group_and_lone_requests_have_none(router):
    url, seen = router
    body = {"model": "kimi-k3", "prompt": ["a b c", "d e f"], "n": 3, "max_tokens": 2}
    seen.clear()
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert len(seen) == 6 and len(set(seen)) == 1 and seen[0] is not None
    first = seen[0]
    seen.clear()
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert len(set(seen)) == 1 and seen[0] != first                    # a new request, a new group
    seen.clear()
    assert httpx.post(url + "/v1/completions", json={**body, "prompt": "a", "n": 1}, timeout=30).status_code == 200
    assert seen == [None]


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}),
                                        ("/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "hi"}], "n": 7})])
def test_more_sequences_than_allowed_is_a_400_before_any_worker(router, path, extra):
    url, seen = router
    seen.clear()
    reply = httpx.post(url + path, json={"model": "kimi-k3", "max_tokens": 2, **extra}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "n" and "at most 6" in error["message"]
    assert seen == []
