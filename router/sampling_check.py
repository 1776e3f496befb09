"""The router's check of a request's sampling parameters (`to_sampling_params`), remembered for the
parameter sets it has already accepted.

The router validates sampling parameters before any worker is busy, as the workers do, but only
for the verdict: it forwards the client's body, not the result. Most traffic repeats a handful of
parameter sets (often none at all besides `model` and `stream`), and building and checking
`SamplingParams` cost ~8 % of the router's CPU per request (benchmarks/router_overhead.py).

The verdict is a pure function of the request's fields other than its prompt, so a request whose
set fields are all scalars is keyed by them (name, type and value: 1 and 1.0 are not one key).
Only acceptances are remembered: a refused request is checked, and refused, every time, with its
own message. Requests with list or object fields (stop lists, tools, logit_bias, ...) are always
checked. Bounded: cleared when full.
"""
from __future__ import annotations

from shared.openai.convert import AnyRequest, to_sampling_params

PROMPT_FIELDS = frozenset({"messages", "prompt"})
SCALARS = (str, int, float, bool, type(None))
MAX_KEYS = 1024


class SamplingCheck:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._accepted: set[tuple] = set()

    def __call__(self, req: AnyRequest) -> None:
        """Raise what `to_sampling_params(req)` raises (a 400 naming the field), else return."""
        key = self._key(req)
        if key is not None and key in self._accepted:
            return
        to_sampling_params(req)
        if key is not None:
            if len(self._accepted) >= self.max_keys:
                self._accepted = set()
            self._accepted.add(key)

    @staticmethod
    def _key(req: AnyRequest) -> tuple | None:
        items: list[object] = [type(req)]
        for name in sorted(req.model_fields_set - PROMPT_FIELDS):
            value = getattr(req, name, None) if name in type(req).model_fields else (req.model_extra or {}).get(name)
            if not isinstance(value, SCALARS):
                return None
            items.append((name, type(value), value))
        return tuple(items)
