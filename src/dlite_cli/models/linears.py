"""The target's linear layers as the decoding engine runs them (runner.py).

On a CPU, every projection of a decoder layer that reads the same input is one matmul — q, k and v; the MLP's
gate and up — and each weight is packed once into oneDNN's blocked layout, the LM head's too.  PyTorch's own
float32 ``linear`` calls MKL, which on an AMD EPYC is several times slower at the few rows a decode pass has:
on the 2-core EPYC dlite is built on, SmolLM2-135M's head over 8 rows took 21.9 ms in MKL and 4.6 ms packed,
and a whole target pass at 512 tokens of context went from 59 to 40 ms for 1 token and from 86 to 44 ms for 8
(vLLM's CPU backend packs its weights the same way).  Elsewhere (a GPU, a dtype oneDNN cannot pack here, a
torch without oneDNN) the model's own modules run.

A weight that a GGUF file held 4- or 8-bit (the embedded default: SmolLM2's decoder layers are Q4_1, its
embeddings, which the LM head shares, Q8_0) is found on its levels and read in that form by the passes of a few
rows that decoding is made of, through dlite's CPU kernels (cpu_kernels.py), in float32 or bfloat16: 5 and 9 bits
a weight instead of 16 or 32.  The kernels compute with the weights exactly as the float32 model holds them (as a
bfloat16 model does, rounded to bfloat16).  Wider passes (a prefill's chunks) run the packed copy, compute-bound.

The packed and quantised copies belong to the model (one set however many runners share it) and leave its weights
as they are: the target is frozen while it decodes.  They take what the weights they pack take (a q4 copy 5/32 of
float32, a q8 copy 9/32).
"""

from __future__ import annotations

import weakref

import torch

from .cpu_kernels import GROUP, VERSION, QuantizedWeight, kernels, quantized

# how the engine's passes compute (the CPU kernels' version too): part of what a timed precision decision depends on
KERNELS = f"fused, oneDNN-packed, dlite's CPU kernels {VERSION} (4- and 8-bit where the weights are)"
PACK_ROWS = 8  # the rows oneDNN is told to expect when it chooses a layout: a decode pass's (1 to K + 1 per row)
PACKABLE = (torch.float32, torch.bfloat16)
QUANTIZED_ROWS = 16  # the most rows a pass reads a quantised copy for (above, the packed one is the faster)
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its TargetLinears


class Projection:
    """One or more linear layers over the same input: ``x (…, in) → one tensor (…, out_i) per layer``."""

    def __init__(self, modules: list[torch.nn.Linear], pack: bool, quantize: bool = False):
        """``quantize``: also keep a 4- or 8-bit copy for narrow passes where the weights are on such levels
        (cpu_kernels.quantized) and dlite's CPU kernels run here."""
        self.sizes = [m.out_features for m in modules]
        weight = torch.cat([m.weight.detach() for m in modules])
        has_bias = any(m.bias is not None for m in modules)
        self.quantized: QuantizedWeight | None = None
        if quantize and not has_bias:
            self.quantized = quantized(weight) if kernels() else None
        self.modules = None if pack else modules
        if pack:
            biases = [m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in modules]
            self.bias = torch.cat(biases) if has_bias else None
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.modules is not None and self.quantized is None:
            return tuple(m(x) for m in self.modules)
        out = self.fused(x)
        return out.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (out,)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """x (…, in) → every layer's output side by side (…, Σ out_i), in their order."""
        if self.quantized is not None and x.numel() <= QUANTIZED_ROWS * x.shape[-1]:
            return self.quantized(x)
        if self.modules is not None:
            return torch.cat([m(x) for m in self.modules], dim=-1)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @property
    def step_bytes(self) -> int:
        """Bytes of weights a one-token pass reads: the quantised copy's where there is one."""
        if self.quantized is not None:
            return self.quantized.nbytes
        return _nbytes([m.weight for m in self.modules] if self.modules is not None else [self.weight])

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed and quantised copies."""
        return (0 if self.modules is not None else _nbytes([self.weight])) + (self.quantized.nbytes if self.quantized else 0)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class LayerLinears:
    """A decoder layer's projections: ``qkv`` (q, k, v), ``o``, ``gate_up`` (gate, up) and ``down``, and its MLP's ``act``."""

    def __init__(self, layer, pack: bool, quantize: bool):
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv = Projection([attention.q_proj, attention.k_proj, attention.v_proj], pack, quantize)
        self.o = Projection([attention.o_proj], pack, quantize)
        self.gate_up = Projection([mlp.gate_proj, mlp.up_proj], pack, quantize)
        self.down = Projection([mlp.down_proj], pack, quantize)
        self.act = mlp.act_fn


class TargetLinears:
    """Every decoder layer's :class:`LayerLinears` and the LM head, packed where :func:`packs` says so, quantised on a
    CPU where their weights are on 4- or 8-bit levels."""

    def __init__(self, model):
        parameter = next(model.parameters())
        self.packed = packs(parameter.device, parameter.dtype)
        quantize = parameter.device.type == "cpu"
        self.layers = [LayerLinears(layer, self.packed, quantize) for layer in model.model.layers]
        self.head = Projection([model.lm_head], self.packed, quantize)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)[0]

    @property
    def projections(self) -> list[Projection]:
        return [self.head] + [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def packed_bytes(self) -> int:
        """Bytes the packed and quantised copies hold (0 where neither is)."""
        return sum(p.packed_bytes for p in self.projections)

    @property
    def step_bytes(self) -> int:
        """Bytes of weights a one-token pass reads through these linears: each one's quantised copy where it has one."""
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


def quantized_bytes(target, device_type: str) -> int:
    """Bytes the 4-bit copies of the target's decoder-layer linears and the 8-bit one of its LM head take where its
    weights are on such levels, counted as if they were (a memory plan traces random weights): a GGUF Q4_1 model's
    5 bits a weight (4 and a float16 scale and minimum per group of GROUP), Q8_0's 9."""
    if device_type != "cpu" or next(target.parameters()).dtype not in PACKABLE:
        return 0
    layers, head = sum(m.weight.numel() for m in layer_linears(target)), target.lm_head.weight.numel()
    return layers // 2 + layers // GROUP * 4 + head + head // GROUP * 2


def packed_bytes(target, device_type: str) -> int:
    """Bytes of the oneDNN-packed copies of the target's linears that decoding (and the feature pass) hold on a CPU;
    0 where they are not packed."""
    dtype = next(target.parameters()).dtype
    return linear_bytes(target) if packs(torch.device(device_type), dtype) else 0
