"""Method names: the grammar every command reads, the registry, and a proposer added as a user would add one."""

import re

import pytest
import torch

from dlite_cli.core.config import load_config
from dlite_cli.core.errors import DliteError
from dlite_cli.decoding.engine import load_engine
from dlite_cli.decoding.engines import supported_vllm
from dlite_cli.decoding.methods import PROPOSERS, Method, known_drafter, known_method, parse_method
from dlite_cli.decoding.proposers.base import Draft, Proposer, ProposerSetup
from dlite_cli.decoding.requests import Request, SamplingParams
from dlite_cli.serve.generate import decoding_engine


def test_the_grammar_reads_engine_drafter_pairing_and_fixed(tmp_path):
    assert parse_method("vllm:dlite+suffix:fixed") == Method("vllm:dlite+suffix:fixed", "dlite", "suffix", False, True)
    assert parse_method("ar").drafter == parse_method("ar:fastest").drafter == "none" and parse_method("ar:fastest").adaptive
    method = parse_method(f"{tmp_path}+ngram")
    assert (method.drafter, method.pairing, method.adaptive, method.in_vllm) == (str(tmp_path), "ngram", True, False)
    assert (method.engine, method.plain, method.local, method.drafter_option) == ("dlite", "ar", f"{tmp_path}+ngram", f"{tmp_path}+ngram")
    method = parse_method("vllm:ar")
    assert (method.engine, method.plain, method.local, method.drafter_option, method.has_checkpoint) == ("vLLM", "vllm:ar", "ar", "none", False)
    assert parse_method("history").keeps_history and parse_method("dlite+suffix").uses_suffix_trees and parse_method("vllm:suffix").uses_suffix_trees
    for name in ("ar", "ar:fastest", "none:fixed", "ngram", "suffix", "dlite", "history:fixed", "vllm:parallel+ngram", "owner/name", str(tmp_path)):
        assert known_method(name).name == name


@pytest.mark.parametrize("name, message", [
    ("nosuch", "unknown drafter 'nosuch': expected"),
    ("dlite:nosuch", "unknown drafter 'dlite:nosuch': expected"),
    ("vllm:/no/such/dir+ngram", "unknown drafter '/no/such/dir' in 'vllm:/no/such/dir+ngram': expected"),
    ("ngram+suffix", "ngram+suffix: +suffix pairs a drafter checkpoint"),
])
def test_a_name_the_grammar_does_not_know_is_one_sentence(name, message):
    with pytest.raises(DliteError, match=re.escape(message)) as error:
        known_method(name)
    assert "\n" not in str(error.value)


def test_a_drafter_option_takes_no_engine():
    assert known_drafter("dlite+suffix:fixed").drafter == "dlite"
    with pytest.raises(DliteError, match="--drafter vllm:dlite: vllm: names an engine in the bench's methods; here pass --engine vllm --drafter dlite"):
        known_drafter("vllm:dlite")


def test_an_unknown_method_stops_the_bench_with_exit_2_before_anything_loads(run_cli):
    for methods in ("ar,nosuch", "dlite:nosuch"):
        done = run_cli("bench", "--target", "micro", "--methods", methods, "--limit", "1", check=False)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        expected = (f"error: unknown drafter {methods.split(',')[-1]!r}: expected [vllm:]DRAFTER[+ngram|+suffix][:fixed] with DRAFTER one "
                    "of none, ngram, suffix, dlite, history, parallel, scratch, a drafter directory or a hub id (or ar for plain decoding)")
        assert done.stderr.strip().splitlines() == [expected]  # nothing loaded first: no other line


class RepeatProposer(Proposer):
    """Proposes the anchor K times over: right wherever the target repeats a token.  In the package it would be
    ``decoding/proposers/repeat.py``, with one line in ``methods.PROPOSERS``."""

    name = "repeat"

    def __init__(self, draft_tokens: int):
        self.draft_tokens = draft_tokens

    @classmethod
    def build(cls, setup: ProposerSetup) -> "RepeatProposer":
        return cls(setup.draft_tokens)

    def propose(self, rows, pick) -> Draft:
        tokens = torch.tensor([[row.anchor] * self.draft_tokens for row in rows])
        return Draft(tokens, [self.draft_tokens] * len(rows), None)


def test_a_new_proposer_is_its_class_and_one_registry_line(cache_dir, monkeypatch):
    monkeypatch.setitem(PROPOSERS, "repeat", RepeatProposer)  # the registry line
    config = load_config("micro", ["decode.adaptive=false"])
    prompt = list(range(40, 60)) * 2
    outputs = {}
    for name in ("none", "repeat", "repeat:fixed"):
        engine, _ = load_engine(config, None, name, slots=1, capacity=512, log=lambda _: None)
        (request,) = engine.run([Request(prompt, SamplingParams(max_new_tokens=16))])
        outputs[name] = request.output_ids
        if name != "none":
            assert isinstance(engine.drafter, RepeatProposer) and engine.draft_tokens == config.drafter.draft_tokens
            assert engine.stats.proposed[0] == engine.stats.rounds > 0  # it proposed every round
    assert outputs["repeat"] == outputs["repeat:fixed"] == outputs["none"]  # the target's own text
    with pytest.raises(DliteError, match="unknown drafter 'repeat'"):
        monkeypatch.delitem(PROPOSERS, "repeat")
        known_method("repeat")


def test_a_new_proposer_vllm_has_no_method_for_is_refused_there_and_decoded_in_dlites_engine_under_auto(cache_dir, monkeypatch, tmp_path):
    monkeypatch.setitem(PROPOSERS, "repeat", RepeatProposer)  # the registry line, and nothing for vLLM
    config, lines = load_config("micro", []), []
    with pytest.raises(DliteError) as refused:
        decoding_engine(config, tmp_path, "repeat", "vllm", 8, lines.append)
    assert str(refused.value) == "vLLM has no speculative method for repeat: decode it in dlite's engine (--engine dlite)"
    if not supported_vllm():
        pytest.skip("auto chooses vLLM only where the vllm extra is installed (make test installs it)")
    engine, _, name = decoding_engine(config, tmp_path, "repeat", "auto", 8, lines.append)
    assert name == "dlite" and isinstance(engine.drafter, RepeatProposer)
    assert f"{refused.value}: in dlite's own engine instead" in lines
