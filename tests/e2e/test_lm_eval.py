"""lm-eval 0.4 against the router with P/D, on small local task files (no downloads): the scores
it reports equal scores computed offline through `LLM` from the same requests.

- `local-completions`, loglikelihood (multiple choice, acc / acc_norm) at batch size 4: lists of
  token prompts with echo + logprobs, the tokenizer probed through /tokenizer_info and /tokenize;
- `local-completions`, generate_until at batch size 4;
- `local-chat-completions`, generate_until (one conversation per request, thinking off).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from shared.openai.convert import shape_chat_message
from shared.openai.shaping import SpecialTokenStrip

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra")
pytestmark = pytest.mark.timeout(600)
TASKS = Path(__file__).parent / "lm_eval_tasks"
MAX_GEN = 8
UNTIL = ["\n", "."]


def _write_tasks(tmp: Path) -> Path:
    (tmp / "mc.yaml").write_text(f"""task: kimi_pd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASKS / 'mc.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    for name, extra in (("qa", ""), ("qa_chat", "  chat_template_kwargs:\n    thinking: false\n")):
        (tmp / f"{name}.yaml").write_text(f"""task: kimi_pd_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASKS / 'qa.jsonl'}
output_type: generate_until
test_split: test
doc_to_text: "Q: {{{{question}}}} A:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {json.dumps(UNTIL)}
  max_gen_toks: {MAX_GEN}
  do_sample: false
  temperature: 0
{extra}metric_list:
  - metric: exact_match
""")
    return tmp


@pytest.fixture(scope="module")
def fleet(pd_fleet):
    # lm-eval's server-tokenizer path probes /tokenizer_info: on there, as vLLM with --enable-tokenizer-info-endpoint
    return pd_fleet


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager
    # only our task files: indexing lm-eval's thousands of built-in task configs costs seconds and none is used
    return TaskManager(include_path=str(_write_tasks(tmp_path_factory.mktemp("tasks"))), include_defaults=False)


def _evaluate(fleet, task_manager, model: str, endpoint: str, task: str, batch_size: int, **kw) -> dict:
    from lm_eval import simple_evaluate
    args = f"base_url={fleet.r.url}{endpoint},model=kimi-k3,num_concurrent=1,max_retries=1"
    return simple_evaluate(model=model, model_args=args, tasks=[task], batch_size=batch_size, log_samples=True,
                           task_manager=task_manager, **kw)


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines()]


def _eos_stop(offline: LLM) -> str:
    """The stop string lm-eval derives from /tokenizer_info (the first token of the eos text)."""
    tok = offline.tokenizer
    return tok.decode([tok.encode(tok.eos_token)[0]])


def test_loglikelihood_scores_equal_offline(fleet, offline, task_manager):
    out = _evaluate(fleet, task_manager, "local-completions", "/v1/completions", "kimi_pd_mc", 4)
    tok = offline.tokenizer
    accs, norms, lls = [], [], []
    for doc in _docs("mc.jsonl"):
        scores = []
        for choice in doc["choices"]:
            context, continuation = doc["question"], " " + choice       # lm-eval's default target delimiter
            whole, ctx = tok.encode(context + continuation), tok.encode(context)
            scored = offline.generate(whole, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
            scores.append(sum(e.logprob for e in scored.prompt_logprobs[len(ctx):]))
        lls.append(scores)
        accs.append(float(max(range(len(scores)), key=scores.__getitem__) == doc["answer"]))
        lengths = [len(" " + c) for c in doc["choices"]]
        normed = [s / n for s, n in zip(scores, lengths, strict=False)]
        norms.append(float(max(range(len(normed)), key=normed.__getitem__) == doc["answer"]))
    result = out["results"]["kimi_pd_mc"]
    assert result["acc,none"] == pytest.approx(sum(accs) / len(accs), abs=1e-9)
    assert result["acc_norm,none"] == pytest.approx(sum(norms) / len(norms), abs=1e-9)
    samples = sorted(out["samples"]["kimi_pd_mc"], key=lambda s: s["doc_id"])
    for sample, scores in zip(samples, lls, strict=True):
        served = [resp[0][0] for resp in sample["resps"]]
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(served, scores, strict=True)), (served, scores)
    print("lm-eval kimi_pd_mc:", result, "offline acc", sum(accs) / len(accs), "acc_norm", sum(norms) / len(norms))


def test_generate_until_completions_equal_offline(fleet, offline, task_manager):
    out = _evaluate(fleet, task_manager, "local-completions", "/v1/completions", "kimi_pd_qa", 4)
    params = SamplingParams(temperature=0, max_tokens=MAX_GEN, stop=UNTIL + [_eos_stop(offline)], seed=1234)
    expected = [offline.generate(offline.tokenizer.encode(f"Q: {d['question']} A:"), params)[0].output.text
                for d in _docs("qa.jsonl")]
    samples = sorted(out["samples"]["kimi_pd_qa"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == expected
    match = [float(text.strip() == d["answer"]) for text, d in zip(expected, _docs("qa.jsonl"), strict=False)]
    assert out["results"]["kimi_pd_qa"]["exact_match,none"] == pytest.approx(sum(match) / len(match))


def test_generate_until_chat_equal_offline(fleet, offline, task_manager):
    out = _evaluate(fleet, task_manager, "local-chat-completions", "/v1/chat/completions", "kimi_pd_qa_chat", 1,
                    apply_chat_template=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_GEN, stop=UNTIL, seed=1234, skip_special_tokens=False)
    expected = []
    for d in _docs("qa.jsonl"):
        text = offline.chat([{"role": "user", "content": f"Q: {d['question']} A:"}], params,
                            thinking=False)[0].output.text
        expected.append(shape_chat_message(text, thinking=False, tools_requested=False,     # vLLM's default
                                           strip=SpecialTokenStrip(offline.tokenizer.special_tokens)).content or "")
    samples = sorted(out["samples"]["kimi_pd_qa_chat"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == expected
