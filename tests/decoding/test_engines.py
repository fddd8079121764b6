"""Which engine decodes, and opening it with its one fallback."""

import pytest

from dlite_cli.core.config import load_config
from dlite_cli.core.errors import DliteError
from dlite_cli.decoding import engines


def test_the_engine_is_vllm_where_it_is_installed_and_dlites_own_with_one_line_where_not(monkeypatch):
    config, lines = load_config("micro"), []
    assert engines.choose_engine(config, "dlite", lines.append) == "dlite" and engines.choose_engine(config, "vllm", lines.append) == "vllm"
    assert lines == []
    monkeypatch.setattr(engines, "installed_vllm", lambda: "0.32.0")
    assert engines.choose_engine(config, "auto", lines.append) == "vllm" and lines == []
    config.decode.engine = "auto"
    assert engines.choose_engine(config, None, lines.append) == "vllm"  # no --engine: the config's
    for version, found in ((None, "vLLM is not installed"), ("0.31.2", "vLLM 0.31.2 is installed and the plugin supports 0.32.x")):
        monkeypatch.setattr(engines, "installed_vllm", lambda version=version: version)
        assert engines.choose_engine(config, "auto", lines.append) == "dlite"
        assert lines.pop() == f"{found}: decoding in dlite's own engine ({engines.VLLM_INSTALL} to decode in vLLM)"
    with pytest.raises(DliteError, match="--engine must be one of auto, vllm, dlite, got 'sglang'"):
        engines.choose_engine(config, "sglang")


def test_what_vllm_refuses_goes_to_dlites_engine_under_auto_alone(monkeypatch):
    monkeypatch.setattr(engines, "installed_vllm", lambda: "0.32.0")
    config, lines = load_config("micro"), []

    def refused():
        raise DliteError("vLLM cannot draft with this")

    assert engines.open_engine(config, "auto", refused, lambda: "dlite's", lines.append) == "dlite's"
    assert lines == ["vLLM cannot draft with this: in dlite's own engine instead"]
    assert engines.open_engine(config, "auto", lambda: "vLLM's", refused, lines.append) == "vLLM's"
    with pytest.raises(DliteError, match="vLLM cannot draft with this"):
        engines.open_engine(config, "vllm", refused, lambda: "dlite's", lines.append)
    assert engines.open_engine(config, "dlite", refused, lambda: "dlite's", lines.append) == "dlite's" and len(lines) == 1
