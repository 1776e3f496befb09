"""Which assistant tool call a tool result answers, and the order results are rendered in.

XTML binds results to calls by position while OpenAI clients bind them by `tool_call_id` and may send
them in any order, so the chat renderer (`shared.prompt.chat`) sorts each run of results into call
order first. Pure bookkeeping on message dicts: no tokenizer, no rendering.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


def call_targets(calls: Sequence[tuple[str | None, str | None]]) -> dict[str, int]:
    """Every id a tool result may name -> its call's 0-based position.

    As in vLLM 0.32, each call answers to its own id and to the alias `NAME:POS`; on a clash the
    earlier registration wins (call by call, the id before the alias).
    """
    targets: dict[str, int] = {}
    for position, (call_id, name) in enumerate(calls):
        for alias in ((call_id,) if call_id else ()) + ((f"{name}:{position}",) if name else ()):
            targets.setdefault(alias, position)
    return targets


def with_results_in_call_order(messages: list[dict[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Messages with their `messages[i]` labels; each run of tool results sorted into call order.

    OpenAI clients bind results by `tool_call_id` and may send them in any order, while XTML binds
    them by position, so a run is reordered by the position of the call it answers.
    """
    calls: Any = None                    # the last assistant turn's tool_calls: what a run of results answers
    run: list[tuple[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool":
            run.append((where, message))
            continue
        if run:
            yield from _sorted_run(run, _call_positions(calls))
            run = []
        if role == "assistant":
            calls = message.get("tool_calls")
        yield where, message
    if run:
        yield from _sorted_run(run, _call_positions(calls))


def _call_positions(tool_calls: Any) -> dict[str, int]:
    """`call_targets` of a raw `tool_calls` list (calls without a usable name answer to their id only)."""
    calls: list[tuple[str | None, str | None]] = []
    for call in tool_calls if isinstance(tool_calls, list) else []:
        call = call if isinstance(call, dict) else {}
        fn = call.get("function", call)
        name = fn.get("name") if isinstance(fn, dict) else None
        calls.append((optional_str(call.get("id")), name if isinstance(name, str) else None))
    return call_targets(calls)


def _sorted_run(run: list[tuple[str, Any]], positions: dict[str, int]) -> list[tuple[str, Any]]:
    if len(run) < 2:
        return run                  # nothing to reorder
    keys = [optional_str(message.get("tool_call_id")) for _, message in run]
    bound = [key for key in keys if key is not None and key in positions]
    if len(bound) != len(keys):
        return run  # an unbound result is reported, with its own label, while rendering
    order = sorted(range(len(run)), key=lambda i: positions[bound[i]])
    return [run[i] for i in order]


def optional_str(value: Any) -> str | None:
    return None if value is None else str(value)
