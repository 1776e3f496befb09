"""kimi-pd prefill worker: computes prompts and hands their state to decode workers under a lease.

Everything the role does is here: the leg (`leg.PrefillLeg`: compute, publish, answer the params)
and the hand-off to the transfer layer (`handoff`). Run it alone with `python -m prefill_worker`.
"""
from __future__ import annotations

from prefill_worker.leg import PrefillLeg
from worker.role import Role

ROLE = Role("prefill", legs=(PrefillLeg,), transfer_required=True)
