"""kimi-pd command-line entry point."""
