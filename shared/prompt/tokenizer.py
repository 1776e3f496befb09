"""`KimiTokenizer`: the Kimi-K3 tiktoken BPE plus its 256 special tokens, on the real file layout.

A tokenizer directory holds `tiktoken.model` (`base64(bytes) rank` per line), `tokenizer_config.json`
(`added_tokens_decoder`, bos/eos/pad/unk names, `model_max_length`) and
`special_tokens_map.json` (checkpoints add `tokenizer.json` and a chat template: `hf_files.py`),
like the released K3 checkpoint, so `from_dir` loads both the shipped 1024-rank tokenizer and the
real 163584-rank one: the special ids are always `num_ranks + offset` (`special_tokens.py`).

Plain `encode` never produces a special id: control-token text typed by a user stays text, which is
what keeps chat prompts injection-safe. The chat renderer adds control tokens by id. A text prompt
(`/v1/completions`, `/tokenize`'s `prompt`, `LLM.generate("...")`) goes through `encode_prompt`, which
reads special-token text as the special tokens, as Hugging Face tokenizers and vLLM do: a chat
rendered to text by the checkpoint's template and sent as a text prompt gives the rendered ids.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import tiktoken

from shared.prompt.bpe_train import PAT_STR, dump_tiktoken_model, parse_tiktoken_model
from shared.prompt.render_memo import RenderMemo
from shared.prompt.special_tokens import NAMED_SPECIAL_OFFSETS, NUM_SPECIAL_TOKENS, special_token_table
from shared.prompt.token_memo import SegmentMemo

GENERATED_DIR = Path(__file__).parent / "data"
TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"

# K3's native context; written to tokenizer_config.json when no other value is given.
DEFAULT_MODEL_MAX_LENGTH = 1_048_576
# `eos_id` is always the chat stop token (config.json eos_token_id on K3), whatever a config calls eos.
EOS_TOKEN = "<|end_of_msg|>"
DEFAULT_BOS, DEFAULT_PAD, DEFAULT_UNK = "[BOS]", "[PAD]", "[UNK]"

# tiktoken's regex can take super-linear time (or overflow) on huge inputs and on very long runs
# without a whitespace change; the HF Kimi tokenizer cuts the text at these sizes, and so do we.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


class KimiTokenizer:
    """tiktoken BPE with `num_ranks` ranks followed by the 256 K3 special tokens."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        special_tokens: dict[str, int] | None = None,
        *,
        bos_token: str = DEFAULT_BOS,
        pad_token: str = DEFAULT_PAD,
        unk_token: str = DEFAULT_UNK,
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
    ) -> None:
        num_ranks = len(mergeable_ranks)
        specials = dict(special_tokens) if special_tokens is not None else special_token_table(num_ranks)
        _check_special_table(specials, num_ranks)
        for name in (bos_token, pad_token, unk_token):
            if name not in specials:
                raise ValueError(f"bos/pad/unk token {name!r} is not a special token")
        self._ranks = dict(mergeable_ranks)
        self._specials = specials
        self._names = {i: name for name, i in specials.items()}
        self._enc = tiktoken.Encoding(
            name=f"kimi_k3_{num_ranks}", pat_str=PAT_STR, mergeable_ranks=self._ranks, special_tokens=specials
        )
        self.bos_token, self.pad_token, self.unk_token = bos_token, pad_token, unk_token
        self.eos_token = EOS_TOKEN
        self.model_max_length = model_max_length
        self.chat_template: str | None = None          # the checkpoint's Jinja twin (`hf_files`), when it has one
        self._memo = SegmentMemo()
        self.render_memo: RenderMemo | None = RenderMemo()   # whole chat pieces (shared.prompt.chat); None: off

    # ---- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> KimiTokenizer:
        """Load `tiktoken.model` (+ `tokenizer_config.json` when present) from a checkpoint dir."""
        path = Path(path)
        model_file = path / TIKTOKEN_FILE
        if not model_file.is_file():
            raise FileNotFoundError(f"no {TIKTOKEN_FILE} in {path}")
        with model_file.open(encoding="ascii") as f:
            ranks = parse_tiktoken_model(f)
        config_file = path / CONFIG_FILE
        config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        tokenizer = cls(
            ranks,
            _specials_from_config(config, len(ranks), path),
            bos_token=_token_name(config.get("bos_token") or DEFAULT_BOS),
            pad_token=_token_name(config.get("pad_token") or DEFAULT_PAD),
            unk_token=_token_name(config.get("unk_token") or DEFAULT_UNK),
            model_max_length=int(config.get("model_max_length", DEFAULT_MODEL_MAX_LENGTH)),
        )
        template = config.get("chat_template")
        tokenizer.chat_template = template if isinstance(template, str) else None
        return tokenizer

    @classmethod
    def generated(cls) -> KimiTokenizer:
        """The small tokenizer shipped in `shared/prompt/data` (trained by `bpe_train`)."""
        return _generated()

    def save(self, path: str | Path) -> None:
        """Write the K3 tokenizer files into a checkpoint directory (created if missing). Checkpoint
        writers use `hf_files.save_tokenizer`, which adds the Hugging Face twin (`tokenizer.json`,
        chat template)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / TIKTOKEN_FILE).write_text(dump_tiktoken_model(self._ranks), encoding="ascii")
        _write_json(path / CONFIG_FILE, self._config())
        _write_json(path / SPECIAL_MAP_FILE, self._special_tokens_map())

    @property
    def mergeable_ranks(self) -> dict[bytes, int]:
        return dict(self._ranks)

    def _special_tokens_map(self) -> dict[str, Any]:
        return {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "additional_special_tokens": self._additional_special_tokens(),
        }

    def _additional_special_tokens(self) -> list[str]:
        core = {self.bos_token, self.eos_token, self.pad_token, self.unk_token}
        return [name for name in NAMED_SPECIAL_OFFSETS if name not in core]

    def _config(self) -> dict[str, Any]:
        decoder = {
            str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, name in sorted(self._names.items())
        }
        return {
            "added_tokens_decoder": decoder,
            **self._special_tokens_map(),
            "clean_up_tokenization_spaces": False,
            "model_max_length": self.model_max_length,
            "tokenizer_class": "TikTokenTokenizer",
        }

    # ---- vocabulary ---------------------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return len(self._ranks)

    @property
    def vocab_size(self) -> int:
        return self.num_ranks + NUM_SPECIAL_TOKENS

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    def id_of(self, name: str) -> int:
        """Id of a special token by name, e.g. `id_of("<|open|>")`."""
        try:
            return self._specials[name]
        except KeyError:
            raise ValueError(f"unknown special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._names

    @property
    def bos_id(self) -> int:
        return self._specials[self.bos_token]

    @property
    def eos_id(self) -> int:
        return self._specials[self.eos_token]

    @property
    def pad_id(self) -> int:
        return self._specials[self.pad_token]

    @property
    def unk_id(self) -> int:
        return self._specials[self.unk_token]

    @property
    def media_pad_id(self) -> int:
        return self._specials["<|media_pad|>"]

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """BPE ids of `text`. Special-token text is plain text unless `allow_special`.

        Plain text up to MAX_RUN_CHARS goes through the segment memo (`token_memo`): equal ids,
        without re-encoding the tags and repeated prefixes every prompt carries."""
        if allow_special or len(text) > MAX_RUN_CHARS:
            return self._encode(text, allow_special)
        return self._memo.encode(text, self._enc.encode_ordinary)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's ids: special-token text (`<|open|>`, `[EOS]`, ...) is the special token, as in
        Hugging Face tokenizers and vLLM. K3 adds no BOS or EOS, so vLLM's `add_special_tokens` changes nothing."""
        return self.encode(text, allow_special=True)

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        encode_piece = self._encode_with_specials if allow_special else self._enc.encode_ordinary
        return [i for piece in _encode_pieces(text) for i in encode_piece(piece)]

    def _encode_with_specials(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a split multi-byte char) decodes to U+FFFD."""
        ids = self._checked(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i < self.num_ranks]
        return self._enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (a special token's name as UTF-8), for incremental detokenisation."""
        (token_id,) = self._checked([token_id])
        return self._enc.decode_single_token_bytes(token_id)

    def _checked(self, ids: Iterable[int]) -> list[int]:
        ids = list(ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i!r} is not in this tokenizer's vocabulary [0, {self.vocab_size})")
        return ids

    def __repr__(self) -> str:
        return f"KimiTokenizer(num_ranks={self.num_ranks}, vocab_size={self.vocab_size})"


@lru_cache(maxsize=1)
def _generated() -> KimiTokenizer:
    return KimiTokenizer.from_dir(GENERATED_DIR)


def _check_special_table(specials: dict[str, int], num_ranks: int) -> None:
    """Exactly the 256 ids above the ranks, with every named K3 token at its K3 offset."""
    expected_ids = set(range(num_ranks, num_ranks + NUM_SPECIAL_TOKENS))
    if set(specials.values()) != expected_ids or len(specials) != NUM_SPECIAL_TOKENS:
        raise ValueError(f"special tokens must be exactly the ids {num_ranks}..{num_ranks + NUM_SPECIAL_TOKENS - 1}")
    for name, offset in NAMED_SPECIAL_OFFSETS.items():
        if specials.get(name) != num_ranks + offset:
            raise ValueError(
                f"special token {name!r} must have id {num_ranks + offset} (num_ranks + {offset}), "
                f"got {specials.get(name)}: not a Kimi-K3 tokenizer"
            )


def _specials_from_config(config: dict[str, Any], num_ranks: int, path: Path) -> dict[str, int]:
    """The K3 table, with names taken from `added_tokens_decoder` where the config has them.

    Real checkpoints may name reserved slots differently, so only the named K3 tokens are checked
    (a K2 tokenizer, whose ids 163586.. mean other things, is rejected by `_check_special_table`).
    Entries past the vocabulary are ignored: no embedding row exists for them.
    """
    by_id = {i: name for name, i in special_token_table(num_ranks).items()}
    for key, entry in config.get("added_tokens_decoder", {}).items():
        token_id, name = int(key), _token_name(entry)
        if token_id < num_ranks:
            raise ValueError(f"{path / CONFIG_FILE}: added token {name!r} has id {token_id}, a BPE rank")
        if token_id in by_id:
            by_id[token_id] = name
    specials = {name: i for i, name in by_id.items()}
    if len(specials) != len(by_id):
        raise ValueError(f"{path / CONFIG_FILE}: duplicate special token names")
    return specials


def _token_name(value: str | dict[str, Any]) -> str:
    """HF stores a token either as its string or as `{"content": ..., ...}`."""
    return value["content"] if isinstance(value, dict) else value


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _encode_pieces(text: str) -> Iterator[str]:
    """`text` cut into pieces tiktoken encodes safely (see MAX_ENCODE_CHARS); usually `text` itself."""
    for start in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
        chunk = text[start:start + MAX_ENCODE_CHARS]
        if len(chunk) <= MAX_RUN_CHARS:
            yield chunk
        else:
            yield from _split_long_runs(chunk, MAX_RUN_CHARS)


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Cut inside any run of > `max_run` chars that are all whitespace or all non-whitespace."""
    start, run, prev_space = 0, 0, None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        run = run + 1 if is_space == prev_space else 1
        prev_space = is_space
        if run > max_run:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]

