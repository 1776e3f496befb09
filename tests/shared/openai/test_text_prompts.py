"""Text prompts read special-token text as the special tokens, as Hugging Face tokenizers and vLLM do:
a chat rendered to text and sent to /v1/completions (or /tokenize) gives exactly the rendered ids,
whatever `add_special_tokens` says (K3 adds no BOS/EOS); chat content stays plain text."""
from __future__ import annotations

import pytest

from shared.openai.prompts import prepare_chat, prepare_completion
from shared.openai.requests import ChatCompletionRequest, CompletionRequest
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
