"""The pipeline without an engine, by part: before_engine/ (settings, plan, the checks made before
the engine starts), input/ (reading the dataset, which rank computes which samples), writers/
(threads, processes, shards, durability under SIGKILL), output/ (the directory, resume, verify)."""
