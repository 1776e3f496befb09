"""`kimi-pd checkpoint eval`: accuracy per task family on held-out instances, greedy, thinking on and off.

Offline it runs the checkpoint through the engine's `LLM` (the serving engine: paged cache, chunked
prefill, continuous batching); with a URL it sends the same conversations to a running router with
the official `openai` client, so the P/D path, the chat renderer of the server and its reasoning and
tool parsers are what is scored. A content answer is right when the content equals the expected
string exactly (surrounding whitespace ignored); a tool call when exactly one call to `get_weather`
with exactly the expected JSON arguments was parsed into `tool_calls`.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from engine.training.tasks import FAMILIES, Instance, eval_instances

if TYPE_CHECKING:  # openai is only needed to evaluate through a router
    from openai.types.chat import ChatCompletionMessageParam

MAX_TOKENS = 256               # the longest answer turn (thinking-on multi_turn) is ~110 tokens


@dataclass(frozen=True)
class Answer:
    content: str
    tool_calls: list[dict[str, Any]]       # OpenAI shape: {"function": {"name", "arguments"}}
    reasoning: str = ""


def is_correct(inst: Instance, answer: Answer) -> bool:
    if inst.tool_call is not None:
        if len(answer.tool_calls) != 1:
            return False
        fn = answer.tool_calls[0]["function"]
        try:
            args = json.loads(fn["arguments"])
        except (json.JSONDecodeError, TypeError):
            return False
        return fn["name"] == inst.tool_call["name"] and args == inst.tool_call["arguments"]
    return not answer.tool_calls and (answer.content or "").strip() == inst.content


@dataclass(frozen=True)
class FamilyScore:
    family: str
    thinking: bool
    correct: int
    total: int
    failures: tuple[tuple[str, str], ...]   # (instance key, what came back), a few for the report

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


Answerer = Callable[[list[Instance], bool], list[Answer]]


def evaluate(answer_all: Answerer, families: Iterable[str] = FAMILIES, n: int = 50,
             thinking_modes: Iterable[bool] = (False, True), seed: int = 1234) -> list[FamilyScore]:
    """Scores per (thinking, family). Every family's instances go to `answer_all` in one call per thinking
    mode, so the engine (or the router's clients) batch across families instead of draining per family."""
    families = list(families)
    per_family = {family: eval_instances(family, n, seed) for family in families}
    scores = []
    for thinking in thinking_modes:
        every = [inst for family in families for inst in per_family[family]]
        answers = answer_all(every, thinking)
        if len(answers) != len(every):
            raise ValueError(f"{len(every)} instances were asked, {len(answers)} answers came back")
        start = 0
        for family in families:
            insts = per_family[family]
            mine, start = answers[start:start + len(insts)], start + len(insts)
            wrong = [(i.key, repr(a.tool_calls or a.content))
                     for i, a in zip(insts, mine, strict=True) if not is_correct(i, a)]
            scores.append(FamilyScore(family, thinking, len(insts) - len(wrong), len(insts), tuple(wrong[:3])))
    return scores


def format_scores(scores: list[FamilyScore], where: str) -> str:
    lines = [f"tiny-chat eval ({where}), greedy, exact match", f"{'family':<12} {'thinking':<9} {'accuracy':>9}  n"]
    for s in scores:
        lines.append(f"{s.family:<12} {'on' if s.thinking else 'off':<9} {100 * s.accuracy:8.1f}%  {s.total}")
        for key, got in s.failures:
            lines.append(f"    wrong: {key} -> {got[:80]}")
    return "\n".join(lines)


# ---- offline: the engine's LLM ------------------------------------------------------------------

def offline_answerer(model_dir: str, max_num_seqs: int = 32) -> Answerer:
    from engine.llm import LLM
    from shared.openai.shaping import SpecialTokenStrip, shape_chat_message
    from shared.prompt.parsers import parse_tool_calls, split_reasoning
    from shared.sampling_params import SamplingParams

    llm = LLM(model=model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, skip_special_tokens=False)

    def answer_all(insts: list[Instance], thinking: bool) -> list[Answer]:
        from engine.training.corpus import history
        prompts = [llm.render(history(i, thinking, keep_history_reasoning=False), tools=list(i.tools) or None,
                              thinking=thinking) for i in insts]
        outs = llm.generate(prompts, params)
        answers = []
        for inst, out in zip(insts, outs, strict=True):
            text = out.output.text
            if out.output.finish_reason == "length":      # cut: shaped as the server shapes it (kept, not dropped)
                shaped = shape_chat_message(text, thinking=thinking, tools_requested=bool(inst.tools),
                                            strip=SpecialTokenStrip(llm.tokenizer.special_tokens), cut=True)
                cut_calls = [{"function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in shaped.tool_calls]
                answers.append(Answer(shaped.content or "", cut_calls, shaped.reasoning_content or ""))
                continue
            split = split_reasoning(text, thinking=thinking)
            calls = [{"function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                     for c in parse_tool_calls(text, thinking=thinking)]
            answers.append(Answer(split.content, calls, split.reasoning))
        return answers

    return answer_all


# ---- through a router: the official openai client ----------------------------------------------

def router_answerer(url: str, concurrency: int = 8, api_key: str = "none", timeout_s: float = 120.0) -> Answerer:
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, timeout=timeout_s, max_retries=0)
    model = client.models.list().data[0].id

    def one(inst: Instance, thinking: bool) -> Answer:
        from engine.training.corpus import history
        kwargs: dict[str, Any] = {}
        if inst.tools:
            kwargs["tools"] = list(inst.tools)
        # plain dicts in the shape of OpenAI's message params (shared.prompt.chat renders the same ones)
        messages = cast("list[ChatCompletionMessageParam]", history(inst, thinking, keep_history_reasoning=False))
        resp = client.chat.completions.create(
            model=model, messages=messages, temperature=0,
            max_tokens=MAX_TOKENS, extra_body={"chat_template_kwargs": {"thinking": thinking}}, **kwargs)
        msg = resp.choices[0].message
        calls = [{"function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in (msg.tool_calls or []) if c.type == "function"]    # K3 calls functions only
        return Answer(msg.content or "", calls, getattr(msg, "reasoning_content", None) or "")

    def answer_all(insts: list[Instance], thinking: bool) -> list[Answer]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda i: one(i, thinking), insts))

    return answer_all


# ---- teacher-forced: a fast proxy while training ------------------------------------------------

def teacher_forced_scores(model, tok, n: int = 50, families: Iterable[str] = FAMILIES,
                          thinking_modes: Iterable[bool] = (False, True), seed: int = 1234,
                          kda_chunk_size: int = 16) -> dict[tuple[str, bool], float]:
    """Share of held-out instances whose whole answer turn is the argmax at every position.

    One batched training forward per (family, thinking) instead of a greedy decode: an answer turn
    that is the argmax everywhere is exactly what greedy decoding generates, so this is greedy exact
    match on the full turn (reasoning included), a slightly stricter score than `evaluate`'s.
    """
    import torch

    from engine.training.corpus import render_example
    from engine.training.dense_forward import dense_logits
    from engine.training.train import make_batch

    out = {}
    with torch.no_grad():
        for thinking in thinking_modes:
            for family in families:
                examples = [render_example(tok, i, thinking) for i in eval_instances(family, n, seed)]
                ids, targets, mask = make_batch(examples, tok.pad_id)
                hit = (dense_logits(model, ids, kda_chunk_size).argmax(-1) == targets) | ~mask
                out[(family, thinking)] = hit.all(-1).float().mean().item()
    return out
