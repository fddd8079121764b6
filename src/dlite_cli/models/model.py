"""The DLite drafter: one class for DLite (W = 0), sliding-window drafters and the history-aware teacher.

One draft round (DESIGN.md §1), for a batch of B anchors, K draft tokens, S target layers, hidden H:

    context   (B, S, H)  target hidden states at the pivot (the position before the anchor), from S layers
      → + depth embedding, RMSNorm → S context slots ("sequence" composition)
        or one slot RMSNorm(W [h_1; …; h_S]) ("feature" composition, the ablation)
    history   (T, S·H)   per-position target features of earlier tokens (W ≠ 0 only)
      → RMSNorm(W_fuse ·) → per-layer keys/values at absolute positions (the draft KV cache,
        built once per position), masked to the last W positions before the pivot
    queries   (B, G+K, H) the anchor group's embeddings (the target's frozen table, passed in: G − 1 tokens
              before the anchor, then the anchor; G = 1 by default) + K placeholders (learned, or the
              target's embedding of a mask token)
      → N decoder layers of the target's family: queries attend bidirectionally to each other and to
        the context slots, which supply keys/values at every layer through that layer's projections.
        Positions are local: the group 0..G−1, placeholders G..G+K−1, the context slots at −1 (the
        pivot; 0 in the public release's convention); with history the block is shifted to the
        anchor's absolute position a (RoPE is relative, so only t − a matters).
      → final RMSNorm → h_1..h_K (B, K, H)
    head      low-rank gated RNN over the K positions (R = head_rank):
                s_i = g ⊙ s_{i−1} + (1 − g) ⊙ tanh(c),  [g, c] = W_g [s_{i−1}; E_R(x_{i−1})]
                u_i = W_u [s_i; h_i],  logits_i = W_V u_i            → (B, K, V')
              without the sequential head ("pure parallel" ablation) s stays 0.  V' is the draft
              vocabulary: the target's V, or (``draft_vocab_size`` N) the N most frequent tokens of
              the training responses (``draft_ids`` maps them to target ids; E_R keeps all V, since an
              anchor may be any token).  A token outside it is never proposed.

No parameter depends on the position in the conversation, so the cost of a W = 0 round is the same
at 500 or 50 000 tokens of context.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import DliteError

FULL_HISTORY = -1  # history_window value of the history-aware teacher: every earlier position
SUPPORTED_FAMILIES = ("llama", "qwen3")


def select_layers(num_layers: int, count: int, rule: str = "even") -> list[int]:
    """``count`` target feature ids (id k < L: the output of decoder layer k; id L: the final-normed output of the
    last layer, Hugging Face's last hidden state).  even: the first, the last and evenly spaced ones between;
    release: the public DLite release's — 0, the last (final-normed), and evenly spaced ones from 1 to L − 2."""
    if not 2 <= count <= num_layers:
        raise DliteError(f"drafter.num_target_layers must be between 2 and the target's {num_layers} layers, got {count}")
    if rule == "even":
        return sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)})
    middle = count - 2
    between = {1 + round((0.5 if middle == 1 else i / (middle - 1)) * (num_layers - 3)) for i in range(middle)}
    return sorted({0, num_layers} | between)


@dataclass
class DrafterSpec:
    """Everything needed to rebuild a drafter; saved as the checkpoint's ``config.json``."""

    model_type: str  # the target's family: llama | qwen3
    hidden_size: int
    vocab_size: int
    target_num_layers: int
    target_layer_ids: list[int]  # S ids; id k < L is the output of the target's decoder layer k, id L its final-normed output
    draft_tokens: int  # K
    num_layers: int  # N
    head_rank: int  # R
    sequential_head: bool
    composition: str  # sequence | feature
    history_window: int  # 0 = DLite, W > 0 = sliding window, FULL_HISTORY = teacher
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    draft_vocab_size: int = 0  # N: the head scores only N target tokens (0 = all V)
    # The query block: G real tokens (the anchor last, G − 1 before it) at local positions 0..G−1, then K
    # placeholders at G..G+K−1; the context slots at ``context_position``.  With G > 1 the sequential head's
    # state is first advanced on the token before the anchor.  Placeholders are learned vectors, or (mask_token_id
    # ≥ 0) the target's embedding of that token.  dlite's own: G 1, context −1, learned; the release's: context 0,
    # the mask token (release.py).
    anchor_group: int = 1
    context_position: int = -1
    mask_token_id: int = -1

    @classmethod
    def for_target(cls, target_config, drafter, history_window: int) -> "DrafterSpec":
        """Build from the target's Hugging Face config and the ``drafter`` config section."""
        if target_config.model_type not in SUPPORTED_FAMILIES:
            raise DliteError(
                f"target family {target_config.model_type!r} is not supported: expected one of {', '.join(SUPPORTED_FAMILIES)}"
            )
        rope = getattr(target_config, "rope_parameters", None) or {}
        heads = target_config.num_attention_heads
        return cls(
            model_type=target_config.model_type,
            hidden_size=target_config.hidden_size,
            vocab_size=target_config.vocab_size,
            target_num_layers=target_config.num_hidden_layers,
            target_layer_ids=select_layers(target_config.num_hidden_layers, drafter.num_target_layers, drafter.layers),
            draft_tokens=drafter.draft_tokens,
            num_layers=drafter.num_layers,
            head_rank=drafter.head_rank,
            sequential_head=drafter.sequential_head,
            composition=drafter.composition,
            history_window=history_window,
            num_heads=heads,
            num_kv_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=target_config.intermediate_size,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            draft_vocab_size=drafter.draft_vocab if drafter.draft_vocab < target_config.vocab_size else 0,
            anchor_group=drafter.anchor_group,
            context_position=drafter.context_position,
            mask_token_id=drafter.mask_token_id,
        )

    def check_fits(self, target_config, where: str) -> None:
        """Refuse, in one sentence, a drafter that was not built for this target."""
        expected = {
            "model_type": target_config.model_type,
            "hidden_size": target_config.hidden_size,
            "vocab_size": target_config.vocab_size,
            "target_num_layers": target_config.num_hidden_layers,
        }
        for key, value in expected.items():
            if getattr(self, key) != value:
                raise DliteError(f"drafter {where} does not fit the target: its {key} is {getattr(self, key)}, the target's is {value}")
        if not all(0 <= i <= target_config.num_hidden_layers for i in self.target_layer_ids):
            raise DliteError(f"drafter {where} reads target layers {self.target_layer_ids}, beyond the target's {target_config.num_hidden_layers}")
        if self.mask_token_id >= target_config.vocab_size:
            raise DliteError(f"drafter {where}'s mask token {self.mask_token_id} is beyond the target's vocabulary of {target_config.vocab_size}")


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of rotary embeddings for ``positions`` (..., L) → (..., L, head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, L, d); cos/sin (B, L, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None].to(x.dtype) + rotated * sin[:, None].to(x.dtype)


def grouped_attention(q, k, v, mask=None, scale=None, fold: bool | None = None):
    """SDPA with grouped-query heads: q (B, h, Q, d), k/v (B, kv, T, d), mask bool broadcastable to (B, 1, Q, T)
    or None → (B, h, Q, d).  With a mask, CUDA's fused kernels refuse ``enable_gqa`` (flash takes no mask, the
    memory-efficient kernel no grouped heads) and SDPA falls back to its math kernel, which repeats K/V to every
    head and materialises the (B, h, Q, T) scores.  There (``fold``, default: on CUDA, and on a CPU below float32)
    each group's queries become extra rows of its K/V head instead — (B, kv, groups·Q, d), the mask's rows
    repeated — so heads match and a fused kernel runs, without copying K/V.  A CPU's float32 flash kernel takes
    the mask and ``enable_gqa`` as they are (8 queries over 512 keys: 0.14 ms, against 0.66 ms for the math
    kernel); in bfloat16 it is slow at few queries a head, and folded it is not (SmolLM2's 9 heads over 3, one
    query over 4 096 keys on a 2-core EPYC: 2.7 ms grouped, 0.44 ms folded)."""
    B, h, Q, d = q.shape
    groups = h // k.shape[1]
    if fold is None:
        fold = q.device.type == "cuda" or q.dtype != torch.float32
    if groups == 1 or not fold:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    # (B or 1, 1, groups·Q, T): query g·Q + i is row i
    rows = None if mask is None else mask.expand(-1, -1, Q, -1).repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], groups * Q, d), k, v, attn_mask=rows, scale=scale)
    return out.reshape(B, h, Q, d)  # CUDA's fused kernels may return it strided, not contiguous


class Attention(nn.Module):
    """Queries from the block; keys/values from [history; context slots; block] (grouped-query, as the target)."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        d, h, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
        self.heads, self.kv_heads, self.head_dim, self.scaling = h, kv, d, d**-0.5
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=False)
        self.qk_norm = spec.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(d, eps=spec.rms_norm_eps)
            self.k_norm = nn.RMSNorm(d, eps=spec.rms_norm_eps)

    def keys_values(self, x, rope_x):
        """x (B, L, H), rope_x cos/sin (B, L, d) → keys, values (B, kv_heads, L, d), keys rotated."""
        B, L, _ = x.shape
        k = self.k_proj(x).view(B, L, self.kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        v = self.v_proj(x).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k.transpose(1, 2), *rope_x), v

    def forward(self, x, slots, rope_q, rope_slots, history_kv=None, mask=None):
        """x (B, Q, H) queries; slots (B, C, H) context slots; history_kv optional (keys, values)
        (B, kv_heads, T, d) already rotated; mask broadcastable to (B, 1, Q, T+C+Q) bool, or None → (B, Q, H)."""
        B, Q, _ = x.shape
        q = self.q_proj(x).view(B, Q, self.heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), *rope_q)
        k_slots, v_slots = self.keys_values(slots, rope_slots)
        k_x, v_x = self.keys_values(x, rope_q)
        keys, values = [k_slots, k_x], [v_slots, v_x]
        if history_kv is not None:
            keys.insert(0, history_kv[0])
            values.insert(0, history_kv[1])
        out = grouped_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class MLP(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer of the target's family (Llama; Qwen3 adds the q/k norms)."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, slots, rope_q, rope_slots, history_kv=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), slots, rope_q, rope_slots, history_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) → the first index of each row's largest (``max``: on a CPU 3x as fast as ``argmax`` in bfloat16)."""
    return logits.max(-1).indices


def shared_history_mask(visible: torch.Tensor, slots: int, queries: int) -> torch.Tensor:
    """Which keys each query may read when B anchors' queries form one row over one shared history:
    visible (B, T), anchor b's history positions → (1, 1, B·Q, T + B·C + B·Q) bool over [history; every anchor's
    C slots; every anchor's Q queries], each anchor seeing its own slots and queries only.  The history is
    read in place, never copied per anchor (at Qwen3-4B shapes a copy per anchor was ≈ 8.6 GB of keys a layer)."""
    B = visible.shape[0]
    own = torch.eye(B, dtype=torch.bool, device=visible.device).repeat_interleave(queries, dim=0)  # (B·Q, B)
    rows = [visible.repeat_interleave(queries, dim=0), own.repeat_interleave(slots, dim=1), own.repeat_interleave(queries, dim=1)]
    return torch.cat(rows, dim=1)[None, None]


@dataclass
class History:
    """What a history-aware drafter (W ≠ 0) reads besides the pivot: its draft KV cache.

    kv         per drafter layer, (keys, values) each (B, kv_heads, T, d), or (1, kv_heads, T, d): one
               sequence's, shared by all B anchors (training); keys rotated at the absolute positions
               0..T−1 of the positions they encode
    mask       (B, T) bool: True where row b's anchor may attend to position t
    anchors    (B,) long: each row's absolute anchor position
    """

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    anchors: torch.Tensor


class Head(nn.Module):
    """Low-rank output head: the gated RNN over draft positions, or (recurrent=False) the parallel ablation.
    Tokens in and out are target ids; logits are over the draft vocabulary ``draft_ids`` (V',)."""

    def __init__(self, hidden_size: int, rank: int, vocab_size: int, draft_vocab_size: int, recurrent: bool):
        super().__init__()
        self.rank, self.recurrent = rank, recurrent
        # draft index → target id; saved with the weights only when it is not the identity
        self.register_buffer("draft_ids", torch.arange(draft_vocab_size or vocab_size), persistent=draft_vocab_size > 0)
        if recurrent:
            self.token_embedding = nn.Embedding(vocab_size, rank)  # E_R
            self.gate = nn.Linear(2 * rank, 2 * rank)  # [s; E_R(x)] → [g, c]
        self.latent = nn.Linear(rank + hidden_size, rank)  # [s; h] → u
        self.vocab = nn.Linear(rank, len(self.draft_ids), bias=False)  # W_V, the one vocabulary projection

    def _advance(self, state, previous):
        """The recurrent state after reading ``previous`` tokens (B,): state (B, R) → (B, R)."""
        g, c = self.gate(torch.cat([state, self.token_embedding(previous)], dim=-1)).chunk(2, dim=-1)
        g = torch.sigmoid(g)
        return g * state + (1 - g) * torch.tanh(c)

    def step(self, state, h, previous):
        """One position: state (B, R), h (B, H), previous tokens (B,) → (new state, logits (B, V))."""
        if self.recurrent:
            state = self._advance(state, previous)
        return state, self.vocab(self.latent(torch.cat([state, h], dim=-1)))

    def initial_state(self, h, seed):
        """The state before the first position: zeros, or advanced once on ``seed`` (B,) (the token before the anchor)."""
        state = h.new_zeros(h.shape[0], self.rank)
        return self._advance(state, seed) if seed is not None and self.recurrent else state

    def forward(self, h, previous, seed=None):
        """Teacher-forced: h (B, K, H), previous (B, K) = [anchor, y_1..y_{K−1}] → logits (B, K, V)."""
        state = self.initial_state(h, seed)
        if not self.recurrent:
            return self.vocab(self.latent(torch.cat([state[:, None].expand(-1, h.shape[1], -1), h], dim=-1)))
        logits = []
        for i in range(h.shape[1]):
            state, step_logits = self.step(state, h[:, i], previous[:, i])
            logits.append(step_logits)
        return torch.stack(logits, dim=1)

    @torch.no_grad()
    def free_running(self, h, anchor, pick=greedy_pick, seed=None):
        """Draft left to right: h (B, K, H), anchor (B,); ``pick(logits (B, V')) → draft indices (B,)``
        chooses each token (argmax, or a sample) and feeds it to the next step → target token ids (B, K),
        logits (B, K, V') and the probability the head gave each chosen token (B, K)."""
        state, previous = self.initial_state(h, seed), anchor
        tokens, logits, confidence = [], [], []
        for i in range(h.shape[1]):
            state, step_logits = self.step(state, h[:, i], previous)
            chosen = pick(step_logits)
            previous = self.draft_ids[chosen]
            tokens.append(previous)
            logits.append(step_logits)
            confidence.append(torch.softmax(step_logits.float(), dim=-1).gather(1, chosen[:, None])[:, 0])
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), torch.stack(confidence, dim=1)


class Drafter(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        H, S, K = spec.hidden_size, len(spec.target_layer_ids), spec.draft_tokens
        self.depth_embedding = nn.Embedding(S, H)
        if spec.composition == "feature":
            self.context_fuse = nn.Linear(S * H, H, bias=False)
        self.context_norm = nn.RMSNorm(H, eps=spec.rms_norm_eps)
        if spec.history_window != 0:
            self.history_fuse = nn.Linear(S * H, H, bias=False)
            self.history_norm = nn.RMSNorm(H, eps=spec.rms_norm_eps)
        if spec.mask_token_id < 0:
            self.placeholders = nn.Parameter(torch.randn(K, H) * 0.02)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = nn.RMSNorm(H, eps=spec.rms_norm_eps)
        self.head = Head(H, spec.head_rank, spec.vocab_size, spec.draft_vocab_size, recurrent=spec.sequential_head)
        self.apply(self._init)

    @property
    def draft_ids(self) -> torch.Tensor:
        """(V',) the target id of each draft-vocabulary entry."""
        return self.head.draft_ids

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Score only these N target tokens (N = draft_vocab_size)."""
        if len(token_ids) != len(self.draft_ids):
            raise DliteError(f"the draft vocabulary has {len(token_ids)} tokens, the drafter expects {len(self.draft_ids)}")
        self.draft_ids.copy_(token_ids)

    def to_draft(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) → draft indices, −1 for tokens outside the draft vocabulary."""
        table = torch.full((self.spec.vocab_size,), -1, dtype=torch.long, device=self.draft_ids.device)
        table[self.draft_ids] = torch.arange(len(self.draft_ids), device=self.draft_ids.device)
        return table[token_ids.long()]

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (..., V') over the draft vocabulary → (..., V) over the target's, −inf outside it."""
        if self.spec.draft_vocab_size == 0:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.spec.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, logits)

    @torch.no_grad()
    def init_head_from(self, lm_head: torch.Tensor) -> None:
        """Start the head as a rank-R factorisation of the target's LM head (V, H) on the draft vocabulary:
        logits ≈ lm_head[draft_ids] · h."""
        u, singular, vh = torch.linalg.svd(lm_head[self.draft_ids.to(lm_head.device)].float(), full_matrices=False)
        R = self.spec.head_rank
        self.head.vocab.weight.copy_(u[:, :R] * singular[:R])
        self.head.latent.weight.zero_()
        self.head.latent.weight[:, R:].copy_(vh[:R])
        self.head.latent.bias.zero_()

    def context_slots(self, context: torch.Tensor) -> torch.Tensor:
        """context (B, S, H) target states at the pivot → (B, S, H) slots, or (B, 1, H) feature-wise."""
        if self.spec.composition == "feature":
            z = context + self.depth_embedding.weight
            return self.context_norm(self.context_fuse(z.flatten(1)))[:, None]
        return self.context_norm(context + self.depth_embedding.weight)

    def history_kv(self, features: torch.Tensor, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The draft KV cache entries of ``features`` (B, T, S·H), the target's features at the absolute
        positions start..start+T−1 → per layer (keys, values) (B, kv_heads, T, d).  Built once per position."""
        B, T, _ = features.shape
        slots = self.history_norm(self.history_fuse(features))
        positions = torch.arange(start, start + T, device=features.device).expand(B, -1)
        rope_slots = rope(positions, self.spec.head_dim, self.spec.rope_theta)
        return [layer.self_attn.keys_values(slots, rope_slots) for layer in self.layers]

    def history(self, features: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor) -> History:
        """A History from raw features (1, T, S·H) of one sequence shared by B anchors (training)."""
        return History(self.history_kv(features), mask, anchors)

    def hidden(self, context, tokens, embed, history: History | None = None):
        """The backbone's K outputs: context (B, S, H) target states at each anchor's pivot; tokens (B, G) the
        anchor group (the anchor last); ``embed`` the target's input embedding; history for W ≠ 0 → h (B, K, H)."""
        spec = self.spec
        B, G, K = tokens.shape[0], spec.anchor_group, spec.draft_tokens
        device, dtype = context.device, self.norm.weight.dtype
        slots = self.context_slots(context)
        # local positions start at the group's first token (the history's absolute positions when W ≠ 0)
        origin = history.anchors[:, None] - (G - 1) if history is not None else torch.zeros(B, 1, dtype=torch.long, device=device)
        query_positions = origin + torch.arange(G + K, device=device)
        slot_positions = (origin + spec.context_position).expand(-1, slots.shape[1])
        with torch.no_grad():  # the target's table is frozen, whatever its requires_grad says
            embedded = embed(tokens).to(dtype)
            if spec.mask_token_id >= 0:
                placeholders = embed(torch.full((B, K), spec.mask_token_id, device=tokens.device)).to(dtype)
        if spec.mask_token_id < 0:
            placeholders = self.placeholders.expand(B, -1, -1)
        x = torch.cat([embedded, placeholders], dim=1)
        rope_q = rope(query_positions, spec.head_dim, spec.rope_theta)
        rope_slots = rope(slot_positions, spec.head_dim, spec.rope_theta)
        mask, shared = None, history is not None and history.kv[0][0].shape[0] < B
        if shared:  # one sequence's history read by every anchor: the anchors become one row
            mask = shared_history_mask(history.mask, slots.shape[1], G + K)
            x, slots = x.reshape(1, B * (G + K), -1), slots.reshape(1, -1, slots.shape[-1])
            rope_q, rope_slots = [tuple(t.reshape(1, -1, t.shape[-1]) for t in r) for r in (rope_q, rope_slots)]
        elif history is not None:
            visible_rest = torch.ones(B, slots.shape[1] + G + K, dtype=torch.bool, device=device)
            mask = torch.cat([history.mask, visible_rest], dim=1)[:, None, None, :]
        for index, layer in enumerate(self.layers):
            x = layer(x, slots, rope_q, rope_slots, history.kv[index] if history is not None else None, mask)
        return self.norm(x.view(B, G + K, -1)[:, G:])

    def _seed(self, tokens):
        """The token before the anchor (B,), which primes the sequential head's state when G > 1; else None."""
        return tokens[:, -2] if self.spec.anchor_group > 1 else None

    def forward(self, context, tokens, embed, previous, **history):
        """Teacher-forced logits (B, K, V); tokens (B, G) the anchor group; previous (B, K) = [anchor, y_1..y_{K−1}].
        W ≠ 0 (training): ``history`` holds Drafter.history's arguments, turned into the draft KV cache inside forward."""
        h = self.hidden(context, tokens, embed, self.history(**history) if history else None)
        return self.head(h, previous, self._seed(tokens))

    @torch.no_grad()
    def draft(self, context, tokens, embed, history: History | None = None, pick=greedy_pick):
        """A draft block after the anchor group ``tokens`` (B, G): → tokens (B, K), logits (B, K, V'), confidence (B, K);
        ``pick`` chooses each token (default argmax) from logits over the draft vocabulary."""
        h = self.hidden(context, tokens, embed, history)
        return self.head.free_running(h, tokens[:, -1], pick, self._seed(tokens))

    # ------------------------------------------------------------ checkpoints

    def save(self, directory: Path, origin: str = "") -> None:
        """Write ``config.json`` + ``model.safetensors`` (the target's embeddings are not included); ``origin``
        names what made it (the training stage), for the bench's tables."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        config = {"architectures": ["DLiteDrafter"], **asdict(self.spec), **({"origin": origin} if origin else {})}
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, directory / "model.safetensors")
