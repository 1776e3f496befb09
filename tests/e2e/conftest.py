from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.fleet import Fleet, offline_llm


@pytest.fixture(scope="package")
def pd_fleet(tmp_path_factory, e2e_model) -> Iterator[Fleet]:
    """One static P/D fleet (`p`, `d`, a router `r` that always disaggregates, and a colocated worker `w`)
    for the modules that only send it requests: started once for tests/e2e rather than once a module (a
    worker start costs seconds of CPU on two cores). Its router also serves /tokenizer_info and may fetch
    loopback image URLs (the workers may not). Shared: a test reads metrics as deltas and keys cache checks
    on a prompt of its own."""
    info = ("--enable-tokenizer-info-endpoint",)
    with Fleet(tmp_path_factory.mktemp("pd"), e2e_model) as f:
        f.w = f.worker("worker", "w0")        # one colocated worker: what P/D must equal; started alongside
        f.static_pd(decode_flags=info, router_flags=(*info, "--allow-private-media-urls"))
        f.wait(f.w)
        yield f


@pytest.fixture(scope="package")
def offline(e2e_model):
    """The colocated reference engine (the workers' cache geometry), loaded once for tests/e2e."""
    return offline_llm(e2e_model)
