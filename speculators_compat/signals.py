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


def release_shared_memory() -> int:
    """Close and unlink every ``SharedMemory`` and named semaphore this process still holds (vLLM's
    message queues after a worker died, a queue's lock): what the interpreter's teardown would
    leave to multiprocessing's resource tracker, which frees it with a warning on the terminal.
    Returns how many were released. Only for a process about to end: nothing may use them after."""
    import contextlib
    import gc
    from multiprocessing import resource_tracker, shared_memory, synchronize

    released = 0
    for obj in gc.get_objects():
        kind = type(obj)  # (not isinstance: that reads __class__, which some lazy modules warn on)
        if issubclass(kind, shared_memory.SharedMemory):
            with contextlib.suppress(OSError, BufferError):
                obj.close()
            with contextlib.suppress(OSError):
                obj.unlink()  # (also tells the tracker)
                released += 1
        elif issubclass(kind, synchronize.SemLock) and getattr(obj._semlock, "name", None):
            import _multiprocessing

            name = obj._semlock.name
            with contextlib.suppress(OSError):
                _multiprocessing.sem_unlink(name)
                resource_tracker.unregister(name, "semaphore")
                released += 1
    return released


def quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (shared by this process and every process it
    spawns, vLLM's workers too) with its stderr on /dev/null. When a worker dies, what it had made
    is left to the tracker, which frees it at the end and says so on the terminal, after the
    command's own error; the freeing stays, the warning goes."""
    import os
    from multiprocessing import resource_tracker

    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)  # (the tracker inherits fd 2 as it starts)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def end_process(code: int) -> None:
    """End the process after a fatal error, its message already printed: the shared memory it
    holds released, the output flushed, and then ``os._exit``, so that no library's teardown
    (triton's nanobind leak report, the resource tracker's warnings) prints after the message."""
    import os
    import sys

    release_shared_memory()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said
            continue
    os._exit(code)


#: seconds the engine's shutdown may take after SIGTERM / SIGINT / SIGHUP before the process ends
#: anyway (a shutdown waiting on a lost host or a hung worker never returns)
SHUTDOWN_GRACE_S = 20.0


def exit_by_deadline(grace_s: float = SHUTDOWN_GRACE_S) -> bool:
    """After the first SIGTERM, SIGINT or SIGHUP, end the process ``grace_s`` seconds later if it
    is still running: the interpreter's handlers run only when the main thread runs Python, and the
    clean-up they start may wait on a host that is gone, so a thread of its own keeps the time. It
    hears of the signal through ``signal.set_wakeup_fd`` (written by the C-level handler, whatever
    the main thread is doing). Main thread only, and not under an asyncio loop (which owns the
    wakeup fd); returns whether it was set up."""
    import os

    if threading.current_thread() is not threading.main_thread():
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        if signal.set_wakeup_fd(w, warn_on_full_buffer=False) != -1:  # someone else's: leave it
            signal.set_wakeup_fd(-1)
            os.close(r)
            os.close(w)
            return False
    except ValueError:
        os.close(r)
        os.close(w)
        return False
    watched = {int(s) for s in (*TERMINATING, signal.SIGINT)}

    def watch() -> None:
        while True:
            data = os.read(r, 64)
            if not data:
                return
            hit = next((b for b in data if b in watched), None)
            if hit is not None:
                threading.Timer(grace_s, _out_of_time, args=(hit, grace_s)).start()
                return

    threading.Thread(target=watch, name="speculators-compat-exit-deadline", daemon=True).start()
    return True


def _out_of_time(signum: int, grace_s: float) -> None:
    import sys

    name = signal.Signals(signum).name
    print(
        f"speculators-compat: the engine did not shut down within {grace_s:.0f} s of {name} (a lost host or a "
        "hung worker); exiting now. Files already written are complete: run the same command again to resume",
        file=sys.stderr,
    )
    end_process(128 + signum)
