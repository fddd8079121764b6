import re

import pytest
import typer.main

from dlite_cli.cli import app


def test_help_lists_every_command_with_a_purpose(run_cli):
    done = run_cli("--help")
    for command in ("prepare-target", "regen", "status"):
        assert command in done.stdout
    assert "Regenerate the training responses" in done.stdout
    regen_help = run_cli("regen", "--help").stdout
    for option in ("--shard", "--limit", "--backend", "--base-url", "--concurrency", "--force", "--set"):
        assert option in regen_help
    bench_help = run_cli("bench", "--help").stdout  # values by name, defaults and ranges, no type tags
    assert "--limit N" in bench_help and "[default: 0.0; x>=0]" in bench_help and "--data WORKLOAD=PATH" in bench_help
    for command in ("regen", "bench", "generate", "serve", "profile", "status", "run"):
        assert not re.search(r"<(bool|str|int|float|path|list)[^>]*>", run_cli(command, "--help").stdout)


def test_every_option_is_spelt_as_its_name_says():
    # some typer releases (0.27) name an option with no flag of its own after its metavar (--SUITE): each one gives its flag
    group = typer.main.get_command(app)
    for name in group.list_commands(typer.Context(group)):
        for param in group.get_command(typer.Context(group), name).params:
            if param.param_type_name != "option":
                continue
            long = [flag for flag in param.opts if flag.startswith("--")]
            assert long and all(flag == flag.lower() for flag in long), f"dlite {name}: {param.name} is {param.opts}"


def test_prepare_target_prints_the_checkpoint_path(run_cli):
    done = run_cli("prepare-target", "--target", "micro")
    path = done.stdout.strip().splitlines()[-1]
    assert path.endswith(tuple("0123456789abcdef")) and "micro-" in path
    assert "is ready" in done.stderr


def test_bad_config_value_is_one_sentence_and_exit_2(run_cli):
    done = run_cli("prepare-target", "--target", "micro", "--set", "target.micro.hidden_size=0", check=False)
    assert done.returncode == 2
    assert "target.micro.hidden_size must be > 0, got 0" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("what, args", [
    ("the target Qwen/Qwen3-0.6B", ["generate", "-p", "hi", "--set", "target.model=Qwen/Qwen3-0.6B"]),
    ("the data set mlabonne/open-perfectblend", ["regen", "--set", "regen.sources=[{name: open-perfectblend, count: 2}]"]),
    ("the data set openai/gsm8k", ["bench", "--workload", "gsm8k", "--data", "gsm8k=openai/gsm8k", "--methods", "ar"]),
    ("the drafter SJTU-DAI-Sys/Qwen3-4B-DLite", ["generate", "-p", "hi", "--drafter", "SJTU-DAI-Sys/Qwen3-4B-DLite"]),
])
def test_without_the_hub_a_target_a_regen_source_a_workload_or_a_drafter_is_one_sentence_and_exit_2(run_cli, tmp_path, what, args):
    done = run_cli(*args, "--target", "micro", check=False, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
                   process=True)  # the hub's library reads HF_HUB_OFFLINE when it is imported
    assert done.returncode == 2 and "Traceback" not in done.stderr
    *before, line = done.stderr.strip().splitlines()  # before it, at most what was decided (a GPU's dtype, not measured)
    assert all(" auto: " in earlier for earlier in before)
    assert line.startswith("error: ") and f"could not load {what} from the Hugging Face hub (HF_HUB_OFFLINE is set); " in line
    assert "--set target.model=DIR" in line if "target" in what else "a local copy" in line

