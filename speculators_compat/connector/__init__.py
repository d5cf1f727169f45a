"""Hidden states inside vLLM's own server: a KV connector that captures the requested layers and
writes speculators' hidden-states files (connector.py). Point vLLM at it with
``"kv_connector": "CaptureConnector", "kv_connector_module_path": "speculators_compat.connector"``."""

from .connector import CaptureConnector

__all__ = ["CaptureConnector"]
