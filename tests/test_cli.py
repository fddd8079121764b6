def test_help_lists_every_command_with_a_purpose(run_cli):
    done = run_cli("--help")
    for command in ("prepare-target", "regen", "status"):
        assert command in done.stdout
    assert "Regenerate the training responses" in done.stdout
    regen_help = run_cli("regen", "--help").stdout
    for option in ("--shard", "--limit", "--backend", "--base-url", "--concurrency", "--force", "--set"):
        assert option in regen_help


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
