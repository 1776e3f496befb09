"""Kimi-K3 "XTML" chat renderer: OpenAI-style messages -> prompt token ids, built directly.

K3 has no Jinja template; its tokenizer's Python encoder emits the prompt as segments. Control
tokens (`<|open|>`, `<|sep|>`, ...) are appended here as special ids and every other piece goes
through `KimiTokenizer.encode`, which never yields a special id, so control-token text inside user
content, tool output or arguments stays plain text (no prompt injection). Like the reference, every
piece is encoded on its own: an attribute is the four pieces ` role`, `="`, `user`, `"`.

Format (no newlines between tags; `OPEN`=`<|open|>`, `SEP`=`<|sep|>`, `CLOSE`=`<|close|>`)::

    tool declarations (only with `tools`):
        OPEN message role="system" type="tool-declare" SEP # Tools ... ```json\\n<compact JSON>\\n```
        CLOSE message SEP <|end_of_msg|>
    thinking effort (only with thinking on):
        OPEN message role="system" type="thinking-effort" SEP <note> CLOSE message SEP <|end_of_msg|>
    system / user:   OPEN message role="user" SEP content CLOSE message SEP <|end_of_msg|>
    tool result:     OPEN message role="tool" tool="NAME" index="N" SEP content CLOSE message SEP <|end_of_msg|>
    assistant:       OPEN message role="assistant" SEP
                       [OPEN think SEP reasoning CLOSE think SEP]            (thinking on only)
                       OPEN response SEP content CLOSE response SEP
                       [OPEN tools SEP
                          OPEN call tool="NAME" index="1" SEP
                            OPEN argument key="K" type="string" SEP raw text CLOSE argument SEP
                            (other types: number/boolean/null/object/array, value as JSON)
                          CLOSE call SEP ...
                        CLOSE tools SEP]
                     CLOSE message SEP <|end_of_msg|>
    generation prompt: OPEN message role="assistant" SEP OPEN think SEP   (OPEN response SEP if thinking off)
    image:           <|media_begin|> image WxH <|media_content|> <|media_pad|> x n <|media_end|>

Sources (public, read not copied): the XTML grammar, attribute escaping (`&`->`&amp;`, `"`->`&quot;`),
typed arguments, 1-based call indices and `response` before `tools` follow the vLLM-Ascend K3 parsers
(`vllm-ascend/vllm-ascend-kimi-k3`: `kimi_k3_xtml.py`, `patch_kimi_k3_tool_parser.py`,
`patch_kimi_k3_reasoning_parser.py`); `developer` -> `system`, thinking efforts {low, high, max} and the
`image WxH` image header (the upload's original size, one text piece) follow vLLM 0.32
(`renderers/kimi_k3.py`, `models/kimi_k3/common/mm_preprocess.py`); `developer` -> `system` follows
`patch_kimi_k3_renderer.py`. Public ports of Moonshot's
`encoding_k3.py` supply the rest: the `tool-declare` and `thinking-effort` system messages and their
order (declarations first), per-piece encoding, the `tool="NAME" index="N"` tool-result attributes,
the raw `json` block for unparseable arguments, sorted compact JSON for declarations, and the think
channel being structural (present, possibly empty, on every assistant turn while thinking is on).

Choices where the sources are silent or disagree:
* `thinking_effort=None` means "max", the default HF `apply_chat_template` (and so vLLM) applies; an
  effort note is therefore always rendered while thinking is on.
* Past reasoning: the encoder ports keep `reasoning_content` in history, one training-cookbook port
  drops the think channel; we keep it by default and `keep_reasoning=False` empties it (the channel
  itself stays, as the encoder always emits it while thinking is on). With thinking off the channel
  and the reasoning are dropped.
* Tool results bind to the most recent assistant's calls by `tool_call_id` (or by order when the id
  is absent); like vLLM 0.32, an id may also be the alias `NAME:POS` (POS the call's 0-based position,
  the ids this project's parser hands out), a consecutive run of results is put into call order, and
  `index` is the answered call's position + 1 (so it skips calls without a result); the tool name
  comes from the matched call.
* The image block carries `image WxH`, W and H the upload's original size (not the resized one), and
  n `<|media_pad|>` tokens, n given by the vision code per image.
* No BOS token is emitted (the reference emits none). A `name` on a system/user/assistant message
  becomes a `name="..."` attribute after `role`.
* Non-string argument values use `json.dumps` defaults (`{"a": 1}`, non-ASCII kept), declarations
  use sorted compact JSON, both as in the encoder ports.
* Not rendered (not in this API): the reference's `tool-choice` / `response-format` system notes and
  mid-conversation tool declarations (a system message carrying `tools`).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.prompt.render_memo import SHORT_CHARS
from shared.prompt.tokenizer import KimiTokenizer
from shared.prompt.tool_order import call_targets, optional_str, with_results_in_call_order

THINKING_EFFORTS = ("low", "medium", "high", "max")   # exactly the values THINKING_EFFORT_BODY lists
DEFAULT_THINKING_EFFORT = "max"
ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_PART_TYPES = ("image_url", "image")

# Body text of the synthesized system messages: protocol strings the model was trained on, as
# reproduced by the public ports of the reference encoder.
# These two bodies are the exact wording K3 was trained on (as public ports of its encoder reproduce it);
# like the tag names, they are part of the prompt format a real checkpoint expects, so they stay verbatim.
TOOL_DECLARE_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
THINKING_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered in the K3 format."""


@dataclass
class RenderedPrompt:
    """Prompt ids plus (start, length) of each image's `<|media_pad|>` run, in image order."""

    token_ids: list[int]
    image_spans: list[tuple[int, int]] = field(default_factory=list)


def render_chat(
    tokenizer: KimiTokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = None,
    image_token_counts: list[int] | None = None,
    image_sizes: list[tuple[int, int]] | None = None,
    keep_reasoning: bool = True,
) -> RenderedPrompt:
    """Render `messages` (OpenAI chat format) into K3 prompt token ids.

    Each image part needs its `<|media_pad|>` count (`image_token_counts`) and its original
    (width, height) (`image_sizes`), in prompt order.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = _Builder(tokenizer, image_token_counts, image_sizes)
    if tools:
        _render_tool_declarations(out, tools)
    if thinking:
        _render_internal_system(out, "thinking-effort", THINKING_EFFORT_BODY.format(effort=_effort(thinking_effort)))
    _render_messages(out, messages, thinking=thinking, keep_reasoning=keep_reasoning)
    if add_generation_prompt:
        out.memoized(("generation-prompt", thinking), 0, lambda: _render_generation_prompt(out, thinking))
    out.check_all_images_used()
    return RenderedPrompt(out.ids, out.image_spans)


# ---- token building -----------------------------------------------------------------------------


class _Builder:
    """Appends control tokens by id and text through `encode`, one piece at a time."""

    def __init__(self, tokenizer: KimiTokenizer, image_token_counts: Sequence[int] | None,
                 image_sizes: Sequence[tuple[int, int]] | None) -> None:
        self.tok = tokenizer
        self.memo = getattr(tokenizer, "render_memo", None)     # shared.prompt.render_memo.RenderMemo
        self.ids: list[int] = []
        self.image_spans: list[tuple[int, int]] = []
        self._image_counts = list(image_token_counts) if image_token_counts is not None else None
        self._image_sizes = list(image_sizes) if image_sizes is not None else None

    def memoized(self, key: Hashable, key_chars: int, render: Callable[[], None]) -> None:
        """`render()`, or the ids it appended before for `key` (`shared.prompt.render_memo`): `key`
        must hold everything the rendering reads, and the piece must be text only."""
        if self._recalled(key):
            return
        start, images = len(self.ids), len(self.image_spans)
        render()
        if len(self.image_spans) == images:
            self._remember(key, start, key_chars)

    def _recalled(self, key: Hashable) -> bool:
        """Append the ids memoised for `key`; False when there are none (or no memo)."""
        ids = None if self.memo is None else self.memo.get(key)
        if ids is None:
            return False
        self.ids.extend(ids)
        return True

    def _remember(self, key: Hashable, start: int, key_chars: int) -> None:
        """Memoise the ids appended since `start` for `key` (text only: no image in them)."""
        if self.memo is not None:
            self.memo.put(key, self.ids[start:], key_chars)

    def control(self, name: str) -> None:
        self.ids.append(self.tok.id_of(name))

    def text(self, text: str) -> None:
        if self.memo is not None and len(text) <= SHORT_CHARS:
            self.ids.extend(self.memo.encode_short(text, self.tok.encode))
        else:
            self.ids.extend(self.tok.encode(text))

    def open_tag(self, tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> None:
        """`<|open|>tag key="value"...<|sep|>`, each piece encoded on its own. A tag's ids depend only on
        the tag and its escaped attributes, so they are memoised whole: every message opens with one, and a
        long history re-renders them all on each turn (inline, not through `memoized`: a closure per tag
        cost a fifth of a 40-message render)."""
        escaped = tuple([(key, _escape_attr(value)) for key, value in attrs]) if attrs else ()
        key = ("open-tag", tag, escaped)
        if self._recalled(key):
            return
        start = len(self.ids)
        self.control("<|open|>")
        self.text(tag)
        for name, value in escaped:
            for piece in (f" {name}", '="', value, '"'):
                self.text(piece)
        self.control("<|sep|>")
        self._remember(key, start, len(tag) + sum(len(value) for _, value in escaped))

    def close_tag(self, tag: str) -> None:
        key = ("close-tag", tag)
        if self._recalled(key):
            return
        start = len(self.ids)
        self.control("<|close|>")
        self.text(tag)
        self.control("<|sep|>")
        self._remember(key, start, len(tag))

    def end_message(self) -> None:
        self.close_tag("message")
        self.control("<|end_of_msg|>")

    def image(self) -> None:
        n = self._next_image_count()
        width, height = self._next_image_size()
        self.control("<|media_begin|>")
        self.text(f"image {width}x{height}")
        self.control("<|media_content|>")
        self.image_spans.append((len(self.ids), n))
        self.ids.extend([self.tok.media_pad_id] * n)
        self.control("<|media_end|>")

    def _next_image_count(self) -> int:
        index = len(self.image_spans)
        if self._image_counts is None:
            raise ChatTemplateError("messages contain images but no image_token_counts were given")
        if index >= len(self._image_counts):
            given = len(self._image_counts)
            raise ChatTemplateError(f"image {index + 1} has no entry in image_token_counts ({given} given)")
        n = self._image_counts[index]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ChatTemplateError(f"image_token_counts[{index}] must be a positive int, got {n!r}")
        return n

    def _next_image_size(self) -> tuple[int, int]:
        index = len(self.image_spans)
        if self._image_sizes is None or index >= len(self._image_sizes):
            raise ChatTemplateError(f"image {index + 1} has no entry in image_sizes")
        size = self._image_sizes[index]
        if (not isinstance(size, (tuple, list)) or len(size) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
            raise ChatTemplateError(f"image_sizes[{index}] must be (width, height) positive ints, got {size!r}")
        return size[0], size[1]

    def check_all_images_used(self) -> None:
        if self._image_counts is not None and len(self._image_counts) != len(self.image_spans):
            raise ChatTemplateError(
                f"{len(self._image_counts)} image_token_counts given for {len(self.image_spans)} images"
            )
        if self._image_sizes is not None and len(self._image_sizes) != len(self.image_spans):
            raise ChatTemplateError(f"{len(self._image_sizes)} image_sizes given for {len(self.image_spans)} images")


def _escape_attr(value: Any) -> str:
    """`&` first, so the `&` of `&quot;` is not escaped again."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _effort(thinking_effort: str | None) -> str:
    effort = DEFAULT_THINKING_EFFORT if thinking_effort is None else thinking_effort
    if effort not in THINKING_EFFORTS:
        raise ChatTemplateError(f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)}; got {effort!r}")
    return effort


def _render_internal_system(out: _Builder, message_type: str, body: str) -> None:
    def render() -> None:
        out.open_tag("message", [("role", "system"), ("type", message_type)])
        out.text(body.strip())
        out.end_message()
    out.memoized(("internal-system", message_type, body), len(body), render)


def _render_generation_prompt(out: _Builder, thinking: bool) -> None:
    out.open_tag("message", [("role", "assistant")])
    out.open_tag("think" if thinking else "response")


def _render_tool_declarations(out: _Builder, tools: list[dict[str, Any]]) -> None:
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError("tools must be a list of objects")
    compact = json.dumps(tools, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    _render_internal_system(out, "tool-declare", TOOL_DECLARE_BODY.format(tools=compact))


# ---- messages -----------------------------------------------------------------------------------


def _render_messages(out: _Builder, messages: list[dict[str, Any]], *, thinking: bool, keep_reasoning: bool) -> None:
    book = _CallBook()
    for where, message in with_results_in_call_order(messages):
        role = _role(where, message)
        if role == "assistant":
            book = _CallBook(_render_assistant(out, where, message, thinking=thinking, keep_reasoning=keep_reasoning))
        elif role == "tool":
            index, name = book.bind(where, message)
            out.open_tag("message", [("role", "tool"), ("tool", name), ("index", index)])
            _render_content(out, where, _required_content(where, message))
            out.end_message()
        else:
            out.open_tag("message", [("role", role), *_name_attr(where, message)])
            _render_content(out, where, _required_content(where, message))
            out.end_message()


def _role(where: str, message: Any) -> str:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ChatTemplateError(f"{where} has unknown role {role!r}; expected one of {', '.join(ROLES)}")
    return "system" if role == "developer" else role


def _name_attr(where: str, message: dict[str, Any]) -> list[tuple[str, str]]:
    name = message.get("name")
    if name is None:
        return []
    if not isinstance(name, str) or not name:
        raise ChatTemplateError(f"{where}.name must be a non-empty string")
    return [("name", name)]


def _required_content(where: str, message: dict[str, Any]) -> Any:
    if message.get("content") is None:
        raise ChatTemplateError(f"{where} ({message['role']}) has no content")
    return message["content"]


def _render_content(out: _Builder, where: str, content: Any) -> None:
    """A string, or a list of text / image parts."""
    if isinstance(content, str):
        out.text(content)
        return
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where}.content must be a string or a list of parts")
    for i, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type == "text" and isinstance(part.get("text"), str):
            out.text(part["text"])
        elif part_type in IMAGE_PART_TYPES:
            out.image()
        else:
            raise ChatTemplateError(f"{where}.content[{i}] must be a text part with a string 'text' or an image part")


# ---- assistant ----------------------------------------------------------------------------------


def _render_assistant(
    out: _Builder, where: str, message: dict[str, Any], *, thinking: bool, keep_reasoning: bool
) -> list[tuple[str | None, str]]:
    """Render one assistant turn; returns its calls as (id, name) for binding tool results."""
    content, tool_calls = message.get("content"), message.get("tool_calls") or []
    if content is None and not tool_calls:
        raise ChatTemplateError(f"{where} (assistant) has neither content nor tool_calls")
    if not isinstance(tool_calls, list):
        raise ChatTemplateError(f"{where}.tool_calls must be a list")
    out.open_tag("message", [("role", "assistant"), *_name_attr(where, message)])
    if thinking:
        out.open_tag("think")
        reasoning = _reasoning(where, message)
        if keep_reasoning and reasoning.strip():
            out.text(reasoning)
        out.close_tag("think")
    out.open_tag("response")
    if content is not None:
        _render_content(out, where, content)
    out.close_tag("response")
    calls = [_normalize_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(tool_calls)]
    if calls:
        _render_tool_calls(out, calls)
    out.end_message()
    return [(call_id, name) for call_id, name, _ in calls]


def _reasoning(where: str, message: dict[str, Any]) -> str:
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    if not isinstance(reasoning, str):
        raise ChatTemplateError(f"{where}.reasoning_content must be a string")
    return reasoning


_Call = tuple[str | None, str, dict[str, Any] | str]  # (id, name, arguments or raw unparseable JSON)


def _normalize_call(where: str, call: Any) -> _Call:
    if not isinstance(call, dict):
        raise ChatTemplateError(f"{where} must be an object")
    if call.get("type", "function") != "function":
        raise ChatTemplateError(f"{where} has unsupported type {call.get('type')!r}")
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ChatTemplateError(f"{where} needs a non-empty function name")
    return optional_str(call.get("id")), name, _arguments(where, fn.get("arguments"))


def _arguments(where: str, arguments: Any) -> dict[str, Any] | str:
    """A dict of arguments, or the raw text when it is not JSON (rendered as a `json` block)."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    if not isinstance(arguments, dict):
        raise ChatTemplateError(f"{where}.function.arguments must be a JSON object")
    return arguments


def _render_tool_calls(out: _Builder, calls: list[_Call]) -> None:
    out.open_tag("tools")
    for index, (_, name, arguments) in enumerate(calls, start=1):
        out.open_tag("call", [("tool", name), ("index", index)])
        if isinstance(arguments, str):
            out.open_tag("json", [("type", "object")])
            out.text(arguments)
            out.close_tag("json")
        else:
            for key, value in arguments.items():
                out.open_tag("argument", [("key", key), ("type", _xtml_type(value))])
                out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                out.close_tag("argument")
        out.close_tag("call")
    out.close_tag("tools")


def _xtml_type(value: Any) -> str:
    """The `type` attribute of an argument; bool before int, since a bool is an int in Python."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


# ---- tool results (their order: shared.prompt.tool_order) -------------------------------------


@dataclass
class _CallBook:
    """The latest assistant's tool calls, as (id, name), and which of them have a result yet."""

    calls: list[tuple[str | None, str]] = field(default_factory=list)
    answered: list[int] = field(default_factory=list)

    def bind(self, where: str, message: dict[str, Any]) -> tuple[int, str]:
        """(call position + 1, tool name) for a tool result: by `tool_call_id` or its `NAME:POS` alias,
        else the first call without a result."""
        if not self.calls:
            raise ChatTemplateError(f"{where} (tool) does not follow an assistant message with tool_calls")
        call_id = message.get("tool_call_id")
        if call_id is None:
            free = [i for i in range(len(self.calls)) if i not in self.answered]
            if not free:
                raise ChatTemplateError(f"{where} (tool) is a result beyond the assistant's {len(self.calls)} calls")
            position = free[0]
        else:
            found = call_targets(self.calls).get(str(call_id))
            if found is None:
                raise ChatTemplateError(f"{where} (tool) answers unknown tool_call_id {call_id!r}")
            position = found
            if position in self.answered:
                raise ChatTemplateError(f"{where} (tool) is a second result for tool_call_id {call_id!r}")
        self.answered.append(position)
        return position + 1, self.calls[position][1]
