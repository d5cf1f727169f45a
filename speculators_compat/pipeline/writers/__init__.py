"""The writers that put a run's samples on disk: threads, processes, shards."""
