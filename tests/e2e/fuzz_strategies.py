"""Hypothesis strategies for hostile HTTP requests to the router and the workers (issue 11).

Each example is one request: a method, a path, headers and a raw body. Bodies are mostly a valid
chat or text-completion request with one to three fields replaced by hostile values (wrong types,
out-of-range numbers, NUL and lone surrogates, over-long ids, nested garbage), plus raw byte bodies
that no JSON parser should accept quietly: 1,000+ levels of nesting, 5,000-digit integers, lone
surrogate escapes, NaN, truncated documents, non-UTF-8. Valid ones stay small (max_tokens <= 4) so
that the fuzz run is bounded by the number of requests, not by generation.
"""
from __future__ import annotations

import base64
import json
import struct
import zlib
from dataclasses import dataclass, field

from hypothesis import strategies as st


@dataclass(frozen=True)
class Probe:
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, bytes] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Probe({self.method} {self.path} {self.body[:300]!r} {self.headers})"


def png(width: int, height: int) -> str:
    """A data URL of a PNG whose header claims `width` x `height` (pixel data need not match)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = zlib.compress(b"\x00\x00\x00\x00" * 2)
    blob = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(blob).decode()


HOSTILE_STRINGS = ["", "\x00", "a\x00b", "\ud800", "\udfff x", "\u202e", "é" * 50, "x" * 5000, "\r\nx: y",
                   "{{}}", "<|im_end|>", "<|kimi_special|>", "[DONE]", "data: [DONE]\n\n", "\\", "%s%n",
                   "../../etc/passwd"]
HOSTILE_NUMBERS = [-1, 0, 1, 2, -(2 ** 63), 2 ** 63, 2 ** 64, 10 ** 18, 1e308, -1e308, 1e-320, 0.5, -0.0, 3.7, 10 ** 30]
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(HOSTILE_NUMBERS), st.sampled_from(HOSTILE_STRINGS),
                    st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                            max_size=4), max_leaves=12)

image_urls = st.sampled_from([png(4, 4), png(64, 64), png(100_000, 100_000), png(8192, 8192), png(0, 0),
                              "data:image/png;base64,!!!!", "data:image/png;base64,", "data:image/gif;base64,R0lG",
                              "http://127.0.0.1:1/x.png", "file:///etc/passwd", "data:text/plain;base64,aGk="])
content_parts = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.sampled_from(HOSTILE_STRINGS) | st.text(max_size=30)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": image_urls})}),
    st.fixed_dictionaries({"type": st.sampled_from(["video", "audio", "", "text"])}),
), max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "root", ""])},
    optional={"content": st.one_of(st.sampled_from(HOSTILE_STRINGS), st.text(max_size=40), content_parts, values),
              "tool_calls": values, "name": values, "tool_call_id": values, "reasoning_content": values}),
    max_size=4)

CHAT_FIELDS = {
    "model": st.sampled_from(["kimi-k3", "gpt-4", "", None]) | values,
    "messages": messages | values,
    "max_tokens": st.integers(-2, 6) | st.sampled_from(HOSTILE_NUMBERS) | values,
    "max_completion_tokens": st.integers(-2, 6) | st.sampled_from(HOSTILE_NUMBERS),
    "temperature": st.sampled_from(HOSTILE_NUMBERS) | values, "top_p": st.sampled_from(HOSTILE_NUMBERS),
    "top_k": st.sampled_from(HOSTILE_NUMBERS), "min_p": st.sampled_from(HOSTILE_NUMBERS),
    "n": st.sampled_from(HOSTILE_NUMBERS), "seed": st.sampled_from(HOSTILE_NUMBERS) | values,
    "stream": st.booleans() | values, "stream_options": values | st.just({"include_usage": True}),
    "stop": values | st.lists(st.sampled_from(HOSTILE_STRINGS), max_size=5),
    "stop_token_ids": st.lists(st.sampled_from(HOSTILE_NUMBERS), max_size=4) | values,
    "logprobs": st.booleans() | values, "top_logprobs": st.sampled_from(HOSTILE_NUMBERS),
    "presence_penalty": st.sampled_from(HOSTILE_NUMBERS), "frequency_penalty": st.sampled_from(HOSTILE_NUMBERS),
    "repetition_penalty": st.sampled_from(HOSTILE_NUMBERS), "min_tokens": st.sampled_from(HOSTILE_NUMBERS),
    "tools": values | st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "tool_choice": values | st.sampled_from(["auto", "none", "required"]),
    "request_id": st.sampled_from(HOSTILE_STRINGS) | values | st.just("ok-id-1"),
    "kv_transfer_params": values | st.fixed_dictionaries({}, optional={
        "do_remote_prefill": values, "do_remote_decode": values,
        "remote_host": st.sampled_from(["127.0.0.1", "", "\x00"]) | values,
        "remote_port": st.sampled_from([0, 1, 65536, -1]) | values, "remote_request_id": values,
        "remote_engine_id": values, "remote_block_ids": values, "interface_version": values}),
    "chat_template_kwargs": values, "reasoning_effort": values | st.sampled_from(["low", "high", "max"]),
    "ignore_eos": values, "skip_special_tokens": values, "user": values, "logit_bias": values,
}
COMPLETION_FIELDS = {**{k: v for k, v in CHAT_FIELDS.items() if k not in ("messages", "tools", "tool_choice")},
                     "prompt": st.one_of(st.sampled_from(HOSTILE_STRINGS), values,
                                         st.lists(st.integers(-5, 10 ** 7), max_size=6),
                                         st.lists(st.lists(st.integers(0, 50), max_size=3), max_size=3)),
                     "echo": values, "suffix": values, "best_of": values, "logprobs": st.sampled_from(HOSTILE_NUMBERS)}
BASE = {"chat": {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "completions": {"model": "kimi-k3", "prompt": "hello", "max_tokens": 2}}


@st.composite
def mutated(draw, kind: str) -> bytes:
    fields = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    body = dict(BASE[kind])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        body[name] = draw(fields[name])
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 6:
        body.setdefault("stop", ["e"])               # keep rare long generations short
    try:
        return json.dumps(body).encode()
    except (UnicodeEncodeError, ValueError):
        return json.dumps(body, ensure_ascii=True).encode()


def _nest(depth: int, leaf: str = "1") -> bytes:
    return ('{"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
            + '{"a": ' * depth + leaf + "}" * depth + "}").encode()


RAW_BODIES = st.one_of(
    st.sampled_from([
        b"", b"null", b"[]", b"[1, 2]", b'"text"', b"42", b"{", b'{"model": ', b"\xff\xfe{}", b"\xef\xbb\xbf{}",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"messages": [{"role": "user", "content": "a\\udc00b"}], "max_tokens": 2}',
        b'{"prompt": "\\ud83d", "max_tokens": 2}',
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "hi", "max_tokens": 2, "seed": -' + b"1" * 4400 + b"}",
        b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "temperature": Infinity}',
        b'{"prompt": "hi", "temperature": 1e400}', b'{"prompt": "hi", "max_tokens": 2, "request_id": "a\\u0000b"}',
        b'{"prompt": "hi", "max_tokens": 2, "request_id": "\\u00e9"}', b'{"a": 1, "a": 2}',
        b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}",
        _nest(1200), _nest(70), _nest(40),
    ]),
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics", "/nope",
         "/v1/chat/completions/x", "/docs", "/openapi.json", "/admin/workers", "/admin/workers/x/drain",
         "/admin/drain", "/internal/kv/release", "/v1/embeddings", "/%00", "/v1/../admin/workers"]
HEADERS = st.dictionaries(st.sampled_from(["x-request-id", "content-type", "authorization", "accept",
                                           "x-forwarded-for"]),
                          st.sampled_from([b"application/json", b"text/plain", b"Bearer nope", b"\xc3\xa9\xc3\xa9",
                                           b"y" * 2000, b"", b"multipart/form-data; boundary=x"]), max_size=2)


@st.composite
def probes(draw, admin_token: str) -> Probe:
    """One hostile request (see the module docstring); admin paths sometimes carry the admin token."""
    headers = dict(draw(HEADERS))
    kind = draw(st.sampled_from(["chat", "chat", "chat", "completions", "completions", "raw", "other"]))
    if kind in ("chat", "completions"):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        return Probe("POST", path, draw(mutated(kind)), headers)
    if kind == "raw":
        return Probe("POST", draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"])), draw(RAW_BODIES),
                     headers)
    path = draw(st.sampled_from(PATHS))
    if path.startswith(("/admin/workers", "/internal")) and draw(st.booleans()):   # never a real drain
        headers["authorization"] = f"Bearer {admin_token}".encode()
    body = draw(st.one_of(st.just(b""), RAW_BODIES, values.map(lambda v: json.dumps(v).encode()),
                          st.just(b'{"url": "ftp://x", "role": "decode"}'), st.just(b'[{"url": 1}]')))
    return Probe(draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])), path, body, headers)
