"""SIGTERM / SIGHUP handled like Ctrl-C in the extraction commands.

A batch scheduler that preempts or times out a job sends SIGTERM first (SIGKILL comes after a
grace period); a closed terminal sends SIGHUP. Python's default for both ends the process on the
spot: the engine's workers are then left to notice their parent is gone, and the run's /dev/shm
arena stays until the next engine starts on that host. ``handle_termination()`` makes both raise
:class:`Terminated` (a ``KeyboardInterrupt``) in the main thread instead, so the ``finally`` blocks
shut the engine down and the files already written stay complete; ``interrupted(e, output)`` is the
message and exit status for it. Library users who drive the generator from their own script may
call ``handle_termination()`` too; it leaves alone a handler the program installed itself.
"""

from __future__ import annotations

import signal
import threading

TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread like Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame) -> None:
    for s in TERMINATING:  # once: a second signal must not cut the clean-up short
        if signal.getsignal(s) is _raise_terminated:
            signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum)


def handle_termination() -> bool:
    """Install the handlers (main thread only; a handler the program set is kept). Returns whether
    any was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    installed = False
    for s in TERMINATING:
        if signal.getsignal(s) in (signal.SIG_DFL, None):
            signal.signal(s, _raise_terminated)
            installed = True
    return installed


def interrupted(e: KeyboardInterrupt, output: str | None = None) -> tuple[str, int]:
    """(message, exit status 128 + signal number) for an interrupted command."""
    signum = getattr(e, "signum", signal.SIGINT)
    kept = f"; the files already in {output} are complete: run the same command again to resume" if output else ""
    return f"interrupted by {signal.Signals(signum).name}{kept}", 128 + signum
