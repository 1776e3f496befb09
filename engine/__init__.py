"""The Kimi-K3 model in PyTorch and its serving runtime."""
