"""The output directory's locks (a part of OutputDir): ``OUT/.lock`` held for a run's lifetime
(shared by the ranks of a sharded run, each holding its ``rank_{K}/.lock`` exclusive) and
``OUT/.run.lock`` held while run.json is compared and written. See outdir.py for the layout."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from ...errors import OutputError

RANK_DIR_RE = re.compile(r"^rank_(\d+)$")


class OutputLock:
    """Locking for OutputDir (which sets root, part, records and the fds used here)."""

    # -- the lock -----------------------------------------------------------------------

    def lock(self) -> None:
        """Create the directory and hold ``.lock`` in it (flock) for this process's lifetime or until
        ``unlock()``: a second extract into the same output is refused, naming the first. A rank of
        a sharded run holds ``.lock`` shared and ``rank_{K}/.lock`` exclusive (module docstring).
        Also proves the directory writable before anything else happens."""
        import fcntl

        self._made_root = not self.root.exists()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create output directory {self.root}: {e.strerror}") from e
        if not self.part.sharded:
            self._lock_fd = self._flock(self.root / ".lock", fcntl.LOCK_EX)
            return
        self._lock_fd = self._flock(self.root / ".lock", fcntl.LOCK_SH, write_holder=False)
        try:
            self.records.mkdir(exist_ok=True)
            self._rank_fd = self._flock(self.records / ".lock", fcntl.LOCK_EX)
        except BaseException:
            self.unlock()
            raise

    def _flock(self, path: Path, mode: int, write_holder: bool = True) -> int:
        import fcntl
        import socket
        import time

        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise OutputError(f"output directory {path.parent} is not writable: {e.strerror}") from e
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if path.parent == self.root and not holder:
                ranks = sorted(p.name for p in self.root.glob("rank_*") if p.is_dir())
                holder = f"the ranks of a sharded extract ({', '.join(ranks)})" if ranks else "another process"
            what = f"{self.part.label} of {self.root}" if path.parent != self.root else str(self.root)
            raise OutputError(
                f"{what} is being written by another extract ({holder or 'another process'}): wait for "
                "it to finish, or use another --output"
                + (
                    " (a one-engine run and the ranks of a sharded one cannot share a directory)"
                    if path.parent == self.root
                    else ""
                )
            ) from None
        if write_holder:
            info = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, info.encode(), 0)
            except OSError as e:
                os.close(fd)
                raise OutputError(f"output directory {path.parent} is not writable: {e.strerror}") from e
        return fd

    def unlock(self) -> None:
        if self._lock_fd is not None and not self.part.sharded and not (self.root / "run.json").exists():
            # a run refused before it made this an output (another's files, bad input): leave no trace
            for n in (".lock", ".run.lock"):
                with contextlib.suppress(FileNotFoundError):
                    (self.root / n).unlink()
            if self._made_root:
                with contextlib.suppress(OSError):
                    self.root.rmdir()  # (only if empty)
        for name in ("_rank_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                if name == "_rank_fd" or not self.part.sharded:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                os.close(fd)  # (closing releases the flock)
                setattr(self, name, None)

    @contextlib.contextmanager
    def _run_json_lock(self):
        """``.run.lock`` held exclusively while run.json is read, compared and written (a moment):
        the ranks of a sharded run starting together agree on one run.json."""
        import fcntl

        fd = os.open(self.root / ".run.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
