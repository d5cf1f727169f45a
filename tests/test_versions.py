from packaging.version import Version

from speculators_compat import versions


def test_nightly_compares_by_base_version():
    assert versions.base_version("0.16.0rc2.dev123+gabc") == Version("0.16.0")
    assert versions.base_version("0.12.0+cpu") == Version("0.12.0")
    assert versions.base_version("not a version") is None


def test_matches_uses_base_version(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda p: "0.17.0rc1.dev5+g1234")
    assert versions.matches("vllm", ">=0.17")
    assert not versions.matches("vllm", "<0.17")
    assert versions.vllm_is_tested() is True
    monkeypatch.setattr(versions, "installed", lambda p: "0.40.0.dev3+gabc")
    assert versions.vllm_is_tested() is False
