"""kimi-pd shared."""
