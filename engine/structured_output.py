"""Structured output with xgrammar over the project's tokenizer: one compiler per engine (its
tokenizer info built once from the token bytes), one matcher per request. The matcher's bitmask is
a token constraint like the others (engine.token_constraints): applied to the logits before a
token is chosen, then the chosen token is accepted; a matcher that has terminated ends the request.

Compiling is the expensive part (a 44 KB JSON schema takes seconds, a 300 KB regex minutes), so
compiled grammars are cached by their spec, and services compile before the request reaches the
engine thread (`AsyncEngine` does, within a `GrammarBudget`): xgrammar releases the GIL while it
compiles, so neither steps nor heartbeats wait on it. The engine thread then only builds a matcher.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from shared.errors import InvalidRequest
from shared.prompt.tokenizer import KimiTokenizer
from shared.structured_output import StructuredOutput


@dataclass(frozen=True)
class GrammarBudget:
    """What one request's grammar may cost a server: its spec's size, and the time compiling it may take
    before the request is refused (400). Compiles run one at a time, off the engine thread."""

    max_spec_bytes: int = 64 << 10
    compile_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_spec_bytes < 1 or self.compile_timeout_s <= 0:
            raise ValueError("a grammar budget needs max_spec_bytes >= 1 and compile_timeout_s > 0")

    def check_size(self, spec: StructuredOutput) -> None:
        size = len(spec.value.encode())
        if size > self.max_spec_bytes:
            raise InvalidRequest(f"structured_outputs: the {spec.kind} is {size} bytes, over this server's limit "
                                 f"of {self.max_spec_bytes} bytes", param="structured_outputs")


class GrammarCompiler:
    CACHE_SIZE = 64                   # compiled grammars kept (a P/D request's two legs, retries, repeated schemas)

    def __init__(self, tokenizer: KimiTokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()                  # the cache only: compiles run unlocked

    @cached_property
    def _compiler(self):
        """Text grammars: special tokens can never be chosen (they are not text)."""
        return self._make(with_specials=False)

    @cached_property
    def _xtml_compiler(self):
        """K3 structure grammars (forced tool calls): special tokens match their names."""
        return self._make(with_specials=True)

    def _make(self, with_specials: bool):
        import xgrammar as xgr
        tok = self.tokenizer
        vocab = [tok.token_bytes(i) if with_specials or not tok.is_special(i) else b"" for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=[tok.eos_id])
        return xgr.GrammarCompiler(info, max_threads=1)

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for `spec` (compiled now unless cached); a spec that cannot compile is a 400."""
        import xgrammar as xgr
        return RequestGrammar(xgr.GrammarMatcher(self.compiled(spec)), self.vocab_size)

    def compiled(self, spec: StructuredOutput) -> Any:
        """`spec` compiled, from the cache when it is there. Thread-safe; may run on any thread."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        try:
            compiled = self._compile(spec)
        except Exception as exc:   # noqa: BLE001 - xgrammar raises several kinds; all are the client's input
            raise InvalidRequest(f"structured_outputs: cannot compile the {spec.kind}: {exc}",
                                 param="structured_outputs") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def is_cached(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return spec in self._cache

    def _compile(self, spec: StructuredOutput):
        c = self._compiler
        if spec.kind == "json":
            return c.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)   # OpenAI: an object
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "xtml":
            return self._xtml_compiler.compile_grammar(spec.value)
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(spec.value))
            return c.compile_grammar(f"root ::= {alternatives}")
        return c.compile_grammar(spec.value)


class RequestGrammar:
    """One request's matcher: `mask` the next logits, `accept` the chosen token, `rollback` drafts."""

    def __init__(self, matcher, vocab_size: int) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.matcher = matcher
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits_row: torch.Tensor) -> None:
        """In place: tokens the grammar does not allow next get -inf."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self._xgr.apply_token_bitmask_inplace(logits_row.unsqueeze(0), self.bitmask.to(logits_row.device))

    def accept(self, token_id: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (a verifier that rejected drafts)."""
        self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()
