"""What the router tokenises prompts with, for prefix hashing: chosen once from `--model`.

The router needs token ids only to hash prompts into blocks the way the workers will see them, so
that placement finds cached prefixes. Three sources, best first:

- `kimi-k3`: a Kimi-K3 checkpoint directory (tiktoken + the XTML chat renderer): exactly what our
  workers compute, and the router also validates sampling parameters as they do;
- `hf`: any Hugging Face tokenizer directory (`tokenizer.json`, and the chat template from
  `chat_template.jinja` or `tokenizer_config.json`), for fronting another model (e.g. stock vLLM
  serving a Llama): chat prompts are rendered with that template in a Jinja sandbox, as vLLM does;
- `text`: no tokenizer at all (`--model` omitted with `--no-tokenizer`): the UTF-8 bytes of the
  prompt text stand in for tokens, so the prefix index is approximate (a shared text prefix still
  lands on the same worker) and token counts are bytes.

Workers of the second and third kinds validate their own sampling parameters; the router forwards
the client's body unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from shared.errors import InvalidRequest
from shared.model_config import ModelConfig, VisionConfig
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.surface import SurfaceOptions
from shared.prompt.prepare import PreparedPrompt

DEFAULT_MAX_MODEL_LEN = 1 << 20          # what /v1/models reports when nothing says (text mode)


class PromptSource(Protocol):
    kind: str
    max_model_len: int
    vision_config: VisionConfig | None

    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedPrompt: ...
    def prepare_completion(self, req: CompletionRequest) -> PreparedPrompt: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def tokenizer_info(self) -> dict[str, Any]: ...


def load_prompt_source(model_dir: str | None, options: SurfaceOptions | None = None) -> PromptSource:
    """The source for `--model`: a K3 checkpoint, an HF tokenizer directory, or none (text)."""
    if model_dir is None:
        return TextSource()
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"--model {model_dir}: not a directory (give a Kimi-K3 checkpoint or a Hugging Face "
                         "tokenizer directory, or --no-tokenizer)")
    if (path / "tiktoken.model").is_file():
        return K3Source(path, options or SurfaceOptions())
    if (path / "tokenizer.json").is_file():
        return HFSource(path)
    raise ValueError(f"--model {model_dir}: neither a Kimi-K3 checkpoint (tiktoken.model) nor a Hugging Face "
                     "tokenizer directory (tokenizer.json); use --no-tokenizer for an approximate text index")


class K3Source:
    """The project's own prompt path (shared.prompt): what kimi-pd workers compute."""

    kind = "kimi-k3"

    def __init__(self, path: Path, options: SurfaceOptions | None = None) -> None:
        from shared.prompt.tokenizer import KimiTokenizer
        self.options = options or SurfaceOptions()
        self.tokenizer = KimiTokenizer.from_dir(path)
        config = ModelConfig.from_file(str(path))
        self.vision_config = config.vision_config
        self.max_model_len = config.text_config.max_position_embeddings

    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedPrompt:
        from shared.openai.prompts import prepare_chat
        return prepare_chat(req, self.tokenizer, self.vision_config, self.options)

    def prepare_completion(self, req: CompletionRequest) -> PreparedPrompt:
        from shared.openai.prompts import prepare_completion
        return prepare_completion(req, self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def tokenizer_info(self) -> dict[str, Any]:
        from shared.openai import tokenize as tokenize_api
        return tokenize_api.tokenizer_info(self.tokenizer, self.max_model_len)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """transformers >= 4.43 writes `chat_template.jinja`; older ones put it in tokenizer_config.json,
    as a string or a list of named templates ("default" is the one chat uses)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class HFSource:
    """A Hugging Face tokenizer (the `tokenizers` library, no transformers, no torch) and its chat
    template in a sandboxed Jinja environment, the way vLLM renders chat prompts."""

    kind = "hf"
    vision_config: VisionConfig | None = None

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer
        self.path = path
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.config = config = _read_json(path / "tokenizer_config.json")
        self.bos_token, self.eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        model_config = _read_json(path / "config.json")
        limit = config.get("model_max_length")
        self.max_model_len = int(model_config.get("max_position_embeddings")
                                 or (limit if isinstance(limit, int) and limit < 1 << 30 else DEFAULT_MAX_MODEL_LEN))
        source = _chat_template(path, config)
        self.template_source = source
        self.template = _compile(source) if source else None

    def render_chat(self, req: ChatCompletionRequest) -> str:
        messages = [m.model_dump(mode="json", exclude_none=True) for m in req.messages]
        if self.template is None:
            return _plain_chat(messages)          # the worker refuses it if it has no template either
        tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools or []] or None
        kwargs = dict(req.chat_template_kwargs or {})
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except Exception as exc:                  # noqa: BLE001 - a template error is the request's problem
            raise InvalidRequest(f"the chat template could not render these messages: {exc}",
                                 param="messages") from None

    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedPrompt:
        # vLLM encodes a rendered chat prompt without adding special tokens (the template has them)
        ids = self.tokenizer.encode(self.render_chat(req), add_special_tokens=False).ids
        return PreparedPrompt(list(ids), cache_salt=req.cache_salt)

    def prepare_completion(self, req: CompletionRequest) -> PreparedPrompt:
        prompt = req.single_prompt
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return PreparedPrompt(ids, cache_salt=req.cache_salt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def tokenizer_info(self) -> dict[str, Any]:
        return {"tokenizer_class": self.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
                "bos_token": self.bos_token, "eos_token": self.eos_token,
                "model_max_length": self.max_model_len, "vocab_size": self.tokenizer.get_vocab_size(),
                **({"chat_template": self.template_source} if self.template_source else {})}


def _compile(source: str):
    from shared.prompt.jinja_template import compile_template
    return compile_template(source)


def _plain_chat(messages: list[dict[str, Any]]) -> str:
    """A stable text of the messages for hashing only (no template: roles and text contents)."""
    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return ""
    return "".join(f"<{m.get('role', '')}>\n{text(m.get('content'))}\n" for m in messages)


class TextSource:
    """No tokenizer: the prompt's UTF-8 bytes are its "tokens" (approximate prefix index)."""

    kind = "text"
    vision_config: VisionConfig | None = None
    max_model_len = DEFAULT_MAX_MODEL_LEN

    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedPrompt:
        messages = [m.model_dump(mode="json", exclude_none=True) for m in req.messages]
        return PreparedPrompt(self.encode(_plain_chat(messages)), cache_salt=req.cache_salt)

    def prepare_completion(self, req: CompletionRequest) -> PreparedPrompt:
        prompt = req.single_prompt
        if isinstance(prompt, str):
            return PreparedPrompt(self.encode(prompt), cache_salt=req.cache_salt)
        return PreparedPrompt(list(prompt), cache_salt=req.cache_salt)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def tokenizer_info(self) -> dict[str, Any]:
        raise InvalidRequest("this router runs without a tokenizer (--no-tokenizer): give --model a tokenizer "
                             "directory to serve /tokenize, /detokenize and /tokenizer_info", param="model")


def foreign_tokenize(source: PromptSource, req) -> dict[str, Any]:
    """`/tokenize` over an HF (or text) source, in vLLM's shape: a `prompt` as completions encode it,
    `messages` as chat renders them."""
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
    source.tokenizer_info()                       # text mode: a clear 400 (no tokenizer)
    if req.prompt is not None:
        ids = source.encode(req.prompt)
    else:
        chat = ChatCompletionRequest.model_validate({
            "messages": [m.model_dump(mode="json", exclude_none=True) for m in req.messages],
            "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs})
        ids = source.prepare_chat(chat).token_ids
    return {"count": len(ids), "max_model_len": source.max_model_len, "tokens": ids,
            "token_strs": [source.decode([i]) for i in ids] if req.return_token_strs else None}


def foreign_detokenize(source: PromptSource, req) -> dict[str, Any]:
    source.tokenizer_info()
    return {"prompt": source.decode(list(req.tokens))}
