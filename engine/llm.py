"""vLLM-like offline API: `LLM(model=DIR, ...).generate(prompts, params)` and `.chat(messages, params)`."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, cast

from engine.core.engine import EngineConfig, LLMEngine
from engine.core.inputs import EngineInput
from engine.core.outputs import RequestOutput
from shared.prompt.images import decode_image_part
from shared.prompt.prepare import image_parts, render_prompt
from shared.sampling_params import SamplingParams

PromptLike = str | list[int] | dict[str, Any] | EngineInput


class LLM:
    def __init__(self, model: str, **settings: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown LLM settings {unknown}; known: {sorted(known - {'model'})}")
        self.engine = LLMEngine(EngineConfig(model=str(model), **settings))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (none at tensor_parallel_size=1)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion together (continuous batching); outputs in prompt order.

        A prompt is text (encoded as is, no chat template), token ids, an EngineInput, or a dict with
        `prompt_token_ids` (and optional `images`: ImageItem list).
        """
        if isinstance(prompts, (str, dict, EngineInput)) or (isinstance(prompts, list) and prompts
                                                            and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = self._params_for(len(prompts), params)
        # n sequences per prompt: n engine requests (sequence i seeded seed + i, as the servers do)
        ids = [[self.engine.add_request(f"llm-{next(self._ids)}", self._to_input(p), sp.for_sequence(i))
                for i in range(sp.n)] for p, sp in zip(prompts, params_list, strict=False)]
        flat = [i for group in ids for i in group]
        finals = dict(zip(flat, self._run(flat), strict=False))
        return [_gather([finals[i] for i in group]) for group in ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             **render_options: Any) -> list[RequestOutput]:
        """Render each conversation with the K3 XTML renderer (images from content parts), then generate."""
        single = bool(messages) and isinstance(messages[0], dict)          # one conversation, not a batch
        conversations = ([cast("list[dict[str, Any]]", messages)] if single
                         else cast("list[list[dict[str, Any]]]", messages))
        return self.generate([self.render(c, **render_options) for c in conversations], params)

    def render(self, messages: list[dict[str, Any]], **render_options: Any) -> EngineInput:
        """The same rendering the servers do (`shared.prompt.prepare`), images from content parts."""
        images = [decode_image_part(part) for part in image_parts(messages)]
        prepared = render_prompt(self.tokenizer, messages, images, self.engine.model.config.vision_config,
                                 **render_options)
        return EngineInput(prepared.token_ids, prepared.images)

    def _to_input(self, prompt: PromptLike) -> EngineInput:
        if isinstance(prompt, EngineInput):
            return prompt
        if isinstance(prompt, str):
            return EngineInput(self.tokenizer.encode_prompt(prompt))
        if isinstance(prompt, dict):
            return EngineInput(list(prompt["prompt_token_ids"]), list(prompt.get("images", [])))
        return EngineInput(list(prompt))

    @staticmethod
    def _params_for(n: int, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts")
        return list(params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            if not self.engine.has_unfinished():
                break
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


def _gather(outs: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput per prompt, its n sequences as `outputs` (index 0..n-1), vLLM's shape."""
    first = outs[0]
    if len(outs) == 1:
        return first
    first.outputs = [dataclasses.replace(o.output, index=i) for i, o in enumerate(outs)]
    return first
