"""The target's linear layers as the decoding engine runs them (runner.py).

On a CPU, every projection of a decoder layer that reads the same input is one matmul — q, k and v; the MLP's
gate and up — and each weight is packed once into oneDNN's blocked layout, the LM head's too.  PyTorch's own
float32 ``linear`` calls MKL, which on an AMD EPYC is several times slower at the few rows a decode pass has:
on the 2-core EPYC dlite is built on, SmolLM2-135M's head over 8 rows took 21.9 ms in MKL and 4.6 ms packed,
and a whole target pass at 512 tokens of context went from 59 to 40 ms for 1 token and from 86 to 44 ms for 8
(vLLM's CPU backend packs its weights the same way).  Elsewhere (a GPU, a dtype oneDNN cannot pack here, a
torch without oneDNN) the model's own modules run.

A target whose weights are a 4-bit model's, dequantised (the embedded default: SmolLM2's Q4_1 GGUF, whose every
group of 32 weights along a row lies on 16 evenly spaced levels), is read as 4 bits by the passes of a few rows
that decoding is made of, in bfloat16 on a CPU (:func:`four_bit`): a weight matrix read from memory at a quarter of
the bytes.  On the 2-core AVX-512 EPYC a bfloat16 step at 512 tokens of context went from 24 to 15 ms, a pass of 2
tokens from 27 to 18 and one of 4 from 27 to 20; at 8 rows the 4-bit kernel is the slower (220 against 164 µs for
a 3072 × 576 matrix) and the bfloat16 copy runs.  The 4-bit copy's scales and zeros are in bfloat16, so a weight it
computes with is the dequantised one up to bfloat16 rounding, as the bfloat16 copy's is.

The packed copies belong to the model (one set however many runners share it) and leave its weights as they
are: the target is frozen while it decodes.  They are as large as the weights they pack (a 4-bit copy: 5/16).
"""

from __future__ import annotations

import weakref

import torch

KERNELS = "fused, oneDNN-packed, 4-bit where the weights are"  # how the engine's passes compute: part of what a timed precision decision depends on
PACK_ROWS = 8  # the rows oneDNN is told to expect when it chooses a layout: a decode pass's (1 to K + 1 per row)
PACKABLE = (torch.float32, torch.bfloat16)
FOUR_BIT_GROUP = 32  # weights along a row that share a scale and a zero
FOUR_BIT_ROWS = 4  # the most rows a pass reads the 4-bit copy for (above, the bfloat16 one is the faster)
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its TargetLinears


class Projection:
    """One or more linear layers over the same input: ``x (…, in) → one tensor (…, out_i) per layer``."""

    def __init__(self, modules: list[torch.nn.Linear], pack: bool, four_bits: bool = False):
        """``four_bits``: also keep a 4-bit copy for narrow passes where the weights are 4-bit (:func:`four_bit`)."""
        self.sizes = [m.out_features for m in modules]
        self.modules = None if pack else modules
        self.four_bit = None
        if pack:
            weight = torch.cat([m.weight.detach() for m in modules])
            biases = [m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in modules]
            self.bias = torch.cat(biases) if any(m.bias is not None for m in modules) else None
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
            if four_bits and self.bias is None and weight.dtype == torch.bfloat16:
                self.four_bit = four_bit(weight)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.modules is not None:
            return tuple(m(x) for m in self.modules)
        out = self.fused(x)
        return out.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (out,)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """x (…, in) → every layer's output side by side (…, Σ out_i), in their order."""
        if self.modules is not None:
            return torch.cat([m(x) for m in self.modules], dim=-1)
        if self.four_bit is not None and x.numel() <= FOUR_BIT_ROWS * x.shape[-1]:
            out = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), *self.four_bit)
            return out.view(*x.shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @property
    def step_bytes(self) -> int:
        """Bytes of weights a one-token pass reads: the 4-bit copy's where there is one."""
        if self.four_bit is not None:
            return _nbytes(self.four_bit)
        return _nbytes([m.weight for m in self.modules] if self.modules is not None else [self.weight])

    @property
    def packed_bytes(self) -> int:
        return 0 if self.modules is not None else _nbytes([self.weight, *(self.four_bit or ())])


def _nbytes(items) -> int:
    """Bytes held by the tensors among ``items`` (anything else, such as a group size, holds none)."""
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


def four_bit(weight: torch.Tensor) -> tuple | None:
    """``weight`` (N, K) → the arguments after x of ``torch._weight_int4pack_mm_for_cpu`` (the 4-bit pack, the group
    size, the (K/32, N, 2) scales and zeros in ``weight``'s dtype) where every group of FOUR_BIT_GROUP along a row lies
    within a quarter step of 16 evenly spaced levels (a 4-bit model's weights, dequantised), else None.  Weights
    trained in a float type fail at once: theirs spread over the whole step."""
    N, K = weight.shape
    if K % FOUR_BIT_GROUP or not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return None
    groups = weight.float().view(N, K // FOUR_BIT_GROUP, FOUR_BIT_GROUP)
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    step = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every weight on level 0
    levels = (groups - low) / step
    codes = levels.round()
    if (levels - codes).abs().max() > 0.25:
        return None
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).view(N, K), 1)
    except RuntimeError:  # a shape this torch's 4-bit kernel does not take
        return None
    scales_zeros = torch.cat([step, low + 8 * step], dim=-1).transpose(0, 1).contiguous()  # the kernel's w = (code − 8)·scale + zero
    return packed, FOUR_BIT_GROUP, scales_zeros.to(weight.dtype)


class LayerLinears:
    """A decoder layer's projections: ``qkv`` (q, k, v), ``o``, ``gate_up`` (gate, up) and ``down``."""

    def __init__(self, layer, pack: bool):
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv = Projection([attention.q_proj, attention.k_proj, attention.v_proj], pack, four_bits=True)
        self.o = Projection([attention.o_proj], pack, four_bits=True)
        self.gate_up = Projection([mlp.gate_proj, mlp.up_proj], pack, four_bits=True)
        self.down = Projection([mlp.down_proj], pack, four_bits=True)
        self.act = mlp.act_fn

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(self.act(gate) * up)[0]


class TargetLinears:
    """Every decoder layer's :class:`LayerLinears` and the LM head, packed where :func:`packs` says so."""

    def __init__(self, model):
        parameter = next(model.parameters())
        self.packed = packs(parameter.device, parameter.dtype)
        self.layers = [LayerLinears(layer, self.packed) for layer in model.model.layers]
        self.head = Projection([model.lm_head], self.packed)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)[0]

    @property
    def projections(self) -> list[Projection]:
        return [self.head] + [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def packed_bytes(self) -> int:
        """Bytes the packed copies hold (0 where the model's own modules run)."""
        return sum(p.packed_bytes for p in self.projections)

    @property
    def step_bytes(self) -> int:
        """Bytes of weights a one-token pass reads through these linears: each one's 4-bit copy where it has one."""
        return sum(p.step_bytes for p in self.projections)


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a target on ``device`` in ``dtype`` runs oneDNN-packed linears: on a CPU whose oneDNN packs that dtype."""
    if device.type != "cpu" or dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACK_ROWS)
    except RuntimeError:  # e.g. bfloat16 where this oneDNN build refuses it
        return False
    return True


def target_linears(model) -> TargetLinears:
    """The model's :class:`TargetLinears`, built on first use and shared by every runner of the model."""
    if model not in _packed:
        _packed[model] = TargetLinears(model)
    return _packed[model]


def pack_modules(model) -> None:
    """Run each of the model's decoder-layer and LM-head linears through a oneDNN-packed copy of its weight, where
    :func:`packs` says so, so that the model's own forward (transformers' ``generate`` in regen, the feature pass)
    runs as fast as the engine's passes.  The weights themselves are kept, for everything that reads them."""
    parameter = next(model.parameters())
    if not packs(parameter.device, parameter.dtype):
        return
    for module in layer_linears(model) + [model.lm_head]:
        projection = Projection([module], pack=True)
        module.forward = lambda x, projection=projection: projection(x)[0]


def layer_linears(model) -> list[torch.nn.Linear]:
    """Every linear layer of the model's decoder layers (not its LM head)."""
    return [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


def linear_bytes(model) -> int:
    """Bytes of the weights a :class:`TargetLinears` packs (every decoder layer's projections and the LM head)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in layer_linears(model) + [model.lm_head])


def four_bit_bytes(target, device_type: str) -> int:
    """Bytes the 4-bit copies of the target's decoder-layer linears take where its weights are 4-bit, counted as if they
    were (a memory plan traces random weights): 4 bits a weight and a bfloat16 scale and zero per group of 32."""
    if next(target.parameters()).dtype != torch.bfloat16 or not packs(torch.device(device_type), torch.bfloat16):
        return 0
    weights = sum(m.weight.numel() for m in layer_linears(target))
    return weights // 2 + weights // FOUR_BIT_GROUP * 4


def packed_bytes(target, device_type: str) -> int:
    """Bytes of the oneDNN-packed copies of the target's linears that decoding (and the feature pass) hold on a CPU;
    0 where they are not packed."""
    dtype = next(target.parameters()).dtype
    return linear_bytes(target) if packs(torch.device(device_type), dtype) else 0
