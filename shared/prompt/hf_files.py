"""The tokenizer as Hugging Face files: `tokenizer.json` and a Jinja chat template.

Harnesses (vllm bench serve, aiperf, guidellm, lm-eval) load a checkpoint's tokenizer with
`AutoTokenizer.from_pretrained(dir)` and no remote code. A `tokenizer.json` (a byte-level BPE with the
K3 pre-tokenizer and the 256 special tokens as added tokens) loads as a fast tokenizer in
transformers 4.x and 5.x alike, where `tiktoken.model` needs 5.x with tiktoken installed.

The BPE is the tiktoken one: a token's merges are its splits into two tokens, prioritised by its
rank, so the fast tokenizer encodes text as `KimiTokenizer.encode` does (checked on the shipped
tokenizers in tests/shared/prompt/test_hf_files.py).
`ignore_merges` makes a piece that is itself a token one id, as tiktoken does.

The chat template renders the text subset of `shared.prompt.chat` (system/developer/user/assistant,
reasoning, tool declarations, tool calls with object arguments, tool results bound by id, `NAME:POS`
alias or order, in call order, `index` = call position + 1; `thinking`/`enable_thinking`,
`thinking_effort`). The server renders by token ids; the template's string, tokenized with special
tokens recognised, gives the same ids for these conversations (tested). It refuses images: their pad
count comes from the vision config, which only the server's renderer knows.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from shared.prompt.bpe_train import PAT_STR
from shared.prompt.chat import DEFAULT_THINKING_EFFORT, THINKING_EFFORT_BODY, THINKING_EFFORTS, TOOL_DECLARE_BODY
from shared.prompt.tokenizer import CONFIG_FILE, KimiTokenizer

TOKENIZER_JSON_FILE = "tokenizer.json"
FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _spell(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """tiktoken's merge rule as a merge list: every split of a token into two tokens, by the rank
    of the merged token (tiktoken merges the adjacent pair whose concatenation ranks lowest).

    Each token contributes all its two-token splits, not only the one it was trained from, because
    some ranks are whole words added to the file (tiny-chat's ` JSONSchema`), reachable from several
    pairs; splits of one token are ordered by the parts' ranks.
    """
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None:
                merges.append((rank, left, right, token[:cut], token[cut:]))
    merges.sort()
    return [(a, b) for _, _, _, a, b in merges]


def tokenizer_json(ranks: dict[bytes, int], specials: dict[str, int]) -> dict[str, Any]:
    """The `tokenizers` serialisation of this BPE plus its special tokens (no BOS is added)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for name, i in sorted(specials.items(), key=lambda kv: kv[1])
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PAT_STR}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
            "vocab": {_spell(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": [[_spell(a), _spell(b)] for a, b in bpe_merges(ranks)],
        },
    }


# The Jinja twin of `shared.prompt.chat.render_chat` for text conversations. `tojson` is HF's
# (json.dumps with ensure_ascii=False); declarations use sorted compact JSON like the renderer.
# The @NAME@ slots are filled from the renderer's constants, so the two never drift apart.
_TEMPLATE = r"""{%- macro attr(value) -%}{{ value|string|replace('&', '&amp;')|replace('"', '&quot;') }}{%- endmacro -%}
{%- macro content(c) -%}
{%- if c is string -%}{{ c }}
{%- elif c is iterable -%}
{%- for part in c -%}
{%- if part.type == 'text' -%}{{ part.text }}
{%- else -%}{{ raise_exception('this chat template renders text only; images need the server (POST /tokenize)') }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro end() -%}<|close|>message<|sep|><|end_of_msg|>{%- endmacro -%}
{%- set thinking = thinking if thinking is defined else (enable_thinking if enable_thinking is defined else true) -%}
{%- set effort = thinking_effort if thinking_effort is defined and thinking_effort else '@DEFAULT_EFFORT@' -%}
{%- if tools -%}
<|open|>message role="system" type="tool-declare"<|sep|>@TOOL_DECLARE_BODY@{{ end() }}
{%- endif -%}
{%- if thinking -%}
{%- if effort not in @THINKING_EFFORTS@ -%}{{ raise_exception('thinking_effort must be one of @EFFORT_LIST@') }}{%- endif -%}
<|open|>message role="system" type="thinking-effort"<|sep|>@THINKING_EFFORT_BODY@{{ end() }}
{%- endif -%}
{%- set ns = namespace(calls=[], answered=[], run=[], in_run=false) -%}
{%- for message in messages -%}
{%- set role = 'system' if message.role == 'developer' else message.role -%}
{%- if role == 'tool' -%}
{%- if not ns.in_run -%}
{#- a run of results starts: bind each, then render them in call order -#}
{%- set ns.in_run = true -%}
{%- set run = namespace(items=[], open=true, bound=true) -%}
{%- for m in messages[loop.index0:] -%}
{%- if run.open and m.role == 'tool' -%}
{%- set found = namespace(pos=-1) -%}
{%- set key = m.tool_call_id|string if m.tool_call_id is defined and m.tool_call_id is not none else none -%}
{%- for call in ns.calls -%}
{%- if found.pos < 0 and key is not none and (key == call.id or key == call.name ~ ':' ~ loop.index0) -%}{%- set found.pos = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if found.pos < 0 -%}{%- set run.bound = false -%}{%- endif -%}
{%- set run.items = run.items + [{'pos': found.pos, 'message': m}] -%}
{%- else -%}{%- set run.open = false -%}
{%- endif -%}
{%- endfor -%}
{%- set items = run.items|sort(attribute='pos') if run.bound else run.items -%}
{%- for item in items -%}
{%- set pos = namespace(value=item.pos) -%}
{%- if pos.value < 0 -%}
{%- if item.message.tool_call_id is defined and item.message.tool_call_id is not none -%}{{ raise_exception('tool result answers unknown tool_call_id ' ~ item.message.tool_call_id) }}{%- endif -%}
{%- for call in ns.calls -%}{%- if pos.value < 0 and loop.index0 not in ns.answered -%}{%- set pos.value = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if pos.value < 0 -%}{{ raise_exception('a tool result without a matching call') }}{%- endif -%}
{%- endif -%}
{%- set ns.answered = ns.answered + [pos.value] -%}
<|open|>message role="tool" tool="{{ attr(ns.calls[pos.value].name) }}" index="{{ pos.value + 1 }}"<|sep|>{{ content(item.message.content) }}{{ end() }}
{%- endfor -%}
{%- endif -%}
{%- else -%}
{%- set ns.in_run = false -%}
{%- set name = ' name="' ~ attr(message.name) ~ '"' if message.name else '' -%}
{%- if role == 'assistant' -%}
<|open|>message role="assistant"{{ name }}<|sep|>
{%- if thinking -%}
{%- set reasoning = message.reasoning_content or message.reasoning or '' -%}
<|open|>think<|sep|>{{ reasoning if reasoning|trim else '' }}<|close|>think<|sep|>
{%- endif -%}
<|open|>response<|sep|>{%- if message.content is not none -%}{{ content(message.content) }}{%- endif -%}<|close|>response<|sep|>
{%- set ns.calls = [] -%}
{%- set ns.answered = [] -%}
{%- if message.tool_calls -%}
<|open|>tools<|sep|>
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- set ns.calls = ns.calls + [{'id': call.id|string if call.id is defined and call.id is not none else none, 'name': fn.name}] -%}
<|open|>call tool="{{ attr(fn.name) }}" index="{{ loop.index }}"<|sep|>
{%- if fn.arguments is mapping -%}
{%- for key, value in fn.arguments.items() -%}
{%- set type = 'string' if value is string else ('boolean' if value is boolean else ('null' if value is none else ('number' if value is number else ('object' if value is mapping else 'array')))) -%}
<|open|>argument key="{{ attr(key) }}" type="{{ type }}"<|sep|>{{ value if value is string else value|tojson }}<|close|>argument<|sep|>
{%- endfor -%}
{%- elif fn.arguments is string and fn.arguments|trim -%}
<|open|>json type="object"<|sep|>{{ fn.arguments }}<|close|>json<|sep|>
{%- endif -%}
<|close|>call<|sep|>
{%- endfor -%}
<|close|>tools<|sep|>
{%- endif -%}
{{ end() }}
{%- else -%}
<|open|>message role="{{ role }}"{{ name }}<|sep|>{{ content(message.content) }}{{ end() }}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|open|>message role="assistant"<|sep|>{{ '<|open|>think<|sep|>' if thinking else '<|open|>response<|sep|>' }}
{%- endif -%}"""  # noqa: E501 - Jinja source: its lines are the shipped chat_template's bytes, wrapping changes them



def _jinja_text(body: str) -> str:
    """A renderer body as template text: `{name}` slots become Jinja expressions."""
    return body.strip().replace("{effort}", "{{ effort }}").replace(
        "{tools}", "{{ tools|tojson(separators=(',', ':'), sort_keys=true) }}")


CHAT_TEMPLATE = (_TEMPLATE
                 .replace("@TOOL_DECLARE_BODY@", _jinja_text(TOOL_DECLARE_BODY))
                 .replace("@THINKING_EFFORT_BODY@", _jinja_text(THINKING_EFFORT_BODY))
                 .replace("@THINKING_EFFORTS@", repr(list(THINKING_EFFORTS)))
                 .replace("@EFFORT_LIST@", ", ".join(THINKING_EFFORTS))
                 .replace("@DEFAULT_EFFORT@", DEFAULT_THINKING_EFFORT))


def save_tokenizer(tokenizer: KimiTokenizer, path: str | Path) -> None:
    """A checkpoint's tokenizer files: the K3 layout (`tiktoken.model`, configs) plus its Hugging Face
    twin, `tokenizer.json` and the chat template, with `tokenizer_class` naming the fast tokenizer
    (AutoTokenizer then reads tokenizer.json; `KimiTokenizer.from_dir` still reads tiktoken.model)."""
    path = Path(path)
    tokenizer.save(path)
    (path / TOKENIZER_JSON_FILE).write_text(
        json.dumps(tokenizer_json(tokenizer.mergeable_ranks, tokenizer.special_tokens), ensure_ascii=False),
        encoding="utf-8")
    config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    config.update(tokenizer_class=FAST_TOKENIZER_CLASS, chat_template=CHAT_TEMPLATE)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
