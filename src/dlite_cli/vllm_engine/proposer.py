"""DLite as a vLLM proposer: dlite's own proposers (decoding/proposers/), fed the target's hidden states vLLM captures.

Each engine step, for every row that sampled tokens, the pivot is the position whose logits gave the row's last
sampled token (the anchor): the last accepted position of the step's verify pass.

    aux hidden states   vLLM's captured residual streams, (num_tokens, H) each, in ascending layer order: id j is the
                        residual after j decoder layers (0: the embeddings; L: the last layer's output, before the
                        final norm)
    dlite layer id k    the output of decoder layer k (= vLLM id k + 1), id L the final-normed output (= vLLM id L
                        through the target's final norm)

A row is handed to dlite's :class:`DLiteAdapter` (or, for ``DIR+ngram`` / ``DIR+suffix``, the :class:`HybridDrafter` of
it and prompt lookup / suffix decoding, the latter with the speculative config's ``suffix_decoding_*`` settings) as an
engine :class:`Request`: its prompt and output tokens, its pivot (S, H) and its sampling parameters.  The drafter keeps
no KV cache; suffix decoding's global tree holds the responses of the requests this worker finished before.  As in dlite's engine, a row gets up to K proposals: all K with ``DIR:fixed``;
otherwise only those expected to pay for their verify (adaptive.py), at the step times measured here — a first
step with K proposals, a second with none, then every step corrects the curve.  With vLLM's
``draft_sample_method: probabilistic`` a sampling row's proposals are drawn from the drafter's q, which goes to
vLLM's rejection sampler over the target's vocabulary; otherwise they are argmaxes, which that sampler treats as
certain: exact either way.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import torch

from ..core.config import SuffixConfig
from ..decoding.adaptive import VerifyCosts
from ..decoding.methods import model_proposer, paired, parse_method
from ..decoding.proposers.base import ProposerSetup
from ..decoding.requests import Request, SamplingParams
from ..decoding.sampling import SamplingPick, probabilities
from ..models.model import greedy_pick
from ..models.release import load_drafter

GREEDY_TEMPERATURE = 1e-5  # vLLM marks greedy rows with a temperature at or below this


def drafter_directory(model: str) -> Path:
    """The checkpoint directory of a speculative ``model`` named as dlite names drafters: DIR, DIR:fixed, DIR+ngram…"""
    return Path(parse_method(model).drafter)


def vllm_layer_ids(target_layer_ids: list[int], num_layers: int) -> list[int]:
    """The vLLM aux ids (ascending, unique) that dlite's feature ids read: id k < L → k + 1, id L → L (normed here)."""
    return sorted({min(k + 1, num_layers) for k in target_layer_ids})


class DLiteProposer:
    """Built by vLLM's model runner (through the plugin) with the engine's config: the speculative config's ``model``
    names the drafter (a DLite directory, with dlite's ``+ngram`` / ``+suffix`` / ``:fixed`` suffixes)."""

    def __init__(self, vllm_config):
        spec_config = vllm_config.speculative_config
        self.name = spec_config.model
        method = parse_method(self.name)
        self.adaptive, self.pairing = method.adaptive, method.pairing  # pairing: "", "ngram" or "suffix"
        self.suffix = SuffixConfig(**{f.name: getattr(spec_config, f"suffix_decoding_{f.name}") for f in dataclasses.fields(SuffixConfig)})
        self.drafter = load_drafter(drafter_directory(self.name), vllm_config.model_config.hf_config).eval()  # checked_spec passed when vLLM built its config
        spec = self.drafter.spec
        self.probabilistic = spec_config.draft_sample_method == "probabilistic"
        self.num_layers = spec.target_num_layers
        self.aux_layers = vllm_layer_ids(spec.target_layer_ids, self.num_layers)
        self.slot_of = [self.aux_layers.index(min(k + 1, self.num_layers)) for k in spec.target_layer_ids]
        self.adapter = self.final_norm = None
        self.rows: dict[str, Request] = {}  # req_id → the row as dlite's drafters saw it last step
        self.clock = StepClock(spec.draft_tokens) if self.adaptive else None

    def load_model(self, target_model) -> None:
        """Take the target's input embedding and final norm, move to its device and dtype, and build dlite's adapter."""
        parameter = next(target_model.parameters())
        self.drafter.to(device=parameter.device, dtype=parameter.dtype)
        self.final_norm = target_model.model.norm
        setup = ProposerSetup(self.drafter.spec.draft_tokens, self.suffix)
        model = model_proposer(self.drafter, target_model.model.embed_tokens, self.name, setup)
        self.adapter = paired(model, self.pairing, setup) if self.pairing else model

    @torch.no_grad()
    def propose(self, runner, sampled_token_ids: list[list[int]], aux_hidden_states: list[torch.Tensor], spec_decode_metadata,
                common_attn_metadata, sampling_metadata) -> tuple[list[list[int]], torch.Tensor | None]:
        """→ up to K draft ids per row of the batch (none for a row that sampled nothing this step), and (probabilistic
        drafting of sampling rows only) q (rows, K, V) over the target's vocabulary."""
        batch = runner.input_batch
        index = [i for i, sampled in enumerate(sampled_token_ids) if sampled]
        if self.clock is not None:
            self.clock.stepped([batch.req_ids[i] for i in index])
        rows = self._rows(batch, index, sampled_token_ids, aux_hidden_states, spec_decode_metadata, common_attn_metadata, sampling_metadata)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if not rows:
            return drafts, None
        if self.clock is not None and self.adapter.costs is None and self.clock.costs is not None:
            self.adapter.adapt(self.clock.costs)  # also times a draft round here
        if self.clock is not None and self.clock.time_a_plain_step(len(rows)):
            self.clock.proposed(0)
            return drafts, None
        sampling = self.probabilistic and not all(row.params.greedy for row in rows)
        draft = self.adapter.propose(rows, SamplingPick(rows) if sampling else greedy_pick)
        tokens = draft.tokens.tolist()
        for b, i in enumerate(index):
            state = runner.requests[batch.req_ids[i]]
            room = state.sampling_params.max_tokens - len(state.output_token_ids) - 1  # the step's own token comes after them
            drafts[i] = tokens[b][: max(0, min(draft.lengths[b], room))]
        if self.clock is not None:
            self.clock.proposed(max(draft.lengths))
        if not sampling or draft.logits is None:
            return drafts, None
        q = torch.zeros(len(sampled_token_ids), self.drafter.spec.draft_tokens, self.drafter.spec.vocab_size, device=draft.logits.device)
        for b, (i, row) in enumerate(zip(index, rows)):
            if not row.params.greedy:
                q[i] = probabilities(draft.logits[b], row.params)
        return drafts, q

    def _rows(self, batch, index, sampled_token_ids, aux_hidden_states, spec_decode_metadata, common_attn_metadata, sampling_metadata) -> list[Request]:
        """The rows that sampled tokens, as dlite's engine Requests (slot: vLLM's request id), after telling the adapter
        what the target accepted of each row's last proposals and which rows ended."""
        starts = common_attn_metadata.query_start_loc_cpu.tolist()
        drafts_in_pass = spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None else [0] * len(sampled_token_ids)
        # the pass ran [anchor of the last step, its drafts] per decoding row (a prompt chunk per prefilling one): the
        # (len(sampled) − 1)-th position after the anchor is the pivot
        pivots = [starts[i + 1] - 1 - drafts_in_pass[i] + len(sampled_token_ids[i]) - 1 for i in index]
        if not index:
            context = None
        else:
            captured = [h[torch.tensor(pivots, device=h.device)] for h in aux_hidden_states]
            slots = [captured[slot] for slot in self.slot_of]
            if self.num_layers in self.drafter.spec.target_layer_ids:  # the last slot is the final-normed output
                slots[-1] = self.final_norm(slots[-1])
            context = torch.stack(slots, dim=1)  # (B, S, H)
        present = set(batch.req_ids)
        for gone in [req_id for req_id in self.rows if req_id not in present]:
            self.adapter.end(self.rows.pop(gone))
        rows = []
        for b, i in enumerate(index):
            req_id, sampled = batch.req_ids[i], sampled_token_ids[i]
            row = self._request(batch, i, req_id, sampling_metadata)
            row.pivot = context[b]
            if req_id in self.rows:  # its last proposals were verified this step
                self.adapter.observe(row, len(sampled) - 1, sampled[-1] if row.params.greedy else None)
            else:
                self.adapter.begin(row, None)
            self.rows[req_id] = row
            rows.append(row)
        return rows

    def _request(self, batch, i: int, req_id: str, sampling_metadata) -> Request:
        """Row ``i`` of vLLM's input batch as an engine Request: its committed tokens (the anchor last), sampling parameters
        and (kept across steps) a generator for sampled proposals."""
        temperature = float(sampling_metadata.temperature[i]) if sampling_metadata.temperature is not None else 0.0
        greedy = sampling_metadata.all_greedy or temperature <= GREEDY_TEMPERATURE
        top_k = int(sampling_metadata.top_k[i]) if sampling_metadata.top_k is not None else 0
        top_p = float(sampling_metadata.top_p[i]) if sampling_metadata.top_p is not None else 1.0
        params = SamplingParams(temperature=0.0 if greedy else temperature, top_k=max(top_k, 0), top_p=top_p)
        end, prompt = int(batch.num_tokens_no_spec[i]), int(batch.num_prompt_tokens[i])
        known = self.rows.get(req_id)
        if known is not None:
            generator = known.generator
        else:  # seeded as the request is in vLLM, where it is
            seeded = sampling_metadata.generators.get(i)
            generator = torch.Generator().manual_seed(seeded.initial_seed() if seeded is not None else random.randrange(2**63))
        tokens = batch.token_ids_cpu[i, :end].tolist()
        return Request(tokens[:prompt], params, tokens[prompt:], slot=req_id, generator=generator)


class StepClock:
    """The target's step times in vLLM, for adaptive proposals: the time from the end of one draft to the start of the
    next is the verify pass of the rows and widths drafted (with vLLM's sampling and bookkeeping around it), timed
    only where the same rows went on.  Until a curve exists, rows get all K proposals, and once such a step of one row
    is timed the next proposes nothing; a line through the two widths is the first curve (VerifyCosts), which every
    later step corrects as dlite's engine does."""

    def __init__(self, draft_tokens: int):
        self.K = draft_tokens
        self.seen: dict[int, float] = {}  # width → ms, at batch 1, until the curve exists
        self.costs: VerifyCosts | None = None
        self.rows: list[str] = []  # this step's rows
        self.last: tuple[list[str], int, float] | None = None  # the last step's rows, widest pass, when their draft ended

    def time_a_plain_step(self, batch: int) -> bool:
        """Whether this step, over ``batch`` rows, should propose nothing, to time a plain step."""
        return self.costs is None and batch == 1 and 1 not in self.seen and any(width > 1 for width in self.seen)

    def stepped(self, rows: list[str]) -> None:
        """A step ended with these rows sampling."""
        now = time.perf_counter()
        if self.last is not None and self.last[0] == rows:
            _, width, since = self.last
            ms = 1000 * (now - since)
            if self.costs is not None:
                self.costs.at(len(rows)).observe(width, ms)
            elif len(rows) == 1:
                self.seen[width] = ms
                wide = max(self.seen)
                if 1 in self.seen and wide > 1:  # a line through a plain step and a drafted one
                    slope = (self.seen[wide] - self.seen[1]) / (wide - 1)
                    self.costs = VerifyCosts([self.seen[1] + slope * q for q in range(self.K + 1)])
        self.rows = rows

    def proposed(self, longest: int) -> None:
        """This step's drafts are out: the longest row's has ``longest`` tokens."""
        self.last = (self.rows, longest + 1, time.perf_counter())
