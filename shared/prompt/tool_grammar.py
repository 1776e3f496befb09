"""The grammar of a forced K3 tool call (`tool_choice` "required" or a named function), in
xgrammar's EBNF over the decoded text (special tokens by their names).

The generation prompt has opened the `think` channel (thinking on) or the `response` channel
(off); the grammar closes what is open with no reasoning and no content, then writes the `tools`
channel with one to `MAX_CALLS` calls of the allowed tools, each with typed `string` arguments
whose keys are the tool's declared parameters, and closes the message. So the output always
parses into at least one tool call (`parsers.parse_tool_calls`); values are bounded in length
so a call completes inside a modest `max_tokens`.
"""
from __future__ import annotations

import json
from typing import Any

from shared.prompt.parsers import CLOSE, MESSAGE_CLOSE, OPEN, RESPONSE_CLOSE, RESPONSE_OPEN, SEP, THINK_CLOSE

MAX_CALLS = 2
MAX_ARGUMENTS = 2
MAX_VALUE_CHARS = 12


def _lit(text: str) -> str:
    return json.dumps(text)


def _alternatives(values: list[str]) -> str:
    return "(" + " | ".join(_lit(v) for v in values) + ")"


def forced_tool_call_grammar(tools: list[dict[str, Any]], *, thinking: bool, name: str | None = None) -> str:
    """EBNF for a forced call of `name` (or of any tool in `tools` when None)."""
    functions = [t.get("function", {}) for t in tools]
    allowed = [f for f in functions if f.get("name") and (name is None or f["name"] == name)]
    if not allowed:
        raise ValueError(f"no tool named {name!r}" if name else "no tools to call")
    head = (THINK_CLOSE + RESPONSE_OPEN if thinking else "") + RESPONSE_CLOSE + f"{OPEN}tools{SEP}"
    rules = [f"root ::= {_lit(head)} call{{1,{MAX_CALLS}}} {_lit(CLOSE + 'tools' + SEP + MESSAGE_CLOSE)}",
             "call ::= " + " | ".join(f"call{i}" for i in range(len(allowed))),
             f"value ::= [^<\"]{{0,{MAX_VALUE_CHARS}}}",
             "index ::= [1-9]"]
    for i, function in enumerate(allowed):
        keys = list(((function.get("parameters") or {}).get("properties") or {}).keys())
        key = _alternatives(keys) if keys else "[a-z_]{1,16}"
        opener = f'{OPEN}call tool="{function["name"]}" index="'
        rules.append(f"call{i} ::= {_lit(opener)} index {_lit(chr(34) + SEP)} arg{i}{{0,{MAX_ARGUMENTS}}} "
                     f"{_lit(CLOSE + 'call' + SEP)}")
        rules.append(f"arg{i} ::= {_lit(OPEN + 'argument key=' + chr(34))} {key} "
                     f"{_lit(chr(34) + ' type=' + chr(34) + 'string' + chr(34) + SEP)} value "
                     f"{_lit(CLOSE + 'argument' + SEP)}")
    return "\n".join(rules)
