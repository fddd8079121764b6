"""Constrained decoding: what a reply must look like (a JSON schema, a tool call) as a grammar over the target's
vocabulary (xgrammar), and one request's grammar as the engine proposes, verifies and commits its tokens.

Every method decodes under a grammar the same way.  Each round the row's proposal is walked through the grammar: where
the grammar leaves one continuation only (a key, punctuation, a tool's name, the end), that text's tokens are proposed
without the drafter (``forced`` drafting); elsewhere the drafter's own next proposal is taken while it is still the
drafter's chain and the grammar allows it, and the proposal ends at the first token the grammar refuses.  The verify pass
then masks the target's logits at every position of the proposal by what the grammar allows there, so that greedy
decoding writes plain decoding's text under the grammar, and sampling draws exactly from the masked distribution.

A reply's format (:func:`reply_format`) follows OpenAI's fields: ``response_format`` (``json_object``, ``json_schema``)
and ``tool_choice`` (``required``, or a named function), a tool call written in the Hermes form the prompt asks for
(models/chat.py).  A tool call's arguments hold no properties beyond those their schema names, and are compact JSON, as
the prompt writes earlier calls, so that more of them is forced; a JSON reply is laid out as the model likes, with whitespace runs bounded, so that a small model cannot wander
off into whitespace; numbers have at most 16 digits before and after the point.
"""

from __future__ import annotations

import json
import re
from functools import cached_property

import torch

from ..core.errors import DliteError
from ..models.chat import CALL_ARGUMENTS, CALL_HEAD, CALL_TAIL

JSON_WHITESPACE = 16  # enough to indent JSON a few levels deep, too little to wander off into whitespace
NUMBER_DIGITS = 16  # the most digits a JSON number has before its point, after it, or in its exponent
NUMBER_RULES = re.compile(r"^(basic_integer|basic_number_\d+) ::= ")  # xgrammar's rules for a JSON number's digits


class Grammars:
    """Compiles reply formats into grammars for one target (its tokenizer, ``vocab_size`` logits and ``eos_ids``), and
    starts a request's :class:`Grammar` on one.  xgrammar is imported on first use, so an engine never asked for a
    format needs none; ``forced``: propose the tokens a grammar forces without the drafter."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int], forced: bool = True):
        self.tokenizer, self.vocab_size, self.eos_ids, self.forced = tokenizer, vocab_size, sorted(eos_ids), forced

    @cached_property
    def compiler(self):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids)
        return xgrammar.GrammarCompiler(info)

    @cached_property
    def encoder(self):
        """The tokenizer's own copy for the engine's thread (a fast tokenizer is not to be shared between threads)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())

    def grammar(self, reply: dict) -> Grammar:
        """A new request's grammar for ``reply`` (a structural tag as :func:`reply_format` builds it); refused in one
        sentence where the format does not compile (a schema xgrammar cannot read)."""
        from xgrammar import GrammarMatcher
        from xgrammar.structural_tag import StructuralTag

        try:
            compiled = self.compiler.compile_structural_tag(StructuralTag.model_validate(reply))
        except (RuntimeError, ValueError) as e:
            raise DliteError(f"the reply's format cannot be compiled into a grammar: {e}") from None
        return Grammar(GrammarMatcher(compiled), self)

    def valid_json(self, text: str, schema: dict) -> bool:
        """Whether ``text`` is JSON valid under ``schema`` (laid out in any way)."""
        from xgrammar import GrammarMatcher

        matcher = GrammarMatcher(self.compiler.compile_json_schema(schema, strict_mode=False))
        return matcher.accept_string(text) and matcher.is_completed()


class Grammar:
    """One request's grammar: the state after the tokens it has committed, walked ahead through a round's proposal and
    back.  Masks are (V,) bool, True where a token is allowed."""

    def __init__(self, matcher, grammars: Grammars):
        import xgrammar

        self.matcher, self.grammars = matcher, grammars
        self.bitmask = xgrammar.allocate_token_bitmask(1, grammars.vocab_size)
        self.bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """(V,) the tokens allowed next; all of them once the grammar has ended (a pass's position after the end is
        never written, yet its distribution must exist)."""
        if self.matcher.is_terminated():
            return torch.ones(self.grammars.vocab_size, dtype=torch.bool)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return ((self.bitmask[0, :, None] >> self.bits) & 1).flatten()[: self.grammars.vocab_size].bool()

    def propose(self, drafted: list[int], limit: int) -> tuple[list[int], torch.Tensor]:
        """The round's proposal from the drafter's ``drafted`` tokens: up to ``limit`` tokens, each allowed by the
        grammar (forced text first where there is some, the module docstring) → (tokens (L,), masks (L + 1, V): what the
        grammar allows at each position of the pass).  The state is left where it was."""
        proposal, masks, pending = [], [self.allowed()], []
        while len(proposal) < limit and not self.matcher.is_terminated():
            if not pending:
                chain = proposal == drafted[: len(proposal)]
                pending = (self._forced(masks[-1]) if self.grammars.forced else []) or (drafted[len(proposal) : len(proposal) + 1] if chain else [])
            if not pending or not masks[-1][pending[0]]:
                break
            proposal.append(pending.pop(0))
            self.matcher.accept_token(proposal[-1])
            masks.append(self.allowed())
        self.matcher.rollback(len(proposal))
        return proposal, torch.stack(masks)

    def _forced(self, allowed: torch.Tensor) -> list[int]:
        """The tokens of the text the grammar forces next: the one token it allows, else its forced string's tokens."""
        if int(allowed.sum()) == 1:
            return [int(allowed.nonzero())]
        text = self.matcher.find_jump_forward_string()
        return self.grammars.encoder.encode(text, add_special_tokens=False).ids if text else []

    def commit(self, tokens: list[int]) -> None:
        """Advance past tokens the target wrote (each allowed, as the pass was masked), up to the grammar's end."""
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(token):
                raise DliteError(f"the grammar refused token {token}, which the engine wrote under it")


def reply_format(tools: list[dict], tool_choice, response_format: dict | None, parallel_tool_calls: bool) -> dict | None:
    """The structural tag (xgrammar's, as a dict) a chat reply must match, or None where it is free text.  ``tools``:
    OpenAI's tools offered; ``tool_choice``: ``"required"``, ``{"type": "function", "function": {"name": …}}`` or
    anything else (free to call or not); ``response_format``: OpenAI's.  A required or named tool choice is one or more
    tool calls and nothing else (exactly one where a function is named or calls are not parallel); otherwise a JSON
    response format is that JSON, or, where tools are offered, tool calls instead."""
    if tool_choice == "required" or isinstance(tool_choice, dict):
        if isinstance(tool_choice, dict):
            tools = [t for t in tools if t["function"]["name"] == tool_choice["function"].get("name")]
            if not tools:
                raise DliteError(f"tool_choice names {tool_choice['function'].get('name')!r}, which is not among the tools")
        if not tools:
            raise DliteError("tool_choice requires a tool call, but no tools are given")
        return _structural(_tool_calls(tools, single=isinstance(tool_choice, dict) or not parallel_tool_calls))
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        answer = _json({"type": "object"}, strict=False, compact=False)
    else:
        spec = response_format.get("json_schema") or {}
        answer = _json(spec.get("schema", {}), strict=bool(spec.get("strict")), compact=False)
    return _structural({"type": "or", "elements": [_tool_calls(tools, single=not parallel_tool_calls), answer]} if tools else answer)


def _structural(format: dict) -> dict:
    return {"type": "structural_tag", "format": format}


def _tool_calls(tools: list[dict], single: bool) -> dict:
    """One or more Hermes tool calls of ``tools`` (one only if ``single``), a line apart, their arguments valid under
    their tool's parameters with no properties beyond those named there (OpenAI's strict function calling, vLLM's
    ``--tool-strict-level parameter``): a small model's call otherwise runs on into properties of its own."""
    tags = [{"type": "tag", "begin": CALL_HEAD + json.dumps(tool["function"]["name"], ensure_ascii=False) + CALL_ARGUMENTS,
             "content": _json(tool["function"].get("parameters") or {"type": "object"}, strict=True, compact=True), "end": CALL_TAIL}
            for tool in tools]
    return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True, "stop_after_first": single}


def _json(schema: dict, strict: bool, compact: bool) -> dict:
    """JSON valid under ``schema`` (``strict``: no properties beyond those it names, as OpenAI's strict mode): ``compact``
    as a tool call's arguments are written (``", "`` and ``": "`` between items), else laid out as the model likes, with
    at most JSON_WHITESPACE whitespace characters in a row."""
    from xgrammar import Grammar as Ebnf

    try:
        layout = {"any_whitespace": False} if compact else {"any_whitespace": True, "max_whitespace_cnt": JSON_WHITESPACE}
        grammar = Ebnf.from_json_schema(schema, strict_mode=strict, **layout)
    except (RuntimeError, ValueError) as e:
        raise DliteError(f"the JSON schema cannot be compiled into a grammar: {e}") from None
    return {"type": "grammar", "grammar": bounded_numbers(str(grammar))}


def bounded_numbers(ebnf: str) -> str:
    """xgrammar's JSON grammar with at most NUMBER_DIGITS digits before a number's point, after it and in its exponent,
    as llama.cpp's JSON grammars bound them: a float64 holds no more, and a small model's number cannot run on."""
    lines = ebnf.splitlines()
    for i, line in enumerate(lines):
        if NUMBER_RULES.match(line):  # "[1-9] [0-9]*" before the point, "digits{1, -1}" after it and in the exponent
            lines[i] = line.replace("[0-9]*", f"[0-9]{{0,{NUMBER_DIGITS - 1}}}").replace("{1, -1}", f"{{1,{NUMBER_DIGITS}}}")
    return "\n".join(lines)

