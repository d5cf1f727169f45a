"""``speculators-compat serve --model M --hidden-states-path DIR [--layer-ids ...] [--states-dtype fp8]
[engine options as extract] [--host H --port P] [--served-model-name N]``.

Checks what it can before the engine starts (the model's files, the layer ids, the output folder),
starts the engine and its continuous loop, then uvicorn. SIGTERM or Ctrl-C: uvicorn stops taking
connections and lets the requests in flight finish, then the loop and the engine shut down.
"""

from __future__ import annotations

import argparse
import logging
import os

logger = logging.getLogger("speculators_compat.serve")

DRAIN_S = 60.0  # how long a shutdown waits for requests in flight


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from ..pipeline.options import add_model_args

    add_model_args(p)
    p.add_argument(
        "--hidden-states-path",
        required=True,
        help="where each request's hs file is written (the path its response names)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument(
        "--no-self-check",
        action="store_true",
        help="skip the per-request check of the sampled token against the captured state",
    )


def build(args: argparse.Namespace):
    """(generator, loop, service) for ``args``: everything but the HTTP server."""
    from ..checkpoint import check_checkpoint
    from ..engine.stream import StreamingLoop
    from ..generator import VllmHiddenStatesGenerator
    from ..layers import read_num_layers
    from ..layers import resolve as resolve_layers
    from ..pipeline.options import ENGINE_ARGS
    from .service import Service

    check_checkpoint(args.model)
    n = read_num_layers(args.model, args.trust_remote_code)
    ids = resolve_layers(args.layer_ids, n, args.layer_id_convention, "speculators-hs")  # vLLM's ids
    os.makedirs(args.hidden_states_path, exist_ok=True)
    if not os.access(args.hidden_states_path, os.W_OK):
        raise ValueError(f"--hidden-states-path {args.hidden_states_path} is not writable")
    engine = {k: getattr(args, k) for k in ENGINE_ARGS if hasattr(args, k) and getattr(args, k) is not None}
    gen = VllmHiddenStatesGenerator(
        args.model,
        layer_ids=ids,
        layer_id_convention="upstream",
        on_overlength="error",
        self_check=not args.no_self_check,
        **engine,
    )
    loop = StreamingLoop(gen.engine)
    name = args.served_model_name or args.model
    return gen, loop, Service(gen, loop, args.hidden_states_path, name)


def main_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import build_app

    gen, loop, service = build(args)
    try:
        app = build_app(service)
        logger.info(
            "serving %s (layers %s, states %s) on http://%s:%d; files in %s",
            service.model_name,
            gen.layer_ids,
            service.states_dtype,
            args.host,
            args.port,
            args.hidden_states_path,
        )
        config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=int(DRAIN_S))
        try:
            uvicorn.Server(config).run()  # (returns once SIGTERM / Ctrl-C drained the requests in flight)
        except KeyboardInterrupt:  # uvicorn raises the signal it drained for again: the shutdown it asked for
            logger.info("requests in flight answered; shutting the engine down")
    finally:
        loop.close(drain_s=DRAIN_S)
        gen.close()
    return 0
