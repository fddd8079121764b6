"""A history-free (W = 0) drafter's round as the decoding engine runs it: what :meth:`Drafter.draft` computes, in
fewer and cheaper ops.

A draft round at batch 1 is some 60 small matmuls and a few hundred elementwise ops, so on a CPU its time is
mostly each op's fixed cost, not arithmetic (the smollm2-135m drafter's round: 5.0 ms eagerly in ``Drafter.draft``
on a 2-core AVX-512 EPYC, for 16 MB of weights).  Here, per backbone layer, the context slots and the queries go
through one fused q/k/v matmul, and their rotary tables are computed once (their local positions are fixed); on a
CPU every linear is oneDNN-packed (linears.py); the head's latent ``W_u [s_i; h_i]`` takes its h part for all K
positions in one matmul before the loop; and the proposals' probabilities are computed once, after it (3.0 ms).
The training stages use :class:`Drafter` itself; a test holds this to the same tokens and logits in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linears import Projection, packs
from .model import Drafter, apply_rope, greedy_pick, grouped_attention, rope


class DraftRound:
    """``draft_round(context (B, S, H), tokens (B, G), embed, pick)`` → tokens (B, K), logits (B, K, V'),
    confidence (B, K), as :meth:`Drafter.draft` for a W = 0 ``drafter`` (frozen while this lives: its linears are
    packed once)."""

    def __init__(self, drafter: Drafter):
        if drafter.spec.history_window != 0:
            raise ValueError("DraftRound runs history-free drafters (W = 0) only")
        self.drafter, spec = drafter, drafter.spec
        weight = drafter.norm.weight
        pack = packs(weight.device, weight.dtype)
        self.layers = [(layer, Projection([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], pack),
                        Projection([layer.self_attn.o_proj], pack), Projection([layer.mlp.gate_proj, layer.mlp.up_proj], pack),
                        Projection([layer.mlp.down_proj], pack)) for layer in drafter.layers]
        slots = 1 if spec.composition == "feature" else len(spec.target_layer_ids)
        positions = torch.cat([torch.full((slots,), spec.context_position), torch.arange(spec.anchor_group + spec.draft_tokens)])
        cos, sin = rope(positions.to(weight.device)[None], spec.head_dim, spec.rope_theta)  # (1, slots + G + K, d)
        self.cos, self.sin = cos.to(weight.dtype), sin.to(weight.dtype)
        head = drafter.head
        latent_s, latent_h = head.latent.weight.split([head.rank, spec.hidden_size], dim=1)
        self.latent_h = (latent_h.contiguous(), head.latent.bias)  # for all K positions at once
        self.latent_s = Projection([_linear(latent_s)], pack)
        self.gate = Projection([head.gate], pack) if head.recurrent else None
        self.vocab = Projection([head.vocab], pack)

    @torch.no_grad()
    def __call__(self, context: torch.Tensor, tokens: torch.Tensor, embed, pick=greedy_pick):
        drafter, spec = self.drafter, self.drafter.spec
        B, G, K = tokens.shape[0], spec.anchor_group, spec.draft_tokens
        slots = drafter.context_slots(context)
        embedded = embed(tokens).to(slots.dtype)
        if spec.mask_token_id >= 0:
            placeholders = embed(torch.full((B, K), spec.mask_token_id, device=tokens.device)).to(slots.dtype)
        else:
            placeholders = drafter.placeholders.expand(B, -1, -1)
        x = torch.cat([embedded, placeholders], dim=1)  # (B, G + K, H)
        for layer, qkv, o, gate_up, down in self.layers:
            x = x + o(self._attention(layer.self_attn, qkv, slots, layer.input_layernorm(x)))[0]
            gate, up = gate_up(layer.post_attention_layernorm(x))
            x = x + down(F.silu(gate) * up)[0]
        return self._head(drafter.norm(x[:, G:]), tokens, pick)

    def _attention(self, attention, qkv: Projection, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Queries from ``x`` (B, Q, H), keys/values from [slots; x], bidirectional → (B, Q, H) before o_proj."""
        B, C, Q, d = slots.shape[0], slots.shape[1], x.shape[1], attention.head_dim
        q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv(torch.cat([slots, x], dim=1)))  # (B, C + Q, heads, d)
        q = q[:, C:]
        if attention.qk_norm:
            q, k = attention.q_norm(q), attention.k_norm(k)
        q = apply_rope(q.transpose(1, 2), self.cos[:, C:], self.sin[:, C:])
        k = apply_rope(k.transpose(1, 2), self.cos, self.sin)
        out = grouped_attention(q, k, v.transpose(1, 2))  # (B, heads, Q, d)
        return out.transpose(1, 2).reshape(B, Q, -1)

    def _head(self, h: torch.Tensor, tokens: torch.Tensor, pick):
        """h (B, K, H) → the head's left-to-right proposals (see :meth:`Head.free_running`)."""
        head = self.drafter.head
        from_h = F.linear(h, *self.latent_h)  # (B, K, R): W_u's h part, and its bias
        seed = tokens[:, -2] if self.drafter.spec.anchor_group > 1 else None
        state, previous = head.initial_state(h, seed), tokens[:, -1]
        chosen, logits = [], []
        for i in range(h.shape[1]):
            if self.gate is not None:
                g, c = self.gate(torch.cat([state, head.token_embedding(previous)], dim=-1))[0].chunk(2, dim=-1)
                state = torch.lerp(torch.tanh(c), state, torch.sigmoid(g))  # g ⊙ s + (1 − g) ⊙ tanh(c)
            step_logits = self.vocab(self.latent_s(state)[0] + from_h[:, i])[0]
            chosen.append(pick(step_logits))
            previous = head.draft_ids[chosen[-1]]
            logits.append(step_logits)
        chosen, logits = torch.stack(chosen, dim=1), torch.stack(logits, dim=1)
        confidence = torch.softmax(logits.float(), dim=-1).gather(-1, chosen[..., None])[..., 0]
        return head.draft_ids[chosen], logits, confidence


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free Linear holding ``weight`` (out, in)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    return linear
