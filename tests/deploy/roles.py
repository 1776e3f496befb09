"""The per-role compose files (deploy/compose/roles/) as compose would resolve them: `extends`
merged, variables interpolated from a node env file (or a dict)."""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

from tests.deploy.helpers import DEPLOY, interpolate_tree, read_env_file

ROLES_DIR = DEPLOY / "compose" / "roles"
NODE_ENV_EXAMPLE = ROLES_DIR / "node.env.example"
ROLE_FILES = {"store": "store.yml", "prefill": "prefill.yml", "decode": "decode.yml", "router": "router.yml",
              "lb": "lb.yml"}
KIMI_PD_ROLES = ("prefill", "decode", "router")


def _merge(base: dict, over: dict) -> dict:
    """Compose's `extends` merge for the keys these files use: mappings merge, the rest overrides."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key == "extends":
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


def raw_role(role: str) -> dict:
    """The role's single service, `extends` resolved, before interpolation."""
    path = ROLES_DIR / ROLE_FILES[role]
    services = yaml.safe_load(path.read_text())["services"]
    assert len(services) == 1, f"{path.name}: one service per role file"
    (service,) = services.values()
    if "extends" in service:
        ext = service["extends"]
        base = yaml.safe_load((path.parent / ext["file"]).read_text())["services"][ext["service"]]
        service = _merge(base, service)
    return service


def role_service(role: str, env: dict[str, str] | None = None) -> dict:
    return interpolate_tree(raw_role(role), read_env_file(NODE_ENV_EXAMPLE) if env is None else env)


def role_file(role: str) -> Path:
    return ROLES_DIR / ROLE_FILES[role]
