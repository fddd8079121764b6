"""The operations a decoder layer is made of, as the decoding engine runs them: the target's passes (runner.py) and a
DLite drafter's round (draft_round.py).  dlite's CPU kernels where they are built (:class:`KernelOps`, cpu_kernels.py),
eager ATen ops elsewhere (:class:`EagerOps`).

    norm(x, norm)                   RMSNorm (a :class:`Norm`, read once from a Hugging Face or torch module)
    add_norm(h, delta, norm)        (h + delta, RMSNorm(h + delta)): a residual connection and the next norm
    gate(gate_up, act)              act(gate) · up, from the fused gate/up projection's output
    attention(params, qkv, keys, values, at)
                                    a layer's attention (:class:`AttentionParams`) from its fused q/k/v projection's
                                    output (B, Q, ·): q/k norms (Qwen3), the rotary embedding, the new keys/values written into the cache rows
                                    ``at`` names (:class:`PassPositions`), attention over each row's held tokens and
                                    its own (or, not causal, over all of them) → (B, Q, heads·d)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from .cpu_kernels import MAX_HEAD_DIM, kernels
from .model import grouped_attention

KERNEL_TOKENS = 16  # the most tokens a row of a pass has for the attention kernel to run it (a prefill's chunks run SDPA's)


@dataclass(frozen=True)
class Norm:
    """An RMSNorm's weight and epsilon."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module) -> Norm:
        """Read from a norm module: Hugging Face's (``variance_epsilon``) or torch's (``eps``, None: its dtype's)."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        return cls(module.weight, eps if eps is not None else torch.finfo(module.weight.dtype).eps)


@dataclass(frozen=True)
class AttentionParams:
    """What a layer's attention takes besides its projections: Qwen3's per-head q/k norms (None for Llama) and the
    scale of its scores."""

    q_norm: Norm | None
    k_norm: Norm | None
    scaling: float

    @classmethod
    def of(cls, module) -> AttentionParams:
        """Read from an attention module (a Hugging Face target's, or a drafter's)."""
        if hasattr(module, "q_norm"):
            return cls(Norm.of(module.q_norm), Norm.of(module.k_norm), module.scaling)
        return cls(None, None, module.scaling)


@dataclass
class PassPositions:
    """Where a pass's B rows of Q tokens go in the KV cache, and what each token attends to."""

    rows: slice | torch.Tensor  # the cache rows (slots), a slice where they are contiguous
    slots: torch.Tensor  # (B,) the same as indices
    positions: torch.Tensor  # (B, Q) each token's position in its row
    span: int  # the cache entries the eager ops attend over
    mask: torch.Tensor | None  # (B, 1, Q, span): key j visible to query (b, i); None: one row, causal
    start: int | None  # the position every row's tokens start at, where the host knows it is one
    cos: torch.Tensor  # (B, Q, d) the rotary embedding of each token, as the model's ``rotary_emb`` gives it
    sin: torch.Tensor
    causal: bool = True  # False: every token of a row sees all of the row's (a drafter's block; the eager ops' mask says the same)

    @cached_property
    def rotation(self) -> Rotation:
        return Rotation(self.cos, self.sin)


class EagerOps:
    """A layer's operations as eager ATen ops, on any device."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + delta
        return h, self.norm(h, norm)

    def gate(self, gate_up: torch.Tensor, act) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    def attention(self, params: AttentionParams, qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, at: PassPositions) -> torch.Tensor:
        B, Q, _ = qkv.shape
        heads, kv_heads = self.heads, self.kv_heads
        qkv = qkv.view(B, Q, -1, self.head_dim)  # (B, Q, heads + 2 kv_heads, d)
        qk, v = qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads :]
        if params.q_norm is not None:  # qwen3
            qk = torch.cat([self.norm(qk[:, :, :heads], params.q_norm), self.norm(qk[:, :, heads:], params.k_norm)], dim=2)
        qk = at.rotation(qk)
        q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:]
        if at.start is not None:  # (B, kv_heads, Q, d) into each row's run of positions
            where = (at.rows, slice(None), slice(at.start, at.start + Q))
            keys[where], values[where] = k.transpose(1, 2), v.transpose(1, 2)
        else:  # (B, Q, kv_heads, d) at each row's positions
            where = (at.slots[:, None], slice(None), at.positions)
            keys[where], values[where] = k, v
        out = grouped_attention(q, keys[at.rows, :, : at.span], values[at.rows, :, : at.span], at.mask, params.scaling)
        return out.transpose(1, 2).reshape(B, Q, -1)


class KernelOps(EagerOps):
    """A layer's operations as dlite's CPU kernels: one call each (cpu_kernels.cpp); the attention of a pass whose rows
    hold more than KERNEL_TOKENS tokens runs SDPA's flash kernel, which is the faster there."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, module):
        super().__init__(heads, kv_heads, head_dim)
        self.kernels = module
        self.none = torch.empty(0)

    def norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        return self.kernels.rms_norm(x, norm.weight, norm.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_rms_norm(h, delta, norm.weight, norm.eps)

    def gate(self, gate_up: torch.Tensor, act) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)

    def attention(self, params: AttentionParams, qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, at: PassPositions) -> torch.Tensor:
        if qkv.shape[1] > KERNEL_TOKENS:
            return super().attention(params, qkv, keys, values, at)
        q_norm, k_norm = params.q_norm, params.k_norm
        return self.kernels.attention(qkv, at.cos, at.sin, keys, values, at.slots, at.positions[:, 0], self.heads,
                                      self.none if q_norm is None else q_norm.weight, self.none if k_norm is None else k_norm.weight,
                                      0.0 if q_norm is None else q_norm.eps, params.scaling, at.causal)


def layer_ops(heads: int, kv_heads: int, head_dim: int, weight: torch.Tensor, silu: bool = True) -> EagerOps:
    """The ops a model's layers run with (``weight``: one of its weights, for its device and dtype): dlite's CPU kernels
    on a CPU in float32 or bfloat16, with SiLU MLPs and head dims of a multiple of 16 up to MAX_HEAD_DIM (where the
    kernels build here); eager ATen ops otherwise."""
    fits = (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0
            and head_dim <= MAX_HEAD_DIM and silu)
    module = kernels() if fits else None
    return KernelOps(heads, kv_heads, head_dim, module) if module is not None else EagerOps(heads, kv_heads, head_dim)


def target_ops(model) -> EagerOps:
    """:func:`layer_ops` for a Hugging Face target."""
    config = model.config
    return layer_ops(config.num_attention_heads, config.num_key_value_heads, model.model.layers[0].self_attn.head_dim,
                     next(model.parameters()), getattr(config, "hidden_act", "silu") == "silu")


class Rotation:
    """The target's rotary embedding at a pass's positions, applied to (B, Q, heads, d) in three ops:
    x·cos + rotate_half(x)·sin, with rotate_half(x)·sin = swap_halves(x)·[−sin₁, sin₂]."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        """cos, sin (B, Q, d) in the activations' dtype, as the model's ``rotary_emb`` gives them."""
        half = cos.shape[-1] // 2
        self.cos = cos[:, :, None]
        self.sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return torch.addcmul(x * self.cos, swapped, self.sin)
