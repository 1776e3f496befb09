"""Text prompts read special-token text as the special tokens, as Hugging Face tokenizers and vLLM do:
a chat rendered to text and sent to /v1/completions (or /tokenize) gives exactly the rendered ids,
whatever `add_special_tokens` says (K3 adds no BOS/EOS); chat content stays plain text."""
from __future__ import annotations

import pytest

from shared.openai.prompts import prepare_chat, prepare_completion
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
from shared.openai.surface import SurfaceOptions
from shared.openai.tokenize import TokenizeRequest, tokenize
from shared.prompt.chat import render_chat
from shared.prompt.tokenizer import KimiTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Reverse: kimi"}],
]


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer.generated()


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_a_rendered_chat_sent_as_text_gives_the_rendered_ids(tok, messages, thinking):
    ids = render_chat(tok, messages, thinking=thinking).token_ids
    text = tok.decode(ids)
    for add_special_tokens in (True, False):
        req = CompletionRequest.model_validate({"prompt": text, "add_special_tokens": add_special_tokens})
        assert prepare_completion(req, tok).token_ids == ids
        counted = tokenize(TokenizeRequest(prompt=text, add_special_tokens=add_special_tokens), tok, 4096, None)
        assert counted["tokens"] == ids
    assert tok.encode(text) != ids                          # plain encoding would have spelled the markers out


def test_special_token_text_is_one_token_in_a_prompt_and_plain_text_in_chat(tok):
    marker = "<|end_of_msg|>"
    prompt = prepare_completion(CompletionRequest.model_validate({"prompt": f"a{marker}b"}), tok).token_ids
    assert tok.eos_id in prompt and len(prompt) == len(tok.encode("a")) + 1 + len(tok.encode("b"))

    def chat(content: str) -> list[int]:
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": content}]})
        return prepare_chat(req, tok, None).token_ids
    assert chat(marker).count(tok.eos_id) == chat("x").count(tok.eos_id)   # only the template's own turn ends
    assert not any(tok.is_special(t) for t in tok.encode(marker))


def test_a_request_chat_template_needs_the_servers_trust_and_then_renders(tok):
    from shared.errors import InvalidRequest
    from shared.openai.surface import SurfaceOptions
    from shared.prompt.hf_files import CHAT_TEMPLATE
    body = {"messages": CONVERSATIONS[1], "chat_template": CHAT_TEMPLATE}
    req = ChatCompletionRequest.model_validate(body)
    with pytest.raises(InvalidRequest, match="--trust-request-chat-template") as info:
        prepare_chat(req, tok, None)
    assert info.value.param == "chat_template"
    trusted = SurfaceOptions(trust_request_chat_template=True)
    for extra in ({}, {"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": False}}):
        plain = prepare_chat(ChatCompletionRequest.model_validate({"messages": CONVERSATIONS[1], **extra}), tok, None)
        # the checkpoint's own template sent with the request renders exactly what the server renders
        templated = prepare_chat(ChatCompletionRequest.model_validate({**body, **extra}), tok, None, trusted)
        assert templated.token_ids == plain.token_ids and templated.thinking == plain.thinking
    other = prepare_chat(ChatCompletionRequest.model_validate(
        {**body, "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}<|end_of_msg|>{% endfor %}"}),
        tok, None, trusted)
    assert other.token_ids[-1] == tok.eos_id and tok.decode(other.token_ids).startswith("[system]Be brief.")
    broken = ChatCompletionRequest.model_validate({**body, "chat_template": "{% for %}"})
    with pytest.raises(InvalidRequest) as info:
        prepare_chat(broken, tok, None, trusted)
    assert info.value.param == "chat_template"


def test_surface_flags_parse_and_pass_on_unchanged():
    """`kimi-pd up` hands the router and every worker the same request-surface flags it was given."""
    import argparse

    from shared.openai.surface import add_surface_args, surface_argv, surface_from_args

    def parsed(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_surface_args(parser)
        return parser.parse_args(argv)
    given = ["--enable-tokenizer-info-endpoint", "--allowed-media-domains", "a.example", "B.example",
             "--media-fetch-timeout", "2.5", "--max-media-bytes", "1000"]
    options = surface_from_args(parsed(given))
    assert options.enable_tokenizer_info_endpoint and not options.trust_request_chat_template
    assert options.media.allowed_domains == ("a.example", "b.example") and options.media.timeout_s == 2.5
    assert surface_from_args(parsed(surface_argv(parsed(given)))) == options
    assert surface_from_args(parsed([])) == SurfaceOptions()


def test_tool_call_history_renders_as_the_template_does_with_vllms_decoded_arguments(tok):
    """vLLM decodes a tool call's JSON-string arguments before applying a chat template; the checkpoint's
    template given them so renders the server's ids. Given the raw string, Jinja cannot decode it and
    writes a `json` block instead (docs/http.md)."""
    import json

    from shared.prompt.hf_files import CHAT_TEMPLATE
    from shared.prompt.jinja_template import compile_template
    arguments = {"city": "Paris", "days": 3, "metric": True}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    def history(args) -> list[dict]:
        return [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    served = prepare_chat(ChatCompletionRequest.model_validate({"messages": history(json.dumps(arguments)),
                                                                "tools": tools}), tok, None).token_ids
    template = compile_template(CHAT_TEMPLATE)

    def rendered(args) -> list[int]:
        text = template.render(messages=history(args), tools=tools, add_generation_prompt=True)
        return tok.encode_prompt(text)
    assert rendered(arguments) == served
    assert rendered(json.dumps(arguments)) != served
