"""kimi-pd prefill worker."""
