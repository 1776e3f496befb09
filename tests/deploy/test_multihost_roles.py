"""The multi-host harness (kimi_pd.multihost) starts each role with its deploy/compose/roles command:
the same argv, from the same node variables, so the rehearsal tests what the docs tell operators to run."""
from __future__ import annotations

import pytest

from kimi_pd.multihost.roles import haproxy_config, node_env, role_argv
from tests.deploy.helpers import HAPROXY_CFG
from tests.deploy.roles import KIMI_PD_ROLES, role_service
from tests.deploy.test_deploy_configs import service_argv


@pytest.mark.parametrize("role", KIMI_PD_ROLES)
def test_harness_argv_is_the_role_files_command(role):
    env = node_env("10.77.0.41", "redis://:pw@10.77.0.10:6379/0", "s" * 24, "admin", "/models/model")
    assert role_argv(role, env) == service_argv(role_service(role, env))


def test_worker_binds_everywhere_and_advertises_its_address():
    env = node_env("10.77.0.41", "redis://:pw@10.77.0.10:6379/0", "s" * 24, "admin", "/models/model")
    argv = role_argv("prefill", env)
    pairs = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert pairs["--host"] == pairs["--kv-host"] == "0.0.0.0"
    assert pairs["--advertise-url"] == "http://10.77.0.41:8101" and pairs["--kv-advertise-host"] == "10.77.0.41"


def test_haproxy_config_lists_the_given_routers_only():
    text = haproxy_config(HAPROXY_CFG.read_text(), ["10.77.0.21:8000", "10.77.0.22:8000"])
    servers = [line.split()[1:] for line in text.splitlines() if line.strip().startswith("server ")]
    assert servers == [["router-1", "10.77.0.21:8000"], ["router-2", "10.77.0.22:8000"]]
    assert "bind :8000" in text
