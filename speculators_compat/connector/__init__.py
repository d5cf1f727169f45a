"""Hidden states inside vLLM's own server: a KV connector that captures the requested layers and
writes speculators' hidden-states files (connector.py). Point vLLM at it with
``"kv_connector": "CaptureConnector", "kv_connector_module_path": "speculators_compat.connector"``.
(Imported lazily: the records and the scheduler's rules load without vLLM.)"""

__all__ = ["CaptureConnector"]


def __getattr__(name: str):
    if name == "CaptureConnector":
        from .connector import CaptureConnector

        return CaptureConnector
    raise AttributeError(name)
