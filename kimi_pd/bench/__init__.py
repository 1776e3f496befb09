"""`kimi-pd bench`: a serving benchmark client for any OpenAI-compatible endpoint.

Follows `vllm bench serve` (flags, metric definitions, result-JSON keys) so results compare with
vLLM's; adds Mooncake trace replay, the prefix-cache hit ratio and PNG plots. Torch-free: it needs
only a tokenizer (to build prompts of exact token lengths), httpx, numpy, tqdm and matplotlib.
"""
