"""The run's progress bar: tqdm when it is installed (the [pipeline] extra), else nothing."""

from __future__ import annotations


def progress_bar(total, enabled, initial: int = 0):
    """A tqdm bar over ``total`` samples; ``enabled`` False: a silent one; a callable: the caller's
    own bar, ``enabled(total)`` (a data-parallel engine's, which reports to its driver)."""
    if callable(enabled):
        return enabled(total)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: a silent stand-in

        class _Null:
            def update(self, *a): ...
            def set_postfix_str(self, *a, **k): ...
            def close(self): ...

        return _Null()
    return tqdm(total=total, initial=initial, unit="sample", disable=not enabled, dynamic_ncols=True, desc="extract")
