"""Engine runtime equivalences on the tiny preset (greedy, token-exact) and cache integrity after each:
batched == alone, chunked == whole, prefix hit == miss, preempted == not, export/import == one engine."""
from __future__ import annotations

import pytest

from engine.core.inputs import EngineInput
from shared.sampling_params import SamplingParams
from tests.engine.core.helpers import GREEDY, assert_clean, image_input, make_llm, prompt_ids, tokens


def test_batched_equals_each_alone_including_an_image(tiny_dir):
    llm = make_llm(tiny_dir, enable_prefix_caching=False)
    prompts = [prompt_ids(n, n) for n in (3, 17, 9, 30)] + [image_input(llm)]
    together = tokens(llm.generate(prompts, GREEDY))
    alone = [tokens(llm.generate([p], GREEDY))[0] for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)
    assert_clean(llm)


def test_chunked_prefill_with_small_budget_equals_whole(tiny_dir):
    prompts = [prompt_ids(n, 100 + n) for n in (29, 13, 40)]
    whole = tokens(make_llm(tiny_dir, enable_prefix_caching=False).generate(prompts, GREEDY))
    small = make_llm(tiny_dir, enable_prefix_caching=False, max_num_batched_tokens=7)
    assert tokens(small.generate(prompts, GREEDY)) == whole
    assert_clean(small)


def test_prefix_hit_same_prompt_twice(tiny_dir):
    llm = make_llm(tiny_dir)
    p = prompt_ids(23, 1)
    cold = llm.generate([p], GREEDY)[0]
    warm = llm.generate([p], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 20            # last full block boundary below 23
    assert warm.output.token_ids == cold.output.token_ids
    assert_clean(llm)


def test_prefix_hit_never_covers_whole_prompt(tiny_dir):
    llm = make_llm(tiny_dir)
    p = prompt_ids(16, 2)                          # an exact multiple of the block size
    first = llm.generate([p], GREEDY)[0]
    second = llm.generate([p], GREEDY)[0]
    assert second.num_cached_tokens == 12 and second.output.token_ids == first.output.token_ids
    assert_clean(llm)


def test_two_requests_sharing_a_prefix_in_one_step(tiny_dir):
    shared = prompt_ids(20, 3)
    prompts = [shared + prompt_ids(5, 4), shared + prompt_ids(7, 5)]
    reference = tokens(make_llm(tiny_dir, enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = make_llm(tiny_dir)
    assert tokens(llm.generate(prompts, GREEDY)) == reference
    llm.engine.check_integrity()
    # both published the same prefix; the pool keeps one cached copy per hash
    third = llm.generate([shared + prompt_ids(6, 6)], GREEDY)[0]
    # pages match for 5 blocks (20 tokens); KDA snapshots sit every 2 blocks, so it resumes at block 4
    assert third.num_cached_tokens == 16
    assert third.output.token_ids == tokens(make_llm(tiny_dir, enable_prefix_caching=False)
                                            .generate([shared + prompt_ids(6, 6)], GREEDY))[0]
    assert_clean(llm)


def test_hit_between_snapshots_resumes_from_the_nearest(tiny_dir):
    llm = make_llm(tiny_dir, snapshot_interval_blocks=3)
    base = prompt_ids(30, 7)                       # snapshots at blocks 3, 6 (interval) and 7 (end)
    llm.generate([base], GREEDY)
    branch = base[:22] + prompt_ids(9, 8)          # diverges inside block 6 -> nearest snapshot: block 3
    out = llm.generate([branch], GREEDY)[0]
    assert out.num_cached_tokens == 12
    assert out.output.token_ids == tokens(make_llm(tiny_dir, enable_prefix_caching=False).generate([branch], GREEDY))[0]
    assert_clean(llm)


def test_reuse_after_eviction(tiny_dir):
    # 4 KDA slots x 12800 B + 20 MLA pages x 768 B: room for about two 35-token requests
    llm = make_llm(tiny_dir, max_num_seqs=2, num_snapshot_slots=2, cache_memory_bytes=4 * 12800 + 20 * 768)
    assert llm.engine.cache_config.num_blocks == 20
    a = prompt_ids(23, 10)
    first = llm.generate([a], GREEDY)[0]
    for seed in (11, 12, 13):                      # other prompts take a's pages and snapshot slots
        llm.generate([prompt_ids(23, seed)], GREEDY)
        llm.engine.check_integrity()
    again = llm.generate([a], GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.output.token_ids == first.output.token_ids
    third = llm.generate([a], GREEDY)[0]           # recomputed pages were published again
    assert third.num_cached_tokens == 20 and third.output.token_ids == first.output.token_ids
    assert_clean(llm)


def test_image_prompt_hit_equals_miss_and_other_pixels_miss(tiny_dir):
    llm = make_llm(tiny_dir)
    first = llm.generate([image_input(llm, 0)], GREEDY)[0]
    again = llm.generate([image_input(llm, 0)], GREEDY)[0]
    other = llm.generate([image_input(llm, 1)], GREEDY)[0]
    assert again.num_cached_tokens > 0 and again.output.token_ids == first.output.token_ids
    image_start = image_input(llm, 0).images[0].start
    assert other.num_cached_tokens <= image_start  # different pixels: no hit past the image's first block
    assert_clean(llm)


def test_preempted_and_resumed_equals_uninterrupted(tiny_dir):
    prompts = [prompt_ids(20, 30), prompt_ids(20, 31)]
    reference = tokens(make_llm(tiny_dir, enable_prefix_caching=False).generate(prompts, GREEDY))
    # 2 KDA slots + 13 pages (12 usable = 48 tokens): both 32-token requests cannot finish together
    tight = make_llm(tiny_dir, enable_prefix_caching=False, max_num_seqs=2, num_snapshot_slots=0,
                     cache_memory_bytes=2 * 12800 + 13 * 768)
    assert tokens(tight.generate(prompts, GREEDY)) == reference
    assert tight.engine.scheduler.num_preemptions > 0
    assert_clean(tight)


def test_export_then_import_into_another_engine_equals_one_engine(tiny_dir):
    from engine.core.state_export import ExportedState
    prompts = [prompt_ids(21, 40), image_input(make_llm(tiny_dir), 3)]
    for prompt in prompts:
        single = make_llm(tiny_dir)
        expected = single.generate([prompt], GREEDY)[0].output
        prefill, decode = make_llm(tiny_dir), make_llm(tiny_dir)
        inputs = prefill._to_input(prompt)
        prefill.engine.add_request("p", inputs, GREEDY, export_state=True)
        while prefill.engine.has_unfinished():
            prefill.engine.step()
        assert "p" in prefill.engine.held
        state = prefill.engine.export_state("p")
        assert set(state.mla) == set(prefill.engine.model.config.text_config.mla_layer_ids)
        assert all(t.shape[0] == len(inputs.prompt_token_ids) for t in state.mla.values())
        assert prefill.engine.release_export("p") and not prefill.engine.release_export("p")
        assert_clean(prefill)
        meta, tensors = state.to_parts()
        rebuilt = ExportedState.from_parts(meta, tensors)
        decode.engine.add_request("d", EngineInput(inputs.prompt_token_ids), GREEDY, imported=rebuilt)
        final = None
        while decode.engine.has_unfinished():
            final = [o for o in decode.engine.step() if o.finished] or final
        got = final[0].output
        assert got.token_ids == expected.token_ids
        assert got.logprobs[0] == pytest.approx(expected.logprobs[0], abs=1e-6)
        assert_clean(decode)


def test_seeded_sampling_reproducible_independent_of_batch_and_differs_across_seeds(tiny_dir):
    llm = make_llm(tiny_dir)
    p = prompt_ids(8, 70)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate([p], seeded)[0].output.token_ids
    assert llm.generate([p], seeded)[0].output.token_ids == alone
    batch = llm.generate([prompt_ids(13, 71), p, prompt_ids(5, 72)],
                         [SamplingParams(temperature=0.8, max_tokens=16), seeded, GREEDY])
    assert batch[1].output.token_ids == alone
    other = llm.generate([p], SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True))[0]
    assert other.output.token_ids != alone
    assert_clean(llm)


def test_stop_strings_cut_exactly(tiny_dir):
    llm = make_llm(tiny_dir)
    p = prompt_ids(12, 80)
    full = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].output.text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    cut = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].output
    assert cut.text == full[:full.find(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                            include_stop_str_in_output=True))[0].output
    assert kept.text == full[:full.find(stop) + len(stop)]
    assert_clean(llm)


def test_streamed_deltas_concatenate_to_the_final_text(tiny_dir):
    llm = make_llm(tiny_dir)
    llm.engine.add_request("s", prompt_ids(9, 90), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    pieces, final = [], None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            pieces.append(out.new_text)
            final = out
    assert "".join(pieces) == final.output.text and len(final.output.token_ids) == 20
    assert_clean(llm)


def test_top_logprobs_reported(tiny_dir):
    llm = make_llm(tiny_dir)
    out = llm.generate([prompt_ids(6, 95)], SamplingParams(temperature=0.0, max_tokens=3, logprobs=3))[0].output
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=False):
        assert len(top) == 3 and top[0][0] == token and top[0][1] == pytest.approx(lp)
        assert [x[1] for x in top] == sorted((x[1] for x in top), reverse=True)


def test_abort_mid_generation_frees_and_others_continue(tiny_dir):
    llm = make_llm(tiny_dir)
    keep, drop = prompt_ids(11, 100), prompt_ids(15, 101)
    expected = llm.generate([keep], GREEDY)[0].output.token_ids
    llm.engine.add_request("keep", keep, GREEDY)
    llm.engine.add_request("drop", drop, GREEDY)
    for _ in range(3):
        llm.engine.step()
    aborted = llm.engine.abort("drop")
    assert aborted.finished and aborted.output.finish_reason == "abort"
    assert llm.engine.abort("drop") is None and llm.engine.abort("nope") is None
    final = None
    while llm.engine.has_unfinished():
        final = [o for o in llm.engine.step() if o.finished] or final
    assert final[0].output.token_ids == expected
    assert_clean(llm)


def test_imported_request_streams_its_first_token(tiny_dir):
    """The first token comes from the prefill side; a decode-side stream must still deliver it."""
    prefill, decode = make_llm(tiny_dir), make_llm(tiny_dir)
    prefill.engine.add_request("p", prompt_ids(14, 400), GREEDY, export_state=True)
    while prefill.engine.has_unfinished():
        prefill.engine.step()
    state = prefill.engine.export_state("p")
    prefill.engine.release_export("p")
    decode.engine.add_request("d", state.prompt_token_ids, GREEDY, imported=state)
    deltas, final = [], None
    while decode.engine.has_unfinished():
        for out in decode.engine.step():
            deltas += out.new_token_ids
            final = out
    assert deltas == final.output.token_ids and deltas[0] == state.first_token_id and len(deltas) == 12
    assert_clean(decode)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12,
                                                           ignore_eos=True)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_resumed_on_another_engine_equals_uninterrupted(tiny_dir, params, cut):
    """Migration (issue 11): a request resumed elsewhere from its first `cut` delivered tokens (same seed
    offset) generates exactly the rest, with the same text and one count of all tokens."""
    from engine.core.inputs import Resume
    prompt = prompt_ids(19, 50)
    whole = make_llm(tiny_dir).generate([prompt], params)[0].output
    other = make_llm(tiny_dir)
    delivered = whole.token_ids[:cut]
    other.engine.add_request("r", EngineInput(prompt, resume=Resume(delivered, seed_offset=cut)), params)
    new_tokens, new_text, last = [], "", None
    while other.engine.has_unfinished():
        for out in other.engine.step():
            new_tokens += out.new_token_ids
            new_text += out.new_text
            last = out
    assert delivered + new_tokens == whole.token_ids
    assert last.output.token_ids == whole.token_ids and last.output.text == whole.text
    other_text_of_delivered = whole.text[:len(whole.text) - len(new_text)]
    assert other_text_of_delivered + new_text == whole.text
    assert_clean(other)


def test_resume_is_validated(tiny_dir):
    from engine.core.inputs import Resume
    from shared.errors import InvalidRequest
    llm = make_llm(tiny_dir)
    for resume in (Resume([10 ** 9]), Resume([]), Resume(list(range(12))), Resume([1, 2], seed_offset=3)):
        with pytest.raises(InvalidRequest):
            llm.engine.add_request(None, EngineInput(prompt_ids(5, 1), resume=resume), GREEDY)
    assert_clean(llm)
