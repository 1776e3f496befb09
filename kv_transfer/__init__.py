"""kimi-pd kv transfer."""
