"""The target's linear layers as the decoding engine runs them (runner.py).

On a CPU, every projection of a decoder layer that reads the same input is one matmul — q, k and v; the MLP's
gate and up — and each weight is packed once into oneDNN's blocked layout, the LM head's too.  PyTorch's own
float32 ``linear`` calls MKL, which on an AMD EPYC is several times slower at the few rows a decode pass has:
on the 2-core EPYC dlite is built on, SmolLM2-135M's head over 8 rows took 21.9 ms in MKL and 4.6 ms packed,
and a whole target pass at 512 tokens of context went from 59 to 40 ms for 1 token and from 86 to 44 ms for 8
(vLLM's CPU backend packs its weights the same way).  Elsewhere (a GPU, a dtype oneDNN cannot pack here, a
torch without oneDNN) the model's own modules run.

The packed copies belong to the model (one set however many runners share it) and leave its weights as they
are: the target is frozen while it decodes.  They are as large as the weights they pack.
"""

from __future__ import annotations

import weakref

import torch

KERNELS = "fused, oneDNN-packed"  # how the engine's passes compute: part of what a timed precision decision depends on
PACK_ROWS = 8  # the rows oneDNN is told to expect when it chooses a layout: a decode pass's (1 to K + 1 per row)
PACKABLE = (torch.float32, torch.bfloat16)
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its TargetLinears


class Projection:
    """One or more linear layers over the same input: ``x (…, in) → one tensor (…, out_i) per layer``."""

    def __init__(self, modules: list[torch.nn.Linear], pack: bool):
        self.sizes = [m.out_features for m in modules]
        self.modules = None if pack else modules
        if pack:
            weight = torch.cat([m.weight.detach() for m in modules])
            biases = [m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in modules]
            self.bias = torch.cat(biases) if any(m.bias is not None for m in modules) else None
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.modules is not None:
            return tuple(m(x) for m in self.modules)
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (out,)

    @property
    def packed_bytes(self) -> int:
        return 0 if self.modules is not None else self.weight.numel() * self.weight.element_size()


class LayerLinears:
    """A decoder layer's projections: ``qkv`` (q, k, v), ``o``, ``gate_up`` (gate, up) and ``down``."""

    def __init__(self, layer, pack: bool):
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv = Projection([attention.q_proj, attention.k_proj, attention.v_proj], pack)
        self.o = Projection([attention.o_proj], pack)
        self.gate_up = Projection([mlp.gate_proj, mlp.up_proj], pack)
        self.down = Projection([mlp.down_proj], pack)
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
    def packed_bytes(self) -> int:
        """Bytes the packed copies hold (0 where the model's own modules run)."""
        projections = [self.head] + [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(p.packed_bytes for p in projections)


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
    for module in [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)] + [model.lm_head]:
        projection = Projection([module], pack=True)
        module.forward = lambda x, projection=projection: projection(x)[0]


def linear_bytes(model) -> int:
    """Bytes of the weights a :class:`TargetLinears` packs (every decoder layer's projections and the LM head)."""
    modules = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)] + [model.lm_head]
    return sum(m.weight.numel() * m.weight.element_size() for m in modules)


def packed_bytes(target, device_type: str) -> int:
    """Bytes of the oneDNN-packed copies of the target's linears that decoding (and the feature pass) hold on a CPU;
    0 where they are not packed."""
    dtype = next(target.parameters()).dtype
    return linear_bytes(target) if packs(torch.device(device_type), dtype) else 0
