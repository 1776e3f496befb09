"""JSON-object flags in the style of `vllm serve` (`--speculative-config`, `--compilation-config`):
one reading, so every such flag refuses non-JSON and non-objects with the same message shape."""
from __future__ import annotations

import json
from typing import Any


def json_object(raw: str | dict[str, Any], flag: str, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """`raw` (JSON text or an already-parsed dict) as a dict; `error` names `flag` otherwise."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise error(f"{flag}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise error(f"{flag}: expected a JSON object")
    return raw
