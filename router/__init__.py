"""kimi-pd router."""
