"""Writes a tiny random Llama (transformers `save_pretrained`) with a BPE tokenizer trained here by the
`tokenizers` library and a small chat template: a model stock vLLM serves on CPU, made without a hub.
Run with the interop venv's Python (it has torch and transformers): `python make_tiny_llama.py OUT`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_WORD_TEXT = ("the a of to and in is it that was for on are with as be at by this had not but from or have an they "
              "which one you were all we when there can more if no out so said what up its about into than them only "
              "time could new two may then do first any my now such like our over man me even most made after also "
              "prefill decode cache block token router worker transfer state prompt answer question number")
WORDS = _WORD_TEXT.split()


def corpus() -> list[str]:
    lines = []
    for i in range(4000):
        lines.append(" ".join(WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(12)) + f" {i % 1000}.")
    return lines


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=1024, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 2048, "chat_template": CHAT_TEMPLATE}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                             "unk_token": "<unk>"}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
                         tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "READY").write_text("ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
