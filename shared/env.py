"""Environment variables that more than one service reads (secrets stay off the command line)."""
from __future__ import annotations

ADMIN_TOKEN_ENV = "KIMI_PD_ADMIN_TOKEN"          # admin API, internal endpoints, and workers' internal auth
CLIENT_KEYS_ENV = "KIMI_PD_API_KEYS"             # the router's client keys: when set, workers need internal auth
