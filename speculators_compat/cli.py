"""``speculators-compat``: doctor / demo / extract / plan / verify / run.

vLLM and torch are imported only by the sub-commands that need them, so ``--help`` and ``doctor``
work anywhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _doctor(args) -> int:
    import speculators_compat

    if args.sweep_shm:
        from .engine.shm import sweep_orphan_shm

        removed = sweep_orphan_shm()
        print(f"removed {len(removed)} shared-memory file(s) no process had open: {' '.join(removed) or '-'}")
        return 0
    if args.probe:
        # import the targets so the report says what applied, not only what would
        for mod in ("vllm.v1.core.sched.scheduler", "speculators.data_generation.vllm_hidden_states_generator"):
            try:
                __import__(mod)
            except Exception as e:  # report, keep going: doctor must print even on a broken stack
                print(f"note: importing {mod} failed: {type(e).__name__}: {e}", file=sys.stderr)
    from .report import build_status, format_status

    st = build_status(probe_engine=args.probe)
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    failed = [p["name"] for p in st["patches"] if p["applies"] and not p["applied"]]
    return 1 if failed and speculators_compat.status()["enabled"] else 0


def _demo(args) -> int:
    from .demo import run_demo

    return run_demo(model=args.model)


def _extract(args) -> int:
    from .pipeline.command import main_extract

    return main_extract(args)


def _plan(args) -> int:
    from .pipeline.plan import main_plan

    return main_plan(args)


def _verify(args) -> int:
    from .pipeline.output.verify import main_verify

    return main_verify(args)


def _serve(args) -> int:
    from .serve.command import main_serve

    return main_serve(args, args.vllm_args)


def node_options(args):
    """The EngineOptions a ``node`` host's workers start with: every engine setting from its flags
    (the driver's states dtype excepted: its workers are told it at set-up)."""
    from .engine import settings
    from .engine.config import EngineOptions

    engine = settings.from_args(args, EngineOptions)
    engine.pop("states_dtype", None)
    return EngineOptions(model=args.model, node_rank=args.node_rank, **engine)


def _node(args) -> int:
    from .engine.node import run_worker_node

    run_worker_node(node_options(args))
    return 0


def _run(args) -> int:
    from .launcher import main_run

    return main_run(args.command)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="speculators-compat", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("doctor", help="installed versions and what each patch did")
    d.add_argument("--json", action="store_true")
    d.add_argument("--probe", action="store_true", help="import vLLM/speculators and probe vLLM's internals")
    d.add_argument(
        "--sweep-shm", action="store_true", help="remove /dev/shm/psm_* files no process has open (killed engines')"
    )
    d.set_defaults(fn=_doctor)

    m = sub.add_parser("demo", help="extract on a built-in tiny model and compare with HF transformers")
    m.add_argument("--model", default="llama", help="tiny model: llama, qwen2, deepseek_v3")
    m.set_defaults(fn=_demo)

    from .pipeline.options import add_extract_args, add_plan_args

    e = sub.add_parser("extract", help="extract hidden states for a dataset (JSONL or speculators dir)")
    add_extract_args(e)
    e.set_defaults(fn=_extract)

    p = sub.add_parser("plan", help="dry run: memory, tokens per step and disk, from config.json only")
    add_plan_args(p)
    p.set_defaults(fn=_plan)

    from .serve.command import add_serve_args

    s = sub.add_parser(
        "serve",
        help="vLLM's own OpenAI server with the capture connector: speculators' clients get their "
        "hidden-states files; other flags go to vllm serve (docs/serving.md)",
    )
    add_serve_args(s)
    s.set_defaults(fn=_serve)

    n = sub.add_parser(
        "node",
        help="run this host's workers of an engine over several hosts (--nnodes); the driver's host "
        "runs extract or serve with the same engine flags (docs/multi-node.md)",
    )
    from .pipeline.options import add_model_args

    add_model_args(n)
    n.add_argument("--node-rank", type=int, required=True, help="this host's rank, 1..nnodes-1")
    n.set_defaults(fn=_node)

    r = sub.add_parser(
        "run",
        help="run a command with the patches in every Python process it starts "
        "(spawned vLLM workers included): speculators-compat run python SCRIPT ARGS...",
    )
    r.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments")
    r.set_defaults(fn=_run)

    v = sub.add_parser("verify", help="check an extract output's files against its manifest (sizes, checksums)")
    v.add_argument("output", help="the output directory of extract")
    v.add_argument("--json", action="store_true")
    v.add_argument(
        "--model",
        default=None,
        help="also check that the states were made by this model's files (the fingerprint in run.json)",
    )
    v.add_argument(
        "--finalize",
        action="store_true",
        help="write manifest.json when every sample's file is there and intact (a sharded run whose "
        "last rank did not write it, or a run stopped after its last file)",
    )
    v.set_defaults(fn=_verify)
    return ap


def main(argv: list[str] | None = None) -> int:
    from .signals import exit_by_deadline, handle_termination, interrupted

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.fn is not _serve:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.vllm_args = rest  # (serve passes the flags it does not know to vllm serve)
    if args.fn is not _serve:  # (vLLM's server handles its own signals)
        handle_termination()  # SIGTERM / SIGHUP shut the engine down like Ctrl-C (signals.py)
        exit_by_deadline()  # ... and end the process if that shutdown hangs
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.fn is _run:  # (the command's own output and exit status, untouched)
        try:
            return _run(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"speculators-compat: error: {e}", file=sys.stderr)
            return 2
    from .engine.core import CaptureError, StallError, WorkerDiedError
    from .errors import HostLostError, OutputError, ShardFailedError

    expected = (
        FileNotFoundError,
        ValueError,
        TypeError,
        ImportError,
        OutputError,
        CaptureError,
        StallError,
        WorkerDiedError,
        ShardFailedError,
        HostLostError,
    )
    try:
        return int(args.fn(args) or 0)
    except expected as e:  # a clear one-line error; --verbose shows the traceback
        if args.verbose:
            raise
        print(f"speculators-compat: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP: the engine is shut down by now
        msg, code = interrupted(e, getattr(args, "output", None) if args.fn is _extract else None)
        print(f"speculators-compat: {msg}", file=sys.stderr)
        return code


def entry() -> None:
    """The ``speculators-compat`` command: ``main()``, and after a failure an exit with the error
    message as its last words (signals.end_process)."""
    from .signals import end_process, quiet_resource_tracker

    quiet_resource_tracker()
    code = main()
    if code:
        end_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
