from pathlib import Path

import pytest
import yaml

from dlite_cli.core.config import CONFIG_DIRS, load_config
from dlite_cli.core.errors import DliteError

SHIPPED = ("micro", "smollm2-135m", "qwen3-4b", "qwen3-8b")


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "custom.yaml"
    path.write_text(text)
    return str(path)


MINIMAL = """
target: {model: micro}
regen:
  sources: [{name: stdlib-code, count: 4}]
  max_length: 256
  max_prompt_tokens: 128
"""


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load(name):
    config = load_config(name)
    assert config.name == name
    assert config.regen.max_prompt_tokens < config.regen.max_length


def test_paper_settings():
    four, eight = load_config("qwen3-4b"), load_config("qwen3-8b")
    assert (four.drafter.num_target_layers, four.drafter.head_rank) == (12, 320)
    assert (eight.drafter.num_target_layers, eight.drafter.head_rank) == (14, 512)
    for c in (four, eight):
        d, t = c.drafter, c.train
        assert (d.draft_tokens, d.num_layers) == (7, 5)
        assert (t.lr, t.grad_clip, t.global_batch, t.schedule, t.warmup_ratio) == (4e-4, 1.0, 32, "cosine", 0.04)
        assert (t.teacher_epochs, t.warmup_epochs, t.stable_epochs) == (8, 2, 6)
        assert (t.gamma, t.lambda_ce, t.lambda_tv, t.max_length) == (4.0, 0.1, 1.0, 4096)
        assert {s.name: s.count for s in c.regen.sources} == {"open-perfectblend": 1_300_000, "nemotron-v2": 600_000}


def test_yaml_path_and_stem_name(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert config.name == "custom"
    assert config.regen.sources[0].count == 4
    assert config.drafter.draft_tokens == 7  # section defaults are the paper's


@pytest.mark.parametrize(
    "text, message",
    [
        (MINIMAL + "extra: 1\n", "unknown key extra"),
        (MINIMAL.replace("max_length: 256", "max_length: 256\n  batchsize: 2"), "unknown key regen.batchsize"),
        (MINIMAL.replace("max_length: 256", "max_length: big"), "regen.max_length must be an integer, got 'big'"),
        (MINIMAL.replace("max_length: 256", "max_length: 0"), "regen.max_length must be > 0, got 0"),
        (MINIMAL.replace("count: 4", "count: -1"), "regen.sources[0].count must be > 0"),
        (MINIMAL.replace("stdlib-code", "reddit"), "regen.sources[0].name must be one of open-perfectblend"),
        (MINIMAL.replace("max_prompt_tokens: 128", "max_prompt_tokens: 300"), "regen.max_prompt_tokens must be smaller"),
        (MINIMAL.replace("target: {model: micro}", "target: {dtype: float32}"), "missing required key target.model"),
        (MINIMAL + "train: {warmup_ratio: 1.5}\n", "train.warmup_ratio must be between 0 and 1"),
        (MINIMAL + "drafter: {sequential_head: 1}\n", "drafter.sequential_head must be true or false"),
        (MINIMAL + "train: [1, 2]\n", "train must be a mapping"),
        ("target: [unclosed", "not valid YAML"),
    ],
)
def test_bad_configs_name_file_and_key(tmp_path, text, message):
    with pytest.raises(DliteError) as error:
        load_config(write(tmp_path, text))
    assert message in str(error.value)
    assert "custom.yaml" in str(error.value)
    assert "\n" not in str(error.value)


def test_overrides_are_validated_like_the_file(tmp_path):
    path = write(tmp_path, MINIMAL)
    config = load_config(path, ["regen.batch_size=3", "train.lr=1e-3", "regen.sources=[{name: sharegpt, count: 2}]"])
    assert config.regen.batch_size == 3 and config.train.lr == 1e-3
    assert config.regen.sources[0].name == "sharegpt"
    with pytest.raises(DliteError, match="regen.batch_size must be > 0"):
        load_config(path, ["regen.batch_size=0"])
    with pytest.raises(DliteError, match="unknown key regen.nope"):
        load_config(path, ["regen.nope=1"])
    with pytest.raises(DliteError, match="expected section.key=value"):
        load_config(path, ["regen.batch_size"])


def test_unknown_target_lists_known_ones():
    with pytest.raises(DliteError) as error:
        load_config("gpt-17")
    assert "unknown target 'gpt-17'" in str(error.value)
    assert "smollm2-135m" in str(error.value)


def test_every_config_key_is_in_the_schema():
    """The shipped files spell out every section, so a reader sees each number that is used."""
    directory = next(d for d in CONFIG_DIRS if d.is_dir())
    for name in ("smollm2-135m", "qwen3-4b", "qwen3-8b"):
        raw = yaml.safe_load((directory / f"{name}.yaml").read_text())
        assert {"target", "regen", "drafter", "train"} <= set(raw)
