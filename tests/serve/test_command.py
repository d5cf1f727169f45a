"""``serve``'s command line (serve/command.py): what it hands vLLM's server, and the API keys its
file routes take."""

from __future__ import annotations

import json

from speculators_compat.cli import build_parser
from speculators_compat.serve.command import api_keys, vllm_argv


def parse(*argv):
    args, rest = build_parser().parse_known_args(["serve", *argv])
    return args, rest


def test_vllm_gets_our_connector_and_every_flag_we_do_not_know():
    args, rest = parse("--model", "/m", "--hidden-states-path", "/hs", "--tensor-parallel-size", "2",
                       "--states-dtype", "fp8", "--api-key", "k", "--enable-auto-tool-choice")  # fmt: skip
    argv = vllm_argv(args, [2, 3, 6], rest)
    assert argv[:2] == ["serve", "/m"] and argv[-3:] == ["--api-key", "k", "--enable-auto-tool-choice"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--host") + 1] == "127.0.0.1"
    for flag in ("--enforce-eager", "--no-enable-prefix-caching", "--enable-scale-out"):
        assert flag in argv
    assert argv[argv.index("--middleware") + 1] == "speculators_compat.serve.files.HiddenStatesFiles"
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "CaptureConnector" and kv["kv_connector_module_path"] == "speculators_compat.connector"
    assert kv["kv_connector_extra_config"] == {
        "shared_storage_path": "/hs",
        "layer_ids": [2, 3, 6],
        "states_dtype": "fp8",
        "self_check": True,
    }
    assert "--nnodes" not in argv  # (one host: vLLM's default)


def test_no_layer_ids_leaves_the_default_to_the_connector():
    args, rest = parse("--model", "/m", "--hidden-states-path", "/hs", "--no-self-check")
    kv = json.loads(vllm_argv(args, None, rest)[vllm_argv(args, None, rest).index("--kv-transfer-config") + 1])
    assert "layer_ids" not in kv["kv_connector_extra_config"] and not kv["kv_connector_extra_config"]["self_check"]


def test_api_keys(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(["--api-key", "a", "--port", "1"]) == ["a"] and api_keys(["--api-key=b"]) == ["b"]
    assert api_keys([]) == []
    monkeypatch.setenv("VLLM_API_KEY", "env")
    assert api_keys([]) == ["env"]


def test_other_commands_still_refuse_unknown_flags(capsys):
    import pytest

    from speculators_compat.cli import main

    with pytest.raises(SystemExit):
        main(["verify", "/nowhere", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
