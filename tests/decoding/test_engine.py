"""The speculative-decoding engine: output identical to the target's own, for every drafter."""

import json
import sys
import time

import pytest
import torch
from conftest import DEVICE, chi_square_passes, on_levels

from dlite_cli.core.config import DrafterConfig, SuffixConfig, TargetConfig
from dlite_cli.core.errors import DliteError
from dlite_cli.decoding import engine as engine_module
from dlite_cli.decoding.adaptive import VerifyCosts
from dlite_cli.decoding.engine import Engine
from dlite_cli.decoding.methods import checkpoint_of, known_method, load_proposer, parse_method
from dlite_cli.decoding.proposers.base import Draft, Proposer, ProposerSetup
from dlite_cli.decoding.proposers.hybrid import HybridDrafter
from dlite_cli.decoding.proposers.model import ModelDrafter
from dlite_cli.decoding.proposers.ngram import NgramDrafter
from dlite_cli.decoding.proposers.none import NoDrafter
from dlite_cli.decoding.proposers.suffix import SuffixDrafter
from dlite_cli.decoding.requests import OutputText, Request, SamplingParams, Stats
from dlite_cli.decoding.sampling import draw, probabilities
from dlite_cli.models.layer_ops import KernelOps
from dlite_cli.models.linears import layer_linears, linear_bytes, target_linears
from dlite_cli.models.model import FULL_HISTORY, Drafter, DrafterSpec
from dlite_cli.models.runner import Prefill, TargetRunner
from dlite_cli.models.targets import load_target

K = 4
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def micro(cache_dir):
    model, tokenizer, _ = load_target(TargetConfig(model="micro"), log=lambda _: None)
    return model, tokenizer


@pytest.fixture(scope="module")
def micro_bfloat16(cache_dir):
    model, tokenizer, _ = load_target(TargetConfig(model="micro", dtype="bfloat16", device="cpu"), log=lambda _: None)
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(micro):
    """A short, a medium and a long prompt (the long one is prefilled in several chunks)."""
    _, tokenizer = micro
    import argparse

    text = open(argparse.__file__).read()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[100:105], ids[2000:2060], ids[5000:5700]]


@pytest.fixture(scope="module")
def reference(micro, prompts):
    """Plain greedy decoding with the Hugging Face model itself, no cache: the ground truth."""
    model, _ = micro
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(input_ids=torch.tensor([ids], device=DEVICE)).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


@pytest.fixture(scope="module")
def drafter_dirs(micro, tmp_path_factory):
    """Untrained checkpoints of every kind, saved and loaded the way users' exports are."""
    model, _ = micro
    dirs = {}
    kinds = (("dlite", 0, True, 0), ("parallel", 0, False, 0), ("teacher", FULL_HISTORY, True, 0), ("window3", 3, True, 0), ("vocab128", 0, True, 128))
    for name, window, head, vocab in kinds:
        options = DrafterConfig(num_target_layers=3, draft_tokens=K, num_layers=1, head_rank=16, sequential_head=head, draft_vocab=vocab)
        torch.manual_seed(0)
        drafter = Drafter(DrafterSpec.for_target(model.config, options, window))
        if vocab:
            drafter.set_draft_vocab(torch.randperm(model.config.vocab_size)[:vocab])
        dirs[name] = tmp_path_factory.mktemp(name)
        drafter.save(dirs[name])
    return dirs


class OracleDrafter(Proposer):
    """Proposes the reference continuation, wrong at output indices 3 and 5 mod 7: accepts 1..K per round."""

    name, draft_tokens = "oracle", K

    def __init__(self, prompts, reference):
        self.answers = {tuple(p): r for p, r in zip(prompts, reference)}

    def propose(self, rows, pick):
        tokens = torch.zeros(len(rows), K, dtype=torch.long)
        for b, row in enumerate(rows):
            answer = self.answers[tuple(row.prompt_ids)]
            done = len(row.output_ids)
            for i in range(K):
                index = done + i
                right = answer[index] if index < len(answer) else 0
                tokens[b, i] = (right + 1) % 512 if index % 7 in (3, 5) else right
        return Draft(tokens, [K] * len(rows), None)


def make_engine(micro, proposer, slots=2, capacity=1024, chunk=256, eos=(), path="eager"):
    """On the static path every pass is K + 1 wide (plain decoding padded too), as the bench runs it."""
    model, tokenizer = micro
    width = K + 1 if path == "static" else 1
    runner = TargetRunner(model, proposer.target_layers, slots=slots, capacity=capacity, prefill_chunk=chunk, path=path, width=width)
    return Engine(runner, proposer, set(eos), lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def load(name, model, capacity=1024):
    """The proposer ``name`` names, as the engine loads it (K for those without a checkpoint)."""
    method = known_method(name)
    return load_proposer(method, checkpoint_of(method, None), ProposerSetup(K, SuffixConfig(), model, capacity))


def proposer_for(name, micro, drafter_dirs, prompts, reference):
    """``name``, with a checkpoint's name standing for its directory among ``drafter_dirs``."""
    if name == "oracle":
        return OracleDrafter(prompts, reference)
    base = parse_method(name).drafter
    return load(str(drafter_dirs[base]) + name[len(base) :] if base in drafter_dirs else name, micro[0])


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("name", ["none", "ngram", "suffix", "dlite", "parallel", "teacher", "window3", "vocab128", "oracle", "dlite+suffix"])
def test_greedy_output_is_the_targets_own_batched_and_alone(name, path, micro, drafter_dirs, prompts, reference):
    """Three mixed-length prompts through two slots (the third joins when a row leaves; on the static
    path the bucket of two then pads the slot that is free), then each alone."""
    proposer = proposer_for(name, micro, drafter_dirs, prompts, reference)
    budgets = [NEW_TOKENS, NEW_TOKENS - 7, NEW_TOKENS]  # rows finish at different rounds
    requests = [Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    engine = make_engine(micro, proposer, path=path)
    engine.run(requests)
    for request, expected, budget in zip(requests, reference, budgets):
        assert request.output_ids == expected[:budget] and request.finish_reason == "length"
    for prompt, expected in zip(prompts, reference):
        (alone,) = make_engine(micro, proposer, slots=1, path=path).run([Request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS))])
        assert alone.output_ids == expected
    stats = engine.stats
    assert stats.generated_tokens == sum(budgets) and stats.prompt_tokens == sum(map(len, prompts))
    assert 1 <= stats.tau <= K + 1
    if name == "oracle":
        assert stats.tau > 2 and 0 < stats.accepted[2] < stats.accepted[1]
    if name in ("teacher", "window3"):
        assert stats.draft_kv_bytes > 0
    else:
        assert stats.draft_kv_bytes == 0


def test_static_path_pads_rows_to_buckets_and_decodes_the_same(micro, prompts, reference):
    """Seven requests through five slots on fixed shapes: rows join and leave, passes are padded to the
    buckets 1, 2, 4 and the five slots, padding rows included, and every output is the target's own."""
    engine = make_engine(micro, OracleDrafter(prompts, reference), slots=5, path="static")
    passes = []  # (bucket, tokens per row, rows in use) of every verify pass
    run = engine.runner.graphs.run

    def recording(key, fn, tokens, lengths):
        passes.append((key[0], key[1], len(engine.active)))
        return run(key, fn, tokens, lengths)

    engine.runner.graphs.run = recording
    budgets = [NEW_TOKENS, 18, 12, 3, 4, 5, 2]  # the high slots free up first, the last rows are in slot 0
    requests = [Request(prompts[i % 3], SamplingParams(max_new_tokens=n)) for i, n in enumerate(budgets)]
    engine.run(requests)
    for i, (request, budget) in enumerate(zip(requests, budgets)):
        assert request.output_ids == reference[i % 3][:budget]
    assert {bucket for bucket, _, _ in passes} >= {1, 4, 5} and any(bucket > rows for bucket, _, rows in passes)
    assert {width for _, width, _ in passes} == {K + 1}


@pytest.mark.parametrize("name", ["ngram", "suffix", "dlite", "teacher", "vocab128", "dlite+ngram", "dlite+suffix"])
def test_adaptive_proposals_are_cut_and_skipped_and_the_output_stays_the_targets(name, micro, drafter_dirs, prompts, reference):
    """Each token added to a pass costs a third of a step here, so the random drafters' proposals are cut
    short and rows are left undrafted; the greedy output is the target's own all the same."""
    proposer = proposer_for(name, micro, drafter_dirs, prompts, reference)
    engine = make_engine(micro, proposer)
    proposer.adapt(VerifyCosts([30.0, 40.0, 50.0, 60.0, 70.0]))
    budgets = [NEW_TOKENS, NEW_TOKENS - 7, NEW_TOKENS]
    requests = [Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    engine.run(requests)
    for request, expected, budget in zip(requests, reference, budgets):
        assert request.output_ids == expected[:budget]
    stats = engine.stats
    assert sum(stats.proposed) < K * stats.rounds and stats.proposed[0] < stats.rounds  # cut, and rounds with nothing proposed
    if name not in ("ngram", "suffix"):
        assert proposer.draft_ms > 0 if not parse_method(name).pairing else proposer.model.draft_ms > 0


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_the_hybrid_takes_the_lookup_where_the_text_repeats_and_the_model_elsewhere(lookup, micro, drafter_dirs, prompts):
    proposer = load(f"{drafter_dirs['dlite']}+{lookup}", micro[0])
    repeated = prompts[1][:20] * 3  # the target continues a repetition it has seen: lookup proposals get accepted
    engine = make_engine(micro, proposer)
    (request,) = engine.run([Request(repeated, SamplingParams(max_new_tokens=NEW_TOKENS))])
    (plain,) = make_engine(micro, NoDrafter()).run([Request(repeated, SamplingParams(max_new_tokens=NEW_TOKENS))])
    assert request.output_ids == plain.output_ids
    assert proposer.name == f"{drafter_dirs['dlite'].name}+{lookup}" and proposer.kv_bytes(request) == 0
    assert proposer.lookup.calibration.counts and proposer.model.calibration.counts == {}  # the lookup proposed; non-adaptive DLite records no bins


@pytest.mark.parametrize("cached", [10, 0])
def test_suffix_decoding_copies_an_earlier_requests_response_from_its_global_tree(cached, micro, prompts, reference):
    """The same prompt twice, one request after the other: the second's proposals come from the first's response,
    kept in the global tree (none kept: the second proposes no more than the first); the text is the target's."""
    proposer = SuffixDrafter(K, SuffixConfig(max_cached_requests=cached))
    engine = make_engine(micro, proposer, slots=1)
    first, second = (engine.run([Request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS))])[0] for _ in range(2))
    assert first.output_ids == second.output_ids == reference[0]
    assert (second.stats.rounds < first.stats.rounds) == (cached > 0) and second.stats.rounds <= first.stats.rounds
    assert list(proposer.cache.cached_requests) == ([0, 1] if cached else []) and not proposer.cache.active_requests
    rebuilt = SuffixDrafter(K, SuffixConfig(max_cached_requests=cached))
    rebuilt.reset([first.output_ids])  # as the bench builds a tree from the stored responses of the episodes before
    (again,) = make_engine(micro, rebuilt, slots=1).run([Request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS))])
    assert again.output_ids == reference[0] and again.stats.rounds == second.stats.rounds


def test_suffix_decoding_without_arctic_inference_says_how_to_install_it(micro, monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # the import fails as it does where it is not installed
    with pytest.raises(DliteError, match=r"arctic-inference.*--no-build-isolation --no-deps arctic-inference==0\.3\.0") as error:
        load("suffix", micro[0])
    assert "\n" not in str(error.value)


def test_rollback_leaves_the_cache_of_the_accepted_tokens_alone(micro, prompts, reference):
    engine = make_engine(micro, OracleDrafter(prompts, reference), slots=1)
    request = Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS))
    engine.add(request)
    for _ in range(4):
        engine.step()
    assert request.finish_reason is None and request.stats.rounds == 4
    runner = engine.runner
    length = runner.length(request.slot)
    assert length == request.position  # everything before the anchor, nothing rejected
    fresh = make_engine(micro, NoDrafter(), slots=1).runner
    fresh.prefill(0, request.tokens[:length], all_features=False)
    for layer in range(len(runner.keys)):
        assert torch.allclose(runner.keys[layer][0, :, :length], fresh.keys[layer][0, :, :length], atol=1e-5)
        assert torch.allclose(runner.values[layer][0, :, :length], fresh.values[layer][0, :, :length], atol=1e-5)


def test_a_next_turn_reuses_the_slots_cache_and_decodes_the_same(micro, prompts, reference):
    """Turn 2 = turn 1's prompt and answer plus more text: only the new tokens are prefilled."""
    first = Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS))
    engine = make_engine(micro, NgramDrafter(K), slots=1)
    engine.run([first])
    follow_up = first.prompt_ids + first.output_ids + prompts[0]
    (reusing,) = engine.run([Request(follow_up, SamplingParams(max_new_tokens=8))])
    (fresh,) = make_engine(micro, NoDrafter(), slots=1).run([Request(follow_up, SamplingParams(max_new_tokens=8))])
    assert reusing.output_ids == fresh.output_ids
    # the slot held the prompt and the output (its last token too if it was an accepted draft)
    held = len(first.prompt_ids) + len(first.output_ids)
    assert held - 1 <= reusing.stats.reused_prompt_tokens <= held
    assert fresh.stats.reused_prompt_tokens == 0


def test_sessions_taking_turns_find_their_conversations_in_the_slots_they_left(micro, prompts):
    """Two conversations, one turn at a time on two slots: a request with no prefix held anywhere takes the slot
    freed longest ago, and a next turn takes the slot holding its conversation."""
    engine = make_engine(micro, NoDrafter(), slots=2)
    first_a, first_b = (Request(prompt, SamplingParams(max_new_tokens=8)) for prompt in (prompts[1], prompts[2][:100]))
    engine.run([first_a])
    engine.run([first_b])
    assert first_a.slot != first_b.slot
    next_b, next_a = (Request(first.tokens + prompts[0], SamplingParams(max_new_tokens=8)) for first in (first_b, first_a))
    engine.run([next_b])
    engine.run([next_a])
    assert (next_a.slot, next_b.slot) == (first_a.slot, first_b.slot)
    for first, following in ((first_a, next_a), (first_b, next_b)):
        assert following.stats.reused_prompt_tokens >= len(first.tokens) - 1


def test_a_shared_header_leaves_a_conversation_in_its_slot_and_a_shared_system_prompt_is_reused(micro, prompts):
    """A match that would throw away more of a slot than it spares counts as none: a new session that shares only a
    template's first tokens with a conversation takes another slot; one that shares most of a slot takes it."""
    engine = make_engine(micro, NoDrafter(), slots=3)
    header, system = prompts[0][:4], prompts[2][:400]
    a, b = Request(header + prompts[1], SamplingParams(max_new_tokens=8)), Request(header + prompts[2][400:500], SamplingParams(max_new_tokens=8))
    engine.run([a])
    engine.run([b])
    assert b.slot != a.slot
    c, d = Request(system + prompts[1][:50], SamplingParams(max_new_tokens=8)), Request(system + prompts[0][:50], SamplingParams(max_new_tokens=8))
    engine.run([c])
    engine.run([d])
    assert d.slot == c.slot and d.stats.reused_prompt_tokens >= 400
    following = Request(a.tokens + prompts[0], SamplingParams(max_new_tokens=8))
    engine.run([following])
    assert following.slot == a.slot and following.stats.reused_prompt_tokens >= len(a.tokens) - 1


def test_a_prefix_another_slot_holds_is_copied_and_not_computed_again(micro, prompts):
    """Two requests that share a long system prompt, admitted together into two slots: the second copies the first's
    keys and values of it, computes only its own tokens, and both decode as each does alone."""
    system = prompts[2][:400]
    a, b = (Request(system + tail, SamplingParams(max_new_tokens=8)) for tail in (prompts[1][:50], prompts[0]))
    make_engine(micro, NoDrafter(), slots=2, chunk=64).run([a, b])
    assert a.slot != b.slot
    assert a.stats.reused_prompt_tokens == 0 and b.stats.reused_prompt_tokens >= 400
    for request in (a, b):
        (alone,) = make_engine(micro, NoDrafter(), slots=1).run([Request(request.prompt_ids, SamplingParams(max_new_tokens=8))])
        assert request.output_ids == alone.output_ids


def test_a_copied_prefix_brings_its_features(micro, prompts):
    """Where every position's features are needed (a history drafter's, the feature pass), a prefix copied from another
    slot comes with the features that slot kept: the same as a fresh prefill's."""
    model, _ = micro
    runner = TargetRunner(model, [0, 1], slots=2, capacity=1024, prefill_chunk=64)
    shared, own = prompts[2][:300], prompts[1]
    runner.prefill(0, shared + prompts[0], all_features=True)
    logits, features, reused = runner.prefill(1, shared + own, all_features=True)
    fresh_logits, fresh_features, _ = TargetRunner(model, [0, 1], slots=1, capacity=1024, prefill_chunk=64).prefill(0, shared + own, all_features=True)
    assert reused >= 300 and features.shape == fresh_features.shape
    assert torch.allclose(features, fresh_features, atol=1e-5) and torch.allclose(logits, fresh_logits, atol=1e-4)


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_rounds(micro, prompts, reference):
    """While a row decodes, each step runs one chunk of an arriving prompt and then the row's round, so the row gains
    a token every step."""
    engine = make_engine(micro, NoDrafter(), slots=2, chunk=64)
    running = Request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS))
    engine.add(running)
    engine.step()
    arriving = Request(prompts[2], SamplingParams(max_new_tokens=NEW_TOKENS))  # 700 tokens: 11 chunks of 64
    engine.add(arriving)
    steps = 0
    while not arriving.output_ids:
        before = len(running.output_ids)
        engine.step()
        steps += 1
        assert len(running.output_ids) == before + 1 or running.finish_reason
    assert steps == 11
    while engine.busy:
        engine.step()
    assert running.output_ids == reference[0] and arriving.output_ids == reference[2]


@pytest.mark.parametrize("where", ["prefill", "round"])
def test_a_request_the_engine_fails_on_fails_alone_and_frees_its_slot(where, micro, prompts, reference, monkeypatch):
    """A fault in one request's prefill fails that request only; one in a round fails that round's rows.  Either
    way the slots come back, ``run`` raises it, and the next request decodes as if nothing happened."""
    engine = make_engine(micro, NoDrafter(), slots=2)
    healthy, failing = Request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS)), Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS))
    if where == "prefill":
        step = Prefill.step
        monkeypatch.setattr(Prefill, "step", lambda self: step(self) if self.prompt != prompts[1] else 1 / 0)
        engine.add(healthy)
        engine.add(failing)
        while engine.busy:
            engine.step()
        assert healthy.output_ids == reference[0]
    else:
        monkeypatch.setattr(engine.runner, "verify", lambda *_: 1 / 0)
        engine.add(failing)
        engine.step()
        monkeypatch.undo()
    assert failing.finish_reason == "error" and isinstance(failing.error, ZeroDivisionError)
    assert sorted(engine.free) == [0, 1] and not engine.busy
    if where == "prefill":
        with pytest.raises(ZeroDivisionError):
            engine.run([Request(prompts[1], SamplingParams(max_new_tokens=4))])
        monkeypatch.undo()
    (after,) = engine.run([Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS))])
    assert after.output_ids == reference[1]


def test_output_text_grows_token_by_token_into_the_tokenizers_own_decoding(micro):
    """Characters split across byte-level tokens never show half-made, and the text only grows."""
    _, tokenizer = micro
    text = "naïve café — 数学 😀 ok\n    return x  # ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    output, seen = OutputText(decode), ""
    for token in ids:
        output.extend([token])
        assert output.text.startswith(seen) and "\ufffd" not in output.text
        seen = output.text
    output.extend([], final=True)
    assert output.text == decode(ids) == text


def test_a_history_drafters_next_turn_reuses_the_prompts_features(micro, drafter_dirs, prompts):
    """A history drafter needs the features of every prompt position: the slot keeps those of turn 1's prompt,
    so turn 2 computes only the rest, and drafts and decodes as from a fresh prefill."""
    model, _ = micro

    def teacher_engine():
        return make_engine(micro, load(str(drafter_dirs["teacher"]), model), slots=1)

    engine = teacher_engine()
    (first,) = engine.run([Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS))])
    follow_up = first.prompt_ids + first.output_ids + prompts[0]
    (reusing,) = engine.run([Request(follow_up, SamplingParams(max_new_tokens=NEW_TOKENS))])
    (fresh,) = teacher_engine().run([Request(follow_up, SamplingParams(max_new_tokens=NEW_TOKENS))])
    assert reusing.stats.reused_prompt_tokens == len(first.prompt_ids) and fresh.stats.reused_prompt_tokens == 0
    assert reusing.output_ids == fresh.output_ids
    assert reusing.stats.accepted == fresh.stats.accepted  # the same drafts: drafted from the same history
    kept, computed = engine.runner.features[0], teacher_engine().runner.prefill(0, follow_up, all_features=True)[1]
    assert kept.shape == computed.shape and torch.allclose(kept, computed, atol=1e-5)
    single_turn = TargetRunner(model, engine.runner.capture_layers, 1, 1024, keep_features=False)  # the bench's concurrency sweep
    assert single_turn.prefill(0, follow_up, all_features=True)[1].shape == computed.shape and single_turn.features == [None]


def test_history_drafter_cache_equals_one_pass_over_the_history(micro, drafter_dirs, prompts, reference):
    """The teacher's draft KV cache, grown round by round, equals its keys/values computed at once, and holds
    about what the row needs, not the engine's capacity."""
    model, _ = micro
    proposer = load(str(drafter_dirs["teacher"]), model, capacity=8192)
    teacher_propose = proposer.propose
    oracle = OracleDrafter(prompts, reference)

    def propose(rows, pick):  # the teacher drafts (reading its cache), the oracle's tokens get accepted
        teacher_propose(rows, pick)
        return oracle.propose(rows, pick)

    proposer.propose = propose
    engine = make_engine(micro, proposer, slots=1)
    request = Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS))
    engine.add(request)
    for _ in range(6):
        engine.step()
    keys, values, length = proposer.cache[request.slot]
    assert length == request.position - 1 and request.stats.committed > 2 * request.stats.rounds  # grown by accepted runs
    assert length <= keys[0].shape[2] <= 2 * length
    runner = TargetRunner(model, proposer.target_layers, slots=1, capacity=1024)
    _, features, _ = runner.prefill(0, request.tokens[:length], all_features=True)
    expected = proposer.drafter.history_kv(features.flatten(1)[None])
    for layer, (k, v) in enumerate(expected):
        assert torch.allclose(keys[layer][:, :, :length], k, atol=1e-4)
        assert torch.allclose(values[layer][:, :, :length], v, atol=1e-4)
    # and drafting from the cache is drafting from the whole history at once (the training path)
    context, group, embed = request.pivot[None], torch.tensor([[request.anchor]], device=DEVICE), model.get_input_embeddings()
    at_once = proposer.drafter.history(features.flatten(1)[None], torch.ones(1, length, dtype=torch.bool, device=DEVICE), torch.tensor([request.position], device=DEVICE))
    assert torch.allclose(proposer.drafter.hidden(context, group, embed, proposer._history([request])), proposer.drafter.hidden(context, group, embed, at_once), atol=1e-4)


def test_eos_stop_strings_and_budget(micro, prompts, reference):
    _, tokenizer = micro
    proposer = OracleDrafter(prompts, reference)
    eos = reference[1][9]
    (ended,) = make_engine(micro, proposer, eos=[eos]).run([Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS))])
    first = reference[1].index(eos)
    assert ended.finish_reason == "stop" and ended.output_ids == reference[1][: first + 1]
    full_text = tokenizer.decode(reference[1], skip_special_tokens=True)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    (stopped,) = make_engine(micro, proposer).run([Request(prompts[1], SamplingParams(max_new_tokens=NEW_TOKENS, stop=(stop,)))])
    assert stopped.finish_reason == "stop" and stopped.text == full_text[: full_text.index(stop)]
    for budget in (1, 2, 5):  # a round may accept more than the budget leaves
        (short,) = make_engine(micro, proposer).run([Request(prompts[1], SamplingParams(max_new_tokens=budget))])
        assert short.output_ids == reference[1][:budget] and short.finish_reason == "length"


def test_requests_that_cannot_fit_are_refused(micro):
    engine = make_engine(micro, NoDrafter(), capacity=64)
    with pytest.raises(DliteError, match="more than the engine's 64"):
        engine.add(Request(list(range(10, 80))))
    with pytest.raises(DliteError, match="empty"):
        engine.add(Request([]))
    with pytest.raises(DliteError, match="top_p"):
        engine.add(Request([5, 6], SamplingParams(temperature=1.0, top_p=0)))


# ---------------------------------------------------------------- sampling


class SelfDrafter(ModelDrafter):
    """Drafts by sampling the target itself at a sharper temperature: q overlaps p but differs from it.
    With ``vocabulary`` it can propose only those tokens (a reduced draft vocabulary: q = 0 elsewhere);
    after ``adapt`` it proposes adaptively, as DLite does (its round is taken to cost nothing).  Its logits are
    in ``dtype``, as a drafter's are in its own (bfloat16 on a GPU)."""

    def __init__(self, model, vocabulary=None, dtype=torch.float32):
        super().__init__("self", 2, [])
        self.model, self.vocabulary, self.dtype = model, vocabulary, dtype

    @property
    def _device(self):
        return torch.device("cpu")

    def round_ms(self):
        return 0.0

    def _observe_round(self, ms):
        pass  # its round is taken to cost nothing, however long the target's own passes take

    def _model_draft(self, rows, pick):
        tokens = torch.zeros(len(rows), self.draft_tokens, dtype=torch.long)
        logits = torch.zeros(len(rows), self.draft_tokens, self.model.config.vocab_size, dtype=self.dtype)
        for i in range(self.draft_tokens):
            for b, row in enumerate(rows):
                ids = row.tokens + tokens[b, :i].tolist()
                logits[b, i] = 3 * self.model(input_ids=torch.tensor([ids], device=DEVICE)).logits[0, -1]  # q kept on the CPU
                if self.vocabulary is not None:
                    outside = torch.ones_like(logits[b, i], dtype=torch.bool).index_fill_(0, self.vocabulary, False)
                    logits[b, i] = logits[b, i].masked_fill(outside, float("-inf"))
            tokens[:, i] = pick(logits[:, i])  # the engine proposes its likeliest
        confidence = torch.stack([probabilities(logits[b], row.params).gather(-1, tokens[b, :, None])[:, 0] for b, row in enumerate(rows)])
        return Draft(tokens, [self.draft_tokens] * len(rows), logits, confidence)


def exact_marginals(model, prompt, params, positions):
    """p(x_j) for j = 1..positions under the target's own sampling, by enumerating the top-k tree."""
    marginals, frontier = [], [(list(prompt), 1.0)]
    for _ in range(positions):
        total = torch.zeros(model.config.vocab_size)
        grown = []
        for ids, weight in frontier:
            p = probabilities(model(input_ids=torch.tensor([ids], device=DEVICE)).logits[0, -1], params).cpu()
            total += weight * p
            grown += [(ids + [t], weight * float(p[t])) for t in p.nonzero().flatten().tolist()]
        marginals.append(total)
        frontier = grown
    return marginals


def sampled_positions(micro, prompt, params, count, path="eager", vocabulary=None, how="fixed"):
    """→ the tokens at each of 3 positions of ``count`` samples, and the engine's Stats.  ``how``: fixed (K every round),
    adaptive (cut where the next token does not pay, rows skipped) or hybrid (prompt lookup where it is expected to do
    better, the self-drafter elsewhere); suffix: suffix decoding alone, hybrid-suffix paired with the self-drafter."""
    model, _ = micro
    # adaptive and hybrid rounds mix drafted rows with certain ones: in bfloat16, as a drafter on a GPU drafts
    drafter = SelfDrafter(model, vocabulary, torch.float32 if how == "fixed" else torch.bfloat16)
    if how in ("hybrid", "hybrid-suffix"):
        drafter = HybridDrafter(drafter, NgramDrafter(2) if how == "hybrid" else SuffixDrafter(2, SuffixConfig()), model.config.vocab_size)
    if how == "suffix":  # proposals from the earlier samples' responses in the global tree
        drafter = SuffixDrafter(2, SuffixConfig())
    slots = 16
    if how not in ("fixed", "suffix"):  # two rows a pass, where a token costs a tenth of a step: some rows are skipped, some cut
        slots = 2
        drafter.adapt(VerifyCosts([3000.0, 3300.0, 3600.0]))
    engine = make_engine(micro, drafter, slots=slots, path=path)
    requests = [Request(prompt, SamplingParams(max_new_tokens=3, temperature=params.temperature, top_k=params.top_k, seed=i)) for i in range(count)]
    with torch.no_grad():
        engine.run(requests)
    return [[r.output_ids[j] for r in requests] for j in range(3)], engine.stats


def test_speculative_sampling_matches_the_targets_distribution_and_a_broken_rule_does_not(micro, prompts, monkeypatch):
    model, _ = micro
    # fixed drafting is measured where the target often draws other than its argmax, and adaptive drafting where it
    # seldom does: there proposals refused at first would soon not be worth their verify
    spread, sharp = SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.05, top_k=5)
    with torch.no_grad():
        expected = {params.temperature: exact_marginals(model, prompts[0], params, 3) for params in (spread, sharp)}
    # the draft vocabulary holds one of the 3 likeliest tokens at each position: drafts are often rejected
    likely = torch.stack(expected[spread.temperature]).topk(3, dim=-1).indices
    vocabulary = torch.cat([likely[:, 0], torch.arange(300, 400)]).unique()
    for path, vocabulary, how in (("eager", None, "fixed"), ("static", None, "fixed"), ("eager", vocabulary, "fixed"),
                                  ("eager", None, "adaptive"), ("eager", None, "hybrid"), ("eager", None, "suffix"),
                                  ("eager", None, "hybrid-suffix")):
        params = spread if how == "fixed" else sharp
        samples, stats = sampled_positions(micro, prompts[0], params, 600, path, vocabulary, how)
        assert stats.rounds > 0 and 0 < sum(stats.accepted) and (sum(stats.accepted) < sum(stats.proposed) or how != "fixed")  # kept, refused
        assert all(chi_square_passes(s, e) for s, e in zip(samples, expected[params.temperature])), (path, how)
    # a classic mistake: keeping a proposal the target could have drawn there, not only the one it drew
    def lenient(target_logits, drafts, params, seed, start):
        p = probabilities(target_logits, params)
        n = next((i for i, d in enumerate(drafts) if p[i, d] == 0), len(drafts))
        return n, draw(target_logits[n], params, seed, start + n)

    monkeypatch.setattr(engine_module, "accept_sampled", lenient)
    broken, _ = sampled_positions(micro, prompts[0], spread, 600)
    assert not all(chi_square_passes(s, e) for s, e in zip(broken[1:], expected[spread.temperature][1:]))


def test_a_seed_writes_the_same_text_whatever_the_method_drafter_batch_or_proposals(micro, prompts):
    model, _ = micro

    def texts(drafter, slots: int) -> tuple[list[list[int]], Stats]:
        requests = [Request(prompts[0], SamplingParams(max_new_tokens=12, temperature=0.05, top_k=5, seed=s)) for s in range(4)]
        engine = make_engine(micro, drafter, slots=slots)
        engine.run(requests)
        return [r.output_ids for r in requests], engine.stats

    plain, _ = texts(NoDrafter(), 1)
    assert len({tuple(text) for text in plain}) > 1  # the seeds write different texts
    adaptive = SelfDrafter(model, dtype=torch.bfloat16)
    adaptive.adapt(VerifyCosts([3000.0, 3300.0, 3600.0]))  # some rows skipped, some cut
    for drafter, slots in ((SelfDrafter(model), 4), (SelfDrafter(model), 1), (adaptive, 2), (NgramDrafter(2), 4)):
        written, stats = texts(drafter, slots)
        assert written == plain, drafter.name
        if drafter.name == "self":
            assert 0 < sum(stats.accepted) < sum(stats.proposed)  # proposals were kept and refused


# ---------------------------------------------------------------- the command


def test_a_cpu_target_runs_fused_packed_linears_that_compute_the_models_own(micro):
    model, _ = micro
    linears = target_linears(model)
    assert linears.packed == (DEVICE.type == "cpu") and linears.packed_bytes == (linear_bytes(model) if linears.packed else 0)
    assert TargetRunner(model, [], slots=1, capacity=64).linears is linears  # one set per model, whatever the runners
    layer, x = model.model.layers[1], torch.randn(2, 3, model.config.hidden_size, device=DEVICE)
    with torch.no_grad():
        q, k, v = linears.layers[1].qkv(x)
        for fused, module in zip((q, k, v), (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)):
            torch.testing.assert_close(fused, module(x))
        gate, up = linears.layers[1].gate_up(x)
        torch.testing.assert_close(linears.layers[1].down(linears.layers[1].act(gate) * up)[0], layer.mlp(x))
        torch.testing.assert_close(linears.lm_head(x), model.lm_head(x))


def test_generate_command(run_cli, tmp_path, drafter_dirs):
    done = run_cli("generate", "--target", "micro", "--drafter", "ngram", "--prompt", "def main():", "--max-new-tokens", "12", "--json")
    result = json.loads(done.stdout)
    assert result["generated_tokens"] == 12 and 1 <= result["tau"] <= 8 and isinstance(result["text"], str)
    done = run_cli("generate", "--target", "micro", "--drafter", str(drafter_dirs["dlite"]), "-p", "x = 1", "--max-new-tokens", "6")
    assert "tau" in done.stderr and done.stdout.strip()
    missing = run_cli("generate", "--target", "micro", "-p", "hi", check=False)
    assert missing.returncode == 2 and "no dlite drafter in runs/micro" in missing.stderr
    unknown = run_cli("generate", "--target", "micro", "--drafter", "eagle", "-p", "hi", check=False)
    assert unknown.returncode == 2 and "unknown drafter 'eagle'" in unknown.stderr


def test_a_graph_captured_inside_a_round_is_taken_out_of_its_time(micro, prompts, reference, monkeypatch):
    """CUDA graphs cannot be captured here: a stand-in books a 1.5 s capture in the ledger, as a capture does (long
    enough that micro's passes stay under it on a loaded machine too)."""
    from dlite_cli.models.graphs import CAPTURES

    engine = make_engine(micro, OracleDrafter(prompts, reference))
    verify = engine.runner.verify

    def verify_after_a_capture(slots, tokens):
        start = time.perf_counter()
        time.sleep(1.5)  # the first pass of a new shape: captured, then replayed
        CAPTURES.count, CAPTURES.seconds = CAPTURES.count + 1, CAPTURES.seconds + time.perf_counter() - start
        monkeypatch.setattr(engine.runner, "verify", verify)
        return verify(slots, tokens)

    monkeypatch.setattr(engine.runner, "verify", verify_after_a_capture)
    (request,) = engine.run([Request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS))])
    assert request.output_ids == reference[0] and request.stats.capture_seconds >= 1.5
    assert request.stats.verify_seconds < 1.5  # every pass of micro together takes a fraction of the capture


@pytest.mark.parametrize("name", ["ngram", "dlite", "oracle", "dlite+suffix"])
def test_in_bfloat16_every_method_writes_plain_decodings_text_on_the_cpu_kernels(name, micro_bfloat16, drafter_dirs, prompts, reference):
    """dlite's CPU kernels compute a position alike in a step and in any verify, so below float32 too, passes as wide
    as their tokens give every method plain decoding's greedy text from the same prefill (fresh slots), alone and two
    rows at a time."""
    if not isinstance(TargetRunner(micro_bfloat16[0], [], 1, 64).ops, KernelOps):
        pytest.skip("dlite's CPU kernels do not run here")
    requests = lambda: [Request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]  # noqa: E731
    plain = make_engine(micro_bfloat16, NoDrafter()).run(requests())
    proposer = proposer_for(name, micro_bfloat16, drafter_dirs, prompts, reference)
    for slots in (1, 2):
        drafted = make_engine(micro_bfloat16, proposer, slots=slots).run(requests())
        assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    assert make_engine(micro_bfloat16, proposer).stats.draft_tokens == K


@pytest.fixture(scope="module")
def micro_gguf(micro):
    """The micro target with every decoder-layer weight moved to 4-bit levels and its LM head to 8-bit ones, as a GGUF
    Q4_1 model's dequantise."""
    import copy

    model = copy.deepcopy(micro[0])
    with torch.no_grad():
        for seed, linear in enumerate(layer_linears(model)):
            linear.weight.copy_(on_levels(*linear.weight.shape, bits=4, seed=seed))
        model.lm_head.weight.copy_(on_levels(*model.lm_head.weight.shape, bits=8))
    if target_linears(model).head.quantized is None:
        pytest.skip("dlite's CPU kernels do not run here")
    return model, micro[1]


def test_a_target_whose_weights_a_gguf_file_held_4_and_8_bit_decodes_its_own_greedy_text(micro_gguf):
    """The engine reads such weights in that form and writes, with any drafter, the text the Hugging Face model writes."""
    model, tokenizer = micro_gguf
    assert {p.quantized.kind for p in target_linears(model).projections} == {"q4", "q8"}
    prompt = tokenizer("def main():\n    parser = argparse.ArgumentParser()", add_special_tokens=False)["input_ids"]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    for proposer in (NoDrafter(), NgramDrafter(K)):
        (request,) = make_engine(micro_gguf, proposer, slots=1).run([Request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS))])
        assert request.output_ids == ids[len(prompt) :]


def test_a_narrow_pass_runs_its_layers_in_one_kernel_call_and_computes_what_the_layer_by_layer_loop_does(micro_gguf):
    """Over 4- and 8-bit weights a pass of at most QUANTIZED_ROWS tokens runs every decoder layer in one call of the
    kernels: the same logits and captured features, bit for bit, as the loop over the layers' own kernel calls, in a
    step, a verify and a batch of rows at different lengths."""
    model, _ = micro_gguf
    runner = TargetRunner(model, [0, 2, model.config.num_hidden_layers], 3, 256)
    assert runner.kernel_layers is not None
    for slot, length in enumerate((40, 57, 3)):
        runner.prefill(slot, list(range(5, 5 + length)), all_features=False)
    for slots, width in (([0], 1), ([1], 5), ([0, 1, 2], 4)):
        tokens = torch.randint(0, 100, (len(slots), width), generator=torch.Generator().manual_seed(width))
        fused = runner.verify(slots, tokens)
        layers, runner.kernel_layers = runner.kernel_layers, None
        loop = runner.verify(slots, tokens)
        runner.kernel_layers = layers
        assert fused[1].shape == (len(slots), width, 3, model.config.hidden_size)
        assert all(torch.equal(a, b) for a, b in zip(fused, loop))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("identical_text", [False, True])
def test_a_pass_is_as_wide_as_its_tokens_unless_identical_text_or_a_gpus_graphs_fix_its_shape(dtype, identical_text):
    from dlite_cli.models.runner import decode_path, pass_width

    path = decode_path("auto", torch.device("cpu"), dtype, identical_text)
    fixed = identical_text and dtype != torch.float32
    assert path == ("static" if fixed else "eager") and pass_width(K + 1, dtype, path, identical_text) == (K + 1 if fixed else 1)
    graphs = decode_path("auto", torch.device("cuda"), dtype, identical_text)
    assert graphs == "graphs" and pass_width(K + 1, dtype, graphs, identical_text) == (1 if dtype == torch.float32 else K + 1)


def test_identical_text_gives_plain_decoding_and_a_drafting_method_the_same_passes_and_text(prompts):
    """In bfloat16 with decode.identical_text, plain decoding's passes are as wide as a drafting method's (the
    config's K + 1), so they write the same greedy text."""
    from dlite_cli.core.config import load_config
    from dlite_cli.decoding.engine import load_engine

    config = load_config("micro", ["target.dtype=bfloat16", "target.device=cpu", "decode.identical_text=true", "decode.adaptive=off"])
    outputs = {}
    for method in ("none", "ngram"):
        engine, _ = load_engine(config, None, method, slots=1, capacity=1024, log=lambda _: None)
        assert engine.runner.width == config.drafter.draft_tokens + 1
        outputs[method] = [r.output_ids for r in engine.run([Request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts])]
    assert outputs["none"] == outputs["ngram"]
