"""``speculators-compat serve --model M --hidden-states-path DIR [--layer-ids ...] [--states-dtype fp8]
[engine options as extract] [--host H --port P] [any other vllm serve flag]``: vLLM's own OpenAI
server (every endpoint, flag, ``--api-key``, metrics) with the capture connector configured
(connector/), the render endpoints on (``--enable-scale-out``: speculators' ``prepare-data
--render-endpoint``) and our file routes and request guards as its middleware (files.py).

It checks what it can before vLLM starts (the model's files, the layer ids, the folder), removes
what dead writers left in the folder, and then runs ``vllm serve`` in this process. Flags it does
not know go to vLLM unchanged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from . import hosts

logger = logging.getLogger("speculators_compat.serve")

CONNECTOR = "CaptureConnector"
CONNECTOR_MODULE = "speculators_compat.connector"
MIDDLEWARE = "speculators_compat.serve.files.HiddenStatesFiles"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from ..pipeline.options import add_model_args

    add_model_args(p)  # (with the flags of one engine over several hosts)
    p.add_argument(
        "--hidden-states-path",
        required=True,
        help="where each captured request's hs file is written (the path its response names)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument(
        "--no-self-check",
        action="store_true",
        help="skip the per-request check of each captured state against vLLM's own log-probabilities",
    )
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=32.0,
        help="the largest request body taken, in MiB (a larger one is answered 413)",
    )


def connector_config(args: argparse.Namespace, native_ids: list[int] | None) -> dict:
    """vLLM's ``--kv-transfer-config`` for our connector."""
    extra = {
        "shared_storage_path": os.path.abspath(args.hidden_states_path),
        "states_dtype": args.states_dtype,
        "self_check": not args.no_self_check,
    }
    if native_ids is not None:  # (none given: the connector's default, the same rule)
        extra["layer_ids"] = native_ids
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }


def vllm_argv(args: argparse.Namespace, native_ids: list[int] | None, rest: list[str]) -> list[str]:
    """``vllm serve``'s arguments for ``args`` plus the flags we do not know (``rest``, last: a
    flag given there wins)."""
    argv = ["serve", args.model, "--host", args.host, "--port", str(args.port)] + engine_flags(args)
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    argv += ["--enforce-eager", "--no-enable-prefix-caching"]
    if _has_render_endpoints():
        argv.append("--enable-scale-out")
    argv += ["--kv-transfer-config", json.dumps(connector_config(args, native_ids))]
    argv += ["--middleware", MIDDLEWARE]
    return argv + list(rest)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine settings among ``args`` as ``vllm serve`` takes them, each as its declaration says
    (engine/settings.py: Setting.serve); ValueError for one serve cannot honour."""
    from ..engine import settings
    from ..engine.config import EngineOptions

    argv: list[str] = []
    for f in settings.declared(EngineOptions):
        s, value, flag = settings.setting(f), getattr(args, f.name, None), settings.flag_of(f)
        default = value == settings.default_of(f)
        if value is None or s.serve == "ours" or (default and s.serve in ("refuse", "flag-if-set")):
            continue  # (ours: the connector's config or our host watch take it)
        if s.serve == "refuse":
            raise ValueError(s.serve_note)
        if s.serve == "switch":
            argv += [flag] if value else []
        elif s.serve == "no-":
            argv += [] if value == "keep" else ["--no-" + flag[2:]]
        else:
            argv += [flag, str(value)]
    return argv


def _has_render_endpoints() -> bool:
    """Does this vLLM have the render endpoints (``--enable-scale-out``; absent in 0.20)?"""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm.entrypoints.scale_out") is not None
    except ImportError:  # (no vLLM here: the flag is harmless to name, and the command line is all we make)
        return True


def _api_servers(rest: list[str]) -> int:
    for i, a in enumerate(rest):
        if a.startswith("--api-server-count"):
            value = a.partition("=")[2] or (rest[i + 1] if i + 1 < len(rest) else "1")
            return int(value) if value.isdigit() else 1
    return 1


def api_keys(rest: list[str]) -> list[str]:
    """The keys vLLM's server will take (``--api-key`` among the passed flags, else VLLM_API_KEY)."""
    keys = []
    for i, a in enumerate(rest):
        if a == "--api-key" and i + 1 < len(rest):
            keys += [k for k in rest[i + 1 :] if not k.startswith("--")][:1]
        elif a.startswith("--api-key="):
            keys.append(a.split("=", 1)[1])
    return keys or [k for k in [os.environ.get("VLLM_API_KEY")] if k]


def request_reserve(args: argparse.Namespace, layers: int) -> int:
    """Bytes one request of ``max_model_len`` tokens needs in the folder (what the 507 guard asks):
    its states as plan counts them, its int64 token ids, and 1 MiB for the file's header."""
    from ..checkpoint import model_limits
    from ..pipeline.plan import state_bytes_per_token

    hidden = model_limits(args.model).get("hidden_size", 0)
    width = 4 if args.dtype == "float32" else 2
    per_token = state_bytes_per_token(layers, hidden, width, args.states_dtype) + 8
    return int(args.max_model_len) * per_token + (1 << 20)


def prepare(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """Everything before vLLM starts: checks, the sweep, the middleware's settings; vLLM's argv."""
    from ..checkpoint import check_checkpoint
    from ..files import locks
    from ..layers import read_num_layers
    from ..layers import resolve as resolve_layers

    engine_flags(args)  # (a setting serve refuses, named before anything is read)
    if hosts.watch_of(args) is not None and _api_servers(rest) > 1:
        raise ValueError(
            "serve over several hosts runs one API server (its host watch fails their requests): drop --api-server-count"
        )
    check_checkpoint(args.model)
    n = read_num_layers(args.model, args.trust_remote_code)
    ids = resolve_layers(args.layer_ids, n, args.layer_id_convention, "speculators-hs")  # upstream's
    native = [i + 1 for i in ids] if args.layer_ids is not None else None  # (the connector takes vLLM's ids)
    folder = args.hidden_states_path
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--hidden-states-path {folder} is not writable")
    swept = locks.sweep(folder)
    print(
        f"speculators-compat serve: {swept['locks']} stale lock(s) and {swept['partials']} temporary file(s) "
        f"removed from {folder}",
        file=sys.stderr,
    )
    from .files import SETTINGS_ENV

    settings = {
        "watching": hosts.watch_of(args) is not None,
        "folder": os.path.abspath(folder),
        "tokens": api_keys(rest),
        "max_body": int(args.max_request_mb * (1 << 20)),
        "reserve": request_reserve(args, len(ids)),
    }
    os.environ[SETTINGS_ENV] = json.dumps(settings)
    return vllm_argv(args, native, rest)


def main_serve(args: argparse.Namespace, rest: list[str]) -> int:
    argv = prepare(args, rest)
    logger.info("vllm %s", " ".join(argv))
    from vllm.entrypoints.cli.main import main as vllm_main

    watch = hosts.start(hosts.watch_of(args))  # (the nodes connect as soon as they start)
    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    finally:
        if watch is not None and hosts.lost() is None:
            watch.close()  # (a normal end: the nodes are told, and end quietly)
    gone = hosts.lost()
    if gone is not None:  # (vLLM's server stopped first, on SIGTERM: the run still failed)
        hosts.finish(gone)
    return 0
