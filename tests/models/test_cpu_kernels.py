"""dlite's CPU kernels: each computes what the eager ATen ops compute, a row of a pass the same however many rows the
pass has, and a weight a GGUF file held 4- or 8-bit is read in that form."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import on_levels

from dlite_cli.models.cpu_kernels import kernels, quantized
from dlite_cli.models.layer_ops import AttentionParams, EagerOps, KernelOps, Norm, PassPositions
from dlite_cli.models.linears import QUANTIZED_ROWS, Projection, packs


@pytest.fixture(scope="module")
def module(cache_dir):
    built = kernels(log=lambda _: None)
    if built is None:
        pytest.skip("dlite's CPU kernels do not build here (no C++ compiler or ninja)")
    return built


@pytest.mark.parametrize("bits", [4, 8])
def test_a_weight_on_4_or_8_bit_levels_is_found_on_them_and_a_float_trained_one_is_not(bits):
    weight = on_levels(96, 128, bits)
    found = quantized(weight)
    assert found.kind == f"q{bits}" and found.nbytes == 96 * 128 * bits // 8 + 96 * 4 * (4 if bits == 4 else 2)
    assert quantized(weight.bfloat16()).kind == f"q{bits}"  # a bfloat16 copy of it too, off its levels by rounding
    for dtype in (torch.float32, torch.bfloat16):
        assert quantized((torch.randn(96, 128) * 0.02).to(dtype)) is None
        assert quantized(torch.nn.Linear(128, 96).weight.detach().to(dtype)) is None
    assert quantized(torch.randn(96, 100)) is None  # rows not made of whole groups


@pytest.mark.parametrize("bits", [4, 8])
def test_the_linear_kernels_compute_the_models_own_product_and_a_row_the_same_in_any_pass(module, bits):
    """In float32 exactly the dense weights' product (up to summation order); in bfloat16 a bfloat16 model's; and a
    row's result does not depend on how many rows the pass has."""
    weight = on_levels(80, 256, bits)
    found = quantized(weight)
    x = torch.randn(11, 256)
    torch.testing.assert_close(found(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(found(x.bfloat16()).float(), (x.bfloat16().float() @ weight.bfloat16().float().T), rtol=0.02, atol=0.02)
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(dtype)
        whole = found(rows)
        assert torch.equal(whole, torch.cat([found(rows[i : i + 1]) for i in range(11)]))
        assert torch.equal(whole[3:7], found(rows[3:7])) and found(rows[None]).shape == (1, 11, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_projection_reads_its_quantized_copy_in_narrow_passes_and_its_packed_one_in_wide(module, dtype):
    if not packs(torch.device("cpu"), dtype):
        pytest.skip(f"this CPU's oneDNN does not pack {dtype}")
    layer = torch.nn.Linear(128, 64, bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(on_levels(64, 128, 4))
    projection = Projection([layer], pack=True, quantize=True)
    assert projection.quantized.kind == "q4" and projection.step_bytes == projection.quantized.nbytes
    for rows in (1, QUANTIZED_ROWS, QUANTIZED_ROWS + 4):
        x = torch.randn(rows, 128).to(dtype)
        narrow = torch.equal(projection.fused(x), projection.quantized(x))
        assert narrow == (rows <= QUANTIZED_ROWS)
        torch.testing.assert_close(projection.fused(x).float(), layer(x).float(), rtol=0.02, atol=0.02)
    assert Projection([torch.nn.Linear(128, 64)], pack=True, quantize=True).quantized is None  # float-trained, with a bias


def attention_inputs(dtype, qwen3: bool, seed: int = 0):
    """A fused q/k/v output for 2 rows of 5 tokens at rows' own positions (one crossing a chunk of keys), random
    caches in 4 slots, the rotary tables, and the attention's parameters (for Qwen3, per-head norms)."""
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, B, Q = 6, 2, 32, 2, 5
    keys = torch.randn(4, kv_heads, 600, d, generator=generator).to(dtype)
    values = torch.randn(keys.shape, generator=generator).to(dtype)
    qkv = torch.randn(B, Q, (heads + 2 * kv_heads) * d, generator=generator).to(dtype)
    slots, starts = torch.tensor([3, 1]), torch.tensor([253, 40])
    positions = starts[:, None] + torch.arange(Q)
    angles = positions[..., None] / 10000 ** (torch.arange(0, d, 2) / d)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    norms = [Norm((torch.rand(d, generator=generator) + 0.5).to(dtype), 1e-6) for _ in range(2)] if qwen3 else [None, None]
    params = AttentionParams(*norms, scaling=d**-0.5)
    return (heads, kv_heads, d), params, qkv, keys, values, slots, positions, (cos.to(dtype), sin.to(dtype))


def eager_attention(heads, kv_heads, d, params, qkv, keys, values, slots, positions, rotary):
    """EagerOps' attention for these rows: keys up to the longest row under a causal mask of each row's own."""
    ops = EagerOps(heads, kv_heads, d)
    span = int(positions.max()) + 1
    mask = (torch.arange(span) <= positions[..., None])[:, None]
    at = PassPositions(slots, slots, positions, span, mask, None, *rotary)
    return ops.attention(params, qkv, keys, values, at)


@pytest.mark.parametrize("qwen3", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_kernel_attends_and_writes_the_cache_as_eager_attention_does(module, dtype, qwen3):
    shapes, attention, qkv, keys, values, slots, positions, rotary = attention_inputs(dtype, qwen3)
    eager_keys, eager_values = keys.clone(), values.clone()
    expected = eager_attention(*shapes, attention, qkv, eager_keys, eager_values, slots, positions, rotary)
    ops = KernelOps(*shapes, module)
    at = PassPositions(slots, slots, positions, 0, None, None, *rotary)
    got = ops.attention(attention, qkv, keys, values, at)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    torch.testing.assert_close(keys.float(), eager_keys.float(), **tolerance)
    assert torch.equal(values, eager_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_attends_the_same_in_any_pass(module, dtype):
    """Each token of a pass of 5, verified alone at its position, or beside another row: the same bits."""
    shapes, attention, qkv, keys, values, slots, positions, rotary = attention_inputs(dtype, qwen3=False)
    ops = KernelOps(*shapes, module)
    whole = ops.attention(attention, qkv, keys.clone(), values.clone(), PassPositions(slots, slots, positions, 0, None, None, *rotary))
    for b in range(2):
        cache = keys.clone(), values.clone()
        for i in range(5):
            one = PassPositions(slots[b : b + 1], slots[b : b + 1], positions[b : b + 1, i : i + 1], 0, None, None,
                                rotary[0][b : b + 1, i : i + 1], rotary[1][b : b + 1, i : i + 1])
            assert torch.equal(ops.attention(attention, qkv[b : b + 1, i : i + 1], *cache, one)[0, 0], whole[b, i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_and_gate_kernels_compute_the_eager_ops(module, dtype):
    eager, ops = EagerOps(4, 2, 16), KernelOps(4, 2, 16, module)
    norm = Norm.of(torch.nn.RMSNorm(96, eps=1e-5).to(dtype))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    h, delta, gate_up = (torch.randn(3, 7, n).to(dtype) for n in (96, 96, 2 * 200))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(ops.norm(h, norm), eager.norm(h, norm), **tolerance)
    for got, expected in zip(ops.add_norm(h, delta, norm), eager.add_norm(h, delta, norm)):
        torch.testing.assert_close(got, expected, **tolerance)
    torch.testing.assert_close(ops.gate(gate_up, torch.nn.functional.silu), eager.gate(gate_up, torch.nn.functional.silu), **tolerance)


def test_where_the_kernels_cannot_be_built_the_engine_runs_eager_ops_and_says_why(tmp_path):
    """A compiler that fails (CXX=false), in a fresh cache: one line says so, and the layers run eager ATen ops."""
    script = ("from transformers import LlamaConfig, LlamaForCausalLM\n"
              "from dlite_cli.models.layer_ops import target_ops\n"
              "config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,"
              " num_key_value_heads=2)\n"
              "print(type(target_ops(LlamaForCausalLM(config))).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DLITE_CACHE": str(tmp_path), "CXX": "false"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "EagerOps"
    failures = [line for line in done.stderr.splitlines() if "could not be built here" in line]
    assert len(failures) == 1 and failures[0].startswith("dlite's CPU kernels") and failures[0].endswith("decoding runs eager ATen ops")
