"""Kimi-K3 tokenizer (tiktoken BPE + special tokens) and the XTML chat renderer."""
