"""Kimi-K3 model: config, layers and the multimodal wrapper."""
