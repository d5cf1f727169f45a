"""A host of an engine that spans several (vLLM 0.32+'s multiprocessing executor over nodes).

The driver's host (node rank 0) runs ``extract`` / ``serve`` / the generator with ``nnodes`` and
``master_addr``; every other host runs :func:`run_worker_node` with the same engine settings and its
own ``node_rank``: it starts that host's share of the workers (``world size / nnodes``, in rank order:
with tensor x pipeline parallelism over two 8-GPU hosts, the second host holds the second stage),
which connect to the driver's executor and serve its calls until it shuts down. Built from the same
``EngineOptions`` as the driver's engine, its workers get the same capture extension, prefix caching
off and the same runner; a worker that does not share the driver's /dev/shm hands its rows back over
vLLM's RPC (stage.py: ``shares_driver_shm``).
"""

from __future__ import annotations

import logging
import threading

from ..errors import HostLostError
from .config import EngineOptions, build_vllm_config
from .liveness import DEFAULT_TIMEOUT_S, PORT_OFFSET, keep_alive

logger = logging.getLogger("speculators_compat.engine")


def run_worker_node(opts: EngineOptions) -> None:
    """Run this host's workers of a multi-host engine until the driver's engine shuts down."""
    if opts.nnodes < 2 or opts.node_rank < 1:
        raise ValueError(
            f"a worker node has node_rank >= 1 of nnodes >= 2 (got {opts.node_rank} of {opts.nnodes}); "
            "node rank 0 is the driver's host: run extract, serve or the generator there"
        )
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    cfg = build_vllm_config(opts)
    pc = cfg.parallel_config
    logger.info(
        "speculators_compat: node %d of %d: %d of %d workers, driver at %s",
        opts.node_rank,
        opts.nnodes,
        pc.world_size // opts.nnodes,
        pc.world_size,
        opts.master_addr,
    )
    executor = MultiprocExecutor(cfg, monitor_workers=False)
    done, lost = threading.Event(), []

    def on_lost(what) -> None:  # the driver is gone: end this host's workers, then this command
        lost.append(what)
        logger.error("speculators_compat: node %d lost the driver, %s; stopping this node", opts.node_rank, what)
        executor.shutdown()

    timeout = opts.liveness_timeout_s or DEFAULT_TIMEOUT_S
    keep_alive(opts.master_addr, pc.master_port + PORT_OFFSET, opts.node_rank, timeout, on_lost, done)
    try:
        codes = _wait_for_workers(executor)
    finally:
        done.set()
        executor.shutdown()
    if lost:
        raise HostLostError(f"node {opts.node_rank}: lost the driver, {lost[0]}; its run stops (rerun it to resume)")
    if any(c != 0 for c in codes):
        raise RuntimeError(f"speculators_compat: this node's workers exited with {codes}")
    logger.info("speculators_compat: the driver's engine shut down; node %d done", opts.node_rank)


def _wait_for_workers(executor) -> list:
    """Until every worker of this host has exited (each does when the driver's engine shuts down:
    worker.py ``compat_release_node``; a crash or a lost driver ends them too): their exit codes."""
    from multiprocessing.connection import wait

    procs = [w.proc for w in executor.workers]
    pending = list(procs)
    while pending:
        wait([p.sentinel for p in pending])
        pending = [p for p in pending if p.exitcode is None]
    return [p.exitcode for p in procs]
