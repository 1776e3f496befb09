"""The not-stuck filter: a worker whose engine reports one long command or step gets no new requests,
unless every candidate is stuck."""
from __future__ import annotations

import pytest

from router.placement import FILTERS, RoutingContext, WorkerState, build_pipeline
from router.settings import RouterSettings
from shared.workers import LoadReport, WorkerInfo


def worker(wid: str, busy_s: float | None) -> WorkerState:
    load = None if busy_s is None else LoadReport(running=1, engine_busy_s=busy_s)
    return WorkerState(WorkerInfo(wid, "decode", f"http://{wid}", "m"), load=load)


CTX = RoutingContext(request_id="r", model="m", role="decode", num_prompt_tokens=8)


@pytest.mark.parametrize(("busy", "kept"), [
    ({"a": 0.0, "b": 0.5}, {"a", "b"}),               # ordinary steps
    ({"a": 0.0, "b": 30.0}, {"a"}),                   # b stuck for 30 s
    ({"a": None, "b": 30.0}, {"a"}),                  # no report: not known to be stuck
    ({"a": 10.0, "b": 10.5}, {"a"}),                  # the bound is inclusive
    ({"a": 60.0, "b": 30.0}, {"a", "b"}),             # all stuck: keep them all, queue rather than 503
])
def test_not_stuck(busy: dict[str, float | None], kept: set[str]) -> None:
    workers = [worker(wid, b) for wid, b in busy.items()]
    assert {w.worker_id for w in FILTERS.build("not-stuck")(CTX, workers)} == kept


def test_a_bound_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="after_s > 0"):
        FILTERS.build("not-stuck", after_s=0)


def test_the_default_policy_skips_a_stuck_worker() -> None:
    pipeline = build_pipeline(**RouterSettings(model="m").pipeline_spec())
    assert [w.worker_id for w in pipeline.candidates(CTX, [worker("stuck", 45.0), worker("free", 0.0)])] == ["free"]
