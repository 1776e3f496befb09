"""The prompt path, torch-free, shared by the router, the workers and the offline engine: the Kimi-K3
tokenizer (tiktoken BPE + special tokens, data in `data/`), the XTML chat renderer, the reasoning and
tool-call parsers, image sizing/decoding, and `prepare.render_prompt` (messages -> token ids + images)."""
