"""Run by test_hf_files.py under a given Python (this one: transformers 5; a cached venv: 4.x).

As a harness would: `AutoTokenizer.from_pretrained(dir)`, no remote code, nothing of this project
imported. Reads {"dirs", "texts", "special_texts", "chats", "special_names"} as JSON on stdin, prints
what the tokenizer made of them.
"""
from __future__ import annotations

import json
import sys


def _ids(value):
    """apply_chat_template returns a list in 4.x and a BatchEncoding-like mapping in 5.x."""
    return list(value["input_ids"]) if hasattr(value, "keys") else list(value)


def probe(directory: str, job: dict) -> dict:
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    chats = []
    for chat in job["chats"]:
        try:
            chats.append(_ids(tok.apply_chat_template(chat["messages"], tokenize=True, **chat["options"])))
        except Exception as exc:                      # noqa: BLE001 - reported to the test, which checks it
            chats.append({"error": f"{type(exc).__name__}: {exc}"})
    encoded = [tok.encode(t, add_special_tokens=False) for t in job["texts"]]
    return {
        "version": transformers.__version__,
        "class": type(tok).__name__,
        "encoded": encoded,
        "decoded": [tok.decode(ids) for ids in encoded],
        # text spelling special tokens: HF maps it to the special ids unless told to split them
        "specials_recognised": [tok.encode(t, add_special_tokens=False) for t in job["special_texts"]],
        "specials_split": [tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                           for t in job["special_texts"]],
        "special_ids": {name: tok.convert_tokens_to_ids(name) for name in job["special_names"]},
        "eos_bos_pad": [tok.eos_token_id, tok.bos_token_id, tok.pad_token_id],
        "len": len(tok),
        "chats": chats,
    }


def main() -> None:
    job = json.load(sys.stdin)
    print(json.dumps({directory: probe(directory, job) for directory in job["dirs"]}))


if __name__ == "__main__":
    main()
