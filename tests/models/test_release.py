"""The public DLite release's checkpoint format (DAI-System/DLite, "dlite_v1"): a release checkpoint written here
in the release's layout imports, its logits equal a forward written from the release's equations, export and
import round-trip, a drafter dlite trains in the release's conventions exports, and every refusal is one sentence."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dlite_cli.core.config import DrafterConfig, MicroConfig, TargetConfig
from dlite_cli.core.errors import DliteError
from dlite_cli.models.model import Drafter, DrafterSpec
from dlite_cli.models.release import export_release, load_drafter
from dlite_cli.models.runner import TargetRunner
from dlite_cli.models.targets import load_model, prepare_target

QWEN3 = ["--target", "micro", "--set", "target.micro.family=qwen3"]
N, K, R, MASK = 2, 4, 16, 500
RELEASE_IDS = [0, 1, 3]  # the release's rule for 3 of 4 layers: 0, L−1, and 1 + round(0.5 · (L − 3)) between


@pytest.fixture(scope="module")
def target(cache_dir):
    prepared = prepare_target(TargetConfig(model="micro", micro=MicroConfig(family="qwen3")), log=lambda _: None)
    return load_model(prepared, "float32", torch.device("cpu"))


def write_release(directory, target, group: int, seed: int = 0, **dlite_config):
    """A DLiteDraftModel checkpoint with random weights, in the release's names, shapes and config."""
    c = target.config
    H, L, V, I, d = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size, c.head_dim
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator) * 0.2  # noqa: E731
    norm = lambda size: 1 + rand(size)  # noqa: E731
    weights = {"norm.weight": norm(H), "context_norm.weight": norm(H), "layer_depth_embedding.weight": rand(L, H),
               "sequential_head.prev_token_embedding.weight": rand(V, R), "sequential_head.state_proj.weight": rand(2 * R, 2 * R),
               "sequential_head.state_proj.bias": rand(2 * R), "sequential_head.state_hidden_mlp.weight": rand(R, R + H),
               "sequential_head.state_hidden_mlp.bias": rand(R), "sequential_head.output_proj.weight": rand(V, R)}
    for i in range(N):
        p = f"layers.{i}."
        weights |= {p + "self_attn.q_proj.weight": rand(heads * d, H), p + "self_attn.k_proj.weight": rand(kv * d, H),
                    p + "self_attn.v_proj.weight": rand(kv * d, H), p + "self_attn.o_proj.weight": rand(H, heads * d),
                    p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
                    p + "mlp.gate_proj.weight": rand(I, H), p + "mlp.up_proj.weight": rand(I, H), p + "mlp.down_proj.weight": rand(H, I),
                    p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)}
    config = c.to_dict() | {"architectures": ["DLiteDraftModel"], "num_hidden_layers": N, "num_target_layers": L, "block_size": K + 1,
                            "layer_types": c.layer_types[:N]}
    config["dlite_config"] = {"architecture_version": "dlite_v1", "model_role": "pivot_q_student", "anchor_group_size": group,
                              "chs_num_layers": 3, "target_layer_ids": RELEASE_IDS, "sequential_head": "rnn", "sequential_rank": R,
                              "mask_token_id": MASK} | dlite_config
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(weights, directory / "model.safetensors")
    return weights


def reference_logits(w, target, ids: list[int], anchor: int, group: int) -> torch.Tensor:
    """The release's forward, from its equations: the context from the target's hidden states (Hugging Face's last one
    final-normed), ``group`` real tokens then K mask tokens, local positions from the first real token with the
    context at 0, full attention, the last K outputs into the gated RNN (primed on the token before the anchor if
    G > 1) → teacher-forced logits (K, V) for the tokens that follow ``anchor``."""
    c = target.config
    eps, theta, d = c.rms_norm_eps, c.rope_parameters["rope_theta"], c.head_dim
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    rms = lambda x, weight: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight  # noqa: E731

    def rotate(x, positions):  # x (heads, T, d)
        angles = positions.float()[:, None] / theta ** (torch.arange(0, d, 2).float() / d)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    with torch.no_grad():
        hidden = target(torch.tensor([ids[:anchor]]), output_hidden_states=True).hidden_states
        context = torch.stack([hidden[i + 1][0, -1] for i in RELEASE_IDS])  # the pivot, anchor − 1
        context = rms(context + w["layer_depth_embedding.weight"][RELEASE_IDS], w["context_norm.weight"])
        table = target.get_input_embeddings().weight
        x = torch.cat([table[ids[anchor - group + 1 : anchor + 1]], table[[MASK] * K]])
        q_positions, c_positions = torch.arange(group + K), torch.zeros(len(RELEASE_IDS), dtype=torch.long)
        for i in range(N):
            p = lambda name: w[f"layers.{i}.{name}.weight"]  # noqa: E731
            xn = rms(x, p("input_layernorm"))
            q = rms((xn @ p("self_attn.q_proj").T).view(-1, heads, d), p("self_attn.q_norm")).transpose(0, 1)
            k = rms((torch.cat([context, xn]) @ p("self_attn.k_proj").T).view(-1, kv, d), p("self_attn.k_norm")).transpose(0, 1)
            v = (torch.cat([context, xn]) @ p("self_attn.v_proj").T).view(-1, kv, d).transpose(0, 1)
            q, k = rotate(q, q_positions), rotate(k, torch.cat([c_positions, q_positions]))
            k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
            attended = torch.softmax(q @ k.transpose(1, 2) / d**0.5, -1) @ v
            x = x + attended.transpose(0, 1).reshape(len(x), -1) @ p("self_attn.o_proj").T
            xn = rms(x, p("post_attention_layernorm"))
            x = x + (F.silu(xn @ p("mlp.gate_proj").T) * (xn @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
        h = rms(x, w["norm.weight"])[-K:]

        def advance(state, token):
            g, candidate = (torch.cat([state, w["sequential_head.prev_token_embedding.weight"][token]]) @ w["sequential_head.state_proj.weight"].T
                            + w["sequential_head.state_proj.bias"]).chunk(2)
            return torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(candidate)

        state = torch.zeros(R)
        if group > 1:
            state = advance(state, ids[anchor - 1])
        logits = []
        for position in range(K):
            state = advance(state, ids[anchor + position])
            latent = torch.cat([state, h[position]]) @ w["sequential_head.state_hidden_mlp.weight"].T + w["sequential_head.state_hidden_mlp.bias"]
            logits.append(latent @ w["sequential_head.output_proj.weight"].T)
        return torch.stack(logits)


@pytest.mark.parametrize("group", [1, 2])
def test_a_release_checkpoint_imports_and_computes_the_release_equations(target, tmp_path, group):
    weights = write_release(tmp_path / "release", target, group)
    drafter = load_drafter(tmp_path / "release", target.config).eval()
    spec = drafter.spec
    assert (spec.anchor_group, spec.context_position, spec.mask_token_id, spec.draft_tokens) == (group, 0, MASK, K)
    assert spec.target_layer_ids == [0, 1, 4]  # the release's layer 3, final-normed: dlite's id L
    ids, anchor = list(range(40, 60)), 12
    runner = TargetRunner(target, spec.target_layer_ids, slots=1, capacity=64)
    _, context, _ = runner.prefill(0, ids[:anchor], all_features=False)  # dlite's own capture of the pivot's features
    tokens = torch.tensor([ids[anchor - group + 1 : anchor + 1]])
    with torch.no_grad():
        ours = drafter(context, tokens, target.get_input_embeddings(), torch.tensor([ids[anchor : anchor + K]]))[0]
    assert torch.allclose(ours, reference_logits(weights, target, ids, anchor, group), atol=1e-5, rtol=1e-4)


def test_export_then_import_is_bitwise_the_same(target, tmp_path):
    write_release(tmp_path / "release", target, group=2)
    first = load_drafter(tmp_path / "release", target.config)
    export_release(first, target.config, tmp_path / "exported", "first")
    again = load_drafter(tmp_path / "exported", target.config)
    assert first.spec == again.spec and first.state_dict().keys() == again.state_dict().keys()
    assert all(torch.equal(a, again.state_dict()[k]) for k, a in first.state_dict().items())
    written, original = load_file(tmp_path / "exported" / "model.safetensors"), load_file(tmp_path / "release" / "model.safetensors")
    assert written.keys() == original.keys() and all(written[k].shape == original[k].shape for k in original)
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["dlite_config"] == \
        json.loads((tmp_path / "release" / "config.json").read_text())["dlite_config"]


def test_a_drafter_trained_in_the_release_conventions_exports_and_drafts_the_same(run_cli, target, tmp_path):
    release = [*QWEN3, "--set", "drafter.layers=release", "--set", "drafter.context_position=0", "--set", f"drafter.mask_token_id={MASK}",
               "--set", "drafter.anchor_group=2", "--set", "drafter.draft_vocab=0"]
    run_cli("regen", *release, "--limit", "8")
    run_cli("stable", *release, "--from-scratch")
    done = run_cli("export", *release, "--drafter", "scratch", "--out", str(tmp_path / "exported"))
    assert "in the dlite_v1 format" in done.stderr
    trained = load_drafter(tmp_path / "runs" / "micro" / "stable-scratch" / "drafter", target.config).eval()
    exported = load_drafter(tmp_path / "exported", target.config).eval()
    generator = torch.Generator().manual_seed(0)
    context, tokens = torch.randn(6, 3, target.config.hidden_size, generator=generator), torch.randint(0, 400, (6, 2), generator=generator)
    embed = target.get_input_embeddings()
    assert torch.equal(trained.draft(context, tokens, embed)[0], exported.draft(context, tokens, embed)[0])
    # the bench names where each checkpoint comes from, and a release-format drafter writes plain decoding's text
    write_release(tmp_path / "release", target, group=1)
    run_cli("bench", *QWEN3, "--workload", "humaneval", "--methods", f"ar,{tmp_path / 'release'},{tmp_path / 'exported'}", "--limit", "1",
            "--max-new-tokens", "8", "--concurrency", "")
    run = tmp_path / "runs" / "micro" / "bench"
    rows = {r["method"]: r for r in json.loads((run / "table1_general_tau.json").read_text())["rows"] if r["target"] == "micro"}
    assert rows[str(tmp_path / "release")]["origin"] == "release" and rows[str(tmp_path / "exported")]["origin"] == "stable-scratch"
    assert rows["ar"]["origin"] == "no checkpoint"
    texts = {r["method"]: [t["output_sha"] for t in r["turns"]] for r in map(json.loads, (run / "results.jsonl").read_text().splitlines())}
    assert len(set(map(tuple, texts.values()))) == 1


@pytest.mark.parametrize("change, says", [
    ({"architecture_version": "dlite_v2"}, "unknown DLite architecture_version 'dlite_v2'; dlite reads 'dlite_v1' checkpoints"),
    ({"mask_token_id": None}, "the release config lacks mask_token_id"),
    ({"target_layer_ids": [0, 2, 3]}, "target_layer_ids [0, 2, 3] are not the release's rule for 3 of 4 layers, [0, 1, 3]"),
])
def test_a_release_checkpoint_dlite_cannot_run_is_refused_in_one_sentence(target, tmp_path, change, says):
    write_release(tmp_path / "release", target, group=1, **change)
    with pytest.raises(DliteError, match=f"^{tmp_path / 'release'}: " + says.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        load_drafter(tmp_path / "release", target.config)


def test_a_drafter_for_another_target_or_with_dlite_only_options_is_refused(run_cli, target, tmp_path):
    write_release(tmp_path / "release", target, group=1)
    other = run_cli("generate", "--target", "micro", "--drafter", str(tmp_path / "release"), "-p", "hi", check=False)  # a llama micro target
    assert other.returncode == 2 and "does not fit the target: its model_type is qwen3, the target's is llama" in other.stderr
    own = tmp_path / "own"
    Drafter(DrafterSpec.for_target(target.config, DrafterConfig(num_target_layers=3, draft_tokens=K, num_layers=1, head_rank=R, draft_vocab=256), 0)).save(own)
    refused = run_cli("export", *QWEN3, "--drafter", str(own), "--out", str(tmp_path / "out"), check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and not (tmp_path / "out").exists()
    (line,) = refused.stderr.strip().splitlines()
    assert f"{own} cannot be written in the dlite_v1 format: its placeholders are learned vectors" in line
    assert "a reduced draft vocabulary of 256 tokens" in line and "not the release's [0, 1, 4] (drafter.layers release)" in line


def test_generate_runs_a_release_checkpoint_losslessly(run_cli, target, tmp_path):
    write_release(tmp_path / "release", target, group=2)
    outputs = {drafter: json.loads(run_cli("generate", *QWEN3, "--drafter", drafter, "-p", "def add(a, b):", "--json", "--max-new-tokens", "24").stdout)
               for drafter in ("none", str(tmp_path / "release"))}
    assert outputs["none"]["text"] == outputs[str(tmp_path / "release")]["text"] and outputs[str(tmp_path / "release")]["rounds"] > 0
