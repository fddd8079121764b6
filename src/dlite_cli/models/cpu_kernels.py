"""dlite's CPU kernels (cpu_kernels.cpp): the operations of a decoder layer for the narrow passes of decoding.

A decode step of SmolLM2-135M on a 2-core CPU was about 600 eager ATen ops, and their fixed costs (dispatch,
TensorIterator, an OpenMP fork for the smallest op) were most of it: 21 ms a step against a 3 ms floor on the
2-core AVX-512 EPYC, where the kernels' share was a third.  Each operation here is one call: a 4-bit or 8-bit
matmul over weights as a GGUF file holds them (read as 5 and 9 bits a weight), an RMSNorm with the residual
add before it, the MLP's gate, and a pass's whole attention (rotary embedding, KV-cache writes, attention over
each row's own length, split by chunks of keys as flash decoding splits it: a verify's tokens read each key once);
and where every projection is 4- or 8-bit, a narrow pass's decoder layers all in one call (``DecoderLayers``, the
same kernels in the same order, without the Python between them).  Each computes in float32, and a row alike
whatever else the pass holds, so a position's result does not depend on how many tokens or rows were verified with it.

They are compiled once per machine, with its compiler and for its instruction set (``-march=native``, capped where
PyTorch's own kernels are: ``ATEN_CPU_CAPABILITY=avx2`` compiles them without AVX-512), into the dlite cache, the
first time an engine needs them (about 30 s).  Where that fails (no compiler, another
architecture) the engine runs eager ATen ops, as on a GPU, and says once why.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.files import cache_dir

SOURCE = Path(__file__).with_suffix(".cpp")
VERSION = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]  # the source's digest: in their build's key and a timed decision's
GROUP = 32  # weights along a row that share a scale (and a minimum): GGUF's Q4_1 and Q8_0
MAX_HEAD_DIM = 128  # attention takes head dims of a multiple of 16 up to this (as cpu_kernels.cpp says)
LEVEL_TOLERANCE = 0.25  # a weight lies on a level if within this share of a step of it (and its dtype's rounding)
# PyTorch's capability on x86 (ATEN_CPU_CAPABILITY caps it) → what the kernels leave out of the machine's instructions
ISA_CAPS = {"AVX2": ["-mno-avx512f"], "DEFAULT": ["-mno-avx", "-mno-fma"]}
_built: dict = {}  # "module" → the extension, or "error" → why it could not be built


def kernels(log=lambda message: print(message, file=sys.stderr)):
    """The compiled extension, built on first use; None where it cannot be built here (the reason logged once)."""
    if "module" not in _built and "error" not in _built:
        try:
            _built["module"] = _build(log)
        except Exception as e:  # noqa: BLE001 (any build failure: the engine runs eager ATen ops instead)
            lines = str(e).strip().splitlines() or [type(e).__name__]
            _built["error"] = next((line for line in lines if "error" in line), lines[-1])
            log(f"dlite's CPU kernels could not be built here ({_built['error']}); decoding runs eager ATen ops")
    return _built.get("module")


def _build(log):
    """Compile cpu_kernels.cpp for this machine into <cache>/cpu-kernels/<key>, or load what an earlier build left there."""
    from torch.utils import cpp_extension

    caps = ISA_CAPS.get(torch.backends.cpu.get_cpu_capability(), []) if platform.machine() == "x86_64" else []
    flags = ["-O3", "-march=native", *caps, "-ffp-contract=fast", "-fopenmp"]
    key = hashlib.sha256(VERSION.encode() + torch.__version__.encode() + _cpu_flags().encode() + " ".join(flags).encode()).hexdigest()[:16]
    directory = cache_dir() / "cpu-kernels" / key
    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.glob("*.so")):
        log("building dlite's CPU kernels for this machine (once, about 30 s)")
    return cpp_extension.load(f"dlite_cpu_kernels_{key}", [str(SOURCE)], build_directory=str(directory), extra_cflags=flags,
                              extra_ldflags=["-fopenmp"])


def _cpu_flags() -> str:
    """What ``-march=native`` compiles for: the processor's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("flags", "model name"))]
    return "\n".join(sorted(set(lines)))


@dataclass
class QuantizedWeight:
    """A weight (N, K) as groups of GROUP codes with a float16 scale each: ``q4`` (affine: w = code·scale + min,
    code 0..15, two codes a byte) or ``q8`` (symmetric: w = code·scale, code −127..127); cpu_kernels.cpp has the layout."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor  # (N, K/GROUP, 2) [scale, min] for q4, (N, K/GROUP) for q8; float16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (…, K) float32 or bfloat16 → x @ wᵀ (…, N) in x's dtype."""
        module = kernels()
        return (module.linear_q4 if self.kind == "q4" else module.linear_q8)(x, self.codes, self.scales)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def quantized(weight: torch.Tensor) -> QuantizedWeight | None:
    """``weight`` (N, K) → its q4 form where every group of GROUP along a row lies on 16 evenly spaced levels from its
    minimum (a GGUF Q4_1 model's weights, dequantised), its q8 form where every group lies on 255 levels symmetric
    about 0 (Q8_0's), else None.  The levels are recovered from the weights: the scales of a float32 copy of such
    a model are float16 values, and code·scale + min gives back its every weight exactly."""
    N, K = weight.shape
    if K % GROUP or weight.device.type != "cpu":
        return None
    groups = weight.detach().float().view(N, K // GROUP, GROUP)
    rounding = torch.finfo(weight.dtype).eps  # relative: a bfloat16 copy's weights are off their levels by up to this
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    codes = _on_levels(groups, low, step, rounding)
    if codes is not None:
        packed = (codes[..., : GROUP // 2] | codes[..., GROUP // 2 :] << 4).to(torch.uint8).view(N, K // 2)
        return QuantizedWeight("q4", packed, torch.cat([step, low], dim=-1).half())
    scale = groups.abs().amax(-1, keepdim=True) / 127
    codes = _on_levels(groups, torch.zeros_like(scale), scale, rounding)
    if codes is not None:
        return QuantizedWeight("q8", codes.to(torch.int8).view(N, K), scale[..., 0].half())
    return None


def _on_levels(groups: torch.Tensor, low: torch.Tensor, step: torch.Tensor, rounding: float) -> torch.Tensor | None:
    """The codes (int32) of ``groups`` on the levels low + code·step, or None where a weight lies off them by more than
    LEVEL_TOLERANCE of a step and the ``rounding`` of its dtype (a constant group: every weight on level 0)."""
    step = torch.where(step > 0, step, torch.ones_like(step))
    levels = (groups - low) / step
    codes = levels.round()
    tolerance = LEVEL_TOLERANCE + groups.abs() / step * rounding
    if ((levels - codes).abs() > tolerance).any() or step.max() > torch.finfo(torch.float16).max:
        return None
    return codes.to(torch.int32)
