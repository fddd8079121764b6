"""The public DLite release's checkpoint format (DAI-System/DLite, ``architecture_version`` "dlite_v1"):
a dlite :class:`~dlite_cli.models.model.Drafter` read from it and written to it.

A release checkpoint directory holds the target's ``Qwen3Config`` with ``num_hidden_layers`` = N (the
drafter's layers, ``layer_types`` cut to match), ``num_target_layers`` = L, ``block_size`` = K + 1 and a
``dlite_config`` block, and weights under the release's names (``DLiteDraftModel``).  Its conventions are
fields of the one DrafterSpec: feature ids by the release's rule, whose last slot is the target's
final-normed state (dlite's id L; the release writes L − 1), context slots at local position 0, the
target's embedding of ``mask_token_id`` as placeholders, and G = ``anchor_group_size`` real-token queries.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

import torch

from ..core.errors import DliteError
from ..core.files import atomic_directory
from .model import Drafter, DrafterSpec, select_layers

ARCHITECTURE_VERSION = "dlite_v1"
MODEL_ROLE = "pivot_q_student"
REQUIRED = ("architecture_version", "model_role", "anchor_group_size", "chs_num_layers", "target_layer_ids", "sequential_head",
            "sequential_rank", "mask_token_id")
# dlite's weight name → the release's (the rest are the same: layers.*, norm, context_norm)
RELEASE_NAMES = {
    "depth_embedding.weight": "layer_depth_embedding.weight",  # (S, H) by slot; the release's is (L, H) by layer id
    "head.token_embedding.weight": "sequential_head.prev_token_embedding.weight",
    "head.gate.weight": "sequential_head.state_proj.weight",
    "head.gate.bias": "sequential_head.state_proj.bias",
    "head.latent.weight": "sequential_head.state_hidden_mlp.weight",
    "head.latent.bias": "sequential_head.state_hidden_mlp.bias",
    "head.vocab.weight": "sequential_head.output_proj.weight",
}


def is_release(raw: dict) -> bool:
    """Whether a checkpoint's config.json is in the release's format."""
    return "dlite_config" in raw


def release_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """dlite feature ids as the release writes them: the final-normed last state (id L) is layer L − 1."""
    return [min(i, num_layers - 1) for i in ids]


def spec_from_release(raw: dict, where: str) -> DrafterSpec:
    """The DrafterSpec of a release config.json (refused in one sentence if it is not one we can run)."""
    block = raw["dlite_config"]
    version = block.get("architecture_version")
    if version != ARCHITECTURE_VERSION:
        raise DliteError(f"{where}: unknown DLite architecture_version {version!r}; dlite reads {ARCHITECTURE_VERSION!r} checkpoints")
    missing = [key for key in REQUIRED if block.get(key) is None]
    missing += [key for key in ("num_target_layers", "block_size", "num_hidden_layers", "hidden_size", "vocab_size") if key not in raw]
    if missing:
        raise DliteError(f"{where}: the release config lacks {', '.join(missing)}")
    if block["model_role"] != MODEL_ROLE or str(block["sequential_head"]).lower() != "rnn" or raw.get("model_type", "qwen3") != "qwen3":
        raise DliteError(f"{where}: a {raw.get('model_type')} {block['model_role']} checkpoint with a {block['sequential_head']} head; "
                         f"dlite reads qwen3 {MODEL_ROLE} checkpoints with an rnn head")
    if raw.get("attention_bias"):
        raise DliteError(f"{where}: attention projections with biases are not supported")
    L, S = raw["num_target_layers"], block["chs_num_layers"]
    ours = select_layers(L, S, "release")
    expected = release_layer_ids(ours, L)
    if list(block["target_layer_ids"]) != expected:
        raise DliteError(f"{where}: target_layer_ids {block['target_layer_ids']} are not the release's rule for {S} of {L} layers, {expected}")
    heads = raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    return DrafterSpec(
        model_type="qwen3", hidden_size=raw["hidden_size"], vocab_size=raw["vocab_size"], target_num_layers=L, target_layer_ids=ours,
        draft_tokens=raw["block_size"] - 1, num_layers=raw["num_hidden_layers"], head_rank=block["sequential_rank"], sequential_head=True,
        composition="sequence", history_window=0, num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, intermediate_size=raw["intermediate_size"], rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))), anchor_group=block["anchor_group_size"], context_position=0,
        mask_token_id=block["mask_token_id"],
    )


def load_release(directory: Path, spec: DrafterSpec) -> Drafter:
    """A Drafter with the weights of a release checkpoint (every ``*.safetensors`` file of ``directory``)."""
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        weights.update(load_file(file))
    if not weights:
        raise DliteError(f"{directory} holds no .safetensors weights")
    ours = {name: RELEASE_NAMES.get(name, name) for name in Drafter(spec).state_dict()}
    missing = sorted(release for release in ours.values() if release not in weights)
    unexpected = sorted(set(weights) - set(ours.values()))
    if missing or unexpected:
        raise DliteError(f"{directory}: the weights do not match the release's DLiteDraftModel"
                         + (f"; missing {', '.join(missing[:3])}" if missing else "") + (f"; unexpected {', '.join(unexpected[:3])}" if unexpected else ""))
    state = {name: weights[release] for name, release in ours.items()}
    state["depth_embedding.weight"] = state["depth_embedding.weight"][release_layer_ids(spec.target_layer_ids, spec.target_num_layers)]  # the rows of the layers read
    model = Drafter(spec)
    model.load_state_dict(state)
    return model


def export_reasons(spec: DrafterSpec) -> list[str]:
    """Why a drafter cannot be written in the release's format (empty: it can)."""
    reasons = []
    if spec.model_type != "qwen3":
        reasons.append(f"its target is a {spec.model_type} model (the release's DLiteDraftModel is Qwen3)")
    if spec.history_window != 0:
        reasons.append(f"it keeps a draft history (history window {spec.history_window})")
    if spec.composition != "sequence":
        reasons.append("it composes the context feature-wise (drafter.composition feature)")
    if not spec.sequential_head:
        reasons.append("it has no sequential head")
    if spec.mask_token_id < 0:
        reasons.append("its placeholders are learned vectors (drafter.mask_token_id -1)")
    if spec.draft_vocab_size:
        reasons.append(f"it scores a reduced draft vocabulary of {spec.draft_vocab_size} tokens (drafter.draft_vocab)")
    if spec.context_position != 0:
        reasons.append(f"its context sits at local position {spec.context_position} (drafter.context_position 0 in the release)")
    expected = select_layers(spec.target_num_layers, len(spec.target_layer_ids), "release")
    if spec.target_layer_ids != expected:
        reasons.append(f"it reads target layers {spec.target_layer_ids}, not the release's {expected} (drafter.layers release)")
    return reasons


def export_release(drafter: Drafter, target_config, out: Path, where: str, origin: str = "") -> None:
    """Write ``drafter`` (built for ``target_config``, a Qwen3Config) to ``out`` in the release's format; ``origin``
    (the stage that trained it) is kept in config.json, where the release's loader ignores it."""
    from safetensors.torch import save_file

    spec = drafter.spec
    reasons = export_reasons(spec)
    if reasons:
        raise DliteError(f"{where} cannot be written in the {ARCHITECTURE_VERSION} format: " + "; ".join(reasons))
    config = target_config.to_dict()
    config.update(
        architectures=["DLiteDraftModel"], num_hidden_layers=spec.num_layers, num_target_layers=spec.target_num_layers,
        block_size=spec.draft_tokens + 1, dtype="float32", **({"origin": origin} if origin else {}),
        dlite_config={"architecture_version": ARCHITECTURE_VERSION, "model_role": MODEL_ROLE, "anchor_group_size": spec.anchor_group,
                      "chs_num_layers": len(spec.target_layer_ids), "target_layer_ids": release_layer_ids(spec.target_layer_ids, spec.target_num_layers), "sequential_head": "rnn",
                      "sequential_rank": spec.head_rank, "mask_token_id": spec.mask_token_id},
    )
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][: spec.num_layers]
    state = {RELEASE_NAMES.get(name, name): tensor.detach().float().contiguous() for name, tensor in drafter.state_dict().items()}
    depth = torch.zeros(spec.target_num_layers, spec.hidden_size)
    depth[release_layer_ids(spec.target_layer_ids, spec.target_num_layers)] = state["layer_depth_embedding.weight"]
    state["layer_depth_embedding.weight"] = depth
    with atomic_directory(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, tmp / "model.safetensors")


def load_spec(directory: Path, target_config=None) -> tuple[DrafterSpec, bool]:
    """The spec of a dlite checkpoint or of one in the public release's format (no weights read), checked against
    ``target_config``, and whether it is the release's."""
    from .release import is_release, spec_from_release

    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise DliteError(f"{directory} is not a drafter checkpoint: it has no config.json")
    raw = json.loads(config_path.read_text())
    if is_release(raw):
        spec = spec_from_release(raw, str(directory))
    else:
        names = {f.name for f in fields(DrafterSpec)}
        missing = {f.name for f in fields(DrafterSpec) if f.default is MISSING} - set(raw)
        if missing:
            raise DliteError(f"{config_path} is not a dlite drafter config: it lacks {', '.join(sorted(missing))}")
        spec = DrafterSpec(**{k: raw[k] for k in names if k in raw})
    if target_config is not None:
        spec.check_fits(target_config, str(directory))
    return spec, is_release(raw)


def load_drafter(directory: Path, target_config=None) -> Drafter:
    """A dlite checkpoint, or one in the public release's format, checked against ``target_config``."""
    from safetensors.torch import load_file

    spec, release = load_spec(directory, target_config)
    if release:
        return load_release(directory, spec)
    model = Drafter(spec)
    model.load_state_dict(load_file(Path(directory) / "model.safetensors"))
    return model
