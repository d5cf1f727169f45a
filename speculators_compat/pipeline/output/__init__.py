"""The output on disk: its directory and locks, the file formats, checksums, verify."""
