"""Dataset -> batches -> engine -> writer, resumable; and the dry-run planner."""
