"""The gateway: an OpenAI-compatible front that places each request on a prefill and a decode worker
(placement: filters, scorers, picker), runs the P/D legs, keeps workers' health, admission and admin.
Imports `shared` and itself only: no torch, no engine (tests/architecture checks it)."""
