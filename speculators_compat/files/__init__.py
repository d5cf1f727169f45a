"""The output files, one room for them: how each format encodes a sample (formats.py, ptfile.py),
their checksums (checksums.py, crc.py), temp + rename, and the ``.lock`` protocol speculators'
clients wait on (locks.py). The pipeline (``extract``) and the capture connector both write through
here; nothing here imports either."""

from . import formats  # noqa: F401, E402  (registers the built-in formats: registry.py)
