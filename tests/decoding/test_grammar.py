"""Constrained decoding: under a grammar every method writes plain decoding's text under that grammar (greedy) or samples
exactly its masked distribution, forced text is drafted for free, refused proposals are cut; and logprobs."""

import json

import pytest
import torch
from conftest import DEVICE, chi_square_passes
from test_engine import K, OracleDrafter, SelfDrafter, drafter_dirs, make_engine, micro, prompts, proposer_for, reference  # noqa: F401

from dlite_cli.core.errors import DliteError
from dlite_cli.decoding.grammar import Grammars, reply_format
from dlite_cli.decoding.proposers.base import Draft, Proposer
from dlite_cli.decoding.proposers.ngram import NgramDrafter
from dlite_cli.decoding.proposers.none import NoDrafter
from dlite_cli.decoding.requests import Request, SamplingParams
from dlite_cli.decoding.sampling import probabilities

pytest.importorskip("xgrammar", reason="xgrammar is a dependency of dlite (make test installs it)")

SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
          "required": ["unit", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}
FORMATS = {  # a reply's format → what its text must parse to (None: anything JSON)
    "json_schema": reply_format([], None, {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}, True),
    "named tool": reply_format([WEATHER, OTHER], {"type": "function", "function": {"name": "get_weather"}}, None, True),
}


@pytest.fixture(scope="module")
def grammars(micro):
    model, tokenizer = micro
    return Grammars(tokenizer, model.config.vocab_size, {tokenizer.eos_token_id})


def engine_with(micro, proposer, grammars, forced=True, slots=2):
    model, tokenizer = micro
    engine = make_engine(micro, proposer, slots=slots, eos={tokenizer.eos_token_id})
    engine.grammars = Grammars(tokenizer, model.config.vocab_size, {tokenizer.eos_token_id}, forced)
    return engine


def constrained(prompts, grammars, reply, params=None):
    return [Request(p, params or SamplingParams(max_new_tokens=120), grammar=grammars.grammar(reply)) for p in prompts]


def masked_greedy(model, grammars, prompt, reply, count=120):
    """Plain greedy decoding under ``reply``'s grammar with the Hugging Face model, no cache: the ground truth."""
    grammar, ids = grammars.grammar(reply), list(prompt)
    with torch.no_grad():
        for _ in range(count):
            logits = model(input_ids=torch.tensor([ids], device=DEVICE)).logits[0, -1].cpu()
            token = int(logits.masked_fill(~grammar.allowed(), float("-inf")).argmax())
            ids.append(token)
            grammar.commit([token])
            if grammar.matcher.is_terminated():
                break
    return ids[len(prompt) :]


def parsed(text: str, format_name: str) -> dict:
    if format_name == "named tool":
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        call = json.loads(text[len("<tool_call>\n") : -len("\n</tool_call>")])
        assert call["name"] == "get_weather"
        return call["arguments"]
    return json.loads(text)


@pytest.mark.parametrize("name", ["none", "ngram", "suffix", "dlite", "oracle", "dlite+suffix"])
def test_greedy_output_under_a_grammar_is_plain_decodings_under_it_and_parses(name, micro, drafter_dirs, prompts, reference, grammars):
    model, tokenizer = micro
    for format_name, reply in FORMATS.items():
        expected = [masked_greedy(model, grammars, p, reply) for p in prompts]
        for forced in (True, False):
            engine = engine_with(micro, proposer_for(name, micro, drafter_dirs, prompts, reference), grammars, forced)
            requests = engine.run(constrained(prompts, engine.grammars, reply))
            assert [r.output_ids for r in requests] == expected, (format_name, forced)
            for r in requests:
                assert r.finish_reason == "stop" and set(parsed(r.text, format_name)) == {"unit", "ok"}


def test_forced_text_is_drafted_for_free_and_refused_proposals_are_cut(micro, prompts, grammars):
    _, tokenizer = micro
    reply = FORMATS["named tool"]
    stats = {}
    for forced in (True, False):
        engine = engine_with(micro, NgramDrafter(K), grammars, forced)
        requests = engine.run(constrained(prompts, engine.grammars, reply))
        stats[forced] = engine.stats
        assert all(r.finish_reason == "stop" for r in requests)
    assert stats[True].tau > 2 and stats[False].tau < stats[True].tau / 1.5  # the tool's name, keys and tags come free

    class Refused(Proposer):  # proposes the end of the turn, which the grammar allows only after the call
        name, draft_tokens = "refused", K

        def propose(self, rows, pick):
            return Draft(torch.full((len(rows), K), tokenizer.eos_token_id), [K] * len(rows), None)

    engine = engine_with(micro, Refused(), grammars, forced=False)
    requests = engine.run(constrained(prompts, engine.grammars, reply))
    assert all(r.finish_reason == "stop" for r in requests)
    # every proposal cut at its first token, but at each reply's end: there one, and it is right
    assert engine.stats.proposed == engine.stats.accepted == [len(prompts), 0, 0, 0]


def grammar_marginals(model, grammars, prompt, reply, params, positions):
    """p(x_j) for j = 1..positions under the target's sampling masked by the grammar, by enumerating the tree."""
    marginals, frontier = [], [(list(prompt), 1.0)]
    for _ in range(positions):
        total, grown = torch.zeros(model.config.vocab_size), []
        for ids, weight in frontier:
            grammar = grammars.grammar(reply)
            grammar.commit(ids[len(prompt) :])
            logits = model(input_ids=torch.tensor([ids], device=DEVICE)).logits[0, -1].cpu()
            p = probabilities(logits.masked_fill(~grammar.allowed(), float("-inf")), params)
            total += weight * p
            grown += [(ids + [t], weight * float(p[t])) for t in p.nonzero().flatten().tolist()]
        marginals.append(total)
        frontier = grown
    return marginals


def test_sampling_under_a_grammar_draws_its_masked_distribution(micro, prompts, grammars):
    model, _ = micro
    reply = reply_format([], None, {"type": "json_object"}, True)  # several tokenizations of every opening
    params = SamplingParams(max_new_tokens=3, temperature=0.7, top_k=5)
    with torch.no_grad():
        expected = grammar_marginals(model, grammars, prompts[0], reply, params, 3)
        engine = engine_with(micro, SelfDrafter(model), grammars, forced=True, slots=16)
        requests = engine.run([Request(prompts[0], SamplingParams(3, 0.7, top_k=5, seed=i), grammar=grammars.grammar(reply)) for i in range(600)])
    assert 0 < sum(engine.stats.accepted) < sum(engine.stats.proposed)
    varied = [j for j, e in enumerate(expected) if int((e > 0).sum()) > 1]  # a forced position has nothing to test
    assert varied and all(chi_square_passes([r.output_ids[j] for r in requests], expected[j]) for j in varied)


def test_json_numbers_have_at_most_16_digits_before_and_after_the_point_and_a_pattern_is_left_alone(grammars):
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "s": {"type": "string", "pattern": "[0-9]*x"}}, "required": ["n", "s"]}
    reply = reply_format([], None, {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}, True)

    def accepts(text: str) -> bool:
        matcher = grammars.grammar(reply).matcher
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts('{"n": ' + "9" * 16 + "." + "1" * 16 + ', "s": "' + "7" * 20 + 'x"}')
    assert not accepts('{"n": ' + "9" * 17 + ', "s": "x"}') and not accepts('{"n": 0.' + "1" * 17 + ', "s": "x"}')


def test_a_format_that_cannot_be_met_is_refused_in_one_sentence(grammars):
    with pytest.raises(DliteError, match="not among the tools"):
        reply_format([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, True)
    with pytest.raises(DliteError, match="no tools"):
        reply_format([], "required", None, True)
    assert reply_format([WEATHER], "auto", None, True) is None and reply_format([], None, {"type": "text"}, True) is None


def test_logprobs_are_the_targets_own_whatever_the_method(micro, prompts, reference):
    model, tokenizer = micro
    for proposer in (NoDrafter(), OracleDrafter(prompts, reference)):
        engine = make_engine(micro, proposer)
        requests = engine.run([Request(p, SamplingParams(max_new_tokens=24, logprobs=3)) for p in prompts])
        for prompt, request in zip(prompts, requests):
            assert [entry.token for entry in request.logprobs] == request.output_ids
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + request.output_ids], device=DEVICE)).logits[0, len(prompt) - 1 : -1]
            log_probs = torch.log_softmax(logits.float(), -1).cpu()
            for i, entry in enumerate(request.logprobs):
                assert entry.logprob == pytest.approx(float(log_probs[i, entry.token]), abs=1e-4)
                assert [t for t, _ in entry.top] == log_probs[i].topk(3).indices.tolist()
