"""The `kimi-pd` command line (`cli.py`) and the top floor that composes every role: `kimi-pd up`, child
process supervision, the planner, `kimi-pd bench` and the multi-host fleet. Nothing below imports it."""
