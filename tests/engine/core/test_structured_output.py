"""Structured output (xgrammar over the project's tokenizer): what greedy and seeded sampling
produce matches the schema, regex, choice or grammar, and ends when the structure is complete."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import SamplingParams
from shared.errors import InvalidRequest
from shared.structured_output import StructuredOutput
from tests.engine.core.helpers import make_llm

pytest.importorskip("xgrammar")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_their_structure(llm, temperature):
    def run(spec: StructuredOutput) -> str:
        params = SamplingParams(temperature=temperature, seed=5, max_tokens=48, structured_output=spec)
        out = llm.generate("Hello there", params)[0].output
        assert out.finish_reason == "stop"
        return out.text

    jsonschema.validate(json.loads(run(StructuredOutput("json", json.dumps(SCHEMA)))), SCHEMA)
    assert isinstance(json.loads(run(StructuredOutput("json_object", ""))), dict)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", run(StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}")))
    assert run(StructuredOutput("choice", json.dumps(["yes", "no", "maybe"]))) in ("yes", "no", "maybe")
    assert run(StructuredOutput("grammar", 'root ::= "A" [0-9] "B"')) in {f"A{i}B" for i in range(10)}


def test_a_bad_schema_is_the_clients_error(llm):
    with pytest.raises(InvalidRequest) as info:
        llm.generate("x", SamplingParams(max_tokens=4, structured_output=StructuredOutput("regex", "([a-")))
    assert info.value.param == "structured_outputs"
