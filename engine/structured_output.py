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
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from shared.errors import InvalidRequest
from shared.prompt.parsers import RESPONSE_OPEN, THINK_CLOSE
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

    def matcher(self, spec: StructuredOutput, accepted: Sequence[int] = ()) -> RequestGrammar | AfterReasoning:
        """A fresh matcher for `spec` (compiled now unless cached); a spec that cannot compile is a 400.
        `accepted`: tokens already generated under it (a resumed request's), advanced over."""
        import xgrammar as xgr
        grammar = RequestGrammar(xgr.GrammarMatcher(self.compiled(spec)), self.vocab_size)
        matcher = AfterReasoning(grammar, self.tokenizer, self.vocab_size) if spec.after_reasoning else grammar
        for token in accepted:
            matcher.accept(token)
        return matcher

    def compiled(self, spec: StructuredOutput) -> Any:
        """`spec` compiled, from the cache when it is there. Thread-safe; may run on any thread."""
        spec = _cache_key(spec)
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
            return _cache_key(spec) in self._cache

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

    def try_accept(self, token_id: int) -> bool:
        """Advance if the grammar allows `token_id` (a verifier's tentative step); False leaves it as it was."""
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (a verifier that rejected drafts)."""
        self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def _cache_key(spec: StructuredOutput) -> StructuredOutput:
    """Where a grammar starts does not change what it compiles to: one cache entry for both."""
    return StructuredOutput(spec.kind, spec.value) if spec.after_reasoning else spec


class AfterReasoning:
    """A grammar that starts where the answer starts (vLLM's reasoning-aware structured output).

    Thinking on, K3 generates `REASONING<|close|>think<|sep|><|open|>response<|sep|>ANSWER`. The
    reasoning is free text (constraining it would leave no room for the answer); once its closer has
    been generated, the response opener is forced token by token, then the request's grammar applies.
    Same interface as `RequestGrammar`, rollback included (DSpark drafts span the phase changes).
    """

    HISTORY = 256                       # tokens a verifier may roll back (far above any draft block)

    def __init__(self, grammar: RequestGrammar, tokenizer: KimiTokenizer, vocab_size: int) -> None:
        self.grammar, self.tokenizer = grammar, tokenizer
        self._closer = THINK_CLOSE.encode()
        self._opener = tokenizer.encode(RESPONSE_OPEN, allow_special=True)
        self._tail = b""                # the reasoning's last bytes, as long as the closer at most
        self._forced = -1               # -1: reasoning; 0..len(opener)-1: opener tokens placed; len: the answer
        self._history: deque[tuple[bytes, int]] = deque(maxlen=self.HISTORY)   # the state before each token

    @property
    def in_answer(self) -> bool:
        return self._forced >= len(self._opener)

    def mask(self, logits_row: torch.Tensor) -> None:
        if self.in_answer:
            self.grammar.mask(logits_row)
        elif self._forced >= 0:         # only the opener's next token
            keep = logits_row[self._opener[self._forced]].clone()
            logits_row.fill_(float("-inf"))
            logits_row[self._opener[self._forced]] = keep

    def accept(self, token_id: int) -> None:
        if not self.terminated:
            self.try_accept(token_id)

    def try_accept(self, token_id: int) -> bool:
        """Advance over `token_id`; False (and no change) only where the answer's grammar refuses it."""
        before = (self._tail, self._forced)
        if self.in_answer:
            if not self.grammar.try_accept(token_id):
                return False
        elif self._forced >= 0:
            self._forced += 1
        else:
            self._tail = (self._tail + self.tokenizer.token_bytes(token_id))[-len(self._closer):]
            if self._tail == self._closer:
                self._forced = 0
        self._history.append(before)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens, across phase changes."""
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self._history)} are kept")
        in_grammar = 0
        for _ in range(num_tokens):
            self._tail, self._forced = self._history.pop()
            in_grammar += self.in_answer            # the state before the token: was it the grammar's
        if in_grammar:
            self.grammar.rollback(in_grammar)

    @property
    def terminated(self) -> bool:
        return self.in_answer and self.grammar.terminated
