"""Launchers above extract: data-parallel engines on one host, Ray shards on a cluster."""
