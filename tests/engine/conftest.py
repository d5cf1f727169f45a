"""Real-engine tests: need vLLM (an environment from scripts/engine_env.py)."""

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this environment (use scripts/engine_env.py)", allow_module_level=True)

from packaging.version import Version  # noqa: E402

from speculators_compat import versions  # noqa: E402
from speculators_compat.testing import models, reference  # noqa: E402

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    # (a conftest's hook sees the whole session's items: only this folder's are engine tests)
    for it in items:
        if HERE in Path(str(it.path)).resolve().parents:
            it.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def vllm_version() -> Version:
    return versions.installed_base("vllm")


@pytest.fixture(scope="session")
def llama_path():
    return str(models.build("llama"))


@pytest.fixture(scope="session")
def qwen2_path():
    return str(models.build("qwen2"))


_refs = {}


@pytest.fixture(scope="session")
def hf_ref():
    def get(path, layer_ids):
        key = (path, tuple(layer_ids))
        if key not in _refs:
            _refs[key] = reference.HFReference(path, layer_ids)
        return _refs[key]

    return get
