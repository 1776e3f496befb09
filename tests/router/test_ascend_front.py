"""The router in front of vLLM-Ascend MooncakeConnectorV1 ranks (protocol stubs, tests/router/ascend_stub.py)
where it must behave like vLLM-Ascend's reference proxy: `min_tokens: 1` on the prefill leg (the client's own
`min_tokens` on the decode leg), and the recompute hand-back run again from a prefill with no duplicate output.
Equivalences: an answer whose decode was given back equals the answer of a fleet that never gives back."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.request.recompute import continuation, merge_whole
from router.settings import RouterSettings
from router.vllm_metrics import load_from_vllm_metrics
from tests.router.ascend_stub import TOKEN_BASE, AscendRank, sequence_text
from tests.router.fake_vllm import Servers

MODEL_DIR = Path(__file__).resolve().parents[2] / "engine" / "presets_data" / "tiny-chat"
PROMPT = "Tell me about the transfer engine and its ports. " * 12
CHAT = {"model": "kimi-k3", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}
COMPLETION = {"model": "kimi-k3", "prompt": PROMPT, "max_tokens": 6}


def router(prefill: list[AscendRank], decode: list[AscendRank], **kw) -> TestClient:
    settings = RouterSettings(model=str(MODEL_DIR), block_size=16, kv_connector="mooncake-ascend",
                              static_prefill=tuple(r.url for r in prefill), static_decode=tuple(r.url for r in decode),
                              disagg_threshold_tokens=1, health_check_s=5.0, **kw)
    return TestClient(create_app(settings))


def events(text: str) -> list[dict | str]:
    out: list[dict | str] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():                # `event: error` frames carry their data on the next line
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed(client: TestClient, path: str, body: dict) -> list[dict | str]:
    resp = client.post(path, json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    return events(resp.text)


def client_view(evs: list[dict | str]) -> tuple[str, list, list]:
    """What the client got: the text, the finish reasons, and every chunk's id."""
    text, finishes, ids = "", [], []
    for ev in evs:
        if isinstance(ev, str) or "choices" not in ev:
            continue
        ids.append(ev["id"])
        for choice in ev["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                finishes.append((choice["finish_reason"], choice.get("stop_reason")))
    return text, finishes, ids


def test_prefill_legs_carry_min_tokens_1_and_the_client_min_tokens_reaches_the_decode():
    p, d = AscendRank("p", "kv_producer", eos_first=True), AscendRank("d", "kv_consumer")
    with Servers(p, d), router([p], [d]) as client:
        for min_tokens in (None, 3):
            body = {**COMPLETION, **({"min_tokens": min_tokens} if min_tokens else {})}
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode", resp.text
            prefill_leg, decode_leg = p.posts()[-1]["body"], d.posts()[-1]["body"]
            assert (prefill_leg["max_tokens"], prefill_leg["min_tokens"]) == (1, 1)
            assert decode_leg.get("min_tokens") == min_tokens and decode_leg["max_tokens"] == 6
            assert decode_leg["kv_transfer_params"] == p.issued[-1]         # the handoff, verbatim
        assert len(d.pulled) == 2 and d.computed_locally == 0


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                       ("/v1/completions", {**COMPLETION, "prompt": list(range(5, 90))})],
                         ids=["chat", "completion", "token-ids"])
def test_a_recomputed_stream_equals_an_undisturbed_one(path, body):
    p, d = AscendRank("p", "kv_producer"), AscendRank("d", "kv_consumer")
    with Servers(p, d), router([p], [d]) as client:
        plain = client_view(streamed(client, path, body))
        d.recomputes = 1
        evs = streamed(client, path, body)
        again = client_view(evs)
    assert plain[0] == sequence_text(6) and plain[1] == [("length", None)]
    assert again[:2] == plain[:2], "the same text once, one end, never the recomputed one"
    assert len(set(again[2])) == 1 and evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
    assert sum(1 for ev in evs if isinstance(ev, dict) and "role" in ev["choices"][0].get("delta", {})) == (
        1 if "chat" in path else 0)
    assert len(p.posts()) == 3, "the rest ran through a prefill again"
    rerun = d.posts()[-1]["body"]
    assert rerun["max_tokens"] == 4 and rerun["kv_transfer_params"] == p.issued[-1]
    if "chat" in path:
        assert rerun["messages"][-1] == {"role": "assistant", "content": sequence_text(2)}
        assert rerun["continue_final_message"] is True and rerun["add_generation_prompt"] is False
    elif isinstance(body["prompt"], list):
        assert rerun["prompt"] == [*body["prompt"], TOKEN_BASE, TOKEN_BASE + 1]
    else:
        assert rerun["prompt"] == PROMPT + sequence_text(2)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completion"])
def test_a_stream_whose_rank_dies_goes_on_elsewhere_in_vllm_terms(path, body):
    p, d = AscendRank("p", "kv_producer"), [AscendRank(f"d{i}", "kv_consumer") for i in range(2)]
    with Servers(p, *d), router([p], d) as client:
        plain = client_view(streamed(client, path, body))
        for rank in d:
            rank.cut = 1                              # the P/D leg dies after 2 tokens; the move is decode-only
        moved = client_view(streamed(client, path, body))
    assert moved[:2] == plain[:2] and len(set(moved[2])) == 1, "the same answer once, under one id"
    legs = [c["body"] for rank in d for c in rank.posts()]
    assert not [leg for leg in legs if "kimi_pd_resume" in leg], "stock vLLM never gets our internal fields"
    rest = [leg for leg in legs if leg.get("continue_final_message") or leg.get("prompt") == PROMPT + sequence_text(2)]
    assert len(rest) == 1 and "kv_transfer_params" not in rest[0] and rest[0]["max_tokens"] == 4


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completion"])
def test_a_recomputed_whole_answer_equals_an_undisturbed_one(path, body):
    p, d = AscendRank("p", "kv_producer"), AscendRank("d", "kv_consumer")
    with Servers(p, d), router([p], [d]) as client:
        plain = client.post(path, json=body).json()
        d.recomputes = 2
        again = client.post(path, json=body).json()
        assert d.recomputes == 0 and len(p.posts()) == 4

    def strip(answer):
        return answer["choices"], answer["usage"]["completion_tokens"]
    assert strip(again) == strip(plain)
    assert again["usage"]["completion_tokens"] == 6 and "recomputed" not in json.dumps(again)


def test_a_request_given_back_too_often_is_an_error_not_an_empty_answer():
    p, d = AscendRank("p", "kv_producer"), AscendRank("d", "kv_consumer", recomputes=100, recompute_after=1)
    with Servers(p, d), router([p], [d], max_attempts=2) as client:
        whole = client.post("/v1/completions", json=COMPLETION)
        assert whole.status_code == 502 and whole.json()["error"]["code"] == "recomputed"
        evs = streamed(client, "/v1/completions", COMPLETION)
        text, finishes, _ = client_view(evs)
        assert text == sequence_text(3) and finishes == []        # each run's one token, once, and no false end
        assert evs[-1] == "[DONE]" and isinstance(evs[-2], dict) and evs[-2]["error"]["code"] == "decode_failed"


def test_continuation_and_merge_shapes():
    chat = {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 10, "min_tokens": 4,
            "kv_transfer_params": {"x": 1}}
    out = continuation(chat, "ab", "why", None, 3)
    assert out == {"messages": [{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "ab", "reasoning_content": "why"}],
                   "max_completion_tokens": 7, "min_tokens": 1, "continue_final_message": True,
                   "add_generation_prompt": False}
    continuing = {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True}
    assert continuation(continuing, "y", "", None, 1)["messages"] == [{"role": "assistant", "content": "xy"}]
    assert continuation({"prompt": [1, 2]}, "t", "", None, 1) is None      # token ids unknown: cannot continue
    first = {"id": "a", "choices": [{"index": 0, "text": "x ", "stop_reason": "recomputed"}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    second = {"id": "b", "choices": [{"index": 0, "text": "y", "finish_reason": "length", "stop_reason": None}],
              "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}}
    merged = merge_whole(first, second)
    assert merged["id"] == "a" and merged["choices"][0]["text"] == "x y"
    assert merged["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_a_data_parallel_server_is_placed_on_as_its_ranks_and_each_leg_pins_one():
    p, d = AscendRank("p", "kv_producer", dp_size=2), AscendRank("d", "kv_consumer", dp_size=2)
    with Servers(p, d), router([p], [d], static_dp_ranks=((p.url, 2), (d.url, 2)), admin_token="adm") as client:
        listed = client.get("/admin/workers", headers={"authorization": "Bearer adm"}).json()["workers"]
        assert sorted(w["worker_id"] for w in listed) == sorted(f"{r.url}#dp{i}" for r in (p, d) for i in (0, 1))
        prompts = [f"{i} " * 60 for i in range(16)]
        for prompt in [*prompts, *[prompts[0]] * 4]:
            resp = client.post("/v1/completions", json={**COMPLETION, "prompt": prompt})
            assert resp.status_code == 200 and resp.headers["x-kimi-pd-decision"] == "prefill-decode", resp.text
    for rank in (p, d):
        pinned = [c["headers"].get("x-data-parallel-rank") for c in rank.posts()]
        assert len(pinned) == 20 and set(pinned) == {"0", "1"}, pinned       # every leg pinned; both ranks used
    decode_ranks = [c["headers"]["x-data-parallel-rank"] for c in d.posts()]
    assert decode_ranks[16:] == [decode_ranks[0]] * 4, "a prompt goes back to the rank that holds its prefix"


def test_a_data_parallel_rank_reads_its_own_engine_load():
    page = "\n".join(f'vllm:num_requests_{kind}{{engine="{e}",model_name="m"}} {n}'
                     for e, kind, n in (("0", "running", 3), ("0", "waiting", 1), ("1", "running", 7),
                                        ("1", "waiting", 0)))
    both, one = load_from_vllm_metrics(page, 0.0), load_from_vllm_metrics(page, 0.0, "1")
    assert (both.running, both.waiting) == (10, 1) and (one.running, one.waiting) == (7, 0)


def test_data_parallel_ranks_flag():
    import argparse

    from router.cli import add_router_args, parse_dp_ranks, settings_from_args
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    s = settings_from_args(parser.parse_args(["--decode", "http://d:8200", "--data-parallel-ranks",
                                              "http://d:8200=4"]), None)
    s.validate()
    assert s.static_dp_ranks == (("http://d:8200", 4),)
    with pytest.raises(ValueError, match="URL=D"):
        parse_dp_ranks(["http://d:8200"])
    for ranks in (("http://other:1", 2), ("http://d:8200", 0)):
        bad = settings_from_args(parser.parse_args(["--decode", "http://d:8200"]), None)
        with pytest.raises(ValueError, match="data-parallel-ranks"):
            type(bad)(**{**bad.__dict__, "static_dp_ranks": (ranks,)}).validate()


def test_a_fan_out_to_stock_ranks_carries_none_of_our_headers():
    """The fan-out group (`x-kimi-pd-group`) is for our workers' schedulers; stock ranks never see it."""
    p, d = AscendRank("p", "kv_producer"), AscendRank("d", "kv_consumer")
    with Servers(p, d), router([p], [d]) as client:
        resp = client.post("/v1/completions", json={**COMPLETION, "prompt": [PROMPT, PROMPT + " again"], "n": 2})
        assert resp.status_code == 200, resp.text
        calls = p.posts() + d.posts()
        assert len(calls) >= 8
        leaked = [name for call in calls for name in call["headers"] if name.startswith("x-kimi-pd")]
        assert leaked == []
