"""vLLM-Ascend's recompute hand-back: a decode rank short of KV memory (its recompute scheduler,
`recompute_scheduler_enable`) ends a request with `finish_reason: "stop"`, `stop_reason: "recomputed"`
and no new token, and expects the proxy to run it again from a prefill. The router runs the rest of it:
the client's request with what was already delivered appended to the context, the token budget less
what was delivered, placed and prefilled as a new request (router/orchestrator.py `rerun`). The client
sees one answer: the recomputed end never reaches it, a stream goes on where it was (no second role
chunk, the same id) and a whole answer is the two parts joined.

Unlike vLLM-Ascend's reference proxy, which appends the delivered text to the FIRST message's content,
a chat continues the answer as vLLM's own `continue_final_message` does (an assistant message holding
what was delivered, `add_generation_prompt: false`); a completion's prompt gets the delivered text (a
text prompt) or the delivered token ids (a token-id prompt).
"""
from __future__ import annotations

from typing import Any

RECOMPUTED = "recomputed"


def recomputed(answer: dict[str, Any]) -> bool:
    """Whether a whole answer is a recomputed hand-back."""
    choices = answer.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return isinstance(first, dict) and first.get("stop_reason") == RECOMPUTED


def continuation(origin: dict[str, Any], text: str, reasoning: str, token_ids: list[int] | None,
                 produced: int) -> dict[str, Any] | None:
    """The request that runs the rest of `origin` (a decode leg's body) after `produced` delivered tokens
    (`text`, `reasoning`, their ids where known); None when the context cannot say what was delivered."""
    out = {k: v for k, v in origin.items() if k not in ("kv_transfer_params", "kimi_pd_resume")}
    messages, prompt = out.get("messages"), out.get("prompt")
    if isinstance(messages, list) and messages:
        last = messages[-1] if isinstance(messages[-1], dict) else {}
        if origin.get("continue_final_message") and isinstance(last.get("content"), str):
            partial = {**last, "content": last["content"] + text}        # the client was continuing it already
            out["messages"] = [*messages[:-1], partial]
        else:
            partial = {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}
            out["messages"] = [*messages, partial]
        out.update(continue_final_message=True, add_generation_prompt=False)
    elif isinstance(prompt, str):
        out["prompt"] = prompt + text
    elif isinstance(prompt, list) and token_ids is not None and len(token_ids) == produced:
        out["prompt"] = [*prompt, *token_ids]
    else:
        return None
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(out.get(key), int):
            out[key] = max(out[key] - produced, 1)
    if isinstance(out.get("min_tokens"), int) and out["min_tokens"]:
        out["min_tokens"] = max(out["min_tokens"] - produced, 0)
    return out


def whole_continuation(origin: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any] | None:
    """`continuation` after a whole (non-streamed) recomputed answer."""
    choice = answer["choices"][0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    if message.get("tool_calls"):
        return None                                  # a call half made cannot be continued as text
    text = message.get("content") if "message" in choice else choice.get("text")
    ids = choice.get("token_ids")
    produced = (answer.get("usage") or {}).get("completion_tokens")
    if not isinstance(produced, int):
        produced = len(ids) if isinstance(ids, list) else 0
    return continuation(origin, text or "", message.get("reasoning_content") or "",
                        ids if isinstance(ids, list) else None, produced)


def merge_whole(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One whole answer from a recomputed answer and the answer of its re-run: the first's id and prompt
    usage, the texts (and token ids) joined, the second's end."""
    a, b = first["choices"][0], second["choices"][0]
    merged = {**b, "index": a.get("index", 0)}
    if isinstance(a.get("message"), dict) and isinstance(b.get("message"), dict):
        merged["message"] = {**b["message"], **_joined(a["message"], b["message"], ("content", "reasoning_content"))}
    else:
        merged.update(_joined(a, b, ("text",)))
    if isinstance(a.get("token_ids"), list) and isinstance(b.get("token_ids"), list):
        merged["token_ids"] = a["token_ids"] + b["token_ids"]
    out = {**second, "id": first.get("id", second.get("id")), "created": first.get("created", second.get("created")),
           "choices": [merged]}
    ua, ub = first.get("usage"), second.get("usage")
    if isinstance(ua, dict) and isinstance(ub, dict):
        completion = (ua.get("completion_tokens") or 0) + (ub.get("completion_tokens") or 0)
        out["usage"] = {**ua, "completion_tokens": completion,
                        "total_tokens": (ua.get("prompt_tokens") or 0) + completion}
    return out


def _joined(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...]) -> dict[str, str]:
    return {k: (a.get(k) or "") + (b.get(k) or "") for k in keys if a.get(k) or b.get(k)}
