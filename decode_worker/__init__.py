"""kimi-pd decode worker: pulls prefill state, generates and streams.

Everything the role does is here: the leg (`leg.DecodeLeg`: pull, release, failure policy) and the
pull itself (`pull`). Run it alone with `python -m decode_worker`.
"""
from __future__ import annotations

from decode_worker.leg import DecodeLeg
from worker.role import Role

ROLE = Role("decode", legs=(DecodeLeg,), transfer_required=True)
