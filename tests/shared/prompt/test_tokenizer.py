"""KimiTokenizer, the BPE trainer and the shipped tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.presets import GENERATED_BPE_RANKS
from shared.prompt.bpe_train import (
    DEFAULT_CORPUS,
    compile_pattern,
    dump_tiktoken_model,
    parse_tiktoken_model,
    train_bpe,
)
from shared.prompt.special_tokens import NAMED_SPECIAL_OFFSETS, NUM_SPECIAL_TOKENS
from shared.prompt.tokenizer import GENERATED_DIR, KimiTokenizer

TOK = KimiTokenizer.generated()

TEXTS = [
    "",
    "Hello, world! It's 2026-07-28 and x**2 == 4.",
    "def f(x):\n    return x  # comment\n\n\n\tindented\r\n",
    "中文分词测试：你好，世界！",
    "日本語とEnglishのmix, Ünïcödé façade, naïve café",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 and e\u0301 combining",
    "   leading and trailing spaces   ",
    "<|open|>message role=\"system\"<|sep|>not a control token",
]

SMALL_CORPUS = (
    "the quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.\n"
    "中文文本也在这里，中文很好。Numbers 123 4567 89.\n"
) * 20


@pytest.fixture(scope="module")
def small_tokenizer() -> KimiTokenizer:
    return KimiTokenizer(train_bpe(SMALL_CORPUS, 300))


# ---- shipped tokenizer ----------------------------------------------------------------------------


def test_shipped_tokenizer_sizes() -> None:
    assert TOK.num_ranks == GENERATED_BPE_RANKS == 1024
    assert TOK.vocab_size == 1024 + NUM_SPECIAL_TOKENS == 1280
    assert len(TOK.special_tokens) == NUM_SPECIAL_TOKENS


def test_shipped_model_is_reproducible_from_the_shipped_corpus() -> None:
    shipped = (GENERATED_DIR / "tiktoken.model").read_text(encoding="ascii")
    retrained = dump_tiktoken_model(train_bpe(DEFAULT_CORPUS.read_text(encoding="utf-8"), GENERATED_BPE_RANKS))
    assert retrained == shipped


def test_every_named_special_id_is_num_ranks_plus_offset() -> None:
    for name, offset in NAMED_SPECIAL_OFFSETS.items():
        assert TOK.id_of(name) == 1024 + offset
    assert TOK.special_tokens["<|reserved_token_8|>"] == 1024 + 8
    assert sorted(TOK.special_tokens.values()) == list(range(1024, 1280))


def test_named_ids() -> None:
    assert TOK.bos_id == TOK.id_of("[BOS]") == 1024
    assert TOK.eos_id == TOK.id_of("<|end_of_msg|>") == 1026
    assert TOK.pad_id == TOK.id_of("[PAD]") == 1279
    assert TOK.unk_id == TOK.id_of("[UNK]") == 1278
    assert TOK.media_pad_id == TOK.id_of("<|media_pad|>") == 1045
    with pytest.raises(ValueError, match="unknown special token"):
        TOK.id_of("<|im_end|>")


# ---- encode / decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert all(0 <= i < TOK.num_ranks for i in ids)
    assert TOK.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text_bytes(text: str) -> None:
    assert b"".join(TOK.token_bytes(i) for i in TOK.encode(text)) == text.encode("utf-8")


def test_bpe_merges_shorten_text() -> None:
    text = "the function returns the value of the argument"
    assert len(TOK.encode(text)) < len(text.encode()) / 2


def test_special_token_text_is_plain_text_by_default() -> None:
    for name in NAMED_SPECIAL_OFFSETS:
        ids = TOK.encode(f"a{name}b")
        assert not any(TOK.is_special(i) for i in ids), name
        assert TOK.decode(ids) == f"a{name}b"


def test_allow_special_maps_control_text_to_its_id() -> None:
    ids = TOK.encode("x<|open|>y", allow_special=True)
    assert ids == TOK.encode("x") + [TOK.id_of("<|open|>")] + TOK.encode("y")


def test_decode_of_special_ids_and_skipping_them() -> None:
    ids = [TOK.id_of("<|open|>")] + TOK.encode("hi") + [TOK.eos_id]
    assert TOK.decode(ids) == "<|open|>hi<|end_of_msg|>"
    assert TOK.decode(ids, skip_special_tokens=True) == "hi"
    assert TOK.token_bytes(TOK.id_of("<|sep|>")) == b"<|sep|>"


@pytest.mark.parametrize("bad", [1280, 99999, -1, 1.5, True])
def test_decode_of_unknown_id_raises(bad: object) -> None:
    with pytest.raises(ValueError, match="not in this tokenizer's vocabulary"):
        TOK.decode([5, bad])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not in this tokenizer's vocabulary"):
        TOK.token_bytes(bad)  # type: ignore[arg-type]


def test_split_multibyte_char_decodes_to_replacement_char() -> None:
    ids = TOK.encode("😀")
    assert len(ids) > 1  # a 4-byte emoji is not one token in a 1024-rank vocabulary
    assert TOK.decode(ids[:1]) == "\ufffd"


def test_very_long_runs_round_trip() -> None:
    text = "a" * 30_000 + " " * 30_000 + "b"
    assert TOK.decode(TOK.encode(text)) == text


def test_pretokenizer_agrees_with_tiktoken() -> None:
    """Encoding the Python-regex pieces one by one equals encoding the whole text with tiktoken."""
    text = "\n".join(TEXTS) + " Hello WORLD it's 12345 中文字符テスト  \n\n  x 😀 a.b()\tEnd"
    pieces = compile_pattern().findall(text)
    assert "".join(pieces) == text
    assert [i for piece in pieces for i in TOK.encode(piece)] == TOK.encode(text)
    assert "中文字符" in pieces and " it's" in pieces and "123" in pieces


# ---- files ----------------------------------------------------------------------------------------


def test_save_and_from_dir_round_trip(tmp_path: Path) -> None:
    TOK.save(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {"tiktoken.model", "tokenizer_config.json", "special_tokens_map.json"}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert len(config["added_tokens_decoder"]) == NUM_SPECIAL_TOKENS
    assert config["added_tokens_decoder"]["1026"]["content"] == "<|end_of_msg|>"
    assert all(entry["special"] for entry in config["added_tokens_decoder"].values())
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == (
        "[BOS]", "<|end_of_msg|>", "[PAD]", "[UNK]")
    assert config["model_max_length"] == TOK.model_max_length
    assert json.loads((tmp_path / "special_tokens_map.json").read_text())["eos_token"] == "<|end_of_msg|>"

    loaded = KimiTokenizer.from_dir(tmp_path)
    assert (loaded.num_ranks, loaded.special_tokens, loaded.eos_id) == (TOK.num_ranks, TOK.special_tokens, TOK.eos_id)
    for text in TEXTS:
        assert loaded.encode(text) == TOK.encode(text)


def test_tiktoken_model_file_format() -> None:
    lines = (GENERATED_DIR / "tiktoken.model").read_text(encoding="ascii").splitlines()
    assert len(lines) == 1024
    assert lines[0] == "AA== 0" and lines[65] == "QQ== 65"  # base64(b"\x00") 0, base64(b"A") 65
    ranks = parse_tiktoken_model(lines)
    assert all(ranks[bytes([b])] == b for b in range(256))


def test_parse_rejects_non_dense_ranks() -> None:
    with pytest.raises(ValueError, match="0..N-1"):
        parse_tiktoken_model(["AA== 0", "AQ== 2"])


def test_from_dir_without_tiktoken_model(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        KimiTokenizer.from_dir(tmp_path)


def test_from_dir_rejects_a_non_k3_special_table(tmp_path: Path) -> None:
    """A K2-style config (`<|im_end|>` where K3 has `<|end_of_msg|>`) is not silently accepted."""
    TOK.save(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"]["1026"]["content"] = "<|im_end|>"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="<\\|end_of_msg\\|>"):
        KimiTokenizer.from_dir(tmp_path)


def test_from_dir_keeps_config_names_of_reserved_slots(tmp_path: Path) -> None:
    TOK.save(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"]["1032"]["content"] = "<|reserved_token_1032|>"
    config_file.write_text(json.dumps(config))
    assert KimiTokenizer.from_dir(tmp_path).decode([1032]) == "<|reserved_token_1032|>"


# ---- other rank counts and the trainer ------------------------------------------------------------


def test_tokenizer_with_a_different_number_of_ranks(small_tokenizer: KimiTokenizer, tmp_path: Path) -> None:
    assert small_tokenizer.num_ranks == 300
    assert small_tokenizer.vocab_size == 556
    for name, offset in NAMED_SPECIAL_OFFSETS.items():
        assert small_tokenizer.id_of(name) == 300 + offset
    small_tokenizer.save(tmp_path)
    loaded = KimiTokenizer.from_dir(tmp_path)
    assert loaded.eos_id == 302 and loaded.media_pad_id == 321
    for text in TEXTS:
        assert loaded.decode(loaded.encode(text)) == text
    with pytest.raises(ValueError):
        loaded.decode([556])


def test_train_is_deterministic_and_byte_ranks_come_first() -> None:
    ranks = train_bpe(SMALL_CORPUS, 300)
    assert ranks == train_bpe(SMALL_CORPUS, 300)
    assert len(ranks) == 300 and sorted(ranks.values()) == list(range(300))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert ranks[b" the"] < ranks[b" fox"]  # " the" is more frequent, so it is learned earlier
    assert parse_tiktoken_model(dump_tiktoken_model(ranks).splitlines()) == ranks


def test_train_never_merges_across_pretokenizer_pieces() -> None:
    """Pieces are "ab", " cd", " ab" (and a trailing " "): only 4 merges exist inside them."""
    learned = [tok for tok, rank in train_bpe("ab cd " * 50, 260).items() if rank >= 256]
    assert len(learned) == 4 and b" ab" in learned and b" cd" in learned
    with pytest.raises(ValueError, match="only 260 ranks"):
        train_bpe("ab cd " * 50, 261)


def test_train_errors() -> None:
    with pytest.raises(ValueError, match=">= 256"):
        train_bpe(SMALL_CORPUS, 100)
    with pytest.raises(ValueError, match="corpus too small"):
        train_bpe("ab", 300)


def test_from_dir_config_edge_cases(tmp_path: Path) -> None:
    TOK.save(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"]["1280"] = {"content": "<|im_user|>", "special": True}  # past the vocab: ignored
    config["bos_token"] = None
    config_file.write_text(json.dumps(config))
    loaded = KimiTokenizer.from_dir(tmp_path)
    assert loaded.vocab_size == 1280 and loaded.bos_id == 1024
    config["added_tokens_decoder"]["7"] = {"content": "<|clash|>", "special": True}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a BPE rank"):
        KimiTokenizer.from_dir(tmp_path)


def test_a_real_size_vocabulary_gets_the_published_k3_ids(tmp_path: Path) -> None:
    """163584 ranks (filler tokens above the shipped ones) -> the K3 ids (docs/model.md, Tokenizer and chat format)."""
    ranks = parse_tiktoken_model((GENERATED_DIR / "tiktoken.model").read_text(encoding="ascii").splitlines())
    shipped = len(ranks)
    ranks.update((b"\xff\xfe" + n.to_bytes(3, "big"), shipped + n) for n in range(163584 - shipped))
    KimiTokenizer(ranks).save(tmp_path)
    real = KimiTokenizer.from_dir(tmp_path)
    published = {"[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587, "<|close|>": 163588,
                 "<|sep|>": 163589, "[start_header_id]": 163590, "[end_header_id]": 163591, "[EOT]": 163593,
                 "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
                 "<|media_pad|>": 163605, "<osagent_mode>": 163649, "[UNK]": 163838, "[PAD]": 163839}
    assert {name: real.id_of(name) for name in published} == published
    assert (real.vocab_size, real.eos_id, real.media_pad_id) == (163840, 163586, 163605)
    assert real.decode(real.encode("hello 中文")) == "hello 中文"
