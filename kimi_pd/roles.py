"""Every worker role, by the name it registers under (`WorkerInfo.role`) and the command that runs it."""
from __future__ import annotations

from decode_worker import ROLE as DECODE
from decode_worker.leg import DecodeLeg
from prefill_worker import ROLE as PREFILL
from prefill_worker.leg import PrefillLeg
from worker.role import Role

# One engine, both halves: local requests always; P/D legs too when a transfer secret is configured.
COLOCATED = Role("both", legs=(PrefillLeg, DecodeLeg), transfer_required=False)

ROLES: dict[str, Role] = {role.name: role for role in (PREFILL, DECODE, COLOCATED)}
# `kimi-pd <command>` -> role
COMMANDS: dict[str, Role] = {"prefill": PREFILL, "decode": DECODE, "worker": COLOCATED}
