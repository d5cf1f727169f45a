"""Reading the input during a run: fixed batches of samples, read one batch ahead on a thread so
that parsing overlaps the engine's work."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

from .dataset import Sample


def batches_of(samples: Iterable[Sample], size: int) -> Iterator[list[Sample]]:
    it = iter(samples)
    while True:
        batch = list(islice(it, size))
        if not batch:
            return
        yield batch


class Prefetch:
    """Batches read one ahead on a thread, so parsing the input overlaps the engine's work (the
    driver thread only waits for the GPU meanwhile). A reading error (a malformed line) is
    raised by ``next()`` at the batch it belongs to, as without prefetching; ``close()`` stops
    the thread when the run ends early."""

    _END = object()

    def __init__(self, it: Iterator, depth: int = 1):
        import queue
        import threading

        self._it, self._q, self._stop = it, queue.Queue(maxsize=max(1, depth)), threading.Event()
        self._t = threading.Thread(target=self._read, name="speculators-compat-read", daemon=True)
        self._t.start()

    def _read(self) -> None:
        import queue

        while not self._stop.is_set():
            try:
                item = next(self._it, self._END)
            except BaseException as e:  # handed to the consumer, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
            if item is self._END or isinstance(item, BaseException):
                return

    def next(self):
        """The next batch, or None at the end."""
        if self._stop.is_set():
            return None
        item = self._q.get()
        if item is self._END:
            self._stop.set()
            return None
        if isinstance(item, BaseException):
            self._stop.set()
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)
