"""Every engine setting is declared once (EngineOptions' fields, engine/settings.py) and reaches
each surface under the same name with the same check: the drop-in constructor's keyword, and the
flags of extract, serve, node and plan. The walk below goes over the declaration itself, so a new
setting fails it until it is given an example here, and a surface that drops one fails it."""

import argparse
import dataclasses

import pytest

from speculators_compat.cli import build_parser, node_options
from speculators_compat.engine import settings
from speculators_compat.engine.config import EngineOptions
from speculators_compat.pipeline.options import ExtractOptions
from speculators_compat.serve import hosts
from speculators_compat.serve.command import connector_config, engine_flags

#: per declared setting: its flag's text, the value that text means, and a value its check refuses
#: (None where every value parses: a switch or free text)
EXAMPLES = {
    "max_model_len": ("4096", 4096, 1),
    "gpu_memory_utilization": ("0.5", 0.5, 1.5),
    "tensor_parallel_size": ("2", 2, 0),
    "pipeline_parallel_size": ("2", 2, 0),
    "distributed_executor_backend": ("ray", "ray", "slurm"),
    "nnodes": ("2", 2, 0),
    "master_addr": ("10.1.2.3", "10.1.2.3", None),
    "master_port": ("29600", 29600, 0),
    "liveness_timeout_s": ("30", 30.0, -1.0),
    "dtype": ("bfloat16", "bfloat16", None),
    "quantization": ("fp8", "fp8", None),
    "trust_remote_code": (None, True, None),
    "max_num_batched_tokens": ("8192", 8192, 0),
    "max_num_seqs": ("64", 64, 0),
    "enable_expert_parallel": (None, True, None),
    "async_scheduling": ("disable", "disable", "sometimes"),
    "states_dtype": ("fp8", "fp8", "int4"),
}
DECLARED = settings.declared(EngineOptions)
BASE = {
    "extract": ["extract", "--model", "m", "--input", "i", "--output", "o"],
    "serve": ["serve", "--model", "m", "--hidden-states-path", "h"],
    "node": ["node", "--model", "m", "--node-rank", "1"],
    "plan": ["plan", "--model", "m"],
}


def _argv(f, surface: str) -> list[str]:
    text = EXAMPLES[f.name][0]
    return BASE[surface] + [settings.flag_of(f)] + ([] if text is None else [text])


def _parse(argv: list[str]) -> argparse.Namespace:
    args, rest = build_parser().parse_known_args(argv)
    assert not rest, rest
    return args


def test_every_declared_setting_has_an_example_and_every_field_is_declared_or_the_librarys():
    assert {f.name for f in DECLARED} == set(EXAMPLES)
    library_set = {"model", "tokenizer", "node_rank", "seed", "enforce_eager", "worker_start_method"}
    python_only = {"zero_copy", "self_check", "engine_kwargs"}  # (the constructor's own keywords)
    others = {f.name for f in dataclasses.fields(EngineOptions)} - set(EXAMPLES)
    assert others == library_set | python_only


@pytest.mark.parametrize("f", DECLARED, ids=lambda f: f.name)
def test_extract_plan_and_node_take_the_flag(f):
    value = EXAMPLES[f.name][1]
    assert ExtractOptions.from_args(_parse(_argv(f, "extract"))).engine[f.name] == value
    assert getattr(_parse(_argv(f, "plan")), f.name) == value
    node = node_options(_parse(_argv(f, "node")))
    # (the states dtype is the driver's: it tells the node's workers at set-up)
    assert getattr(node, f.name) == (value if f.name != "states_dtype" else "auto")


@pytest.mark.parametrize("f", DECLARED, ids=lambda f: f.name)
def test_serve_passes_the_flag_to_vllm_or_refuses_it_by_name(f):
    s = settings.setting(f)
    args = _parse(_argv(f, "serve"))
    if s.serve == "refuse":
        with pytest.raises(ValueError, match=s.serve_note.split(":")[0]):
            engine_flags(args)
        return
    argv = engine_flags(args)
    if s.serve == "ours":  # (taken by serve itself: the connector's config, the host watch)
        taken = {
            "states_dtype": lambda: connector_config(args, None)["kv_connector_extra_config"]["states_dtype"],
            "liveness_timeout_s": lambda: hosts.watch_of(argparse.Namespace(**{**vars(args), "nnodes": 2})).timeout_s,
        }
        assert taken[f.name]() == EXAMPLES[f.name][1]
        assert settings.flag_of(f) not in argv
    elif s.serve == "switch":
        assert settings.flag_of(f) in argv
    elif s.serve == "no-":
        assert "--no-" + settings.flag_of(f)[2:] in argv
    else:
        i = argv.index(settings.flag_of(f))
        assert argv[i + 1] == EXAMPLES[f.name][0]


@pytest.mark.parametrize("f", [f for f in DECLARED if EXAMPLES[f.name][2] is not None], ids=lambda f: f.name)
def test_a_refused_value_is_refused_alike_by_keyword_and_by_flag(f, capsys):
    """The same check for the constructor's keyword (ValueError naming the keyword, before the
    model is read) and for each command's flag (argparse's exit 2 naming the flag)."""
    from speculators_compat.generator import VllmHiddenStatesGenerator

    bad = EXAMPLES[f.name][2]
    with pytest.raises(ValueError, match=rf"^{f.name} must be "):
        VllmHiddenStatesGenerator("/nonexistent/model", **{f.name: bad})
    with pytest.raises(ValueError, match=rf"^{f.name} must be "):
        settings.check_all(EngineOptions(model="m", **{f.name: bad}))
    flag = settings.flag_of(f)
    for surface in BASE:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_known_args([*BASE[surface], flag, str(bad)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: " in err, (surface, err)


def test_the_constructor_names_a_keyword_it_does_not_know():
    from speculators_compat.generator import VllmHiddenStatesGenerator

    with pytest.raises(TypeError, match="unexpected keyword argument.*tensor_paralel_size.*tensor_parallel_size"):
        VllmHiddenStatesGenerator("/nonexistent/model", tensor_paralel_size=2)


def test_the_constructor_defaults_are_the_declared_defaults():
    import inspect

    from speculators_compat.generator import VllmHiddenStatesGenerator

    params = inspect.signature(VllmHiddenStatesGenerator.__init__).parameters
    for f in DECLARED:
        if f.name in params:  # (upstream's positional ones, written out)
            assert params[f.name].default == settings.default_of(f), f.name
