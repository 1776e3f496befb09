"""What a request's output must match (vLLM's `structured_outputs`, OpenAI's `response_format`):
one kind and its value. Torch-free and engine-free: the router validates the shape, the engine
compiles it (engine/structured_output.py, with xgrammar)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequest

KINDS = ("json", "json_object", "regex", "choice", "grammar", "xtml")   # xtml: K3 structure (forced tool calls)


@dataclass(frozen=True)
class StructuredOutput:
    kind: str           # one of KINDS
    value: str          # JSON schema text, regex, JSON list of choices, EBNF grammar ("" for json_object)
    # True: the grammar constrains the answer only. The reasoning (K3's think channel) runs free until it
    # closes, the response channel's opener follows, and the grammar applies from there (vLLM's
    # reasoning-aware structured output); a chat request with thinking on sets it.
    after_reasoning: bool = False

    @classmethod
    def from_request(cls, response_format: Any, structured_outputs: Any) -> StructuredOutput | None:
        """From `response_format` (text / json_object / json_schema) or vLLM's `structured_outputs`
        (exactly one of json, regex, choice, grammar); giving both is a 400."""
        spec = _from_response_format(response_format)
        other = _from_structured_outputs(structured_outputs)
        if spec is not None and other is not None:
            raise InvalidRequest("structured_outputs: give either response_format or structured_outputs",
                                 param="structured_outputs")
        return spec or other


def _from_response_format(rf: Any) -> StructuredOutput | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest('response_format: type must be "text", "json_object" or "json_schema"',
                             param="response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutput("json_object", "")
    schema = (rf.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema: must be a JSON schema object",
                             param="response_format.json_schema.schema")
    return StructuredOutput("json", json.dumps(schema))


def _from_structured_outputs(so: Any) -> StructuredOutput | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidRequest("structured_outputs: must be an object", param="structured_outputs")
    given = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object") and v}
    unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"})
    if unknown:
        raise InvalidRequest(f"structured_outputs: {', '.join(unknown)} not supported", param="structured_outputs")
    if len(given) != 1:
        raise InvalidRequest("structured_outputs: give exactly one of json, regex, choice, grammar",
                             param="structured_outputs")
    kind, value = next(iter(given.items()))
    if kind == "json":
        return StructuredOutput("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        return StructuredOutput("json_object", "")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest("structured_outputs.choice: must be a list of non-empty strings",
                                 param="structured_outputs.choice")
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str):
        raise InvalidRequest(f"structured_outputs.{kind}: must be a string", param=f"structured_outputs.{kind}")
    return StructuredOutput(kind, value)
