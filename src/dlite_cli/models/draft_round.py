"""A history-free (W = 0) drafter's round as the decoding engine runs it: what :meth:`Drafter.draft` computes, in
fewer and cheaper ops.

A draft round at batch 1 is some 60 small matmuls and a few hundred elementwise ops, so on a CPU its time is
mostly each op's fixed cost, not arithmetic (the smollm2-135m drafter's round: 10.5 ms eagerly in ``Drafter.draft``
on a 2-core AVX-512 EPYC in bfloat16, for 16 MB of weights).  Here the backbone's layers run as the target's passes
do (layer_ops.py: dlite's CPU kernels where they are built), the context slots and the queries through one fused
q/k/v matmul and one call of attention that sees both ways, their rotary tables computed once (their local positions
are fixed); on a CPU every linear is oneDNN-packed (linears.py); the head's latent ``W_u [s_i; h_i]`` takes its h part
for all K positions in one matmul, and a greedy round runs the head's K steps in one kernel call.  The training
stages use :class:`Drafter` itself; a test holds this to the same tokens and probabilities in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_kernels import GROUP
from .layer_ops import AttentionParams, KernelOps, Norm, PassPositions, layer_ops
from .linears import Projection, packs
from .model import Drafter, greedy_pick, rope


class DraftRound:
    """``draft_round(context (B, S, H), tokens (B, G), embed, pick)`` → tokens (B, K), logits (B, K, V') (None for a
    greedy round on dlite's CPU kernels, which keeps none), confidence (B, K), as :meth:`Drafter.draft` for a W = 0
    ``drafter`` (frozen while this lives: its linears are packed once)."""

    def __init__(self, drafter: Drafter):
        if drafter.spec.history_window != 0:
            raise ValueError("DraftRound runs history-free drafters (W = 0) only")
        self.drafter, spec = drafter, drafter.spec
        weight = drafter.norm.weight
        pack = packs(weight.device, weight.dtype)
        self.ops = layer_ops(spec.num_heads, spec.num_kv_heads, spec.head_dim, weight)
        self.layers = [(Projection([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], pack),
                        Projection([layer.self_attn.o_proj], pack), Projection([layer.mlp.gate_proj, layer.mlp.up_proj], pack),
                        Projection([layer.mlp.down_proj], pack)) for layer in drafter.layers]
        next_norms = [layer.input_layernorm for layer in drafter.layers][1:] + [drafter.norm]
        self.first_norm, self.context_norm = Norm.of(drafter.layers[0].input_layernorm), Norm.of(drafter.context_norm)
        self.layer_params = [(AttentionParams.of(layer.self_attn), Norm.of(layer.post_attention_layernorm), Norm.of(after))
                             for layer, after in zip(drafter.layers, next_norms)]
        self.slots = 1 if spec.composition == "feature" else len(spec.target_layer_ids)
        positions = torch.cat([torch.full((self.slots,), spec.context_position), torch.arange(spec.anchor_group + spec.draft_tokens)])
        cos, sin = rope(positions.to(weight.device)[None], spec.head_dim, spec.rope_theta)  # (1, slots + G + K, d)
        self.cos, self.sin = cos.to(weight.dtype), sin.to(weight.dtype)
        head = drafter.head
        latent_s, latent_h = head.latent.weight.split([head.rank, spec.hidden_size], dim=1)
        self.latent_h = Projection([_linear(latent_h, head.latent.bias)], pack)  # for all K positions at once
        self.latent_s_weight = latent_s.contiguous()
        self.latent_s = Projection([_linear(self.latent_s_weight)], pack)
        self.gate = Projection([head.gate], pack) if head.recurrent else None
        self.vocab = Projection([head.vocab], pack)
        self.greedy_kernel = isinstance(self.ops, KernelOps) and head.rank % GROUP == 0  # the head's K steps in one call

    @torch.no_grad()
    def __call__(self, context: torch.Tensor, tokens: torch.Tensor, embed, pick=greedy_pick):
        drafter, spec, ops = self.drafter, self.drafter.spec, self.ops
        B, G, K, C = tokens.shape[0], spec.anchor_group, spec.draft_tokens, self.slots
        slots = self._context_slots(context)
        embedded = embed(tokens).to(slots.dtype)
        if spec.mask_token_id >= 0:
            placeholders = embed(torch.full((B, K), spec.mask_token_id, device=tokens.device)).to(slots.dtype)
        else:
            placeholders = drafter.placeholders.expand(B, -1, -1)
        h = torch.cat([embedded, placeholders], dim=1)  # (B, G + K, H)
        x = ops.norm(h, self.first_norm)
        # the block attends both ways over [slots; block], whose keys/values go to a cache of the round's own
        at = PassPositions(slice(0, B), torch.arange(B, device=tokens.device), torch.arange(C + G + K, device=tokens.device).expand(B, -1),
                           C + G + K, None, 0, self.cos.expand(B, -1, -1), self.sin.expand(B, -1, -1), causal=False)
        cache = (B, spec.num_kv_heads, C + G + K, spec.head_dim)
        for (qkv, o, gate_up, down), (attention, post_attention, after) in zip(self.layers, self.layer_params):
            keys, values = slots.new_empty(cache), slots.new_empty(cache)
            attended = ops.attention(attention, qkv.fused(torch.cat([slots, x], dim=1)), keys, values, at)[:, C:]
            h, x = ops.add_norm(h, o.fused(attended), post_attention)
            h, x = ops.add_norm(h, down.fused(ops.gate(gate_up.fused(x), F.silu)), after)
        return self._head(x[:, G:], tokens, pick)

    def _context_slots(self, context: torch.Tensor) -> torch.Tensor:
        """:meth:`Drafter.context_slots`, its norm on the layer ops."""
        drafter = self.drafter
        if drafter.spec.composition == "feature":
            return drafter.context_slots(context)
        return self.ops.norm(context.to(drafter.norm.weight.dtype) + drafter.depth_embedding.weight, self.context_norm)

    def _head(self, h: torch.Tensor, tokens: torch.Tensor, pick):
        """h (B, K, H) → the head's left-to-right proposals (see :meth:`Head.free_running`)."""
        head = self.drafter.head
        from_h = self.latent_h(h)[0]  # (B, K, R): W_u's h part, and its bias
        seed = tokens[:, -2] if self.drafter.spec.anchor_group > 1 else None
        state, previous = head.initial_state(h, seed), tokens[:, -1]
        if pick is greedy_pick and self.greedy_kernel:
            none = self.ops.none
            recurrent = (head.token_embedding.weight, head.gate.weight, head.gate.bias) if head.recurrent else (none, none, none)
            chosen, confidence = self.ops.kernels.greedy_head(from_h, state, previous, *recurrent, self.latent_s_weight, head.vocab.weight,
                                                              head.draft_ids)
            return chosen, None, confidence
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


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    """A Linear holding ``weight`` (out, in) and ``bias``."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    linear.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
    return linear
