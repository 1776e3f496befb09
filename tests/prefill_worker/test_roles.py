"""Roles: one file names them all, each role package runs on its own, and a role that moves state
refuses to start without the transfer secret (before any model is loaded)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from decode_worker import ROLE as DECODE
from kimi_pd.roles import COMMANDS, ROLES
from prefill_worker import ROLE as PREFILL
from shared.kv_transfer_params import KVTransferParams

ROOT = Path(__file__).resolve().parents[2]


def test_one_table_names_every_role_and_the_legs_they_serve() -> None:
    assert set(ROLES) == {"prefill", "decode", "both"} and ROLES["prefill"] is PREFILL and ROLES["decode"] is DECODE
    assert {c: r.name for c, r in COMMANDS.items()} == {"prefill": "prefill", "decode": "decode", "worker": "both"}
    kinds = {name: [leg.kind for leg in role.legs] for name, role in ROLES.items()}
    assert kinds == {"prefill": ["prefill"], "decode": ["decode"], "both": ["prefill", "decode"]}
    assert KVTransferParams.prefill_request().leg == "prefill"
    assert KVTransferParams(do_remote_prefill=True).leg == "decode" and KVTransferParams().leg == "local"


def test_roles_that_move_state_need_the_secret() -> None:
    for role in (PREFILL, DECODE):
        with pytest.raises(ValueError, match="transfer secret of at least 16 bytes"):
            role.validate(b"short")
        role.validate(b"x" * 16)
        assert role.serves_transfers(b"")
    ROLES["both"].validate(b"")
    assert not ROLES["both"].serves_transfers(b"") and ROLES["both"].serves_transfers(b"x" * 16)


@pytest.mark.parametrize("package", ["prefill_worker", "decode_worker"])
def test_each_role_runs_on_its_own(package: str, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KIMI_PD_TRANSFER_SECRET"}
    env["PYTHONPATH"] = str(ROOT)
    refused = subprocess.run([sys.executable, "-m", package, "--model", str(tmp_path)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "KIMI_PD_TRANSFER_SECRET" in refused.stderr, refused.stderr[-2000:]
    assert f"python -m {package}: error" in refused.stderr
