"""kimi-pd decode worker."""
