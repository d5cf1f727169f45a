"""The version-adaptive engine loop (driver side: core.py; worker side: worker.py)."""
