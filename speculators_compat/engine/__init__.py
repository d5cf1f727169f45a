"""The version-adaptive engine loop (driver side: core.py; worker side: worker.py)."""

# A new hand-off arena slab is this many times the largest batch the worker has seen (arena.py;
# here, free of torch, so that `plan` can size /dev/shm from config.json alone)
ARENA_HEADROOM = 1.25
